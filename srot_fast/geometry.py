r"""The only place the Sinkhorn loop meets the points: soft-min operators of the (soft) cost.

A geometry holds row points x (N, D), column points y (M, D), the cost exponent p, optional
per-point cost offsets u (N,), v (M,) — the soft SROT cost c'_ij = C(x_i, y_j) + u_i + v_j — and
the primitives module of one backend. Offsets are free (docs/DESIGN.md, Problem):
    -eps * LSE_j[h_j - c'_ij / eps] = u_i - eps * LSE_j[h_j - v_j / eps - C_ij / eps],
so they ride on the plain kernel with shifted inputs and outputs, never on an N x M pass.

``PartialGeometry`` wraps a geometry with one dummy point per side (Chapel et al. 2020): cost 0
between a dummy and the real points of the other side, +inf between the two dummies. Balanced OT
on the augmented measures is partial OT. The dummy row and column are rank one, so the augmented
soft-min is the plain one plus a log-add-exp.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["Geometry", "PartialGeometry", "bbox_diameter"]

STORE_PAIRS = 1 << 22  # B N M up to which a geometry keeps its squared distances for its soft-min passes
STORE_MIN_D = 8        # (in dimension D >= this, on a backend that reads them: cpu); below, computing is as fast,
STORE_SMALL = 1 << 18  # but for small problems (N M up to this, any D), where a pass is mostly overhead and the
                       # whole loop then runs as one compiled call (srot_fast/_loop.py, _compiled_loop),
STORE_COLD = 1 << 20   # and for a cold solve to a tolerance (eps-scaling: dozens of updates) of up to this many pairs


def bbox_diameter(x: torch.Tensor, y: torch.Tensor, a: Optional[torch.Tensor] = None,
                  b: Optional[torch.Tensor] = None) -> float:
    """Diagonal length of the bounding box of both point clouds (GeomLoss's default), in data units,
    computed in float64. With weights a, b, only points of positive weight count (padding is neutral);
    for a batch (B, N, D), the largest diagonal over the problems."""
    if x.numel() == 0 or y.numel() == 0:
        return 0.0
    shape = (-1,) + tuple(x.shape[-2:]), (-1,) + tuple(y.shape[-2:])
    pts = torch.cat([x.reshape(shape[0]), y.reshape(shape[1])], -2).double()  # (B, N + M, D)
    if a is None and b is None:
        low, high = torch.aminmax(pts, dim=-2)
    else:
        keep = torch.cat([torch.ones(pts.shape[0], t.shape[-2], dtype=torch.bool, device=pts.device) if w is None
                          else (w > 0).reshape(pts.shape[0], -1) for t, w in ((x, a), (y, b))], -1)[..., None]
        high, low = torch.where(keep, pts, -math.inf).amax(-2), torch.where(keep, pts, math.inf).amin(-2)
    return float((high - low).norm(dim=-1).max())


class Geometry:
    """Soft-min operators for the cost C + u + v on a batch of B problems (x (B, N, D), y (B, M, D),
    u (B, N), v (B, M)) with the given backend ops: one kernel call per pass for the whole batch.
    ``options``: keyword options passed to every primitive call (the Triton backend's ``precision`` and
    ``autotune``, :func:`srot_fast.kernels.triton.options.kernel_options`; {} for the other backends)."""

    def __init__(self, ops, x: torch.Tensor, y: torch.Tensor, p: int,
                 u: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None, options: Optional[dict] = None,
                 stored=None, cold: bool = False):
        self.ops, self.x, self.y, self.p, self.u, self.v = ops, x, y, p, u, v
        self.cold = cold  # a solve to a tolerance that starts with eps-scaling (no warm start): see _stored
        self.options = {} if options is None else dict(options)
        self.batch, self.n, self.m = x.shape[0], x.shape[-2], y.shape[-2]
        self._sq = stored  # see _stored: [distances, transpose or None], False (not kept), None (not decided yet)

    def _stored(self, side: int):
        """The (B, N, M) squared distances |x_i - y_j|^2 (``side`` 0) or their (B, M, N) transpose (1), kept for the
        soft-min passes when the backend reads them (``ops.squared_distances``, ``ops.softmin_sq``), on CPU, in
        float32 / float64, for B N M <= STORE_PAIRS (2 B N M values at most: 32 MB in float32, 64 MB in float64) in
        dimension D >= STORE_MIN_D, or in any dimension for problems of N M <= STORE_SMALL pairs (STORE_COLD when
        ``cold``): in high dimension a pass then reads N M values instead of computing N M distances of D terms, on
        small problems it skips the per-pass transpose of y and lets the solver run its whole loop as one compiled
        call; a warm-started solve of a few updates does not repay computing them above STORE_SMALL (measured:
        docs/DESIGN.md, Kernel primitive). They are the values the compiled pass computes, so the result is the
        same. Computed at the first pass of each side (the cost of one pass); None when not kept."""
        if self._sq is False:
            return None
        if self._sq is None:
            sq_fn = getattr(self.ops, "squared_distances", None)
            pairs = self.batch * self.n * self.m
            keep = (sq_fn is not None and self.x.device.type == "cpu" and self.x.dtype == self.y.dtype
                    and self.x.dtype in (torch.float32, torch.float64) and 0 < pairs
                    and pairs <= STORE_PAIRS and (self.n * self.m <= (STORE_COLD if self.cold else STORE_SMALL)
                                                  or self.x.shape[-1] >= STORE_MIN_D))
            self._sq = [sq_fn(self.x, self.y), None] if keep else False
        if not self._sq:
            return None
        if self._sq[side] is None:  # the transpose, at the first column pass (self-transport solves have none)
            self._sq[side] = self._sq[1 - side].transpose(1, 2).contiguous()
        return self._sq[side]

    def stored_distances(self, transpose: bool = True):
        """(sq, sq_t): the (B, N, M) squared distances and their (B, M, N) transpose (None unless ``transpose``)
        where this geometry keeps them (:meth:`_stored`), else None."""
        sq = self._stored(0)
        return None if sq is None else (sq, self._stored(1) if transpose else None)

    def release(self) -> None:
        """Frees the stored distances (the passes after this stream)."""
        self._sq = False

    def softmin_x(self, h: torch.Tensor, eps: float) -> torch.Tensor:
        """(B, N) -eps * LSE_j[h_j - c'_ij / eps] for column log-weights h (B, M)."""
        if self.v is not None:
            h = h - self.v / eps
        sq = self._stored(0)
        out = (self.ops.softmin(self.x, self.y, h, eps, self.p, **self.options) if sq is None
               else self.ops.softmin_sq(sq, h, eps, self.p))
        return out if self.u is None else out + self.u

    def softmin_y(self, h: torch.Tensor, eps: float) -> torch.Tensor:
        """(B, M) -eps * LSE_i[h_i - c'_ij / eps] for row log-weights h (B, N)."""
        if self.u is not None:
            h = h - self.u / eps
        sq = self._stored(1)
        out = (self.ops.softmin(self.y, self.x, h, eps, self.p, **self.options) if sq is None
               else self.ops.softmin_sq(sq, h, eps, self.p))
        return out if self.v is None else out + self.v

    def weighted_mean(self, side: str, h: torch.Tensor, eps: float, phi: str) -> torch.Tensor:
        """The backend's ``weighted_mean`` for the points of ``side``: 'x' gives (B, N, D) for the rows under
        softmax_j(h_j - C_ij / eps), h (B, M); 'y' gives (B, M, D) for the columns, h (B, N). The offsets are
        not applied: fold them into h."""
        pts, other = (self.x, self.y) if side == "x" else (self.y, self.x)
        return self.ops.weighted_mean(pts, other, h, eps, self.p, phi, **self.options)

    def plan_argmax(self, h: torch.Tensor, eps: float) -> torch.Tensor:
        """(B, N) int64 argmax_j (h_j - C_ij / eps) for column log-weights h (B, M) (offsets folded into h)."""
        return self.ops.plan_argmax(self.x, self.y, h, eps, self.p, **self.options)

    def max_cost(self) -> torch.Tensor:
        """(B,) largest ground cost max_ij C(x_i, y_j) of each problem (offsets not included)."""
        return self.ops.max_cost(self.x, self.y, self.p, **self.options)

    def subset(self, idx: torch.Tensor) -> "Geometry":
        """The problems ``idx`` (int64 (K,)) of the batch, as a geometry of their own."""
        u = None if self.u is None else self.u[idx]
        v = None if self.v is None else self.v[idx]
        stored = [None if t is None else t[idx] for t in self._sq] if self._sq else self._sq
        return Geometry(self.ops, self.x[idx], self.y[idx], self.p, u, v, self.options, stored, self.cold)

    def transposed(self) -> "Geometry":
        stored = self._sq[::-1] if self._sq else self._sq
        return Geometry(self.ops, self.y, self.x, self.p, self.v, self.u, self.options, stored, self.cold)


def compiled_library(geom):
    """``srot_fast.kernels.cpu_ops`` where the solver's per-update bookkeeping for ``geom`` runs in its compiled
    CPU library -- a backend built on it (``cpu``, ``blocksparse``), points on the CPU, an unsharded geometry (a
    partial one: its real geometry), the library available -- else None."""
    real = getattr(geom, "real", geom)
    if (getattr(real, "comm", None) is not None or not getattr(getattr(real, "ops", None), "CPU_LIBRARY", False)
            or real.x.device.type != "cpu"):
        return None
    from .kernels import cpu_ops

    return cpu_ops if cpu_ops.available() else None


class PartialGeometry:
    """``geom`` augmented with a dummy row (index N) and a dummy column (index M), for transported mass
    ``mass``.

    The dual of the augmented problem has one direction along which alternating updates only drift, by
    about eps log 2 per update: shifting the real potentials by +c and the dummy ones by -c multiplies the
    real-to-real plan by exp(2 c / eps) and leaves the rest unchanged. :meth:`rebalance` maximises the dual
    objective along it in closed form (the real plan's mass becomes ``mass``), with no extra kernel pass,
    and can first give the two dummy potentials their exact updates (closed form too: cost 0 to every real
    point of the other side).
    """

    def __init__(self, geom: Geometry, mass: float):
        self.real = geom
        self.mass = mass
        self.batch, self.n, self.m = geom.batch, geom.n + 1, geom.m + 1
        self._last_real = None  # (B, N) real-vs-real part of the last softmin_x
        self._native = None  # cpu_ops where _augment runs in its compiled library, else False (decided at first use)

    def subset(self, idx: torch.Tensor) -> "PartialGeometry":
        return PartialGeometry(self.real.subset(idx), self.mass)

    def _real_logsumexp(self, t: torch.Tensor) -> torch.Tensor:
        """(B,) log-sum-exp of t (B, n) over the real points (a sharded geometry takes every rank's)."""
        return torch.logsumexp(t, -1)

    def _dummy_softmin(self, h: torch.Tensor, eps: float) -> torch.Tensor:
        """(B, 1) the dummy point's soft-min for log-weights h (B, m + 1): cost 0 to the real points of the
        other side, +inf to its dummy."""
        return -eps * self._real_logsumexp(h[:, :-1])[:, None]

    def _augment(self, real, h: torch.Tensor, eps: float) -> torch.Tensor:
        """(B, n + 1) augmented soft-min from the real one ``real`` (B, n) and log-weights h (B, m + 1). With the
        ``cpu`` or ``blocksparse`` backend on CPU tensors (unsharded), one call of the compiled library
        (``cpu_ops.partial_augment``, float64 arithmetic) instead of these torch operations."""
        if self._native is None:
            self._native = compiled_library(self) or False
        if self._native and real.dtype in (torch.float32, torch.float64) and h.dtype == real.dtype:
            return self._native.partial_augment(real, h, eps)
        rows = -eps * torch.logaddexp(-real / eps, h[:, -1:])              # + dummy column at cost 0
        return torch.cat([rows, self._dummy_softmin(h, eps)], -1)

    def shift_last(self, k: torch.Tensor) -> None:
        """The real part of the last row soft-min moved by k (B,), as the potentials of the columns moved by -k."""
        if self._last_real is not None:
            self._last_real = self._last_real + k[:, None].to(self._last_real.dtype)

    def softmin_x(self, h: torch.Tensor, eps: float) -> torch.Tensor:
        real = self.real.softmin_x(h[:, :-1], eps)  # real rows vs real columns
        self._last_real = real
        return self._augment(real, h, eps)

    def softmin_y(self, h: torch.Tensor, eps: float) -> torch.Tensor:
        return self._augment(self.real.softmin_y(h[:, :-1], eps), h, eps)

    def rebalance(self, f: torch.Tensor, g: torch.Tensor, log_b: torch.Tensor, eps: float, log_a: torch.Tensor,
                  dummies: bool = False):
        """(f, g, s) shifted along the real / dummy direction to the dual's maximum on it, where s is the row
        soft-min at the new g; the last :meth:`softmin_x` call must have been at this g (no kernel pass).
        ``dummies``: the dummy row and column potentials first take their exact updates, so that the plan's
        dummy row and column carry their masses |b| - s and |a| - s (what an averaged eps-scaling step leaves
        furthest off; the shift keeps them). With the compiled library where :meth:`_augment` uses it: one call
        for the dummies (``cpu_ops.partial_dummies``) and one for the step (``cpu_ops.partial_rebalance``), float64
        arithmetic, instead of these torch operations."""
        if (self._native and self._last_real is not None
                and all(t.dtype == f.dtype for t in (g, log_a, log_b, self._last_real))):
            if dummies:
                f, g = self._native.partial_dummies(f, g, log_a, log_b, eps)
            f, g, self._last_real, s = self._native.partial_rebalance(f, g, self._last_real, log_a, log_b, eps,
                                                                      self.mass)
            return f, g, s
        if dummies:
            f_dummy, g_dummy = self._dummy_softmin(log_b + g / eps, eps), self._dummy_softmin(log_a + f / eps, eps)
            f, g = torch.cat([f[:, :-1], f_dummy], -1), torch.cat([g[:, :-1], g_dummy], -1)
        log_real = self._real_logsumexp(log_a[:, :-1] + (f[:, :-1] - self._last_real) / eps)  # log real plan mass
        c = (0.5 * eps * (math.log(self.mass) - log_real)).nan_to_num(0.0, 0.0, 0.0)[:, None]
        shift_f = torch.cat([c.expand_as(f[:, :-1]), -c], -1)
        shift_g = torch.cat([c.expand_as(g[:, :-1]), -c], -1)
        f, g = f + shift_f, g + shift_g
        self._last_real = self._last_real - c
        h = log_b + g / eps
        return f, g, self._augment(self._last_real, h, eps)
