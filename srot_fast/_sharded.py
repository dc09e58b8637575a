r"""Point clouds sharded over the ranks of a ``torch.distributed`` process group: the collectives the
sharded solve needs (:class:`Comm`) and the geometry the Sinkhorn loop runs on (:class:`ShardedGeometry`,
:class:`ShardedPartialGeometry`). The public API is :mod:`srot_fast.distributed`.

Each rank holds a shard of the row points x (N_r, D) and of the column points y (M_r, D) (any sizes,
zero included). The row soft-min of the local x block needs every column shard:
    -eps LSE_j[h_j - C_ij / eps] = -eps LSE_k LSE_{j in shard k}[...],
so it runs the backend's ``softmin`` on the local block against each shard k and merges the per-shard
log-sum-exps (an online log-sum-exp; the weighted means of the gradients merge the same way, weighted by
exp(LSE_k - LSE)). The shards reach the other ranks in one of two ways (:class:`Side`):

- ``"gather"``: every rank keeps a copy of the other ranks' points (gathered once); a pass then moves only
  the log-weights h (M floats), by an asynchronous all-gather that runs while the local block is computed.
- ``"ring"``: the shards (points and h) travel around the ring of ranks, W - 1 steps per pass; at each step
  the next shard is sent / received (one ``batch_isend_irecv``) while the current one is computed. Memory stays
  O((N_r + max_k M_k) D) per rank.

Sums over points (masses, marginal errors, the dual value) are all-reduced by :meth:`ShardedGeometry.point_sum`,
which the loop of :mod:`srot_fast._loop` uses in place of the local sum. Every rank takes part in every
collective in the same order: the loop's decisions depend only on all-reduced quantities, so they agree.
"""
from __future__ import annotations

import math
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from .geometry import PartialGeometry

__all__ = ["Comm", "Side", "ShardedGeometry", "ShardedPartialGeometry", "MODES", "GATHER_BYTES"]

MODES = ("auto", "gather", "ring")
GATHER_BYTES = 1 << 30  # mode='auto' gathers all points on every rank when they take at most this much
_ERRORS = {cls.__name__: cls for cls in (ValueError, TypeError, FloatingPointError, RuntimeError, ImportError,
                                         NotImplementedError, IndexError, KeyError)}


