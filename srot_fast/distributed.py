r"""Sharded solves over a ``torch.distributed`` process group (NCCL on GPUs, gloo on CPUs), launched with
``torchrun`` or any other launcher; docs/DISTRIBUTED.md has the guide and the performance model.

Each rank passes its own shard of the points: x (N_r, D) with its weights a (N_r,) and offsets u (N_r,),
y (M_r, D) with b (M_r,) and v (M_r,). Shards may have any sizes, zero included, on any backend. The
solve is the one of :func:`srot_fast.sinkhorn` (the same loop, :mod:`srot_fast._loop`) on a sharded
geometry (:mod:`srot_fast._sharded`): each soft-min pass runs the local x block against every y shard
and merges the per-shard log-sum-exps; sums over points are all-reduced. So, up to floating-point
rounding, every rank gets

- the value (global, the same on every rank), the iteration count and the marginal error of the
  single-process solve on the concatenated shards (in rank order);
- its own shard of the potentials f, g and of the transported masses;
- after ``value.backward()`` on every rank, the gradients of the value w.r.t. its own x, y, a, b, u, v.

Why a separate module rather than a ``group=`` argument on :func:`srot_fast.sinkhorn`: the sharded call
has different semantics (local shards in, local potentials out, a global value, and every call -- the
backward pass included -- is a collective that every rank must make in the same order), and keeping it
apart leaves the single-process path free of any collective. The arguments are otherwise the same.

Rules of a collective call: every rank calls with the same scalar arguments (p, eps, penalty, ...; checked),
the same dtype and feature dimension, the same ``requires_grad`` flags (backward is a collective too), and
calls ``backward`` on the value (or neither does). A bad argument on one rank raises the same error on
every rank (naming the rank) instead of leaving the others waiting.

``mode``: 'gather' keeps a copy of the other ranks' points on each rank (gathered once per call), and a pass
moves only the log-weights (8 M bytes in float64); 'ring' passes the shards (points and log-weights) around
the ring of ranks at every pass, overlapped with compute, for clouds whose copy does not fit;
'auto' gathers when all points take at most ``GATHER_BYTES``. Inputs are unbatched.

Run ``python -m srot_fast.distributed --help`` for a sharded 2-D gradient flow (spawns gloo ranks itself,
or runs under ``torchrun``).
"""
from __future__ import annotations

import math
import os
import warnings
import zlib
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

from . import _checks, _loop
from . import loss as _loss
from ._envelope import first_order_only
from ._loop import epsilon_schedule
from ._sharded import MODES, Comm, ShardedGeometry, ShardedPartialGeometry, Side
from .backends import get_ops, resolve_backend
from .kernels.triton.options import check_autotune, check_precision, kernel_options
from .penalties import Penalty
from .sinkhorn import ConvergenceWarning, _penalties, schedule_terms
from .weights import soft_offsets

__all__ = ["sinkhorn", "SROTLoss", "ShardedResult", "GATHER_BYTES", "main"]

GATHER_BYTES = 1 << 30  # mode='auto' gathers all points on every rank when they take at most this much


# ------------------------------------------------------------------------------------------- result
@dataclass(frozen=True)
class ShardedResult:
    r"""Output of :func:`sinkhorn` on one rank.

    Attributes:
        f (N_r,), g (M_r,): this rank's shards of the dual potentials (cost units).
        value (): the dual objective of the whole problem (the same on every rank), differentiable w.r.t. this
            rank's x, y, a, b, u, v (call ``backward`` on every rank).
        n_iter (int), marginal_error (float): as in :class:`srot_fast.SinkhornResult`, for the whole problem.
        row_mass (N_r,), col_mass (M_r,): this rank's shards of pi 1 and pi^T 1.
        transported_mass (float): sum_ij pi_ij over all ranks.
        eps, p, backend, mode, passes, syncs, rank, world_size: what ran.
    """

    f: torch.Tensor
    g: torch.Tensor
    value: torch.Tensor
    n_iter: int
    marginal_error: float
    row_mass: torch.Tensor
    col_mass: torch.Tensor
    transported_mass: float
    eps: float
    p: int
    backend: str
    mode: str
    passes: int
    syncs: int
    rank: int
    world_size: int
    _geom: ShardedGeometry
    _hx: torch.Tensor

    def barycentric_projection(self) -> torch.Tensor:
        """(N_r, D) sum_j pi_ij y_j / sum_j pi_ij for this rank's source points, over every rank's y
        (a collective: call it on every rank)."""
        return self._geom.weighted_mean("x", self._hx, self.eps, "y")[0]


