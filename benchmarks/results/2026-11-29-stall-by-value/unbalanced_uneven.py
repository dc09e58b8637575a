"""Updates of the 20 small problems with uneven weights of tests/test_solver.py (40-59 x 60-41 points, p = 2,
eps 0.01) under KL and TV (tau 1), at tol 1e-4 and 1e-8, 20000 updates at most.

    OMP_NUM_THREADS=1 python unbalanced_uneven.py MODE     # MODE: now, nowatch (stall watch off), plain

Each line: mode, penalty, tol, total updates, unconverged, the three largest (updates, seed).
"""
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tests"))
from test_solver import _uneven  # noqa: E402

import srot_fast._anderson as anderson  # noqa: E402
from srot_fast import sinkhorn  # noqa: E402

mode = sys.argv[1]
if mode == "nowatch":
    anderson.STALL = 10**9
for pen in ("kl", "tv"):
    for tol in (1e-4, 1e-8):
        total, unconverged, counts = 0, 0, []
        for seed in range(20):
            x, y, a, b = _uneven(40 + seed, 60 - seed, seed)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                r = sinkhorn(x, y, a, b, eps=0.01, tol=tol, max_iter=20000, penalty=pen, tau=1.0,
                             accelerate=mode != "plain")
            total += int(r.n_iter)
            unconverged += not bool(r.converged)
            counts.append((int(r.n_iter), seed))
        print(mode, pen, tol, total, unconverged, sorted(counts)[-3:], flush=True)
