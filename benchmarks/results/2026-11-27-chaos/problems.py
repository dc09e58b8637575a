"""The problems of the scripts in this folder and their rounding-level perturbation.

``safeguard_problem(seed)``: the value-safeguard test's problem (tests/test_solver.py): two float64 clouds of 300
points in 2-D (N(0, I) and N(e_1, I)), offsets u, v = 0.1 diam^2 U(0, 1), diam the bounding-box diagonal.
``perturb(t, gen)``: t times 1 + 1e-15 z, z standard normal from ``gen`` (None stays None).
``runs(u, v, K)``: the K offset pairs of chaos.py / vs_chaos.py.
``solve``: p = 2, eps = (ratio diam)^2, eps-scaling 0.5, tol 1e-4, max_iter 20000, backend 'cpu'."""
import warnings

import torch

from srot_fast import sinkhorn

F64 = torch.float64
PENALTY = {"partial": dict(mass=0.5), "kl": dict(penalty="kl", tau=1.0), "tv": dict(penalty="tv", tau=1.0),
           "balanced": {}}


def safeguard_problem(seed: int):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(300, 2, generator=g, dtype=F64), torch.randn(300, 2, generator=g, dtype=F64)
    y[:, 0] += 1.0
    both = torch.cat([x, y])
    diam = float((both.max(0).values - both.min(0).values).norm())
    u, v = (0.1 * diam**2 * torch.rand(300, generator=g, dtype=F64) for _ in range(2))
    return x, y, u, v, diam


def perturb(t, gen):
    return None if t is None else t * (1 + 1e-15 * torch.randn(t.shape, generator=gen, dtype=F64))


def runs(u, v, count: int):
    """(u, v) as given, then perturbed with generator seeds 100 + k for k = 1 .. count - 1."""
    for k in range(count):
        gen = torch.Generator().manual_seed(100 + k)
        yield (u, v) if k == 0 else (perturb(u, gen), perturb(v, gen))


def solve(x, y, u, v, diam, penalty, ratio=0.005, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sinkhorn(x, y, p=2, eps=(ratio * diam) ** 2, u=u, v=v, scaling=0.5, diameter=diam, tol=1e-4,
                        max_iter=kw.pop("max_iter", 20000), backend="cpu", **PENALTY[penalty], **kw)
