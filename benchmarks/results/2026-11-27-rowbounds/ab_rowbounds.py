"""Block-sparse pruning with and without the second sweep (exact row bounds and their linear trend), in one
process, interleaved: ``TIGHTEN_ABOVE = 2`` gives the box bounds alone (the previous pruning), the module default
adds the second sweep. Usage: python ab_rowbounds.py OUT.json [--threads 2]."""
import json
import math
import sys
import time

import torch
from srot_fast.kernels import blocksparse

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from bench_blocksparse import clouds, loss_and_grad, make_loss  # noqa: E402

from srot_fast import sinkhorn  # noqa: E402
from srot_fast.datasets import make_cloud_3d  # noqa: E402

torch.set_num_threads(int(sys.argv[sys.argv.index("--threads") + 1]) if "--threads" in sys.argv else 2)
DEFAULT = blocksparse.TIGHTEN_ABOVE
MODES = {"boxes": 2.0, "rows": DEFAULT}
rows = []


def emit(row):
    rows.append(row)
    print(json.dumps(row), flush=True)
    json.dump(rows, open(sys.argv[1], "w"), indent=1)


def passes(name, x, y, eps, p, h):
    for mode, t in MODES.items():
        blocksparse.TIGHTEN_ABOVE = t
        blocksparse.softmin(x, y, h, eps, p)
        t0 = time.perf_counter()
        blocksparse.softmin(x, y, h, eps, p)
        emit(dict(kind="pass", case=name, mode=mode, seconds=time.perf_counter() - t0,
                  kept=blocksparse.last_kept_fraction()))


# one pass at the target eps: 2-D (bench_blocksparse data, blur 0.01 x diam, p = 2), 3-D surfaces (cloud3d data)
for n in (50_000, 200_000):
    x, y, diam = clouds(n)
    eps = (0.01 * diam) ** 2
    passes(f"2d n={n} p=2 log b", x, y, eps, 2, torch.full((n,), -math.log(n)))
d3 = make_cloud_3d(40_000, seed=0)
n3 = d3.x.shape[0]
passes("cloud3d n=40000 p=2 blur 0.05 log b", d3.x, d3.y, 0.0025, 2, torch.full((n3,), -math.log(n3)))

# cold loss + gradient, interleaved twice
x0, y0, diam = clouds(50_000, seed=1)
for rep in range(2):
    for case in ("plain_p2", "soft_p1"):
        for mode, t in MODES.items():
            blocksparse.TIGHTEN_ABOVE = t
            loss = make_loss(0.01 * diam, case, 1e-3, "blocksparse")
            t0 = time.perf_counter()
            value, gx, gy, n_iter = loss_and_grad(loss, x0, y0, case)
            emit(dict(kind="cold", case=f"2d n=50000 {case}", mode=mode, rep=rep, seconds=time.perf_counter() - t0,
                      value=value, n_iter=n_iter, passes=loss.last_result.passes))

# a cloud3d plan (balanced OT, p = 2, blur 0.05, tol 1e-3) and one pass at its solved potentials
for mode, t in MODES.items():
    blocksparse.TIGHTEN_ABOVE = t
    t0 = time.perf_counter()
    r = sinkhorn(d3.x, d3.y, p=2, eps=0.0025, tol=1e-3, backend="blocksparse")
    emit(dict(kind="solve", case="cloud3d n=40000 OT p=2 blur 0.05", mode=mode, seconds=time.perf_counter() - t0,
              value=float(r.value), n_iter=int(r.n_iter), passes=r.passes))
h = torch.full((n3,), -math.log(n3)) + r.g / 0.0025
passes("cloud3d n=40000 p=2 blur 0.05 solved g", d3.x, d3.y, 0.0025, 2, h)
blocksparse.TIGHTEN_ABOVE = DEFAULT