# ------------------------------------------------------------------------------------------ checks
def _points(t, name: str) -> torch.Tensor:
    """A (N_r, D) floating tensor; N_r = 0 (a rank without points) is allowed."""
    if torch.is_tensor(t) and t.dim() == 3:
        raise ValueError(f"{name} must be this rank's shard (N_r, D); srot_fast.distributed does not take "
                         f"batches (B, N, D), got {tuple(t.shape)}")
    if torch.is_tensor(t) and t.dim() == 2 and t.shape[0] == 0 and t.shape[1] > 0 and t.is_floating_point():
        return t
    return _checks.check_points(t, name)


def _weights(w, like: torch.Tensor, name: str) -> Optional[torch.Tensor]:
    """None, or finite non-negative weights (N_r,) (a shard's total may be 0; the global one is checked later)."""
    if w is None:
        return None
    if not torch.is_tensor(w):
        raise TypeError(f"{name} must be a torch.Tensor of weights, got {type(w).__name__}")
    if w.device != like.device:
        raise ValueError(f"{name} is on {w.device} but the points are on {like.device}; move it to {like.device}")
    if w.shape != like.shape[:-1]:
        raise ValueError(f"{name} must have shape {tuple(like.shape[:-1])} (one weight per point of this rank), "
                         f"got {tuple(w.shape)}")
    if w.dtype != like.dtype and not (like.dtype in (torch.float16, torch.bfloat16) and w.dtype == torch.float32):
        raise TypeError(f"{name} must have dtype {like.dtype} like the points, got {w.dtype}")
    if not torch.isfinite(w).all():
        raise ValueError(f"{name} contains NaN or inf")
    if (w < 0).any():
        raise ValueError(f"{name} has negative weights")
    return w


def _mode(mode) -> str:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return mode


def _consistent(comm: Comm, rows: list, key: dict) -> None:
    """Raise the same ValueError on every rank when the call's arguments ``key`` (everything but the shards'
    sizes and values) differ between ranks; ``rows[r][-1]`` is rank r's checksum of ``key``."""
    sums = [row[-1] for row in rows]
    if len(set(sums)) == 1:
        return
    keys = [None] * comm.world
    dist.all_gather_object(keys, key, group=comm.group)
    r = next(k for k in range(comm.world) if sums[k] != sums[0])
    diff = [name for name in keys[0] if keys[0][name] != keys[r].get(name)]
    raise ValueError("every rank must call with the same arguments (only the shards differ): "
                     + ", ".join(f"{n} is {keys[0][n]!r} on rank 0 but {keys[r][n]!r} on rank {r}" for n in diff))


def _checksum(key: dict) -> int:
    return zlib.crc32(repr(sorted(key.items())).encode())


def _resolve_mode(mode: str, n: int, m: int, d: int, dtype: torch.dtype) -> str:
    if mode != "auto":
        return mode
    return "gather" if (n + m) * d * torch.finfo(dtype).bits // 8 <= GATHER_BYTES else "ring"


