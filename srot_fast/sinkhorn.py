r"""Log-domain (unbalanced / partial) entropic OT, written once for every backend (docs/DESIGN.md, Solver).

Problem, for weights a (N,), b (M,), cost c'_ij = C(x_i, y_j) + u_i + v_j:
    min_{pi >= 0} <c', pi> + eps KL(pi | a (x) b) + tau_a D(pi 1 | a) + tau_b D(pi^T 1 | b),
D = KL, TV, or a hard constraint (balanced, tau = inf). Dual updates
    f <- A_a(-eps LSE_j[log b_j + (g_j - c'_ij)/eps]),  g <- A_b(-eps LSE_i[log a_i + (f_i - c'_ij)/eps]),
plan pi_ij = a_i b_j exp((f_i + g_j - c'_ij)/eps), value = the dual objective
    <a, phi_a(f)> + <b, phi_b(g)> - eps (<pi, 1> - |a| |b|).

The iteration (eps-scaling, then accelerated alternating updates) is in
:mod:`srot_fast._loop`; it sees only ``geom.softmin_x`` / ``geom.softmin_y`` (srot_fast.geometry) and
never branches on a backend. A leading batch dimension solves B problems as one (one kernel launch per
pass). Gradients of the value follow the envelope theorem (never back-propagation through the
iterations): d/dx_i = sum_j pi_ij grad_x C(x_i, y_j), d/da_i = phi_a(f_i) - eps (pi 1_i / a_i - |b|).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional, Union

import torch

from . import _checks, _loop, _multiscale
from ._loop import epsilon_schedule
from .backends import get_ops, resolve_backend
from .geometry import Geometry, PartialGeometry, bbox_diameter
from .penalties import Penalty

__all__ = ["sinkhorn", "SinkhornResult", "epsilon_schedule", "ConvergenceWarning"]


class ConvergenceWarning(UserWarning):
    """Sinkhorn stopped at ``max_iter`` before reaching ``tol``."""


# ------------------------------------------------------------------------------------------ gradients
class _NoSecondOrder(torch.autograd.Function):
    """Returns ``t``, recorded as a function of the inputs ``anchors``, with a backward that refuses:
    marks first-order gradients (built with create_graph=True) that must not be differentiated again."""

    @staticmethod
    def forward(ctx, t, *anchors):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(
            "srot_fast: second-order derivatives (double backward / Hessian-vector products) of an OT value are "
            "not supported; its gradients come from the envelope theorem, which is exact to first order only. "
            "Use torch.autograd.grad(..., create_graph=False), or finite differences of the gradient.")


@dataclass
class _Saved:
    """What the envelope backward needs (batched, detached). Shapes for B problems."""

    ops: object
    eps: float
    p: int
    grad_row: torch.Tensor  # (B, N) pi 1 after an exact update of f for the final g
    grad_col: torch.Tensor  # (B, M) pi^T 1 after an exact update of g for the final f
    ga: torch.Tensor        # (B, N) d value / d a
    gb: torch.Tensor        # (B, M) d value / d b
    hx: torch.Tensor        # (B, M) column log-weights of the plan's row softmax
    hy: torch.Tensor        # (B, N) row log-weights of the plan's column softmax


class _EnvelopeValue(torch.autograd.Function):
    """Returns precomputed dual values (B,); its backward applies the envelope theorem."""

    @staticmethod
    def forward(ctx, value, saved: _Saved, x, y, a, b, u, v):
        ctx.save_for_backward(x, y, a, b, u, v)
        ctx.saved = saved
        ctx.has_u, ctx.has_v = u is not None, v is not None
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        x, y, a, b, u, v = ctx.saved_tensors
        sv: _Saved = ctx.saved
        need = ctx.needs_input_grad
        second = torch.is_grad_enabled()  # create_graph=True: the result must not be differentiated again
        grad = grad.detach()
        gx = gy = gA = gB = gu = gv = None
        with torch.no_grad():
            gr = grad[:, None]
            if need[2]:
                gx = (gr * sv.grad_row)[..., None] * sv.ops.weighted_mean(x.detach(), y.detach(), sv.hx, sv.eps,
                                                                           sv.p, "grad")
            if need[3]:
                gy = (gr * sv.grad_col)[..., None] * sv.ops.weighted_mean(y.detach(), x.detach(), sv.hy, sv.eps,
                                                                           sv.p, "grad")
            gA = gr * sv.ga if need[4] else None
            gB = gr * sv.gb if need[5] else None
            gu = gr * sv.grad_row if need[6] and ctx.has_u else None
            gv = gr * sv.grad_col if need[7] and ctx.has_v else None
        outs = [gx, gy, gA, gB, gu, gv]
        if second:
            anchors = [t for t in (x, y, a, b, u, v) if t is not None and t.requires_grad]
            outs = [None if o is None else _NoSecondOrder.apply(o, *anchors) for o in outs]
        return (None, None, *outs)


# ------------------------------------------------------------------------------------------- result
@dataclass(frozen=True)
class SinkhornResult:
    r"""Output of :func:`sinkhorn`. Shapes below are for one problem; a batched call adds a leading B.

    Attributes:
        f (N,), g (M,): dual potentials, in cost units (plan pi_ij = a_i b_j exp((f_i+g_j-c'_ij)/eps)).
        value (): the dual objective, differentiable w.r.t. x, y, a, b, u, v (envelope theorem).
        n_iter: updates spent (eps-scaling included); an int, or a (B,) int64 tensor for a batch.
        marginal_error: L1 gap between the plan's marginals and those the penalty prescribes,
            relative to the mass of a (for balanced OT: |pi 1 - a|_1 / |a|); a float, or (B,) for a batch.
        converged: whether the solve met ``tol`` or ``value_tol`` (always True with ``tol=None``); a bool,
            or (B,) for a batch.
        row_mass (N,): mass transported from each source point, pi 1.
        col_mass (M,): mass transported to each target point, pi^T 1.
        eps, p, backend: the entropic regularisation (cost units), cost exponent and backend used.
        passes: soft-min kernel passes launched (each covers the whole batch); syncs: host
            synchronisations spent on the stopping test.
    """

    f: torch.Tensor
    g: torch.Tensor
    value: torch.Tensor
    n_iter: Union[int, torch.Tensor]
    marginal_error: Union[float, torch.Tensor]
    converged: Union[bool, torch.Tensor]
    row_mass: torch.Tensor
    col_mass: torch.Tensor
    eps: float
    p: int
    backend: str
    passes: int
    syncs: int
    _geom: Geometry
    _a: torch.Tensor
    _b: torch.Tensor
    _batched: bool

    @property
    def transported_mass(self):
        """Total mass of the plan restricted to real points, sum_ij pi_ij (a float, or (B,) for a batch)."""
        m = self.row_mass.sum(-1)
        return m if self._batched else float(m)

    def _out(self, t: torch.Tensor) -> torch.Tensor:
        return t if self._batched else t[0]

    def plan(self, max_entries: int = 1 << 26) -> torch.Tensor:
        """Dense (N, M) plan over real points ((B, N, M) for a batch); refuses above ``max_entries`` entries."""
        geom = self._geom
        if geom.batch * geom.n * geom.m > max_entries:
            raise ValueError(f"a dense {geom.n} x {geom.m} plan exceeds max_entries={max_entries}; "
                             "use row_mass / barycentric_projection instead")
        from .kernels.tensorized import cost_matrix

        c = cost_matrix(geom.x, geom.y, geom.p)
        if geom.u is not None:
            c = c + geom.u[..., :, None]
        if geom.v is not None:
            c = c + geom.v[..., None, :]
        f, g = self._f.detach(), self._g.detach()
        logits = (f[..., :, None] + g[..., None, :] - c) / self.eps
        pi = self._a[..., :, None] * self._b[..., None, :] * torch.exp(logits)
        return self._out(pi)

    @property
    def _f(self) -> torch.Tensor:
        return self.f if self._batched else self.f[None]

    @property
    def _g(self) -> torch.Tensor:
        return self.g if self._batched else self.g[None]

    def _col_logits(self) -> torch.Tensor:
        """(B, M) column log-weights h_j such that pi_ij ∝_j exp(h_j - C_ij / eps) within each row."""
        h = torch.log(self._b) + self._g.detach() / self.eps
        return h if self._geom.v is None else h - self._geom.v / self.eps

    def barycentric_projection(self) -> torch.Tensor:
        """(N, D) sum_j pi_ij y_j / sum_j pi_ij: where the plan sends each source point (one kernel pass)."""
        geom = self._geom
        return self._out(geom.ops.weighted_mean(geom.x, geom.y, self._col_logits(), self.eps, geom.p, "y"))

    def plan_argmax(self) -> torch.Tensor:
        """(N,) int64 index j of the largest plan entry in each row (label propagation: point i takes
        the label of y_j); one kernel pass, no N x M matrix."""
        geom = self._geom
        return self._out(geom.ops.plan_argmax(geom.x, geom.y, self._col_logits(), self.eps, geom.p))


# ------------------------------------------------------------------------------------------ helpers
def _dual_value(a, b, f, g, s, t, pen_a: Penalty, pen_b: Penalty, eps: float):
    """(B,) dual objectives and their partial derivatives (B, N), (B, M) w.r.t. a and b at fixed potentials."""
    ratio_a = torch.exp((f - s) / eps)  # (pi 1)_i / a_i
    ratio_b = torch.exp((g - t) / eps)
    mass_a, mass_b = a.sum(-1, keepdim=True), b.sum(-1, keepdim=True)
    plan_mass = (b * ratio_b).sum(-1)
    value = ((a * pen_a.phi(f)).sum(-1) + (b * pen_b.phi(g)).sum(-1)
             - eps * (plan_mass - (mass_a * mass_b)[:, 0]))
    ga = pen_a.phi(f) - eps * (ratio_a - mass_b)
    gb = pen_b.phi(g) - eps * (ratio_b - mass_a)
    return value, ga, gb


def _schedule_value(a, b, f, g, pen_a: Penalty, pen_b: Penalty, eps: float) -> torch.Tensor:
    """(B,) GeomLoss's value for its fixed schedule (``tol=None``): <a, f> + <b, g> (balanced), or
    (tau + eps/2) <a, 1 - exp(-f/tau)> + ... (KL). It equals the dual objective at the fixed point."""
    def side(w, pot, pen):
        if pen.kind == "kl":
            return (pen.tau + eps / 2) * (w * -torch.expm1(-pot / pen.tau)).sum(-1)
        return (w * pen.phi(pot)).sum(-1)
    return side(a, f, pen_a) + side(b, g, pen_b)


def _penalties(penalty: str, tau) -> tuple[Penalty, Penalty]:
    if penalty == "balanced":
        if tau is not None:
            raise ValueError("tau is only used with penalty='kl' or 'tv'; leave it None for 'balanced'")
        return Penalty("balanced"), Penalty("balanced")
    if penalty in ("kl", "tv"):
        if tau is None:
            raise ValueError(f"penalty={penalty!r} needs tau (a positive number or a pair (tau_a, tau_b))")
        tau_a, tau_b = _checks.pair_of(tau, "tau")
        return Penalty(penalty, tau_a), Penalty(penalty, tau_b)
    raise ValueError(f"penalty must be 'balanced', 'kl' or 'tv', got {penalty!r}")


def _check_solution(sol: _loop.Solution, tol: Optional[float], max_iter: int, value_tol: Optional[float]) -> None:
    if not (torch.isfinite(sol.f).all() and torch.isfinite(sol.g).all() and torch.isfinite(sol.marginal_error).all()):
        raise FloatingPointError(
            "Sinkhorn produced non-finite potentials; eps may be too small for this dtype "
            "(try float64 or a larger blur)")
    if tol is not None and not bool(sol.converged.all()):
        worst = float(sol.marginal_error[~sol.converged].max())
        also = "" if value_tol is None else f" and the value had not passed value_tol={value_tol:g}"
        warnings.warn(f"Sinkhorn stopped at max_iter={max_iter} with relative marginal error {worst:.2e} > "
                      f"tol={tol:g}{also}; raise max_iter, eps (blur) or tol", ConvergenceWarning, stacklevel=4)


def _empty(x, y, a, b, eps, p, name, ops, in_dtype) -> SinkhornResult:
    z = (x.sum((1, 2)) + y.sum((1, 2))) * 0
    zn, zm = a.new_zeros(0, x.shape[1]), b.new_zeros(0, y.shape[1])
    return SinkhornResult(f=zn, g=zm, value=z.to(in_dtype), n_iter=torch.zeros(0, dtype=torch.int64),
                          marginal_error=x.new_zeros(0, dtype=torch.float64),
                          converged=torch.zeros(0, dtype=torch.bool), row_mass=zn, col_mass=zm, eps=eps,
                          p=p, backend=name, passes=0, syncs=0,
                          _geom=Geometry(ops, x.detach(), y.detach(), p), _a=a.detach(), _b=b.detach(), _batched=True)


# ------------------------------------------------------------------------------------------- solver
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
    tol: Optional[float] = 1e-4,
    max_iter: int = 1000,
    backend: str = "auto",
    init: Optional[tuple] = None,
    accelerate: bool = True,
    check_every: Optional[int] = None,
    value_tol: Optional[float] = None,
) -> SinkhornResult:
    r"""Entropic (unbalanced / partial) OT between sum_i a_i delta_{x_i} and sum_j b_j delta_{y_j}.

    Args:
        x: (N, D) source points, or (B, N, D) for B problems solved as one. y: (M, D) or (B, M, D)
            target points (same dtype and device). float16 / bfloat16 are computed in float32 and the
            value is returned in the input dtype.
        a: (N,) or (B, N) non-negative weights (default 1/N). b: (M,) or (B, M) (default 1/M). Zero weights
            are allowed (ragged batches: pad with zero-weight points).
        p: 1 for the cost |x - y|, 2 for |x - y|^2 / 2.
        eps: entropic regularisation in cost units (= blur**p); default 0.05**p.
        penalty: 'balanced' (hard marginals), 'kl' (unbalanced) or 'tv' (partial-like), with strength
            ``tau`` (a number or a pair (tau_a, tau_b); inf makes that side balanced). Same as POT's reg_m.
        mass: transported mass s for entropic partial OT (dummy-point augmentation); needs 'balanced'.
        u: (N,), v: (M,) cost offsets (batched like the points): the cost becomes C(x_i, y_j) + u_i + v_j
            (soft SROT). With ``mass``, offsets apply to real pairs only (not transporting a point is free).
        scaling: eps-scaling factor in (0, 1); eps goes from diameter**p to eps by factors scaling**p.
        diameter: the data diameter for eps-scaling (default: diagonal of the bounding box of the points
            of positive weight).
        tol: stop when every problem's relative L1 marginal error is <= tol. ``None``: GeomLoss's fixed
            schedule (one averaged update per eps, then one extrapolation; no stopping test), with GeomLoss's
            value formula (for probability weights it equals the dual objective at the fixed point).
        max_iter: cap on all updates, eps-scaling included (a longer eps schedule is thinned to fit).
        backend: 'auto' | 'tensorized' | 'cpu' | 'keops' | 'triton' (see srot_fast.backends).
        init: optional warm start (f0, g0) shaped like the potentials, e.g. those of a previous, nearby
            problem (gradient flows); skips eps-scaling.
        accelerate: safeguarded Anderson acceleration of the updates (over-relaxation for partial OT; see
            srot_fast._loop); False gives plain alternating Sinkhorn updates.
        check_every: updates between two host checks of the stopping test (default: every update on
            the CPU, adaptive on CUDA, where each check is a device synchronisation).
        value_tol: also stop a problem when its value has converged to about this relative accuracy and
            its marginal error is <= 100 tol: the dual objective is read every 8 updates, and the problem
            stops when the geometric tail of its rises, d_k r / (1 - r) with r = d_k / d_{k-1}, is
            <= value_tol |value| (a heuristic estimate, docs/DESIGN.md, Solver).
            None (default): the marginal test alone. ``SROTLoss`` uses tol / 10 (1e-4 at its default tol).

    Returns:
        :class:`SinkhornResult` (potentials, differentiable value, n_iter, marginal error, masses).

    Example:
        >>> x, y = torch.randn(100, 2), torch.randn(80, 2) + 1
        >>> res = sinkhorn(x, y, p=1, eps=0.01, penalty="kl", tau=1.0)
        >>> res.value, res.n_iter, res.row_mass.sum()
    """
    p = _checks.check_p(p)
    eps = _checks.check_positive(0.05**p if eps is None else eps, "eps")
    return _solve(x, y, a, b, p=p, eps=eps, penalty=penalty, tau=tau, mass=mass, u=u, v=v, scaling=scaling,
                  diameter=diameter, tol=tol, max_iter=max_iter, backend=backend, init=init,
                  accelerate=accelerate, check_every=check_every, value_tol=value_tol)


def _solve(x, y, a=None, b=None, *, p, eps, penalty="balanced", tau=None, mass=None, u=None, v=None,
           scaling=0.5, diameter=None, tol=1e-4, max_iter=1000, backend="auto", init=None, accelerate=True,
           check_every=None, self_transport=False, value_tol=None) -> SinkhornResult:
    """:func:`sinkhorn` after its scalar checks; ``self_transport=True`` (x is y, a is b, u is v) takes the
    symmetric loop. ``diameter`` may be 0 here (identical clouds)."""
    batched = torch.is_tensor(x) and x.dim() == 3
    x = _checks.check_points(x, "x", batched=True)
    y = _checks.check_points(y, "y", batched=True)
    _checks.check_pair(x, y)
    in_dtype = x.dtype
    a = _checks.check_weights(a, x, "a")
    b = _checks.check_weights(b, y, "b")
    u = _checks.check_offsets(u, x, "u")
    v = _checks.check_offsets(v, y, "v")
    name = resolve_backend(backend, x.shape[-2], y.shape[-2], x.device, points=(x, y), eps=eps, p=p)
    x, y = _checks.compute_dtype(x, y, keep_half=name == "triton")  # Triton loads half points as they are
    a, b, u, v = _checks.compute_dtype(a, b, u, v)
    cdt = a.dtype  # the dtype the solver runs in (float32 for half points)
    scaling = _checks.check_positive(scaling, "scaling")
    if not scaling < 1:
        raise ValueError(f"scaling must be in (0, 1), got {scaling}")
    if tol is not None:
        tol = _checks.check_positive(tol, "tol")
    if value_tol is not None:
        value_tol = _checks.check_positive(value_tol, "value_tol")
    max_iter = _checks.non_negative_int(max_iter, "max_iter")
    check_every = _checks.positive_int(check_every, "check_every", allow_none=True)
    pen_a, pen_b = _penalties(penalty, tau)
    if mass is not None:
        if penalty != "balanced":
            raise ValueError("mass (partial OT) needs penalty='balanced'")
        mass = _checks.check_positive(mass, "mass")
        if self_transport:
            raise ValueError("self-transport is not defined for partial OT (mass)")
    if not batched:
        x, y, a, b = x[None], y[None], a[None], b[None]
        u = None if u is None else u[None]
        v = None if v is None else v[None]
    ops = get_ops(name)
    if x.shape[0] == 0:  # an empty batch: empty results, still connected to the inputs
        return _empty(x, y, a, b, eps, p, name, ops, in_dtype)

    xd, yd, ad, bd = x.detach(), y.detach(), a.detach(), b.detach()
    ud = None if u is None else u.detach()
    vd = None if v is None else v.detach()
    geom = Geometry(ops, xd, yd, p, ud, vd)
    if diameter is None:
        diam = bbox_diameter(xd, yd, ad, bd)
    else:
        diam = float(diameter) if diameter == 0 else _checks.check_positive(diameter, "diameter")
    _checks.check_scale(diam, p, eps, cdt)
    mass_a, mass_b = ad.sum(-1), bd.sum(-1)
    _checks.check_masses(mass_a, mass_b, cdt)
    eps_list = epsilon_schedule(p, diam, eps ** (1 / p), scaling)

    if init is not None:
        if not (isinstance(init, (tuple, list)) and len(init) == 2):
            raise TypeError("init must be a pair (f0, g0) of potentials")
        f0 = _checks.check_offsets(init[0], x if batched else x[0], "init[0]")
        g0 = _checks.check_offsets(init[1], y if batched else y[0], "init[1]")
        init = (f0.detach().to(cdt), g0.detach().to(cdt))
        if not batched:
            init = (init[0][None], init[1][None])

    with torch.no_grad():
        if mass is not None:
            if mass > float(torch.minimum(mass_a, mass_b).min()) * (1 + 1e-12):
                raise ValueError(f"mass must be <= min(a.sum(), b.sum()) = "
                                 f"{float(torch.minimum(mass_a, mass_b).min()):.6g}, got {mass}")
            # dummy weights |b| - s and |a| - s; clamped at 0 when s rounds above a float sum
            aa = torch.cat([ad, (mass_b - mass).clamp_min(0)[:, None]], -1)
            bb = torch.cat([bd, (mass_a - mass).clamp_min(0)[:, None]], -1)
            if init is not None:  # dummy potentials start at 0
                init = tuple(torch.cat([t, t.new_zeros(t.shape[0], 1)], -1) for t in init)
            pgeom = PartialGeometry(geom, mass)
            sol = _multiscale.alternating(pgeom, aa.log(), bb.log(), pen_a, pen_b, eps_list, tol,
                                          max_iter, init, accelerate, check_every, value_tol=value_tol)
            f, g = sol.f[:, :-1], sol.g[:, :-1]
            s_real = geom.softmin_x(bd.log() + g / eps, eps)
            t_real = geom.softmin_y(ad.log() + f / eps, eps)
            # the column soft-min of the augmented problem at the final f (the loop's t may predate the
            # last rebalancing shift of f), from the real one: no extra pass
            t_aug = pgeom._augment(t_real, aa.log() + sol.f / eps, eps)
            value, ga_aug, gb_aug = _dual_value(aa, bb, sol.f, sol.g, sol.s, t_aug, pen_a, pen_b, eps)
            ga = ga_aug[:, :-1] + gb_aug[:, -1:]  # b'_M = |a| - s depends on a
            gb = gb_aug[:, :-1] + ga_aug[:, -1:]
            f_hat, g_hat = pen_a.aprox(sol.s, eps)[:, :-1], pen_b.aprox(t_aug, eps)[:, :-1]
            passes = sol.passes + 2
        else:
            if pen_a.balanced and pen_b.balanced:
                rtol = 1e-6 if in_dtype in (torch.float32, torch.float64) else 1e-3  # half weights round at ~5e-4
                gap = (mass_a - mass_b).abs() > rtol * torch.maximum(mass_a, mass_b)
                if bool(gap.any()):
                    k = int(gap.nonzero()[0])
                    raise ValueError(
                        f"balanced OT needs a and b of equal total mass, got {float(mass_a[k]):.6g} and "
                        f"{float(mass_b[k]):.6g}; normalise them or use penalty='kl'/'tv'")
            if self_transport:
                sol = _multiscale.symmetric(geom, ad.log(), pen_a, eps_list, tol, max_iter, init, check_every,
                                            value_tol=value_tol)
            else:
                sol = _multiscale.alternating(geom, ad.log(), bd.log(), pen_a, pen_b, eps_list, tol, max_iter,
                                              init, accelerate, check_every, value_tol=value_tol)
            value, ga, gb = _dual_value(ad, bd, sol.f, sol.g, sol.s, sol.t, pen_a, pen_b, eps)
            if tol is None:
                value = _schedule_value(ad, bd, sol.f, sol.g, pen_a, pen_b, eps)
            f, g, s_real, t_real = sol.f, sol.g, sol.s, sol.t
            f_hat, g_hat = pen_a.aprox(sol.s, eps), pen_b.aprox(sol.t, eps)
            passes = sol.passes
        _check_solution(sol, tol, max_iter, value_tol)
        row_mass = _checks.masses(ad, f, s_real, eps)
        col_mass = _checks.masses(bd, g, t_real, eps)
        # Point / offset gradients: the x-side uses f_hat, the exact update of f for the final g (and the y-side
        # g_hat for the final f), i.e. the gradient of max_f D(f, g) in x and of max_g D(f, g) in y. At
        # convergence f_hat = f and g_hat = g; with a fixed iteration budget (GeomLoss-style flows) the row
        # weights stay a_i-sized instead of a_i exp((f - f_hat) / eps), which blew up a 100k-point flow.
        saved = _Saved(ops=ops, eps=eps, p=p,
                       grad_row=_checks.masses(ad, f_hat, s_real, eps), grad_col=_checks.masses(bd, g_hat, t_real, eps),
                       ga=ga, gb=gb,
                       hx=bd.log() + (g if vd is None else g - vd) / eps,
                       hy=ad.log() + (f if ud is None else f - ud) / eps)

    value = _EnvelopeValue.apply(value, saved, x, y, a, b, u, v).to(in_dtype)
    n_iter = sol.n_iter if batched else int(sol.n_iter[0])
    err = sol.marginal_error if batched else float(sol.marginal_error[0])
    one = (lambda t: t) if batched else (lambda t: t[0])
    conv = sol.converged if batched else bool(sol.converged[0])
    return SinkhornResult(f=one(f), g=one(g), value=one(value), n_iter=n_iter, marginal_error=err, converged=conv,
                          row_mass=one(row_mass), col_mass=one(col_mass), eps=eps, p=p, backend=name,
                          passes=passes, syncs=sol.syncs, _geom=geom, _a=ad, _b=bd, _batched=batched)
