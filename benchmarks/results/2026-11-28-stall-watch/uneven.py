"""20 problems of 40-59 x 60-41 points in 2-D with uneven weights (tests/test_solver.py's _uneven; p = 2, eps 0.01)
to tol 1e-4 and 1e-8, and the 200 tiny problems of tiny_vs_plain.py (eps 0.003, default backend, 3000 updates at
most): updates per problem, in all, and how many did not converge. Run from this folder.

    PYTHONPATH=TREE python uneven.py [--plain]
"""
import sys
import time
import warnings

import torch
from tiny_vs_plain import case as tiny  # the same folder

from srot_fast import sinkhorn

warnings.simplefilter("ignore")
torch.set_num_threads(1)


def data(n, m, seed):
    g = torch.Generator().manual_seed(seed)
    d = dict(dtype=torch.float64, generator=g)
    x = torch.randn(n, 2, **d)
    y = torch.randn(m, 2, **d) * 0.8 + 0.7
    a = torch.rand(n, **d) + 0.2
    b = torch.rand(m, **d) + 0.2
    return x, y, a / a.sum(), b / b.sum()


plain = "--plain" in sys.argv
t0 = time.time()
for tol in (1e-4, 1e-8):
    total = unconverged = 0
    counts = []
    for s in range(20):
        x, y, a, b = data(40 + s, 60 - s, s)
        r = sinkhorn(x, y, a, b, eps=0.01, tol=tol, max_iter=20000, accelerate=not plain)
        total += int(r.n_iter)
        unconverged += not bool(r.converged)
        counts.append(int(r.n_iter))
    print(f"data40 tol {tol}: updates {total} unconv {unconverged}", counts)
total = unconverged = 0
counts = []
for s in range(200):
    x, y, a, b = tiny(s)
    r = sinkhorn(x, y, a, b, eps=0.003, max_iter=3000, accelerate=not plain)
    total += int(r.n_iter)
    unconverged += not bool(r.converged)
    if s in (99, 123, 147, 149, 151):
        counts.append(int(r.n_iter))
print(f"tiny: updates {total} unconv {unconverged}", counts, f"{time.time() - t0:.0f}s")
