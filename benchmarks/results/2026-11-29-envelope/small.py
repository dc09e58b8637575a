"""Per-problem updates and convergence: 20 uneven 40-59-point problems (tol 1e-4, 1e-8) and 200 tiny problems
(eps 0.003, 3000 updates at most). Run with the tree on PYTHONPATH (envelope.patch reads ZOB_D, ZOB_ALL).

    python small.py OUT.json [--plain]
"""
import json
import sys
import time
import warnings

import torch

from srot_fast import sinkhorn

warnings.simplefilter("ignore")
torch.set_num_threads(1)


def tiny(seed):
    g = torch.Generator().manual_seed(seed)
    n, m = (int(torch.randint(3, 30, (1,), generator=g)) for _ in range(2))
    x, y = torch.randn(n, 2, generator=g, dtype=torch.float64), torch.randn(m, 2, generator=g, dtype=torch.float64)
    a, b = torch.rand(n, generator=g, dtype=torch.float64), torch.rand(m, generator=g, dtype=torch.float64)
    return x, y, a / a.sum(), b / b.sum()


def data(n, m, seed):
    g = torch.Generator().manual_seed(seed)
    d = dict(dtype=torch.float64, generator=g)
    x = torch.randn(n, 2, **d)
    y = torch.randn(m, 2, **d) * 0.8 + 0.7
    a = torch.rand(n, **d) + 0.2
    b = torch.rand(m, **d) + 0.2
    return x, y, a / a.sum(), b / b.sum()


acc = "--plain" not in sys.argv
out = {}
t0 = time.time()
for tol in (1e-4, 1e-8):
    rows = []
    for s in range(20):
        x, y, a, b = data(40 + s, 60 - s, s)
        r = sinkhorn(x, y, a, b, eps=0.01, tol=tol, max_iter=20000, accelerate=acc)
        rows.append((int(r.n_iter), bool(r.converged)))
    out[f"uneven{tol}"] = rows
    print(tol, sum(n for n, _ in rows), sum(not c for _, c in rows), flush=True)
rows = []
for s in range(200):
    x, y, a, b = tiny(s)
    try:
        r = sinkhorn(x, y, a, b, eps=0.003, max_iter=3000, accelerate=acc)
        rows.append((int(r.n_iter), bool(r.converged)))
    except FloatingPointError:
        rows.append((3000, False))
out["tiny"] = rows
print("tiny", sum(n for n, _ in rows), sum(not c for _, c in rows), f"{time.time()-t0:.0f}s")
json.dump(out, open(sys.argv[1], "w"))
