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

import math
import warnings
from dataclasses import dataclass
from typing import Optional, Union

import torch

from . import _checks, _loop, _multiscale
from ._envelope import EnvelopeValue, Saved
from ._loop import epsilon_schedule
from .backends import get_ops, resolve_backend
from .geometry import Geometry, PartialGeometry, bbox_diameter
from .kernels.triton.options import kernel_options
from .penalties import Penalty
from .result import SinkhornResult

__all__ = ["sinkhorn", "SinkhornResult", "epsilon_schedule", "ConvergenceWarning"]


class ConvergenceWarning(UserWarning):
    """Sinkhorn stopped at ``max_iter`` before reaching ``tol``."""


# ------------------------------------------------------------------------------------------- values
def _dual_value(a, b, f, g, s, t, pen_a: Penalty, pen_b: Penalty, eps: float, grads: bool = True):
    """(B,) dual objectives and their partial derivatives (B, N), (B, M) w.r.t. a and b at fixed potentials
    (None, None with ``grads=False``)."""
    ratio_b = torch.exp((g - t) / eps)  # (pi^T 1)_j / b_j
    mass_a, mass_b = a.sum(-1, keepdim=True), b.sum(-1, keepdim=True)
    plan_mass = (b * ratio_b).sum(-1)
    phi_f, phi_g = pen_a.phi(f), pen_b.phi(g)
    value = (a * phi_f).sum(-1) + (b * phi_g).sum(-1) - eps * (plan_mass - (mass_a * mass_b)[:, 0])
    if not grads:
        return value, None, None
    ga = phi_f - eps * (torch.exp((f - s) / eps) - mass_b)
    gb = phi_g - eps * (ratio_b - mass_a)
    return value, ga, gb


def schedule_terms(pen: Penalty, pot: torch.Tensor, eps: float) -> torch.Tensor:
    """Per point of one side, GeomLoss's value term for its fixed schedule (``tol=None``): pot (balanced), or
    (tau + eps/2) (1 - exp(-pot/tau)) (KL); weighted by a (b) and summed over both sides it is the value,
    which equals the dual objective at the fixed point."""
    if pen.kind == "kl":
        return (pen.tau + eps / 2) * -torch.expm1(-pot / pen.tau)
    return pen.phi(pot)


# ------------------------------------------------------------------------------------------- checks
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


@dataclass
class _Inputs:
    """The arguments of one solve after their checks: batched (B, ...) tensors in the compute dtype (still
    attached to the caller's graph), the solver's scalars, the backend and its kernel options."""

    x: torch.Tensor
    y: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    u: Optional[torch.Tensor]
    v: Optional[torch.Tensor]
    batched: bool           # the caller passed (B, N, D) points
    in_dtype: torch.dtype   # the dtype of the caller's points (the value's dtype)
    backend: str
    options: dict
    scaling: float
    tol: Optional[float]
    value_tol: Optional[float]
    max_iter: int
    check_every: Optional[int]
    accelerate: bool
    pen_a: Penalty
    pen_b: Penalty
    mass: Optional[float]

    @property
    def cdt(self) -> torch.dtype:
        """The dtype the solver runs in (float32 for half points)."""
        return self.a.dtype


def _check_inputs(x, y, a, b, u, v, *, p, eps, backend, precision, autotune, scaling, tol, value_tol, max_iter,
                  check_every, accelerate, penalty, tau, mass, self_transport, checked=False) -> _Inputs:
    """Every check of :func:`sinkhorn`'s arguments but the scalars p and eps (already checked; they help
    ``backend="auto"`` choose), in the order the errors show; unbatched inputs get a leading batch dimension of 1.
    ``checked=True``: the caller has passed x, y, a, b (tensors) through check_points, check_pair and
    check_weights already and made u, v finite offsets of the compute dtype (SROTLoss, whose three solves share
    them), and those checks are skipped."""
    batched = torch.is_tensor(x) and x.dim() == 3
    if not checked:
        x = _checks.check_points(x, "x", batched=True)
        y = _checks.check_points(y, "y", batched=True)
        _checks.check_pair(x, y)
        a = _checks.check_weights(a, x, "a")
        b = _checks.check_weights(b, y, "b")
        u = _checks.check_offsets(u, x, "u")
        v = _checks.check_offsets(v, y, "v")
    in_dtype = x.dtype
    name = resolve_backend(backend, x.shape[-2], y.shape[-2], x.device, points=(x, y), eps=eps, p=p)
    options = kernel_options(name, precision, autotune)
    x, y = _checks.compute_dtype(x, y, keep_half=name == "triton")  # Triton loads half points as they are
    a, b, u, v = _checks.compute_dtype(a, b, u, v)
    scaling = _checks.check_scaling(scaling)
    tol = None if tol is None else _checks.check_positive(tol, "tol")
    value_tol = None if value_tol is None else _checks.check_positive(value_tol, "value_tol")
    max_iter = _checks.non_negative_int(max_iter, "max_iter")
    check_every = _checks.positive_int(check_every, "check_every", allow_none=True)
    accelerate = _checks.check_flag(accelerate, "accelerate")
    pen_a, pen_b = _penalties(penalty, tau)
    if self_transport and pen_a != pen_b:
        raise ValueError(f"self-transport needs one penalty on both marginals, got {pen_a} and {pen_b}")
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
    return _Inputs(x, y, a, b, u, v, batched, in_dtype, name, options, scaling, tol, value_tol, max_iter,
                   check_every, accelerate, pen_a, pen_b, mass)


