r"""Exact OT partners on small problems through POT (dense N x M cost, CPU, float64).

- :func:`exact_ot`: W_C(a, b) by network simplex (``ot.emd``).
- :func:`exact_partial`: partial OT transporting mass s (``ot.partial.partial_wasserstein``).
- :func:`exact_robot`: ROBOT (Mukherjee et al. 2021), exact OT with the truncated cost min(C, 2 lam).
- :func:`exact_ot_tv`: OT with TV marginal penalties lam (|pi 1 - a|_1 + |pi^T 1 - b|_1), exact.

GAN critic losses (paper §4, GAN experiment):

- :func:`rot_critic_loss`: the ROT critic loss of Nietert et al. (2022) with optional SROT weights.
- :func:`gradient_penalty`: the WGAN-GP penalty of Gulrajani et al. (2017).

Entropic partial OT is ``srot_fast.sinkhorn(..., mass=s)`` (dummy-point augmentation, any backend).
Costs follow srot_fast's convention: |x - y| for p = 1, |x - y|^2 / 2 for p = 2.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from . import _checks
from .kernels.tensorized import cost_matrix

__all__ = ["exact_ot", "exact_partial", "exact_robot", "exact_ot_tv", "rot_critic_loss", "gradient_penalty"]


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
    if abs(a.sum() - b.sum()) > _checks.mass_rtol(x.dtype) * max(a.sum(), b.sum()):
        raise ValueError(f"exact OT needs a and b of equal total mass, got {a.sum():.6g} and {b.sum():.6g}")
    plan = ot.emd(a, b * (a.sum() / b.sum()), c, numItermax=10_000_000)
    return float((plan * c).sum()), torch.as_tensor(plan, dtype=x.dtype, device=x.device)


def exact_partial(x: torch.Tensor, y: torch.Tensor, a: Optional[torch.Tensor] = None,
                  b: Optional[torch.Tensor] = None, *, mass: float, p: int = 2) -> tuple[float, torch.Tensor]:
    """Exact partial OT moving ``mass`` (0 < mass <= min(|a|, |b|)): (value, (N, M) plan)."""
    import ot

    a, b, c, x = _dense_problem(x, y, a, b, p)
    mass = _checks.check_positive(mass, "mass")
    _checks.check_partial_mass(mass, float(min(a.sum(), b.sum())), x.dtype)
    plan = ot.partial.partial_wasserstein(a, b, c, m=min(mass, a.sum(), b.sum()), numItermax=10_000_000)
    return float((plan * c).sum()), torch.as_tensor(plan, dtype=x.dtype, device=x.device)


def exact_robot(x: torch.Tensor, y: torch.Tensor, a: Optional[torch.Tensor] = None,
                b: Optional[torch.Tensor] = None, *, lam: float, p: int = 2) -> tuple[float, torch.Tensor]:
    """ROBOT (Mukherjee et al. 2021): exact OT with the truncated cost min(C, 2 lam), via ``ot.emd``.

    Args:
        x: (N, D) source points, y: (M, D) target points; a: (N,), b: (M,) weights of equal total
            mass (default uniform). lam: truncation level (> 0), the cost is min(C, 2 lam).
        p: 1 for C = |x - y|, 2 for C = |x - y|^2 / 2.

    Returns:
        (value, plan): value = <min(C, 2 lam), plan>, plan (N, M) with marginals a and b (dtype/device of x).
        With equal masses this equals :func:`exact_ot_tv` with the same lam (Mukherjee et al., formulation 3).
    """
    import ot

    a, b, c, x = _dense_problem(x, y, a, b, p)
    lam = _checks.check_positive(lam, "lam")
    if abs(a.sum() - b.sum()) > _checks.mass_rtol(x.dtype) * max(a.sum(), b.sum()):
        raise ValueError(f"ROBOT needs a and b of equal total mass, got {a.sum():.6g} and {b.sum():.6g}")
    ct = np.minimum(c, 2.0 * lam)
    plan = ot.emd(a, b * (a.sum() / b.sum()), ct, numItermax=10_000_000)
    return float((plan * ct).sum()), torch.as_tensor(plan, dtype=x.dtype, device=x.device)


def exact_ot_tv(x: torch.Tensor, y: torch.Tensor, a: Optional[torch.Tensor] = None,
                b: Optional[torch.Tensor] = None, *, lam: float, p: int = 2) -> tuple[float, torch.Tensor]:
    r"""Exact OT with TV marginal penalties: min_{pi >= 0} <C, pi> + lam (|pi 1 - a|_1 + |pi^T 1 - b|_1).

    This is the eps -> 0 limit of ``srot_fast.sinkhorn(x, y, a, b, penalty='tv', tau=lam)``. An optimal
    plan never exceeds the marginals (removing excess mass lowers cost and penalty), so with
    m = pi.sum() the objective is lam (|a| + |b|) + <C - 2 lam, pi> over pi 1 <= a, pi^T 1 <= b. That is
    solved exactly as balanced OT (``ot.emd``) on supports augmented by one dummy point each (source
    dummy of mass |b|, target dummy of mass |a|, zero cost to and between dummies). a and b may have
    different total masses.

    Args:
        x: (N, D), y: (M, D) points; a: (N,), b: (M,) non-negative weights (default uniform 1/N, 1/M).
        lam: the TV penalty strength (> 0). p: 1 for C = |x - y|, 2 for C = |x - y|^2 / 2.

    Returns:
        (value, plan) with plan the (N, M) optimal sub-coupling (real-to-real part).
    """
    import ot

    a, b, c, x = _dense_problem(x, y, a, b, p)
    lam = _checks.check_positive(lam, "lam")
    n, m = c.shape
    sa, sb = a.sum(), b.sum()
    aug = np.zeros((n + 1, m + 1))
    aug[:n, :m] = c - 2.0 * lam
    aa = np.concatenate([a, [sb]])
    bb = np.concatenate([b, [sa]])
    full = ot.emd(aa, bb, aug, numItermax=10_000_000)
    plan = full[:n, :m]
    value = (plan * c).sum() + lam * (np.abs(plan.sum(1) - a).sum() + np.abs(plan.sum(0) - b).sum())
    return float(value), torch.as_tensor(plan, dtype=x.dtype, device=x.device)


def rot_critic_loss(d_real: torch.Tensor, d_fake: torch.Tensor, *, delta: float = 0.1,
                    weights_real: Optional[torch.Tensor] = None) -> torch.Tensor:
    r"""ROT critic loss (Nietert et al. 2022) as used by the paper's GAN: the critic minimises

        -E_w[D(real)] + (1 - delta) E[D(fake)] + delta max_{i: w_i > 0} D(real_i).

    Args:
        d_real: (B,) or (B, 1) critic outputs on the real batch. d_fake: (B',) or (B', 1) on generated samples.
        delta: robustness radius in [0, 1); delta = 0 is the WGAN critic loss -E D(real) + E D(fake).
        weights_real: optional (B,) non-negative weights on the real batch (e.g. hard SROT weights), normalised
            here to sum 1; points with zero weight are left out of both the mean and the max.

    Returns:
        A scalar tensor (differentiable w.r.t. the critic outputs).
    """
    d_real = _checks.check_critic_outputs(d_real, "d_real")
    d_fake = _checks.check_critic_outputs(d_fake, "d_fake")
    delta = _checks.check_fraction(delta, "delta")
    if weights_real is None:
        mean_real = d_real.mean()
        max_real = d_real.max()
    else:
        if not torch.is_tensor(weights_real):
            raise TypeError(f"weights_real must be a torch.Tensor, got {type(weights_real).__name__}")
        if weights_real.shape != d_real.shape:
            raise ValueError(f"weights_real must have shape {tuple(d_real.shape)} (one weight per real sample), "
                             f"got {tuple(weights_real.shape)}")
        w = weights_real.to(d_real.dtype).detach()
        if not torch.isfinite(w).all():
            raise ValueError("weights_real contains NaN or inf")
        if (w < 0).any():
            raise ValueError("weights_real has negative weights")
        total = w.sum()
        if not total > 0:
            raise ValueError("weights_real has zero total mass (all weights are zero)")
        w = w / total
        mean_real = (w * d_real).sum()
        max_real = d_real[w > 0].max()
    loss = -mean_real + (1.0 - delta) * d_fake.mean()
    if delta > 0:
        loss = loss + delta * max_real
    return loss


def gradient_penalty(critic, real: torch.Tensor, fake: torch.Tensor, *,
                     generator: Optional[torch.Generator] = None) -> torch.Tensor:
    r"""WGAN-GP penalty (Gulrajani et al. 2017): E[(|grad_x D(x_hat)|_2 - 1)^2] on random interpolates.

    Args:
        critic: callable mapping (B, ...) inputs to (B,) or (B, 1) scores.
        real, fake: (B, ...) tensors of the same shape (fake is detached here).
        generator: optional torch.Generator for the interpolation coefficients t ~ U(0, 1) per sample,
            x_hat = t real + (1 - t) fake.

    Returns:
        A scalar tensor, differentiable w.r.t. the critic's parameters (create_graph=True).
    """
    for name, t in (("real", real), ("fake", fake)):
        if not torch.is_tensor(t):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2 or t.shape[0] == 0:
            raise ValueError(f"{name} must have shape (B, ...) with B >= 1, got {tuple(t.shape)}")
    if real.shape != fake.shape:
        raise ValueError(f"real and fake must have the same shape, got {tuple(real.shape)} and {tuple(fake.shape)}")
    if not callable(critic):
        raise TypeError("critic must be callable (an nn.Module or a function)")
    shape = (real.shape[0],) + (1,) * (real.dim() - 1)
    t = torch.rand(shape, generator=generator, dtype=real.dtype, device=real.device) if generator is not None \
        else torch.rand(shape, dtype=real.dtype, device=real.device)
    x_hat = (t * real.detach() + (1 - t) * fake.detach()).requires_grad_(True)
    out = critic(x_hat)
    (grad,) = torch.autograd.grad(out.sum(), x_hat, create_graph=True)
    norm = grad.reshape(grad.shape[0], -1).norm(dim=1)
    return ((norm - 1.0) ** 2).mean()