class Comm:
    """One rank's view of a process group (``None``: the default group) and the collectives of the solve.
    Small tensors travel on ``device`` (CUDA for NCCL, else CPU)."""

    def __init__(self, group=None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("srot_fast.distributed needs an initialised process group: call "
                               "torch.distributed.init_process_group(...) first (torchrun sets up its environment)")
        self.group = dist.group.WORLD if group is None else group
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        if self.rank < 0:
            raise RuntimeError("this process is not a member of the given process group")
        nccl = dist.get_backend(self.group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def peer(self, r: int) -> int:
        """Global rank of group rank ``r`` (point-to-point calls take global ranks)."""
        return dist.get_global_rank(self.group, r) if self.group is not dist.group.WORLD else r

    # -- reductions ------------------------------------------------------------------------------------
    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Element-wise sum of ``t`` over the ranks (a new tensor; ``t`` is unchanged)."""
        if self.world == 1:
            return t
        out = t.clone()
        dist.all_reduce(out, dist.ReduceOp.SUM, group=self.group)
        return out

    def max(self, t: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum of ``t`` over the ranks."""
        if self.world == 1:
            return t
        out = t.clone()
        dist.all_reduce(out, dist.ReduceOp.MAX, group=self.group)
        return out

    def logsumexp(self, t: torch.Tensor) -> torch.Tensor:
        """log sum_r exp(t_r) of per-rank log-sum-exps ``t`` (any shape): gathered, then reduced the same way
        on every rank (exact, no overflow)."""
        if self.world == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.logsumexp(torch.stack(parts), 0)

    def gather_ints(self, values: list) -> list:
        """[values of rank 0, values of rank 1, ...] for a list of ints of the same length on every rank."""
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        if self.world == 1:
            return [values]
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t, group=self.group)
        return [p.tolist() for p in parts]

    def agree(self, fn, meta=None, width: int = 0):
        """Run ``fn()`` (argument checks) on every rank, then gather ``meta(out)`` (a list of ``width`` ints,
        e.g. shard sizes) from every rank. If ``fn`` raised on any rank, every rank raises the same error
        (the first failing rank's, naming it) instead of leaving the others waiting in a collective.
        Returns (out, [meta of each rank])."""
        try:
            out, err = fn(), None
            mine = [0] + (list(meta(out)) if meta is not None else [])
            if len(mine) != width + 1:
                raise RuntimeError(f"srot_fast: internal error, {len(mine) - 1} metadata values for width {width}")
        except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
            out, err = None, e
            mine = [1] + [0] * width
        rows = self.gather_ints(mine)
        failed = [r for r, row in enumerate(rows) if row[0]]
        if failed:
            msg = [None] * self.world
            dist.all_gather_object(msg, None if err is None else (type(err).__name__, str(err)), group=self.group)
            r = failed[0]
            kind, text = msg[r]
            raise _ERRORS.get(kind, RuntimeError)(f"rank {r} of {self.world}: {text}") from err
        return out, [row[1:] for row in rows]


class Side:
    """One side's points on this rank, pts (B, n_r, D), and the way the other ranks' shards reach it.

    ``sizes[k]`` is the number of points of rank k. ``mode`` is 'gather' (the other shards' points are kept
    here, gathered at construction) or 'ring' (they travel at every pass). The constructor is a collective.
    """

    def __init__(self, comm: Comm, pts: torch.Tensor, mode: str, sizes: Optional[list] = None):
        if mode not in ("gather", "ring"):
            raise ValueError(f"mode must be 'gather' or 'ring', got {mode!r}")
        self.comm, self.pts, self.mode = comm, pts, mode
        self.sizes = sizes if sizes is not None else [r[0] for r in comm.gather_ints([pts.shape[-2]])]
        self.others = None  # (B, sum of the other shards' sizes, D) in rank order ('gather')
        if mode == "gather" and comm.world > 1 and self.total > 0:
            self.others = self._gather_others(pts)

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def subset(self, idx: torch.Tensor) -> "Side":
        """The problems ``idx`` of the batch (local, no communication)."""
        out = Side.__new__(Side)
        out.comm, out.pts, out.mode, out.sizes = self.comm, self.pts[idx], self.mode, self.sizes
        out.others = None if self.others is None else self.others[idx]
        return out

    def _gather_others(self, t: torch.Tensor, async_op: bool = False):
        """The other ranks' ``t`` (B, n_k, ...) concatenated along dim 1 in rank order (padded all-gather);
        with ``async_op``, a function that waits and returns it."""
        comm, big = self.comm, max(self.sizes)
        pad = t.new_zeros(t.shape[0], big, *t.shape[2:])
        pad[:, :t.shape[1]] = t
        parts = [torch.empty_like(pad) for _ in range(comm.world)]
        work = dist.all_gather(parts, pad, group=comm.group, async_op=async_op)

        def result():
            if work is not None and async_op:
                work.wait()
            return torch.cat([parts[k][:, :self.sizes[k]] for k in range(comm.world) if k != comm.rank], 1)
        return result if async_op else result()

    def blocks(self, h: torch.Tensor) -> Iterator[tuple]:
        """(points (B, m_k, D), h_k (B, m_k)) for the local shard (first) and the other ranks' shards, with
        this rank's column log-weights ``h`` (B, n_r). The next block's communication runs while the consumer
        works on the current one. Consume it fully on every rank (it drives collectives)."""
        comm = self.comm
        if comm.world == 1 or self.total == 0:
            yield self.pts, h
            return
        if self.mode == "gather":
            wait = self._gather_others(h, async_op=True)
            yield self.pts, h
            h_others = wait()
            if self.others.shape[1] > 0:
                yield self.others, h_others
            return
        # ring: at step s this rank holds the shard of rank (rank - s) mod W and passes it on to rank + 1
        B, D = self.pts.shape[0], self.pts.shape[-1]
        nxt, prv = comm.peer((comm.rank + 1) % comm.world), comm.peer((comm.rank - 1) % comm.world)
        cur = torch.cat([self.pts.reshape(-1), h.reshape(-1)]) if self.pts.shape[1] else None
        owner = comm.rank
        for step in range(comm.world):
            ops, reqs, buf = [], [], None
            if step < comm.world - 1:
                incoming = (owner - 1) % comm.world
                if self.sizes[owner] > 0:
                    ops.append(dist.P2POp(dist.isend, cur, nxt, comm.group, step))
                if self.sizes[incoming] > 0:
                    buf = self.pts.new_empty(B * self.sizes[incoming] * (D + 1))
                    ops.append(dist.P2POp(dist.irecv, buf, prv, comm.group, step))
                if ops:  # one batch: NCCL would deadlock on a send and a receive issued one after the other
                    reqs = dist.batch_isend_irecv(ops)
            if cur is not None:
                m = self.sizes[owner]
                yield cur[:B * m * D].reshape(B, m, D), cur[B * m * D:].reshape(B, m)
            for r in reqs:
                r.wait()
            cur, owner = buf, (owner - 1) % comm.world


class ShardedGeometry:
    """The soft-min operators of :class:`srot_fast.geometry.Geometry` for sharded points: this rank's rows
    x (B, n_r, D) with offsets u (B, n_r), its columns y (B, m_r, D) with v (B, m_r); ``xs`` / ``ys`` are their
    :class:`Side` objects (the same object when x is y). Inputs and outputs of the soft-mins are this
    rank's shards of the log-weights / potentials. Every method that communicates is a collective.
    ``options``: keyword options of every primitive call, as in :class:`srot_fast.geometry.Geometry`."""

    def __init__(self, ops, xs: Side, ys: Side, p: int, u: Optional[torch.Tensor] = None,
                 v: Optional[torch.Tensor] = None, options: Optional[dict] = None):
        self.ops, self.xs, self.ys, self.p, self.u, self.v = ops, xs, ys, p, u, v
        self.options = {} if options is None else dict(options)
        self.x, self.y, self.comm = xs.pts, ys.pts, xs.comm
        self.batch, self.n, self.m = self.x.shape[0], self.x.shape[-2], self.y.shape[-2]

    # -- the loop's interface -------------------------------------------------------------------------
    def softmin_x(self, h: torch.Tensor, eps: float) -> torch.Tensor:
        """(B, n_r) -eps * LSE_j[h_j - c'_ij / eps] over every column shard, for this rank's h (B, m_r)."""
        if self.v is not None:
            h = h - self.v / eps
        out = self._softmin(self.x, self.ys, h, eps)
        return out if self.u is None else out + self.u

    def softmin_y(self, h: torch.Tensor, eps: float) -> torch.Tensor:
        """(B, m_r) -eps * LSE_i[h_i - c'_ij / eps] over every row shard, for this rank's h (B, n_r)."""
        if self.u is not None:
            h = h - self.u / eps
        out = self._softmin(self.y, self.xs, h, eps)
        return out if self.v is None else out + self.v

    def point_sum(self, t: torch.Tensor) -> torch.Tensor:
        """(B,) sum of t (B, n) over the points of every rank (all-reduced)."""
        return self.comm.sum(t.sum(-1))

    def point_logsumexp(self, t: torch.Tensor) -> torch.Tensor:
        """(B,) log-sum-exp of t (B, n) over the points of every rank."""
        return self.comm.logsumexp(torch.logsumexp(t, -1))

    def subset(self, idx: torch.Tensor) -> "ShardedGeometry":
        u = None if self.u is None else self.u[idx]
        v = None if self.v is None else self.v[idx]
        xs = self.xs.subset(idx)
        ys = xs if self.ys is self.xs else self.ys.subset(idx)
        return ShardedGeometry(self.ops, xs, ys, self.p, u, v, self.options)

    # -- passes ---------------------------------------------------------------------------------------
    def _softmin(self, pts: torch.Tensor, side: Side, h: torch.Tensor, eps: float) -> torch.Tensor:
        """-eps * LSE over all of ``side``'s shards for the local rows ``pts`` (B, n, D)."""
        outs = []
        for cols, hk in side.blocks(h):
            if pts.shape[1] and cols.shape[1]:
                outs.append(self.ops.softmin(pts, cols, hk, eps, self.p, **self.options))
        if len(outs) == 1:
            return outs[0]
        if not outs:
            return pts.new_full(pts.shape[:2], math.inf)
        lse = torch.logsumexp(torch.stack([-o / eps for o in outs]), 0)
        return -eps * lse

    def weighted_mean(self, side: str, h: torch.Tensor, eps: float, phi: str) -> torch.Tensor:
        """(B, n, D) the backend's ``weighted_mean`` for this rank's points of ``side`` ('x': rows against all
        columns, 'y': columns against all rows) under the softmax over every shard of the other side, with
        this rank's log-weights h of the other side (offsets already folded in)."""
        pts, other = (self.x, self.ys) if side == "x" else (self.y, self.xs)
        lse = mean = None
        for cols, hk in other.blocks(h):
            if not (pts.shape[1] and cols.shape[1]):
                continue
            l_k = -self.ops.softmin(pts, cols, hk, eps, self.p, **self.options) / eps      # (B, n) this block's LSE
            m_k = self.ops.weighted_mean(pts, cols, hk, eps, self.p, phi, **self.options)  # (B, n, D) its mean
            if lse is None:
                lse, mean = l_k, m_k
                continue
            new = torch.logaddexp(lse, l_k)
            w_old, w_new = (lse - new).exp()[..., None], (l_k - new).exp()[..., None]
            mean = (torch.where(w_old > 0, w_old * mean, torch.zeros_like(mean))
                    + torch.where(w_new > 0, w_new * m_k, torch.zeros_like(m_k)))
            lse = new
        if mean is None:
            mean = pts.new_zeros(pts.shape)
        return mean

    def max_cost(self) -> torch.Tensor:
        """(B,) largest ground cost C(x_i, y_j) over all pairs of all ranks (-inf without any pair)."""
        best = self.x.new_full((self.batch,), -math.inf)
        h = self.y.new_zeros(self.y.shape[:2])
        for cols, _ in self.ys.blocks(h):
            if self.n and cols.shape[1]:
                best = torch.maximum(best, self.ops.max_cost(self.x, cols, self.p, **self.options).to(best.dtype))
        return self.comm.max(best)


class ShardedPartialGeometry(PartialGeometry):
    """:class:`srot_fast.geometry.PartialGeometry` over a :class:`ShardedGeometry`: every rank holds the same
    copy of the two dummy points (the last entry of its row and column vectors); the log-sum-exps over real
    points run over every rank and :meth:`point_sum` counts the dummy once."""

    def subset(self, idx: torch.Tensor) -> "ShardedPartialGeometry":
        return ShardedPartialGeometry(self.real.subset(idx), self.mass)

    def point_sum(self, t: torch.Tensor) -> torch.Tensor:
        """(B,) sum of t (B, n_r + 1) over the real points of every rank, plus the dummy once."""
        return self.real.point_sum(t[..., :-1]) + t[..., -1]

    def _real_logsumexp(self, t: torch.Tensor) -> torch.Tensor:
        """(B,) log-sum-exp of t (B, n_r) over the real points of every rank (the dummy row and the partial OT
        rebalancing step of :class:`PartialGeometry` use it)."""
        return self.real.point_logsumexp(t)
