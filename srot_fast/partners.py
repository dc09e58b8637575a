r"""Exact OT partners on small problems through POT (dense N x M cost, CPU, float64).

- :func:`exact_ot`: W_C(a, b) by network simplex (``ot.emd``).
- :func:`exact_partial`: partial OT transporting mass s (``ot.partial.partial_wasserstein``).

Entropic partial OT is ``srot_fast.sinkhorn(..., mass=s)`` (dummy-point augmentation, any backend).
Costs follow srot_fast's convention: |x - y| for p = 1, |x - y|^2 / 2 for p = 2.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _checks
from .kernels.tensorized import cost_matrix

__all__ = ["exact_ot", "exact_partial"]


def _dense_problem(x, y, a, b, p):
    x = _checks.check_points(x, "x")
    y = _checks.check_points(y, "y")
    _checks.check_pair(x, y)
    p = _checks.check_p(p)
    a = _checks.check_weights(a, x, "a")
    b = _checks.check_weights(b, y, "b")
    c = cost_matrix(x.detach().double(), y.detach().double(), p).cpu().numpy()
    return a.detach().double().cpu().numpy(), b.detach().double().cpu().numpy(), c, x


def exact_ot(x: torch.Tensor, y: torch.Tensor, a: Optional[torch.Tensor] = None,
             b: Optional[torch.Tensor] = None, p: int = 2) -> tuple[float, torch.Tensor]:
    """Exact OT (value, (N, M) plan) between weighted point clouds of equal mass, via ``ot.emd``."""
    import ot

    a, b, c, x = _dense_problem(x, y, a, b, p)
    if abs(a.sum() - b.sum()) > 1e-9 * max(a.sum(), b.sum()):
        raise ValueError(f"exact OT needs a and b of equal total mass, got {a.sum():.6g} and {b.sum():.6g}")
    plan = ot.emd(a, b * (a.sum() / b.sum()), c, numItermax=10_000_000)
    return float((plan * c).sum()), torch.as_tensor(plan, dtype=x.dtype, device=x.device)


def exact_partial(x: torch.Tensor, y: torch.Tensor, a: Optional[torch.Tensor] = None,
                  b: Optional[torch.Tensor] = None, *, mass: float, p: int = 2) -> tuple[float, torch.Tensor]:
    """Exact partial OT moving ``mass`` (0 < mass <= min(|a|, |b|)): (value, (N, M) plan)."""
    import ot

    a, b, c, x = _dense_problem(x, y, a, b, p)
    mass = _checks.check_positive(mass, "mass")
    if mass > min(a.sum(), b.sum()) * (1 + 1e-12):
        raise ValueError(f"mass must be <= min(a.sum(), b.sum()) = {min(a.sum(), b.sum()):.6g}, got {mass}")
    plan = ot.partial.partial_wasserstein(a, b, c, m=min(mass, a.sum(), b.sum()), numItermax=10_000_000)
    return float((plan * c).sum()), torch.as_tensor(plan, dtype=x.dtype, device=x.device)
