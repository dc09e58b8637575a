r"""Log-domain (unbalanced) Sinkhorn with eps-scaling, written once for every backend (SPEC §3).

Problem, for weights a (N,), b (M,), cost c'_ij = C(x_i, y_j) + u_i + v_j:
    min_{pi >= 0} <c', pi> + eps KL(pi | a (x) b) + tau_a D(pi 1 | a) + tau_b D(pi^T 1 | b),
D = KL, TV, or a hard constraint (balanced, tau = inf). Dual updates
    f <- A_a(-eps LSE_j[log b_j + (g_j - c'_ij)/eps]),  g <- A_b(-eps LSE_i[log a_i + (f_i - c'_ij)/eps]),
plan pi_ij = a_i b_j exp((f_i + g_j - c'_ij)/eps), value = the dual objective
    <a, phi_a(f)> + <b, phi_b(g)> - eps (<pi, 1> - |a| |b|).

The loop sees only ``geom.softmin_x`` / ``geom.softmin_y`` (srot_fast.geometry); it never branches
on a backend. Gradients of the value follow the envelope theorem (never back-propagation through
the iterations): d/dx_i = sum_j pi_ij grad_x C(x_i, y_j), d/da_i = phi_a(f_i) - eps (pi 1_i / a_i - |b|).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from . import _checks
from .backends import get_ops, resolve_backend
from .geometry import Geometry, PartialGeometry, bbox_diameter
from .penalties import Penalty

__all__ = ["sinkhorn", "SinkhornResult", "epsilon_schedule", "ConvergenceWarning"]


class ConvergenceWarning(UserWarning):
    """Sinkhorn stopped at ``max_iter`` before reaching ``tol``."""


def epsilon_schedule(p: int, diam: float, blur: float, scaling: float) -> list[float]:
    """eps values from diam**p down to blur**p by factors scaling**p (GeomLoss's schedule)."""
    if diam <= blur:
        return [blur**p]
    steps = torch.arange(p * math.log(diam), p * math.log(blur), p * math.log(scaling), dtype=torch.float64)
    return [diam**p] + [math.exp(float(e)) for e in steps] + [blur**p]


@dataclass
class _Solution:
    f: torch.Tensor          # (N',) potentials of the (possibly augmented) problem
    g: torch.Tensor          # (M',)
    s: torch.Tensor          # (N',) row soft-min at the final g (so pi 1 = a exp((f - s)/eps))
    t: torch.Tensor          # (M',) column soft-min at the final f
    n_iter: int
    marginal_error: float


def _marginal_error(w, f, s, pen: Penalty, eps: float) -> torch.Tensor:
    """sum_i w_i |exp((f_i - s_i)/eps) - exp((A(s)_i - s_i)/eps)|: L1 gap between the plan's marginal
    and the one the penalty prescribes at the current potentials (|pi 1 - a| when balanced)."""
    return (w * (torch.exp((f - s) / eps) - torch.exp((pen.aprox(s, eps) - s) / eps)).abs()).sum()


def _check_finite(f, g, err, tol, max_iter):
    if not (torch.isfinite(f).all() and torch.isfinite(g).all() and math.isfinite(err)):
        raise FloatingPointError(
            "Sinkhorn produced non-finite potentials; eps may be too small for this dtype "
            "(try float64 or a larger blur)"
        )
    if err > tol:
        warnings.warn(f"Sinkhorn stopped at max_iter={max_iter} with relative marginal error {err:.2e} > "
                      f"tol={tol:g}; raise max_iter, eps (blur) or tol", ConvergenceWarning, stacklevel=4)


def _sinkhorn_loop(geom, log_a, log_b, a, pen_a: Penalty, pen_b: Penalty,
                   eps_list: Sequence[float], tol: float, max_iter: int, init=None) -> _Solution:
    """Symmetric averaged updates along ``eps_list``, then alternating updates at the last eps until
    the relative marginal error is <= tol or ``max_iter`` updates ran. With ``init = (f0, g0)``
    the eps-scaling is skipped (warm start at the last eps)."""
    if init is not None:
        eps = eps_list[-1]
        f, g = init
        n_iter = 0
    else:
        eps = eps_list[0]
        f = pen_a.aprox(geom.softmin_x(log_b, eps), eps)
        g = pen_b.aprox(geom.softmin_y(log_a, eps), eps)
        for eps in eps_list:  # eps-scaling: symmetric, averaged (stable while eps shrinks)
            ft = pen_a.aprox(geom.softmin_x(log_b + g / eps, eps), eps)
            gt = pen_b.aprox(geom.softmin_y(log_a + f / eps, eps), eps)
            f, g = 0.5 * (f + ft), 0.5 * (g + gt)
        n_iter = len(eps_list)
    mass_a = float(a.sum())
    t = None
    s = geom.softmin_x(log_b + g / eps, eps)
    while True:  # at the target eps: alternating updates; (f, g, s, t) stay mutually consistent
        err = float(_marginal_error(a, f, s, pen_a, eps)) / mass_a
        if err <= tol or n_iter >= max_iter:
            break
        f = pen_a.aprox(s, eps)
        t = geom.softmin_y(log_a + f / eps, eps)
        g = pen_b.aprox(t, eps)
        s = geom.softmin_x(log_b + g / eps, eps)
        n_iter += 1
    if t is None:  # no alternating update ran: the column soft-min for the final f (one pass; g stays, so the
        # solve costs 2 L + 4 passes at max_iter = L, as GeomLoss's L updates + last extrapolation)
        t = geom.softmin_y(log_a + f / eps, eps)
    _check_finite(f, g, err, tol, max_iter)
    return _Solution(f, g, s, t, n_iter, err)


def _symmetric_loop(geom, log_a, a, pen: Penalty, eps_list: Sequence[float], tol: float, max_iter: int,
                    init=None) -> _Solution:
    """Self-transport OT(a, a) (x = y, u = v): the optimal f equals g, and the averaged update
    f <- (f + A(S(f))) / 2 converges fast even where alternating updates crawl (isolated points)."""
    if init is not None:
        eps_list = eps_list[-1:]
        f = init[0]
    else:
        f = pen.aprox(geom.softmin_x(log_a, eps_list[0]), eps_list[0])
    n_iter = 0
    for eps in eps_list[:-1]:
        f = 0.5 * (f + pen.aprox(geom.softmin_x(log_a + f / eps, eps), eps))
        n_iter += 1
    eps = eps_list[-1]
    mass_a = float(a.sum())
    while True:
        s = geom.softmin_x(log_a + f / eps, eps)
        err = float(_marginal_error(a, f, s, pen, eps)) / mass_a
        if err <= tol or n_iter >= max_iter:
            break
        f = 0.5 * (f + pen.aprox(s, eps))
        n_iter += 1
    _check_finite(f, f, err, tol, max_iter)
    return _Solution(f, f, s, s, n_iter, err)


class _EnvelopeValue(torch.autograd.Function):
    """Returns a precomputed dual value; its backward applies the envelope theorem.

    Saved: x, y (points), row_mass (N,) ~ pi 1 and col_mass (M,) ~ pi^T 1 (each side's marginal after an
    exact update of its own potential), ga (N,), gb (M,) the weight gradients, hx (M,) / hy (N,) the
    column / row log-weights of the plan's softmax.
    """

    @staticmethod
    def forward(ctx, value, x, y, a, b, u, v, row_mass, col_mass, ga, gb, hx, hy, ops, eps, p):
        ctx.save_for_backward(x, y, row_mass, col_mass, ga, gb, hx, hy)
        ctx.ops, ctx.eps, ctx.p = ops, eps, p
        ctx.has_u, ctx.has_v = u is not None, v is not None
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        x, y, row_mass, col_mass, ga, gb, hx, hy = ctx.saved_tensors
        need = ctx.needs_input_grad
        gx = gy = gA = gB = gu = gv = None
        if need[1]:
            gx = grad * row_mass[:, None] * ctx.ops.weighted_mean(x, y, hx, ctx.eps, ctx.p, "grad")
        if need[2]:
            gy = grad * col_mass[:, None] * ctx.ops.weighted_mean(y, x, hy, ctx.eps, ctx.p, "grad")
        if need[3]:
            gA = grad * ga
        if need[4]:
            gB = grad * gb
        if need[5] and ctx.has_u:
            gu = grad * row_mass
        if need[6] and ctx.has_v:
            gv = grad * col_mass
        return None, gx, gy, gA, gB, gu, gv, None, None, None, None, None, None, None, None, None


@dataclass(frozen=True)
class SinkhornResult:
    r"""Output of :func:`sinkhorn`.

    Attributes:
        f (N,), g (M,): dual potentials, in cost units (plan pi_ij = a_i b_j exp((f_i+g_j-c'_ij)/eps)).
        value (): the dual objective, differentiable w.r.t. x, y, a, b, u, v (envelope theorem).
        n_iter: number of Sinkhorn updates (eps-scaling steps included).
        marginal_error: L1 gap between the plan's marginals and those the penalty prescribes,
            relative to the mass of a (for balanced OT: |pi 1 - a|_1 / |a|).
        row_mass (N,): mass transported from each source point, pi 1.
        col_mass (M,): mass transported to each target point, pi^T 1.
        eps, p, backend: the entropic regularisation (cost units), cost exponent and backend used.
    """

    f: torch.Tensor
    g: torch.Tensor
    value: torch.Tensor
    n_iter: int
    marginal_error: float
    row_mass: torch.Tensor
    col_mass: torch.Tensor
    eps: float
    p: int
    backend: str
    _geom: Geometry
    _a: torch.Tensor
    _b: torch.Tensor

    @property
    def transported_mass(self) -> float:
        """Total mass of the plan restricted to real points, sum_ij pi_ij."""
        return float(self.row_mass.sum())

    def plan(self, max_entries: int = 1 << 26) -> torch.Tensor:
        """Dense (N, M) plan over real points; refuses above ``max_entries`` entries."""
        geom = self._geom
        if geom.n * geom.m > max_entries:
            raise ValueError(f"a dense {geom.n} x {geom.m} plan exceeds max_entries={max_entries}; "
                             "use row_mass / barycentric_projection instead")
        from .kernels.tensorized import cost_matrix

        c = cost_matrix(geom.x, geom.y, geom.p)
        if geom.u is not None:
            c = c + geom.u[:, None]
        if geom.v is not None:
            c = c + geom.v[None, :]
        f, g = self.f.detach(), self.g.detach()
        return self._a[:, None] * self._b[None, :] * torch.exp((f[:, None] + g[None, :] - c) / self.eps)

    def _col_logits(self) -> torch.Tensor:
        """(M,) column log-weights h_j such that pi_ij ∝_i exp(h_j - C_ij / eps) within each row."""
        h = torch.log(self._b) + self.g.detach() / self.eps
        return h if self._geom.v is None else h - self._geom.v / self.eps

    def barycentric_projection(self) -> torch.Tensor:
        """(N, D) sum_j pi_ij y_j / sum_j pi_ij: where the plan sends each source point (one kernel pass)."""
        geom = self._geom
        return geom.ops.weighted_mean(geom.x, geom.y, self._col_logits(), self.eps, geom.p, "y")

    def plan_argmax(self) -> torch.Tensor:
        """(N,) int64 index j of the largest plan entry in each row (label propagation: point i takes
        the label of y_j); one kernel pass, no N x M matrix."""
        geom = self._geom
        return geom.ops.plan_argmax(geom.x, geom.y, self._col_logits(), self.eps, geom.p)


def _dual_value(a, b, f, g, s, t, pen_a: Penalty, pen_b: Penalty, eps: float):
    """Dual objective and its partial derivatives w.r.t. a and b at fixed potentials."""
    ratio_a = torch.exp((f - s) / eps)  # (pi 1)_i / a_i
    ratio_b = torch.exp((g - t) / eps)
    mass_a, mass_b = a.sum(), b.sum()
    plan_mass = (b * ratio_b).sum()
    value = (a * pen_a.phi(f)).sum() + (b * pen_b.phi(g)).sum() - eps * (plan_mass - mass_a * mass_b)
    ga = pen_a.phi(f) - eps * (ratio_a - mass_b)
    gb = pen_b.phi(g) - eps * (ratio_b - mass_a)
    return value, ga, gb


def sinkhorn(
    x: torch.Tensor,
    y: torch.Tensor,
    a: Optional[torch.Tensor] = None,
    b: Optional[torch.Tensor] = None,
    *,
    p: int = 2,
    eps: Optional[float] = None,
    penalty: str = "balanced",
    tau: Union[float, tuple, None] = None,
    mass: Optional[float] = None,
    u: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    scaling: float = 0.5,
    diameter: Optional[float] = None,
    tol: float = 1e-4,
    max_iter: int = 1000,
    backend: str = "auto",
    init: Optional[tuple] = None,
) -> SinkhornResult:
    r"""Entropic (unbalanced / partial) OT between sum_i a_i delta_{x_i} and sum_j b_j delta_{y_j}.

    Args:
        x: (N, D) source points. y: (M, D) target points (same dtype and device).
        a: (N,) non-negative weights (default 1/N). b: (M,) (default 1/M). Zero weights are allowed.
        p: 1 for the cost |x - y|, 2 for |x - y|^2 / 2.
        eps: entropic regularisation in cost units (= blur**p); default 0.05**p.
        penalty: 'balanced' (hard marginals), 'kl' (unbalanced) or 'tv' (partial-like), with strength
            ``tau`` (a number or a pair (tau_a, tau_b); inf makes that side balanced). Same as POT's reg_m.
        mass: transported mass s for entropic partial OT (dummy-point augmentation); needs 'balanced'.
        u: (N,), v: (M,) cost offsets: the cost becomes C(x_i, y_j) + u_i + v_j (soft SROT). With
            ``mass``, offsets apply to real pairs only (not transporting a point is free).
        scaling: eps-scaling factor in (0, 1); eps goes from diameter**p to eps by factors scaling**p.
        diameter: the data diameter for eps-scaling (default: diagonal of the bounding box).
        tol: stop when the relative L1 marginal error is <= tol; max_iter: cap on the updates.
        backend: 'auto' | 'tensorized' | 'cpu' | 'keops' | 'triton' (see srot_fast.backends).
        init: optional warm start (f0 (N,), g0 (M,)), e.g. the potentials of a previous, nearby
            problem (gradient flows); skips eps-scaling.

    Returns:
        :class:`SinkhornResult` (potentials, differentiable value, n_iter, marginal error, masses).

    Example:
        >>> x, y = torch.randn(100, 2), torch.randn(80, 2) + 1
        >>> res = sinkhorn(x, y, p=1, eps=0.01, penalty="kl", tau=1.0)
        >>> res.value, res.n_iter, res.row_mass.sum()
    """
    x = _checks.check_points(x, "x")
    y = _checks.check_points(y, "y")
    _checks.check_pair(x, y)
    p = _checks.check_p(p)
    a = _checks.check_weights(a, x, "a")
    b = _checks.check_weights(b, y, "b")
    u = _checks.check_offsets(u, x, "u")
    v = _checks.check_offsets(v, y, "v")
    eps = _checks.check_positive(0.05**p if eps is None else eps, "eps")
    scaling = _checks.check_positive(scaling, "scaling")
    if not scaling < 1:
        raise ValueError(f"scaling must be in (0, 1), got {scaling}")
    tol = _checks.check_positive(tol, "tol")
    if not isinstance(max_iter, int) or max_iter < 0:
        raise ValueError(f"max_iter must be a non-negative int, got {max_iter!r}")
    if penalty == "balanced":
        if tau is not None:
            raise ValueError("tau is only used with penalty='kl' or 'tv'; leave it None for 'balanced'")
        tau_a = tau_b = math.inf
    elif penalty in ("kl", "tv"):
        if tau is None:
            raise ValueError(f"penalty={penalty!r} needs tau (a positive number or a pair (tau_a, tau_b))")
        tau_a, tau_b = _checks.pair_of(tau, "tau")
    else:
        raise ValueError(f"penalty must be 'balanced', 'kl' or 'tv', got {penalty!r}")
    pen_a, pen_b = Penalty(penalty, tau_a), Penalty(penalty, tau_b)
    name = resolve_backend(backend, x.shape[0], y.shape[0], x.device)
    ops = get_ops(name)

    xd, yd, ad, bd = x.detach(), y.detach(), a.detach(), b.detach()
    ud = None if u is None else u.detach()
    vd = None if v is None else v.detach()
    geom = Geometry(ops, xd, yd, p, ud, vd)
    diam = bbox_diameter(xd, yd) if diameter is None else _checks.check_positive(diameter, "diameter")
    eps_list = epsilon_schedule(p, diam, eps ** (1 / p), scaling)
    mass_a, mass_b = float(ad.sum()), float(bd.sum())

    if init is not None:
        if not (isinstance(init, (tuple, list)) and len(init) == 2):
            raise TypeError("init must be a pair (f0, g0) of potentials")
        init = (_checks.check_offsets(init[0], x, "init[0]").detach(),
                _checks.check_offsets(init[1], y, "init[1]").detach())

    with torch.no_grad():
        if mass is not None:
            if penalty != "balanced":
                raise ValueError("mass (partial OT) needs penalty='balanced'")
            mass = _checks.check_positive(mass, "mass")
            if mass > min(mass_a, mass_b) * (1 + 1e-12):
                raise ValueError(f"mass must be <= min(a.sum(), b.sum()) = {min(mass_a, mass_b):.6g}, got {mass}")
            one = ad.new_ones(1)
            aa = torch.cat([ad, one * (mass_b - mass)])
            bb = torch.cat([bd, one * (mass_a - mass)])
            if init is not None:  # dummy potentials start at 0
                init = (torch.cat([init[0], init[0].new_zeros(1)]), torch.cat([init[1], init[1].new_zeros(1)]))
            sol = _sinkhorn_loop(PartialGeometry(geom), aa.log(), bb.log(), aa, pen_a, pen_b,
                                 eps_list, tol, max_iter, init)
            value, ga_aug, gb_aug = _dual_value(aa, bb, sol.f, sol.g, sol.s, sol.t, pen_a, pen_b, eps)
            ga = ga_aug[:-1] + gb_aug[-1]  # b'_M = |a| - s depends on a
            gb = gb_aug[:-1] + ga_aug[-1]
            f, g = sol.f[:-1], sol.g[:-1]
            f_hat, g_hat = pen_a.aprox(sol.s, eps)[:-1], pen_b.aprox(sol.t, eps)[:-1]
            s_real = geom.softmin_x(bd.log() + g / eps, eps)
            t_real = geom.softmin_y(ad.log() + f / eps, eps)
        else:
            if pen_a.balanced and pen_b.balanced and abs(mass_a - mass_b) > 1e-6 * max(mass_a, mass_b):
                raise ValueError(
                    f"balanced OT needs a and b of equal total mass, got {mass_a:.6g} and {mass_b:.6g}; "
                    "normalise them or use penalty='kl'/'tv'"
                )
            if x is y and a is b and u is v and tau_a == tau_b:  # self-transport (debiasing terms)
                sol = _symmetric_loop(geom, ad.log(), ad, pen_a, eps_list, tol, max_iter, init)
            else:
                sol = _sinkhorn_loop(geom, ad.log(), bd.log(), ad, pen_a, pen_b, eps_list, tol, max_iter, init)
            value, ga, gb = _dual_value(ad, bd, sol.f, sol.g, sol.s, sol.t, pen_a, pen_b, eps)
            f, g, s_real, t_real = sol.f, sol.g, sol.s, sol.t
            f_hat, g_hat = pen_a.aprox(sol.s, eps), pen_b.aprox(sol.t, eps)
        row_mass = ad * torch.exp((f - s_real) / eps)
        col_mass = bd * torch.exp((g - t_real) / eps)
        # Point / offset gradients: the x-side uses f_hat, the exact update of f for the final g (and the y-side
        # g_hat for the final f), i.e. the gradient of max_f D(f, g) in x and of max_g D(f, g) in y. At
        # convergence f_hat = f and g_hat = g; with a fixed iteration budget (GeomLoss-style flows) the row
        # weights stay a_i-sized instead of a_i exp((f - f_hat) / eps), which blew up a 100k-point flow.
        grad_row = ad * torch.exp((f_hat - s_real) / eps)
        grad_col = bd * torch.exp((g_hat - t_real) / eps)
        hx = bd.log() + (g if vd is None else g - vd) / eps
        hy = ad.log() + (f if ud is None else f - ud) / eps

    value = _EnvelopeValue.apply(value, x, y, a, b, u, v, grad_row, grad_col, ga, gb, hx, hy, ops, eps, p)
    return SinkhornResult(f=f, g=g, value=value, n_iter=sol.n_iter, marginal_error=sol.marginal_error,
                          row_mass=row_mass, col_mass=col_mass, eps=eps, p=p, backend=name,
                          _geom=geom, _a=ad, _b=bd)