# ------------------------------------------------------------------------------------------- solver
def sinkhorn(
    x: torch.Tensor,
    y: torch.Tensor,
    a: Optional[torch.Tensor] = None,
    b: Optional[torch.Tensor] = None,
    *,
    group=None,
    mode: str = "auto",
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
) -> ShardedResult:
    r""":func:`srot_fast.sinkhorn` on points sharded over the ranks of ``group`` (a collective call).

    Args:
        x: (N_r, D) this rank's source points (N_r may be 0). y: (M_r, D) this rank's target points.
        a: (N_r,) this rank's source weights (default 1/N, N = the total over ranks). b: (M_r,) (default 1/M).
        group: the process group (default: the default group of ``torch.distributed.init_process_group``).
        mode: 'auto' | 'gather' | 'ring', how the other ranks' shards reach this one (module docstring).
        u: (N_r,), v: (M_r,) this rank's cost offsets. init: (f0 (N_r,), g0 (M_r,)) this rank's warm start.
        p, eps, penalty, tau, mass, scaling, diameter, tol, max_iter, backend, accelerate, check_every, value_tol,
            precision, autotune: as in :func:`srot_fast.sinkhorn`, the same on every rank; ``backend`` is this
            rank's kernel backend (``precision`` and ``autotune`` act on Triton only).

    Returns:
        :class:`ShardedResult`: this rank's potentials and masses, the global value, n_iter, marginal error.

    Example (on every rank of a ``torchrun --nproc-per-node 2`` job):
        >>> dist.init_process_group("gloo")
        >>> x, y = my_shard_of_x, my_shard_of_y
        >>> res = srot_fast.distributed.sinkhorn(x, y, p=1, eps=0.01, penalty="kl", tau=1.0)
        >>> res.value.backward()          # x.grad: the gradient of the global value w.r.t. this rank's x
    """
    comm = Comm(group)
    key = dict(p=p, eps=eps, penalty=penalty, tau=tau, mass=mass, scaling=scaling, diameter=diameter, tol=tol,
               max_iter=max_iter, backend=backend, accelerate=accelerate, check_every=check_every, mode=mode,
               value_tol=value_tol, precision=precision, autotune=autotune)

    def check():
        p_, eps_ = _checks.check_p(p), _checks.check_positive(0.05**p if eps is None else eps, "eps")
        _mode(mode)
        xs, ys = _points(x, "x"), _points(y, "y")
        _checks.check_pair(xs, ys)
        out = dict(x=xs, y=ys, a=_weights(a, xs, "a"), b=_weights(b, ys, "b"),
                   u=_checks.check_offsets(u, xs, "u"), v=_checks.check_offsets(v, ys, "v"), p=p_, eps=eps_)
        _scalar_checks(penalty, tau, mass, scaling, tol, max_iter, check_every, diameter)
        out["value_tol"] = None if value_tol is None else _checks.check_positive(value_tol, "value_tol")
        check_precision(precision)
        check_autotune(autotune)
        resolve_backend(backend, xs.shape[0], ys.shape[0], xs.device)  # this rank can run it
        if init is not None:
            if not (isinstance(init, (tuple, list)) and len(init) == 2):
                raise TypeError("init must be a pair (f0, g0) of this rank's potentials")
            out["init"] = (_checks.check_offsets(init[0], xs, "init[0]"), _checks.check_offsets(init[1], ys, "init[1]"))
        else:
            out["init"] = None
        full = dict(key, dtype=str(xs.dtype), dim=xs.shape[-1], device=xs.device.type,
                    **{"requires_grad of (x, y, a, b, u, v)": [t is not None and t.requires_grad
                                                                for t in (xs, ys, a, b, u, v)],
                       "given (a, b, u, v, init)": [t is not None for t in (a, b, u, v, init)]})
        out["key"] = full
        return out

    args, rows = comm.agree(check, lambda o: [o["x"].shape[0], o["y"].shape[0], _checksum(o["key"])], 3)
    _consistent(comm, rows, args["key"])
    ns, ms = [r[0] for r in rows], [r[1] for r in rows]
    pen_a, pen_b = _penalties(penalty, tau)
    return _solve(comm, args["x"], args["y"], args["a"], args["b"], args["u"], args["v"], ns, ms, p=args["p"],
                  eps=args["eps"], pen_a=pen_a, pen_b=pen_b, mass=mass, scaling=scaling, diameter=diameter, tol=tol,
                  max_iter=max_iter, backend=backend, init=args["init"], accelerate=accelerate,
                  check_every=check_every, mode=mode, value_tol=args["value_tol"], precision=precision,
                  autotune=autotune)


def _scalar_checks(penalty, tau, mass, scaling, tol, max_iter, check_every, diameter) -> None:
    _penalties(penalty, tau)
    if mass is not None:
        if penalty != "balanced":
            raise ValueError("mass (partial OT) needs penalty='balanced'")
        _checks.check_positive(mass, "mass")
    s = _checks.check_positive(scaling, "scaling")
    if not s < 1:
        raise ValueError(f"scaling must be in (0, 1), got {scaling}")
    if tol is not None:
        _checks.check_positive(tol, "tol")
    _checks.non_negative_int(max_iter, "max_iter")
    _checks.positive_int(check_every, "check_every", allow_none=True)
    if diameter is not None and diameter != 0:
        _checks.check_positive(diameter, "diameter")


def _bbox_diameter(comm: Comm, x, y, a, b) -> float:
    """:func:`srot_fast.geometry.bbox_diameter` over every rank's points of positive weight."""
    def ends(pts, w):
        pts, keep = pts.double(), (w > 0)[:, None]
        inf = torch.tensor(math.inf, dtype=torch.float64, device=pts.device)
        return torch.where(keep, pts, -inf).amax(0), -torch.where(keep, pts, inf).amin(0)

    def safe(pts, w):
        if pts.shape[0] == 0:
            neg = pts.new_full((pts.shape[1],), -math.inf, dtype=torch.float64)
            return neg, neg
        return ends(pts, w)
    hx, lx = safe(x, a)
    hy, ly = safe(y, b)
    tot = comm.max(torch.stack([hx, lx, hy, ly]).to(comm.device)).cpu()
    diag = (torch.maximum(tot[0], tot[2]) - torch.minimum(-tot[1], -tot[3])).norm()
    return float(diag)


