"""Partial OT's final column error against the error its stopping test read (rows of the augmented problem; for a
problem marked not converged by the column check, rows + columns): the 24 d = 2 / 64, n = 1000 partial OT cases of
the convergence grid (mass 0.5, tol 1e-4, backend cpu) and one source point against 2000 (tol 1e-8). From the
repository root: OMP_NUM_THREADS=1 python benchmarks/results/2026-11-30-partial-columns/column_error.py
"""
import importlib
import sys
import warnings

import torch

sys.path.insert(0, "benchmarks")
import bench_convergence as bc  # noqa: E402

from srot_fast import _loop  # noqa: E402
from srot_fast.geometry import PartialGeometry  # noqa: E402

S = importlib.import_module("srot_fast.sinkhorn")  # (the package exports the function under the same name)
warnings.simplefilter("ignore")
rec = []
orig = S._fit_partial


def fit(geom, inp, eps, eps_list, init, mass_a, mass_b, grads):
    out = orig(geom, inp, eps, eps_list, init, mass_a, mass_b, grads)
    a, b, mass = inp.a.detach(), inp.b.detach(), inp.mass
    aa = torch.cat([a, (mass_b - mass).clamp_min(0)[:, None]], -1)
    bb = torch.cat([b, (mass_a - mass).clamp_min(0)[:, None]], -1)
    t_real = geom.softmin_y(a.log() + out.f / eps, eps)
    t_aug = PartialGeometry(geom, mass)._augment(t_real, aa.log() + out.sol.f / eps, eps)
    col = _loop.marginal_error(bb.log(), out.sol.g, t_aug, t_aug, eps) / bb.sum(-1)
    rec.append((float(out.sol.marginal_error.max()), float(col.max())))
    return out


S._fit_partial = fit
for d, n in ((2, 1000), (64, 1000)):
    for p in (1, 2):
        for ratio in bc.RATIOS:
            for off in (False, True):
                x, y, u, v, diam = bc.problem(n, d, p, off)
                r = S.sinkhorn(x, y, u=u, v=v, p=p, eps=(ratio * diam) ** p, diameter=diam, mass=0.5, tol=1e-4,
                               backend="cpu")
                print(d, n, p, ratio, off, int(r.n_iter), "reported %.2e col %.2e" % rec[-1], flush=True)
gen = torch.Generator().manual_seed(2)
y = torch.rand(2000, 2, generator=gen, dtype=torch.float64)
r = S.sinkhorn(torch.tensor([[0.5, 0.5]], dtype=torch.float64), y, p=2, eps=0.02**2, mass=0.5, tol=1e-8)
print("one point", int(r.n_iter), "reported %.2e col %.2e" % rec[-1], "converged", bool(r.converged))