def _check_init(init, inp: _Inputs):
    """None, or the warm start (f0, g0) as detached (B, N), (B, M) potentials in the compute dtype."""
    if init is None:
        return None
    if not (isinstance(init, (tuple, list)) and len(init) == 2):
        raise TypeError("init must be a pair (f0, g0) of potentials")
    f0 = _checks.check_offsets(init[0], inp.x if inp.batched else inp.x[0], "init[0]")
    g0 = _checks.check_offsets(init[1], inp.y if inp.batched else inp.y[0], "init[1]")
    f0, g0 = f0.detach().to(inp.cdt), g0.detach().to(inp.cdt)
    return (f0, g0) if inp.batched else (f0[None], g0[None])


def _check_balance(mass_a, mass_b, in_dtype) -> None:
    """Balanced OT: every problem's a and b must carry the same total mass (to rounding)."""
    gap = (mass_a - mass_b).abs() > _checks.mass_rtol(in_dtype) * torch.maximum(mass_a, mass_b)
    if bool(gap.any()):
        k = int(gap.nonzero()[0])
        raise ValueError(f"balanced OT needs a and b of equal total mass, got {float(mass_a[k]):.6g} and "
                         f"{float(mass_b[k]):.6g}; normalise them or use penalty='kl'/'tv' with a finite tau")


UNRESOLVED = 0.1  # a rounding unit of the potentials above this many eps: the plan and its errors are not resolved


def _check_solution(sol: _loop.Solution, inp: _Inputs, eps: float) -> None:
    """Non-finite potentials raise; a problem not converged to ``tol`` gets a ConvergenceWarning. So does one whose
    potentials are so large that a rounding unit of them exceeds UNRESOLVED eps (partial OT whose potentials
    drifted, float32 at a tiny eps): its plan entries exp((f + g - C) / eps) and the marginal error computed from
    them are then off by 10 % or more (the error may read 0), and it is marked not converged."""
    finite = torch.isfinite(sol.f).all() & torch.isfinite(sol.g).all() & torch.isfinite(sol.marginal_error).all()
    size = torch.maximum(sol.f.abs().amax(-1), sol.g.abs().amax(-1))  # (B,); no side is empty here
    unresolved = (size * torch.finfo(inp.cdt).eps > UNRESOLVED * eps) & (inp.tol is not None)
    is_finite, any_unresolved = torch.stack([finite, unresolved.any()]).tolist()  # one host sync
    if not is_finite:
        raise FloatingPointError(
            "Sinkhorn produced non-finite potentials; eps may be too small for this dtype "
            "(try float64 or a larger blur)")
    if any_unresolved:
        sol.converged = sol.converged & ~unresolved
        k = int(torch.where(unresolved, size, -math.inf).argmax())
        name = str(inp.cdt).replace("torch.", "")
        warnings.warn(f"Sinkhorn's potentials reached {float(size[k]):.3g}, where one rounding unit of {name} is "
                      f"{float(size[k]) * torch.finfo(inp.cdt).eps / eps:.2g} eps (eps={eps:g}): the plan and the "
                      f"marginal error are not resolved, so the result is marked not converged; solve in float64 "
                      f"(float32 input), with a larger eps (blur), or with accelerate=False", ConvergenceWarning,
                      stacklevel=4)
        return
    unwarned = sol.converged if sol.warned is None else sol.converged | sol.warned
    if inp.tol is not None and not bool(unwarned.all()):
        k = int(torch.where(unwarned, -math.inf, sol.marginal_error).argmax())  # the worst problem
        a, b = inp.a[k].detach().double(), inp.b[k].detach().double()
        f, g = sol.f[k, :a.shape[-1]].double(), sol.g[k, :b.shape[-1]].double()  # partial OT: the real points
        size = 0.5 * float((a * f.abs()).sum() / a.sum() + (b * g.abs()).sum() / b.sum())
        also = "" if inp.value_tol is None else f" and the value had not passed value_tol={inp.value_tol:g}"
        warnings.warn(_checks.unconverged(inp.max_iter, float(sol.marginal_error[k]), inp.tol, inp.cdt, eps, size,
                                          also), ConvergenceWarning, stacklevel=4)