def _sums(comm: Comm, ts: list, dummy: bool) -> torch.Tensor:
    """(K, B) sums over every rank's points of the (B, n) tensors ``ts``, in one all-reduce; with ``dummy``
    their last entry is the replicated dummy point of partial OT, counted once."""
    loc = torch.stack([(t[..., :-1] if dummy else t).sum(-1) for t in ts])
    tot = comm.sum(loc.to(comm.device)).to(loc.device)
    return tot + torch.stack([t[..., -1] for t in ts]) if dummy else tot


def _dual_value(comm, a, b, f, g, s, t, pen_a: Penalty, pen_b: Penalty, eps: float, dummy: bool):
    """Sharded :func:`srot_fast.sinkhorn._dual_value`: (B,) global dual objectives, and this rank's (B, n), (B, m)
    derivatives w.r.t. a and b."""
    ratio_a, ratio_b = torch.exp((f - s) / eps), torch.exp((g - t) / eps)
    rows = _sums(comm, [a, a * pen_a.phi(f)], dummy)
    cols = _sums(comm, [b, b * pen_b.phi(g), b * ratio_b], dummy)
    mass_a, mass_b = rows[0], cols[0]
    value = rows[1] + cols[1] - eps * (cols[2] - mass_a * mass_b)
    ga = pen_a.phi(f) - eps * (ratio_a - mass_b[:, None])
    gb = pen_b.phi(g) - eps * (ratio_b - mass_a[:, None])
    return value, ga, gb


@dataclass
class _State:
    """What the sharded envelope backward needs (detached, batch of 1)."""

    geom: ShardedGeometry
    eps: float
    grad_row: torch.Tensor
    grad_col: torch.Tensor
    ga: torch.Tensor
    gb: torch.Tensor
    hx: torch.Tensor
    hy: torch.Tensor
    need_x: bool  # x requires grad on every rank (checked): the backward runs the x pass, a collective
    need_y: bool


class _ShardedEnvelope(torch.autograd.Function):
    """The global value (1,); its backward is the envelope theorem with sharded weighted means (collectives)."""

    @staticmethod
    def forward(ctx, value, st: _State, x, y, a, b, u, v):
        ctx.save_for_backward(x, y, a, b, u, v)
        ctx.st = st
        ctx.has_u, ctx.has_v = u is not None, v is not None
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        x, y, a, b, u, v = ctx.saved_tensors
        st: _State = ctx.st
        need = ctx.needs_input_grad
        grad = grad.detach()
        gx = gy = gA = gB = gu = gv = None
        with torch.no_grad():
            gr = grad[:, None]
            if st.need_x:  # every rank runs the pass (it communicates), whatever its own shard needs
                wm = st.geom.weighted_mean("x", st.hx, st.eps, "grad")
                gx = ((gr * st.grad_row)[..., None] * wm)[0].to(x.dtype) if need[2] else None
            if st.need_y:
                wm = st.geom.weighted_mean("y", st.hy, st.eps, "grad")
                gy = ((gr * st.grad_col)[..., None] * wm)[0].to(y.dtype) if need[3] else None
            gA = (gr * st.ga)[0].to(a.dtype) if need[4] else None
            gB = (gr * st.gb)[0].to(b.dtype) if need[5] else None
            gu = (gr * st.grad_row)[0] if need[6] and ctx.has_u else None
            gv = (gr * st.grad_col)[0] if need[7] and ctx.has_v else None
        return (None, None, *first_order_only([gx, gy, gA, gB, gu, gv], (x, y, a, b, u, v)))


