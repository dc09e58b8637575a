"""Updates to tol 1e-4 on the d = 2, n = 1000 cases of the convergence grid when eps-scaling starts lower: from
the bounding-box diagonal (GeomLoss's schedule, the default), half and a quarter of it, and at the target blur
(no eps-scaling at all). Problems and settings are those of ``../2026-11-27-before/grid_tree.py``.

    OMP_NUM_THREADS=1 python schedule.py [D] > schedule_d2_n1000.txt

Each line: p, penalty, blur/diam, offsets, [(n_iter, converged) for diameter = diam, diam/2, diam/4, blur].
"""
import itertools
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-11-27-before"))
from grid_tree import penalty_kwargs, problem  # noqa: E402

from srot_fast.sinkhorn import sinkhorn  # noqa: E402

d = int(sys.argv[1]) if len(sys.argv) > 1 else 2
for p, pen, ratio, off in itertools.product((1, 2), ("balanced", "kl", "tv", "partial"), (0.1, 0.02, 0.005),
                                            (False, True)):
    x, y, u, v, diam = problem(1000, d, p, off)
    eps = (ratio * diam) ** p
    out = []
    for start in (diam, 0.5 * diam, 0.25 * diam, ratio * diam):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = sinkhorn(x, y, p=p, eps=eps, u=u, v=v, scaling=0.5, diameter=start, tol=1e-4, max_iter=20000,
                         backend="cpu", **penalty_kwargs(pen))
        out.append((int(r.n_iter), bool(r.converged)))
    print(p, pen, ratio, off, out, flush=True)
