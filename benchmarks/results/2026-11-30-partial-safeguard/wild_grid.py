"""The partial OT cases of the convergence grid (mass 0.5, tol 1e-4, float64, backend cpu) with Anderson.wild at
WILD = 100 and with it off (WILD = inf): updates, value, converged. Run from the repository root:
    python benchmarks/results/2026-11-30-partial-safeguard/wild_grid.py
"""
import math
import sys
import warnings

sys.path.insert(0, "benchmarks")
import bench_convergence as bc  # noqa: E402

from srot_fast import _anderson, _loop  # noqa: E402
from srot_fast.sinkhorn import sinkhorn  # noqa: E402

warnings.simplefilter("ignore")
for d, n in ((2, 1000), (64, 1000), (2, 4000)):
    for p in (1, 2):
        for ratio in bc.RATIOS:
            for off in (False, True):
                x, y, u, v, diam = bc.problem(n, d, p, off)
                eps = (ratio * diam) ** p
                out = []
                for wild in (100, math.inf):
                    _loop.WILD = _anderson.WILD = wild
                    r = sinkhorn(x, y, u=u, v=v, p=p, eps=eps, diameter=diam, mass=0.5, tol=1e-4, max_iter=20000,
                                 backend="cpu")
                    out.append((int(r.n_iter), float(r.value), bool(r.converged)))
                print(d, n, p, ratio, off, out[0], out[1], "SAME" if out[0][0] == out[1][0] else "DIFF", flush=True)