def _solve(comm: Comm, x, y, a, b, u, v, ns: list, ms: list, *, p, eps, pen_a, pen_b, mass, scaling, diameter, tol,
           max_iter, backend, init, accelerate, check_every, mode, self_transport=False,
           value_tol=None, precision=None, autotune=None) -> ShardedResult:
    """The sharded solve, after the (agreed) argument checks: x (n_r, D), y (m_r, D), a, b, u, v this rank's
    shards (a, b may be None: uniform); ``ns``, ``ms`` every rank's shard sizes. Errors raised here are the
    same on every rank (they depend on all-reduced quantities only)."""
    n, m = sum(ns), sum(ms)
    if n == 0 or m == 0:
        raise ValueError(f"{'x' if n == 0 else 'y'} has no point on any rank")
    in_dtype = x.dtype
    a = torch.full(x.shape[:1], 1.0 / n, dtype=x.dtype, device=x.device) if a is None else a
    b = torch.full(y.shape[:1], 1.0 / m, dtype=y.dtype, device=y.device) if b is None else b
    x, y, a, b, u, v = _checks.compute_dtype(x, y, a, b, u, v)
    grad_flags = (x.requires_grad, y.requires_grad)
    xd, yd, ad, bd = x.detach(), y.detach(), a.detach(), b.detach()
    ud = None if u is None else u.detach()
    vd = None if v is None else v.detach()
    tot = comm.sum(torch.stack([ad.double().sum(), bd.double().sum()]).to(comm.device)).cpu()
    for k, name in enumerate(("a", "b")):
        if not tot[k] > 0:
            raise ValueError(f"{name} has zero total mass (all weights are zero on every rank)")
    mass_a, mass_b = tot[0:1].to(x.dtype), tot[1:2].to(x.dtype)
    _checks.check_masses(mass_a, mass_b, x.dtype)
    if diameter is None:
        diam = _bbox_diameter(comm, xd, yd, ad, bd)
    else:
        diam = float(diameter)
    _checks.check_scale(diam, p, eps, x.dtype)
    eps_list = epsilon_schedule(p, diam, eps ** (1 / p), scaling)
    name = resolve_backend(backend, n, m, x.device)
    ops = get_ops(name)
    mode = _resolve_mode(mode, n, m, x.shape[-1], x.dtype)
    xs = Side(comm, xd[None], mode, ns)
    ys = xs if self_transport else Side(comm, yd[None], mode, ms)
    geom = ShardedGeometry(ops, xs, ys, p, None if ud is None else ud[None], None if vd is None else vd[None],
                           kernel_options(name, precision, autotune))
    if init is not None:
        init = (init[0].detach().to(x.dtype)[None], init[1].detach().to(x.dtype)[None])
    a1, b1 = ad[None], bd[None]

    with torch.no_grad():
        if mass is not None:
            if mass > float(torch.minimum(mass_a, mass_b).min()) * (1 + 1e-12):
                raise ValueError(f"mass must be <= min(a.sum(), b.sum()) = "
                                 f"{float(torch.minimum(mass_a, mass_b).min()):.6g} (over all ranks), got {mass}")
            aa = torch.cat([a1, (mass_b - mass).clamp_min(0)[:, None]], -1)
            bb = torch.cat([b1, (mass_a - mass).clamp_min(0)[:, None]], -1)
            if init is not None:
                init = tuple(torch.cat([t, t.new_zeros(t.shape[0], 1)], -1) for t in init)
            pgeom = ShardedPartialGeometry(geom, mass)
            sol = _loop.alternating(pgeom, aa.log(), bb.log(), pen_a, pen_b, eps_list, tol, max_iter, init,
                                    accelerate, check_every, value_tol=value_tol)
            f, g = sol.f[:, :-1], sol.g[:, :-1]
            s_real = geom.softmin_x(b1.log() + g / eps, eps)
            t_real = geom.softmin_y(a1.log() + f / eps, eps)
            t_aug = pgeom._augment(t_real, aa.log() + sol.f / eps, eps)
            value, ga_aug, gb_aug = _dual_value(comm, aa, bb, sol.f, sol.g, sol.s, t_aug, pen_a, pen_b, eps, True)
            ga = ga_aug[:, :-1] + gb_aug[:, -1:]
            gb = gb_aug[:, :-1] + ga_aug[:, -1:]
            f_hat, g_hat = pen_a.aprox(sol.s, eps)[:, :-1], pen_b.aprox(t_aug, eps)[:, :-1]
            passes = sol.passes + 2
        else:
            if pen_a.balanced and pen_b.balanced:
                rtol = 1e-6 if in_dtype in (torch.float32, torch.float64) else 1e-3
                if abs(float(tot[0]) - float(tot[1])) > rtol * max(float(tot[0]), float(tot[1])):
                    raise ValueError(
                        f"balanced OT needs a and b of equal total mass (over all ranks), got {float(tot[0]):.6g} "
                        f"and {float(tot[1]):.6g}; normalise them or use penalty='kl'/'tv'")
            if self_transport:
                sol = _loop.symmetric(geom, a1.log(), pen_a, eps_list, tol, max_iter, init, check_every,
                                      value_tol=value_tol)
            else:
                sol = _loop.alternating(geom, a1.log(), b1.log(), pen_a, pen_b, eps_list, tol, max_iter, init,
                                        accelerate, check_every, value_tol=value_tol)
            value, ga, gb = _dual_value(comm, a1, b1, sol.f, sol.g, sol.s, sol.t, pen_a, pen_b, eps, False)
            if tol is None:
                value = _sums(comm, [a1 * schedule_terms(pen_a, sol.f, eps)], False)[0] + \
                    _sums(comm, [b1 * schedule_terms(pen_b, sol.g, eps)], False)[0]
            f, g, s_real, t_real = sol.f, sol.g, sol.s, sol.t
            f_hat, g_hat = pen_a.aprox(sol.s, eps), pen_b.aprox(sol.t, eps)
            passes = sol.passes
        finite = bool(torch.isfinite(f).all() and torch.isfinite(g).all())
        bad = comm.max(torch.tensor([0.0 if finite else 1.0], device=comm.device))
        if float(bad) > 0 or not math.isfinite(float(sol.marginal_error.max())):
            raise FloatingPointError("Sinkhorn produced non-finite potentials; eps may be too small for this dtype "
                                     "(try float64 or a larger blur)")
        err = float(sol.marginal_error[0])
        if tol is not None and not bool(sol.converged.all()):
            warnings.warn(f"Sinkhorn stopped at max_iter={max_iter} with relative marginal error {err:.2e} > "
                          f"tol={tol:g}; raise max_iter, eps (blur) or tol", ConvergenceWarning, stacklevel=3)
        row_mass = _checks.masses(a1, f, s_real, eps)
        col_mass = _checks.masses(b1, g, t_real, eps)
        moved = float(_sums(comm, [row_mass], False)[0])
        hx = b1.log() + (g if vd is None else g - vd[None]) / eps
        hy = a1.log() + (f if ud is None else f - ud[None]) / eps
        st = _State(geom=geom, eps=eps, grad_row=_checks.masses(a1, f_hat, s_real, eps),
                    grad_col=_checks.masses(b1, g_hat, t_real, eps), ga=ga, gb=gb, hx=hx, hy=hy,
                    need_x=grad_flags[0], need_y=grad_flags[1])
    value = _ShardedEnvelope.apply(value, st, x, y, a, b, u, v).to(in_dtype)
    return ShardedResult(f=f[0], g=g[0], value=value[0], n_iter=int(sol.n_iter[0]), marginal_error=err,
                         row_mass=row_mass[0], col_mass=col_mass[0], transported_mass=moved, eps=eps, p=p,
                         backend=name, mode=mode, passes=passes, syncs=sol.syncs, rank=comm.rank,
                         world_size=comm.world, _geom=geom, _hx=hx)