# -------------------------------------------------------------------------------------------- solve
@dataclass
class _Fit:
    """A solved batch on the real points: potentials f (B, N), g (B, M); the real row / column soft-mins
    s, t at the final g / f; the dual value (B,) and its derivatives ga, gb in a and b; f_hat, g_hat the
    exact updates of f (g) for the final g (f), which the point gradients use; the loop's record."""

    f: torch.Tensor
    g: torch.Tensor
    s: torch.Tensor
    t: torch.Tensor
    value: torch.Tensor
    ga: torch.Tensor
    gb: torch.Tensor
    f_hat: torch.Tensor
    g_hat: torch.Tensor
    passes: int
    sol: _loop.Solution


def _fit_full(geom: Geometry, inp: _Inputs, eps, eps_list, init, self_transport, grads) -> _Fit:
    """Balanced / unbalanced OT (self-transport: the symmetric loop); ``grads``: whether to compute the value's
    derivatives in a and b."""
    a, b, pen_a, pen_b = inp.a.detach(), inp.b.detach(), inp.pen_a, inp.pen_b
    loop = dict(value_tol=inp.value_tol)
    if self_transport:
        sol = _multiscale.symmetric(geom, a.log(), pen_a, eps_list, inp.tol, inp.max_iter, init, inp.check_every,
                                    **loop)
    else:
        sol = _multiscale.alternating(geom, a.log(), b.log(), pen_a, pen_b, eps_list, inp.tol, inp.max_iter, init,
                                      inp.accelerate, inp.check_every, **loop)
        sol = _loop.centred(sol, a, b, pen_a, pen_b, inp.tol)
    value, ga, gb = _dual_value(a, b, sol.f, sol.g, sol.s, sol.t, pen_a, pen_b, eps, grads)
    if inp.tol is None:  # GeomLoss's value for its fixed schedule
        value = (a * schedule_terms(pen_a, sol.f, eps)).sum(-1) + (b * schedule_terms(pen_b, sol.g, eps)).sum(-1)
    return _Fit(sol.f, sol.g, sol.s, sol.t, value, ga, gb, pen_a.aprox(sol.s, eps), pen_b.aprox(sol.t, eps),
                sol.passes, sol)


def _fit_partial(geom: Geometry, inp: _Inputs, eps, eps_list, init, mass_a, mass_b, grads) -> _Fit:
    """Partial OT of mass s: balanced OT between the measures augmented with a dummy point each, of weights
    |b| - s and |a| - s (:class:`PartialGeometry`); the result is read back on the real points."""
    a, b, pen_a, pen_b, mass = inp.a.detach(), inp.b.detach(), inp.pen_a, inp.pen_b, inp.mass
    _checks.check_partial_mass(mass, float(torch.minimum(mass_a, mass_b).min()), inp.in_dtype)
    # dummy weights |b| - s and |a| - s; clamped at 0 when s rounds above a float sum
    aa = torch.cat([a, (mass_b - mass).clamp_min(0)[:, None]], -1)
    bb = torch.cat([b, (mass_a - mass).clamp_min(0)[:, None]], -1)
    if init is not None:  # dummy potentials start at 0
        init = tuple(torch.cat([t, t.new_zeros(t.shape[0], 1)], -1) for t in init)
    pgeom = PartialGeometry(geom, mass)
    sol = _multiscale.alternating(pgeom, aa.log(), bb.log(), pen_a, pen_b, eps_list, inp.tol, inp.max_iter, init,
                                  inp.accelerate, inp.check_every, value_tol=inp.value_tol)
    f, g = sol.f[:, :-1], sol.g[:, :-1]
    s_real = geom.softmin_x(b.log() + g / eps, eps)
    t_real = geom.softmin_y(a.log() + f / eps, eps)
    # the column soft-min of the augmented problem at the final f (the loop's t may predate the last
    # rebalancing shift of f), from the real one: no extra pass
    t_aug = pgeom._augment(t_real, aa.log() + sol.f / eps, eps)
    if inp.tol is not None:
        _check_partial_columns(sol, bb, t_aug, eps, inp.tol)
    value, ga_aug, gb_aug = _dual_value(aa, bb, sol.f, sol.g, sol.s, t_aug, pen_a, pen_b, eps, grads)
    ga = gb = None
    if grads:
        ga = ga_aug[:, :-1] + gb_aug[:, -1:]  # b'_M = |a| - s depends on a
        gb = gb_aug[:, :-1] + ga_aug[:, -1:]
    f_hat, g_hat = pen_a.aprox(sol.s, eps)[:, :-1], pen_b.aprox(t_aug, eps)[:, :-1]
    return _Fit(f, g, s_real, t_real, value, ga, gb, f_hat, g_hat, sol.passes + 2, sol)


