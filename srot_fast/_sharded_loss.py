"""The sharded loss behind :mod:`srot_fast.distributed`: :class:`SROTLoss` over point clouds sharded across
the ranks of a process group (hard / soft SROT with all-reduced masses and gamma, sharded debiasing)."""
from __future__ import annotations

import torch

from . import _checks
from . import loss as _loss
from ._sharded import Comm, ShardedGeometry, Side
from ._sharded_solve import (
    ShardedResult,
    _bbox_diameter,
    _checksum,
    _consistent,
    _mode,
    _points,
    _resolve_mode,
    _solve,
    _weights,
)
from .backends import get_ops, resolve_backend
from .kernels.triton.options import kernel_options
from .sinkhorn import _penalties
from .weights import soft_offsets

__all__ = ["SROTLoss"]


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
    soft SROT's gamma = max C is all-reduced, the debiasing terms are sharded self-transport solves. With
    ``warm_start`` each of the three solves starts from this rank's shards of the previous call's potentials when
    they fit on every rank. ``last_result`` is the :class:`ShardedResult` of the cross problem.
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
                s_x, s_y = self._scores(x[None], y[None], scores, batched=False)
                s_x = None if s_x is None else s_x[0]  # checked by _scores
                s_y = None if s_y is None else s_y[0]
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
        res = self._run(comm, x, y, a, b, u, v, ns, ms, diam, mode, self._agreed_init(comm, self._warm, a, b))
        if self.warm_start:
            self._warm = (res.f.detach(), res.g.detach())
        self.last_result = res
        if self.verbose and comm.rank == 0:
            print(f"SROTLoss (rank 0 of {comm.world}, {res.mode}): {res.backend}, updates {res.n_iter}, "
                  f"marginal error {res.marginal_error:.2e}, {res.passes} passes, {res.syncs} syncs")
        if not self.debias:
            return (res.f.detach(), res.g.detach()) if self.potentials else res.value
        sym = self._symmetric()
        kept = self._warm_debias or (None, None)
        rxx = self._run(comm, x, x, a, a, u, u, ns, ns, diam, mode, self._agreed_init(comm, kept[0], a, a),
                        self_transport=sym)
        ryy = self._run(comm, y, y, b, b, v, v, ms, ms, diam, mode, self._agreed_init(comm, kept[1], b, b),
                        self_transport=sym)
        if self.warm_start:
            self._warm_debias = tuple((r.f.detach(), r.g.detach()) for r in (rxx, ryy))
        if self.potentials:
            return (res.f - rxx.f).detach(), (res.g - ryy.g).detach()
        value = res.value - 0.5 * (rxx.value + ryy.value)
        if self.tol is None:
            return value
        masses = _AllSum.apply(torch.stack([a.sum(), b.sum()]), comm)
        return value + (0.5 * self.eps * (masses[0] - masses[1]) ** 2).to(res.value.dtype)

    def _agreed_init(self, comm, kept, a, b):
        """With ``warm_start``, this rank's shards ``kept`` of the previous call's potentials of the same solve where
        they fit its weights a, b on every rank (one collective), else None on every rank (a cold solve)."""
        if not self.warm_start or kept is None:  # the same on every rank: all ranks make the same calls
            return None
        ok = self._init(kept, a, b) is not None  # this rank's test
        return kept if bool(comm.max(torch.tensor([0.0 if ok else 1.0], device=comm.device)) == 0) else None

    def _run(self, comm, x, y, a, b, u, v, ns, ms, diam, mode, init, self_transport=False) -> ShardedResult:
        pen_a, pen_b = _penalties(self.penalty, self.tau)
        return _solve(comm, x, y, a, b, u, v, ns, ms, p=self.p, eps=self.eps, pen_a=pen_a, pen_b=pen_b,
                      mass=self.mass, scaling=self.scaling, diameter=diam, tol=self.tol, max_iter=self.max_iter,
                      backend=self._backend(x), init=init, accelerate=True, check_every=None, mode=mode,
                      value_tol=self.value_tol, precision=self.precision, autotune=self.autotune,
                      self_transport=self_transport)


def _compute_cast(t: torch.Tensor) -> torch.Tensor:
    return t.to(_loss._compute(t.dtype))
