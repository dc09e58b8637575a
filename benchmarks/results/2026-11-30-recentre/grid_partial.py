"""The 36 partial OT cases of the convergence grid (mass 0.5, tol 1e-4, backend cpu), in float64 then float32:
one line each -- dtype, d, n, p, blur / diameter, offsets, updates, value, converged, seconds. From the repository
root:
    OMP_NUM_THREADS=1 python benchmarks/results/2026-11-30-recentre/grid_partial.py
"""
import sys
import time
import warnings

import torch

sys.path.insert(0, "benchmarks")
import bench_convergence as bc  # noqa: E402

from srot_fast.sinkhorn import sinkhorn  # noqa: E402

warnings.simplefilter("ignore")


def cast(t, dt):
    return None if t is None else t.to(dt)


for dt in (torch.float64, torch.float32):
    for d, n in ((2, 1000), (64, 1000), (2, 4000)):
        for p in (1, 2):
            for ratio in bc.RATIOS:
                for off in (False, True):
                    x, y, u, v, diam = bc.problem(n, d, p, off)
                    t0 = time.perf_counter()
                    r = sinkhorn(cast(x, dt), cast(y, dt), u=cast(u, dt), v=cast(v, dt), p=p, eps=(ratio * diam) ** p,
                                 diameter=diam, mass=0.5, tol=1e-4, max_iter=20000, backend="cpu")
                    print(str(dt)[6:], d, n, p, ratio, off, int(r.n_iter), repr(float(r.value)), bool(r.converged),
                          "%.3f" % (time.perf_counter() - t0), flush=True)
