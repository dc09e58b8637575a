"""The sharded solve behind :mod:`srot_fast.distributed`: argument checks of a collective call, the solve on a
:class:`srot_fast._sharded.ShardedGeometry` (the loop of :mod:`srot_fast._loop`, sums over points
all-reduced), the envelope backward (sharded weighted means: collectives) and the per-rank result."""
from __future__ import annotations

import math
import warnings
import zlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from . import _checks, _loop
from ._envelope import EnvelopeValue, Saved
from ._loop import epsilon_schedule
from ._sharded import GATHER_BYTES, MODES, Comm, ShardedGeometry, ShardedPartialGeometry, Side
from .backends import get_ops, resolve_backend
from .kernels.triton.options import kernel_options
from .penalties import Penalty
from .sinkhorn import ConvergenceWarning, schedule_terms

__all__ = ["ShardedResult"]


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


def _solve(comm: Comm, x, y, a, b, u, v, ns: list, ms: list, *, p, eps, pen_a, pen_b, mass, scaling, diameter, tol,
           max_iter, backend, init, accelerate, check_every, mode, self_transport=False,
           value_tol=None, precision=None, autotune=None) -> ShardedResult:
    """The sharded solve, after the (agreed) argument checks: x (n_r, D), y (m_r, D), a, b, u, v this rank's
    shards (a, b may be None: uniform); ``ns``, ``ms`` every rank's shard sizes. Errors raised here are the
    same on every rank (they depend on all-reduced quantities only)."""
    n, m = sum(ns), sum(ms)
    if self_transport and pen_a != pen_b:
        raise ValueError(f"self-transport needs one penalty on both marginals, got {pen_a} and {pen_b}")
    if n == 0 or m == 0:
        raise ValueError(f"{'x' if n == 0 else 'y'} has no point on any rank")
    in_dtype = x.dtype
    a = torch.full(x.shape[:1], 1.0 / n, dtype=x.dtype, device=x.device) if a is None else a
    b = torch.full(y.shape[:1], 1.0 / m, dtype=y.dtype, device=y.device) if b is None else b
    x, y, a, b, u, v = _checks.compute_dtype(x, y, a, b, u, v)
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
            _checks.check_partial_mass(mass, float(torch.minimum(mass_a, mass_b).min()), in_dtype, " (over all ranks)")
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
                if abs(float(tot[0]) - float(tot[1])) > _checks.mass_rtol(in_dtype) * max(float(tot[0]), float(tot[1])):
                    raise ValueError(
                        f"balanced OT needs a and b of equal total mass (over all ranks), got {float(tot[0]):.6g} "
                        f"and {float(tot[1]):.6g}; normalise them or use penalty='kl'/'tv' with a finite tau")
            if self_transport:
                sol = _loop.symmetric(geom, a1.log(), pen_a, eps_list, tol, max_iter, init, check_every,
                                      value_tol=value_tol)
            else:
                sol = _loop.alternating(geom, a1.log(), b1.log(), pen_a, pen_b, eps_list, tol, max_iter, init,
                                        accelerate, check_every, value_tol=value_tol)
                sol = _loop.centred(sol, a1, b1, pen_a, pen_b, tol, _loop._point_sum(geom))
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
            af, wa, bg, wb = _sums(comm, [a1 * f.abs(), a1, b1 * g.abs(), b1], False)[:, 0].tolist()
            warnings.warn(_checks.unconverged(max_iter, err, tol, x.dtype, eps, 0.5 * (af / wa + bg / wb)),
                          ConvergenceWarning, stacklevel=3)
        row_mass = _checks.masses(a1, f, s_real, eps)
        col_mass = _checks.masses(b1, g, t_real, eps)
        moved = float(_sums(comm, [row_mass], False)[0])
        hx = b1.log() + (g if vd is None else g - vd[None]) / eps
        hy = a1.log() + (f if ud is None else f - ud[None]) / eps
        saved = Saved(geom=geom, eps=eps, grad_row=_checks.masses(a1, f_hat, s_real, eps),
                      grad_col=_checks.masses(b1, g_hat, t_real, eps), ga=ga, gb=gb, hx=hx, hy=hy)
    # the backward's weighted means are collectives: every rank runs them, as x (y) requires grad on every rank
    # or on none (checked); batch of 1
    lead = [None if t is None else t[None] for t in (x, y, a, b, u, v)]
    value = EnvelopeValue.apply(value, saved, *lead).to(in_dtype)
    return ShardedResult(f=f[0], g=g[0], value=value[0], n_iter=int(sol.n_iter[0]), marginal_error=err,
                         row_mass=row_mass[0], col_mass=col_mass[0], transported_mass=moved, eps=eps, p=p,
                         backend=name, mode=mode, passes=passes, syncs=sol.syncs, rank=comm.rank,
                         world_size=comm.world, _geom=geom, _hx=hx)