def _check_partial_columns(sol: _loop.Solution, bb: torch.Tensor, t_aug: torch.Tensor, eps: float, tol: float) -> None:
    """Partial OT's stopping test reads the rows of its augmented problem after its first look. With a single
    source point of positive weight the rebalancing step leaves those rows exact whatever g is, and a solve
    whose first look read the rows only stopped with its columns 57 % off (value 0.0160 for 0.0202): a guard
    against what the rows cannot see. A problem reported converged whose column
    error at the final f (from t_aug (B, M + 1), the augmented column soft-min: no pass) exceeds VALUE_SPAN tol
    (the most a value test may leave) is marked not converged, its error the sum of both, with a
    ConvergenceWarning. Elsewhere the final column error stays about the row error (at most 1.2 tol on the
    convergence grid's partial OT cases)."""
    col = _loop.marginal_error(bb.log(), sol.g, t_aug, t_aug, eps) / bb.sum(-1)
    off = sol.converged & (col > _loop.VALUE_SPAN * tol)
    if bool(off.any()):
        k = int(torch.where(off, col, -math.inf).argmax())
        sol.converged, sol.warned = sol.converged & ~off, off
        sol.marginal_error = torch.where(off, sol.marginal_error + col, sol.marginal_error)
        warnings.warn(f"partial OT: the result met tol={tol:g} on the rows of its augmented problem but its columns "
                      f"are off by {float(col[k]):.2e} (relative), so it is marked not converged; raise max_iter or "
                      f"lower tol, or swap x and y (partial OT is symmetric) where x has few points",
                      ConvergenceWarning, stacklevel=5)


def _saved(geom: Geometry, inp: _Inputs, fit: _Fit, eps: float, rows: bool, cols: bool) -> Saved:
    """What the envelope backward needs: the row side (grad_row, hx) where ``rows`` (x or u takes a gradient),
    the column side where ``cols``. The x-side uses f_hat, the exact update of f for the final g (and
    the y-side g_hat for the final f), i.e. the gradient of max_f D(f, g) in x and of max_g D(f, g) in y. At
    convergence f_hat = f and g_hat = g; with a fixed iteration budget (GeomLoss-style flows) the row weights
    stay a_i-sized instead of a_i exp((f - f_hat) / eps), which blew up a 100k-point flow."""
    a, b = inp.a.detach(), inp.b.detach()
    grad_row = hx = grad_col = hy = None
    if rows:
        grad_row = _checks.masses(a, fit.f_hat, fit.s, eps)
        hx = b.log() + (fit.g if geom.v is None else fit.g - geom.v) / eps
    if cols:
        grad_col = _checks.masses(b, fit.g_hat, fit.t, eps)
        hy = a.log() + (fit.f if geom.u is None else fit.f - geom.u) / eps
    return Saved(geom=geom, eps=eps, grad_row=grad_row, grad_col=grad_col, ga=fit.ga, gb=fit.gb, hx=hx, hy=hy)


def _result(geom: Geometry, inp: _Inputs, fit: _Fit, value: torch.Tensor, eps: float, p: int) -> SinkhornResult:
    """The :class:`SinkhornResult`, without the batch dimension for an unbatched call."""
    a, b, sol = inp.a.detach(), inp.b.detach(), fit.sol
    one = (lambda t: t) if inp.batched else (lambda t: t[0])
    return SinkhornResult(
        f=one(fit.f), g=one(fit.g), value=one(value),
        n_iter=sol.n_iter if inp.batched else int(sol.n_iter[0]),
        marginal_error=sol.marginal_error if inp.batched else float(sol.marginal_error[0]),
        converged=sol.converged if inp.batched else bool(sol.converged[0]),
        eps=eps, p=p, backend=inp.backend, passes=fit.passes, syncs=sol.syncs, _geom=geom, _a=a, _b=b, _s=fit.s,
        _t=fit.t, _batched=inp.batched)