# --------------------------------------------------------------------------------------------- loss
class _AllSum(torch.autograd.Function):
    """Sum of a small tensor over the ranks, differentiable: every rank computes the same global loss from it,
    so the gradient w.r.t. each rank's summand is the sum of the ranks' gradients w.r.t. the total."""

    @staticmethod
    def forward(ctx, t, comm: Comm):
        ctx.comm = comm
        return comm.sum(t.to(comm.device)).to(t.device)

    @staticmethod
    def backward(ctx, grad):
        comm = ctx.comm
        return comm.sum(grad.contiguous().to(comm.device)).to(grad.device), None


class SROTLoss(_loss.SROTLoss):
    r""":class:`srot_fast.SROTLoss` on point clouds sharded over the ranks of ``group`` (a collective call).

    Same constructor arguments as :class:`srot_fast.SROTLoss`, plus ``group`` (default: the default process group)
    and ``mode`` ('auto' | 'gather' | 'ring', see the module docstring). Call ``loss(x, y)`` or
    ``loss(a, x, b, y)`` (or ``scores=(s_x, s_y)``) on every rank with this rank's shards x (N_r, D), y (M_r, D),
    a (N_r,), b (M_r,) (unbatched); the value is the global one on every rank, and ``backward`` on every rank gives
    each rank the gradients of its own points and weights. ``potentials=True`` returns this rank's shards of
    (f, g). A detector scores each rank's own points; hard SROT renormalises the weights with all-reduced masses,
    soft SROT's gamma = max C is all-reduced, the debiasing terms are sharded self-transport solves.
    ``last_result`` is the :class:`ShardedResult` of the cross problem.
    """

    def __init__(self, *args, group=None, mode: str = "auto", **kwargs):
        super().__init__(*args, **kwargs)
        self.group, self.mode = group, _mode(mode)

    def _key(self) -> dict:
        return dict(p=self.p, blur=self.blur, penalty=self.penalty, tau=self.tau, mass=self.mass,
                    diameter=self.diameter, scaling=self.scaling, debias=self.debias, potentials=self.potentials,
                    backend=self.backend, strategy=self.strategy, tol=self.tol, max_iter=self.max_iter,
                    gamma=self.gamma, ce_floor=self.ce_floor, warm_start=self.warm_start, mode=self.mode,
                    detector=self.detector is not None, value_tol=self.value_tol, precision=self.precision,
                    autotune=self.autotune)

    def forward(self, *args, scores=None):
        comm = Comm(self.group)

        def check():
            a, x, b, y = self._split_args(args)
            x, y = _points(x, "x"), _points(y, "y")
            _checks.check_pair(x, y)
            a, b = _weights(a, x, "a"), _weights(b, y, "b")
            s_x = s_y = None
            if self.strategy is not None or scores is not None:
                s_x, s_y = self._scores(x[None], y[None], scores)
                s_x = None if s_x is None else _checks.check_probabilities(s_x[0], "scores[0]")
                s_y = None if s_y is None else _checks.check_probabilities(s_y[0], "scores[1]")
            resolve_backend(self._backend(x), x.shape[0], y.shape[0], x.device)  # this rank can run it
            key = dict(self._key(), dtype=str(x.dtype), dim=x.shape[-1], scores=scores is not None,
                       **{"given (a, b)": [a is not None, b is not None],
                          "requires_grad of (x, y, a, b)": [t is not None and t.requires_grad for t in (x, y, a, b)]})
            return dict(x=x, y=y, a=a, b=b, s_x=s_x, s_y=s_y, key=key)

        args_, rows = comm.agree(check, lambda o: [o["x"].shape[0], o["y"].shape[0], _checksum(o["key"])], 3)
        _consistent(comm, rows, args_["key"])
        ns, ms = [r[0] for r in rows], [r[1] for r in rows]
        return self._sharded(comm, ns, ms, **{k: args_[k] for k in ("x", "y", "a", "b", "s_x", "s_y")})

    def _sharded(self, comm: Comm, ns, ms, x, y, a, b, s_x, s_y):
        n, m = sum(ns), sum(ms)
        if n == 0 or m == 0:
            raise ValueError(f"{'x' if n == 0 else 'y'} has no point on any rank")
        a = torch.full(x.shape[:1], 1.0 / n, dtype=_loss._compute(x.dtype), device=x.device) if a is None else a
        b = torch.full(y.shape[:1], 1.0 / m, dtype=_loss._compute(y.dtype), device=y.device) if b is None else b
        mode = _resolve_mode(self.mode, n, m, x.shape[-1], _loss._compute(x.dtype))
        u = v = None
        if self.strategy == "hard":
            keep_x, keep_y = (s_x <= 0.5).to(a.dtype), (s_y >= 0.5).to(b.dtype)
            tot = _AllSum.apply(torch.stack([a.sum(), (a * keep_x).sum(), b.sum(), (b * keep_y).sum()]), comm)
            for k, name in ((1, "the source (a)"), (3, "the target (b)")):
                if not tot[k] > 0:
                    raise ValueError(f"hard SROT: the detector flags every point of {name} on every rank (or all "
                                     "kept points have zero weight); nothing would be left to transport. Check the "
                                     "detector or use strategy='soft'.")
            a = a * keep_x * (tot[0] / tot[1])  # differentiable in every rank's a, as hard_weights is
            b = b * keep_y * (tot[2] / tot[3])
        elif self.strategy == "soft":
            if self.gamma is not None:
                gam = self.gamma
            else:
                xs, ys = _compute_cast(x.detach()[a.detach() > 0]), _compute_cast(y.detach()[b.detach() > 0])
                name = resolve_backend(self._backend(x), n, m, x.device)
                geom = ShardedGeometry(get_ops(name), Side(comm, xs[None], mode), Side(comm, ys[None], mode), self.p,
                                       options=kernel_options(name, self.precision, self.autotune))
                gam = float(geom.max_cost()[0])
                gam = gam if gam > 0 else 1.0
            u, v = soft_offsets(s_x, s_y, gam, self.ce_floor)
            u, v = u.to(_loss._compute(x.dtype)), v.to(_loss._compute(y.dtype))
        diam = self.diameter
        if diam is None:
            diam = _bbox_diameter(comm, x.detach(), y.detach(), a.detach(), b.detach())
        init = None
        if self.warm_start and self._warm is not None:
            f0, g0 = self._warm
            ok = f0.shape == a.shape and g0.shape == b.shape and f0.dtype == _loss._compute(a.dtype)
            if bool(comm.max(torch.tensor([0.0 if ok else 1.0], device=comm.device)) == 0):
                init = self._warm
        res = self._run(comm, x, y, a, b, u, v, ns, ms, diam, mode, init)
        if self.warm_start:
            self._warm = (res.f.detach(), res.g.detach())
        self.last_result = res
        if self.verbose and comm.rank == 0:
            print(f"SROTLoss (rank 0 of {comm.world}, {res.mode}): {res.backend}, updates {res.n_iter}, "
                  f"marginal error {res.marginal_error:.2e}, {res.passes} passes, {res.syncs} syncs")
        if not self.debias:
            return (res.f.detach(), res.g.detach()) if self.potentials else res.value
        rxx = self._run(comm, x, x, a, a, u, u, ns, ns, diam, mode, None, self_transport=True)
        ryy = self._run(comm, y, y, b, b, v, v, ms, ms, diam, mode, None, self_transport=True)
        if self.potentials:
            return (res.f - rxx.f).detach(), (res.g - ryy.g).detach()
        value = res.value - 0.5 * (rxx.value + ryy.value)
        if self.tol is None:
            return value
        masses = _AllSum.apply(torch.stack([a.sum(), b.sum()]), comm)
        return value + (0.5 * self.eps * (masses[0] - masses[1]) ** 2).to(res.value.dtype)

    def _run(self, comm, x, y, a, b, u, v, ns, ms, diam, mode, init, self_transport=False) -> ShardedResult:
        pen_a, pen_b = _penalties(self.penalty, self.tau)
        return _solve(comm, x, y, a, b, u, v, ns, ms, p=self.p, eps=self.eps, pen_a=pen_a, pen_b=pen_b,
                      mass=self.mass, scaling=self.scaling, diameter=diam, tol=self.tol, max_iter=self.max_iter,
                      backend=self._backend(x), init=init, accelerate=True, check_every=None, mode=mode,
                      value_tol=self.value_tol, precision=self.precision, autotune=self.autotune,
                      self_transport=self_transport)


