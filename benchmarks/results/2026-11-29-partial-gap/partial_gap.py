"""What a partial OT stop leaves on the real marginals: the d = 2, n = 1000 partial OT cases (mass 0.5) of the
convergence grid (``../2026-11-27-before/grid_tree.py``), solved to tol 1e-4; per case the reported error (rows of
the augmented problem), the mass the returned plan puts above a and above b, and the transported mass.

    OMP_NUM_THREADS=1 python partial_gap.py > partial_gap.txt
"""
import itertools
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-11-27-before"))
from grid_tree import problem  # noqa: E402

from srot_fast.sinkhorn import sinkhorn  # noqa: E402

for p, ratio, off in itertools.product((1, 2), (0.1, 0.02, 0.005), (False, True)):
    x, y, u, v, diam = problem(1000, 2, p, off)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = sinkhorn(x, y, p=p, eps=(ratio * diam) ** p, u=u, v=v, scaling=0.5, diameter=diam, tol=1e-4,
                     max_iter=20000, backend="cpu", mass=0.5)
    a = torch.full((1000,), 1e-3, dtype=torch.float64)  # a = b, uniform
    above_a = float((r.row_mass - a).clamp_min(0).sum())
    above_b = float((r.col_mass - a).clamp_min(0).sum())
    print(f"p={p} blur/diam={ratio} offsets={off} n_iter={int(r.n_iter)} error={float(r.marginal_error):.2e} "
          f"above_a={above_a:.2e} above_b={above_b:.2e} mass={float(r.transported_mass):.8f}", flush=True)
