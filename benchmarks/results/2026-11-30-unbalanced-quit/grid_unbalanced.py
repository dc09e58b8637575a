"""The KL and TV (tau = 1) cases of the convergence grid, accelerated, tol 1e-4, float64, backend cpu, max_iter
20000: one line each -- penalty, d, n, p, blur / diameter, offsets, updates, value, converged, seconds. From the
repository root:
    OMP_NUM_THREADS=1 python benchmarks/results/2026-11-30-unbalanced-quit/grid_unbalanced.py
"""
import sys
import time
import warnings

sys.path.insert(0, "benchmarks")
import bench_convergence as bc  # noqa: E402

from srot_fast.sinkhorn import sinkhorn  # noqa: E402

warnings.simplefilter("ignore")
for pen in ("kl", "tv"):
    for d, n in ((2, 1000), (64, 1000), (2, 4000)):
        for p in (1, 2):
            for ratio in bc.RATIOS:
                for off in (False, True):
                    x, y, u, v, diam = bc.problem(n, d, p, off)
                    t0 = time.perf_counter()
                    r = sinkhorn(x, y, u=u, v=v, p=p, eps=(ratio * diam) ** p, diameter=diam, penalty=pen, tau=bc.TAU,
                                 tol=1e-4, max_iter=20000, backend="cpu")
                    print(pen, d, n, p, ratio, off, int(r.n_iter), repr(float(r.value)), bool(r.converged),
                          "%.3f" % (time.perf_counter() - t0), flush=True)