def _empty(inp: _Inputs, geom: Geometry, eps: float, p: int) -> SinkhornResult:
    """The result of an empty batch (B = 0): empty tensors, the value still connected to the inputs."""
    x, y, a, b = inp.x, inp.y, inp.a, inp.b
    z = (x.sum((1, 2)) + y.sum((1, 2))) * 0
    zn, zm = a.new_zeros(0, x.shape[1]), b.new_zeros(0, y.shape[1])
    return SinkhornResult(f=zn, g=zm, value=z.to(inp.in_dtype), n_iter=torch.zeros(0, dtype=torch.int64),
                          marginal_error=x.new_zeros(0, dtype=torch.float64),
                          converged=torch.zeros(0, dtype=torch.bool), eps=eps, p=p, backend=inp.backend,
                          passes=0, syncs=0, _geom=geom, _a=a.detach(), _b=b.detach(), _s=zn, _t=zm, _batched=True)


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
    precision: Optional[str] = None,
    autotune: Optional[bool] = None,
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
            ``tau`` (a number or a pair (tau_a, tau_b); inf or None makes that side balanced). Same as POT's reg_m.
        mass: transported mass s for entropic partial OT (dummy-point augmentation); needs 'balanced'.
        u: (N,), v: (M,) cost offsets (batched like the points): the cost becomes C(x_i, y_j) + u_i + v_j
            (soft SROT). With ``mass``, offsets apply to real pairs only (not transporting a point is free).
        scaling: eps-scaling factor in (0, 1); eps goes from diameter**p to eps by factors scaling**p.
        diameter: the data diameter for eps-scaling (default: diagonal of the bounding box of the points
            of positive weight).
        tol: stop when every problem's relative L1 marginal error (rows plus columns; partial OT: the rows of
            its augmented problem, its columns checked once at the end; docs/DESIGN.md, Stopping rule) is
            <= tol. ``None``: GeomLoss's fixed schedule (one averaged update per eps, then one extrapolation; no
            stopping test), with GeomLoss's value formula (for probability weights it equals the dual objective
            at the fixed point). In float32, tight tolerances at small eps take several times float64's updates
            or are out of reach: rounding the potentials moves the error by about 1.2e-7 mean|f| / eps
            (README.md; the ConvergenceWarning says when that is the limit).
        max_iter: cap on all updates, eps-scaling included (a longer eps schedule is thinned to fit). 0: no
            update; the value is then that of the exact row update for the starting g (a lower bound). Not
            read with ``tol=None``, which runs GeomLoss's whole schedule.
        backend: 'auto' | 'tensorized' | 'cpu' | 'keops' | 'triton' | 'blocksparse' (see srot_fast.backends;
            SROTLoss's 'online' alias is not taken here).
        init: optional warm start (f0, g0) shaped like the potentials, e.g. those of a previous, nearby
            problem (gradient flows); skips eps-scaling (with ``tol=None``: a single update at eps).
        accelerate: safeguarded Anderson acceleration of the updates (see
            srot_fast._loop); False gives plain alternating Sinkhorn updates.
        check_every: updates between two host checks of the stopping test (default: every update on
            the CPU, adaptive on CUDA, where each check is a device synchronisation).
        value_tol: also stop a problem when its value has converged to about this relative accuracy and
            its marginal error is <= 100 tol: the dual objective is read every 8 updates, and the problem
            stops when the geometric tail of its rises, d_k r / (1 - r) with r = d_k / d_{k-1}, is
            <= value_tol |value| (a heuristic estimate, docs/DESIGN.md, Solver).
            None (default): the marginal test alone. ``SROTLoss`` uses tol / 10 (1e-4 at its default tol).
            Not read with ``tol=None`` (no test runs).
        precision: the Triton backend's ``tl.dot`` precision for float32 points with D >= 32: 'tf32x3'
            (fp32-accurate on tensor cores), 'ieee' (fp32 FMA) or 'tf32' (faster, ~1e-4 relative error on
            squared distances; docs/DESIGN.md). None: ``SROT_TRITON_DOT_PRECISION``, else 'tf32x3'. The
            other backends accept it and ignore it: they compute in the input dtype (float32 products for
            float32 points).
        autotune: whether the Triton backend autotunes the block sizes of its large launches (None:
            ``SROT_TRITON_AUTOTUNE``, on unless '0'); ignored by the other backends.

    Returns:
        :class:`SinkhornResult` (potentials, differentiable value, n_iter, marginal error, masses).

    Example:
        >>> x, y = torch.randn(100, 2), torch.randn(80, 2) + 1
        >>> res = sinkhorn(x, y, p=1, eps=0.01, penalty="kl", tau=1.0)
        >>> res.value, res.n_iter, res.row_mass.sum()
    """
    p = _checks.check_p(p)
    eps = _checks.check_positive(0.05**p if eps is None else eps, "eps")
    if diameter is not None:
        diameter = _checks.check_positive(diameter, "diameter")
    return _solve(x, y, a, b, p=p, eps=eps, penalty=penalty, tau=tau, mass=mass, u=u, v=v, scaling=scaling,
                  diameter=diameter, tol=tol, max_iter=max_iter, backend=backend, init=init,
                  accelerate=accelerate, check_every=check_every, value_tol=value_tol, precision=precision,
                  autotune=autotune)


def _solve(x, y, a=None, b=None, *, p, eps, penalty="balanced", tau=None, mass=None, u=None, v=None,
           scaling=0.5, diameter=None, tol=1e-4, max_iter=1000, backend="auto", init=None, accelerate=True,
           check_every=None, self_transport=False, value_tol=None, precision=None, autotune=None,
           checked=False) -> SinkhornResult:
    """:func:`sinkhorn` after its scalar checks; ``self_transport=True`` (x is y, a is b, u is v) takes the
    symmetric loop. ``diameter`` may be 0 here (identical clouds). ``checked``: see :func:`_check_inputs`."""
    inp = _check_inputs(x, y, a, b, u, v, p=p, eps=eps, backend=backend, precision=precision, autotune=autotune,
                        scaling=scaling, tol=tol, value_tol=value_tol, max_iter=max_iter, check_every=check_every,
                        accelerate=accelerate, penalty=penalty, tau=tau, mass=mass, self_transport=self_transport,
                        checked=checked)
    u, v = (None if t is None else t.detach() for t in (inp.u, inp.v))
    # cold: eps-scaling to a tolerance (dozens of updates), where keeping the distances of larger problems pays
    geom = Geometry(get_ops(inp.backend), inp.x.detach(), inp.y.detach(), p, u, v, inp.options,
                    cold=init is None and inp.tol is not None)
    if inp.x.shape[0] == 0:  # an empty batch: empty results, still connected to the inputs
        return _empty(inp, geom, eps, p)
    ad, bd = inp.a.detach(), inp.b.detach()
    if diameter is None:
        diam = bbox_diameter(geom.x, geom.y, ad, bd)
    else:
        diam = float(diameter) if diameter == 0 else _checks.check_positive(diameter, "diameter")
    _checks.check_scale(diam, p, eps, inp.cdt)
    mass_a, mass_b = ad.sum(-1), bd.sum(-1)
    _checks.check_masses(mass_a, mass_b, inp.cdt)
    eps_list = epsilon_schedule(p, diam, eps ** (1 / p), inp.scaling)
    init = _check_init(init, inp)
    # which inputs the value is differentiated in: the backward's saved tensors are computed for those alone
    # (EnvelopeValue still wraps the value, so that forward-mode AD gets its error, not a missing tangent)
    grad = [torch.is_grad_enabled() and t is not None and t.requires_grad
            for t in (inp.x, inp.y, inp.a, inp.b, inp.u, inp.v)]
    with torch.no_grad():
        if inp.mass is not None:
            fit = _fit_partial(geom, inp, eps, eps_list, init, mass_a, mass_b, grad[2] or grad[3])
        else:
            if inp.pen_a.balanced and inp.pen_b.balanced:
                _check_balance(mass_a, mass_b, inp.in_dtype)
            fit = _fit_full(geom, inp, eps, eps_list, init, self_transport, grad[2] or grad[3])
        geom.release()  # the passes after the fit (gradients, plans) stream
        _check_solution(fit.sol, inp, eps)
    with torch.no_grad():
        saved = _saved(geom, inp, fit, eps, grad[0] or grad[4], grad[1] or grad[5])
    value = EnvelopeValue.apply(fit.value, saved, inp.x, inp.y, inp.a, inp.b, inp.u, inp.v)
    return _result(geom, inp, fit, value.to(inp.in_dtype), eps, p)