def _compute_cast(t: torch.Tensor) -> torch.Tensor:
    return t.to(_loss._compute(t.dtype))


# ----------------------------------------------------------------------------------- example: a 2-D flow
def _flow(rank: int, world: int, args) -> list:
    """One rank of the sharded 2-D gradient flow: the particles beta (``args.points`` in all) follow the gradient of
    the (unbalanced) OT loss towards a mixture of four Gaussians alpha; each rank holds its shard of both clouds
    and moves its own particles. Rank 0 prints the loss; returns the losses (every rank)."""
    import time

    torch.manual_seed(args.seed)
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    n = args.points
    centers = torch.tensor([[2.0, 2.0], [-2.0, 2.0], [-2.0, -2.0], [2.0, -2.0]])
    alpha = centers[torch.randint(0, 4, (n,))] + 0.4 * torch.randn(n, 2)
    beta = torch.randn(n, 2) * 0.5
    cut = [n * r // world for r in range(world + 1)]
    x = alpha[cut[rank]:cut[rank + 1]].to(dev)
    y = beta[cut[rank]:cut[rank + 1]].to(dev)
    reach = None if args.reach == 0 else args.reach
    loss = SROTLoss(p=2, blur=args.blur, reach=reach, debias=False, warm_start=True, backend=args.backend,
                    mode=args.mode)
    start = time.perf_counter()
    values = []
    for step in range(args.steps + 1):
        y = y.detach().requires_grad_()
        value = loss(x, y)
        value.backward()
        values.append(value.item())
        if rank == 0 and (step % max(args.steps // 10, 1) == 0 or step == args.steps):
            res = loss.last_result
            print(f"step {step:4d}  OT {float(value.detach()):.5f}  updates {res.n_iter:4d}  {res.mode} on "
                  f"{world} rank(s), {res.backend}, {time.perf_counter() - start:7.2f} s", flush=True)
        if step < args.steps:
            y = y - args.lr * n * y.grad  # n * grad_j = b_j^-1 grad_j: the flow's velocity of particle j
    return values


def _spawned(rank: int, world: int, port: int, args) -> None:
    import datetime
    import socket

    loopback = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    if loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback[0])
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    try:
        _flow(rank, world, args)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    """``python -m srot_fast.distributed``: a sharded 2-D gradient flow. Under ``torchrun`` it joins the job's
    process group (NCCL when CUDA is available, else gloo); otherwise it spawns ``--nproc`` gloo ranks on
    127.0.0.1."""
    import argparse
    import socket

    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(prog="python -m srot_fast.distributed", description=main.__doc__)
    ap.add_argument("--nproc", type=int, default=2, help="gloo ranks to spawn when not under torchrun")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per spawned rank")
    ap.add_argument("--points", type=int, default=4000, help="points per cloud, over all ranks")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--blur", type=float, default=0.1)
    ap.add_argument("--reach", type=float, default=1.0, help="reach of the unbalanced (KL) loss; 0: balanced OT")
    ap.add_argument("--mode", default="auto", choices=MODES)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
        try:
            _flow(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(args.nproc, port, args), nprocs=args.nproc)


if __name__ == "__main__":
    main()
