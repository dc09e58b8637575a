r"""Safeguarded Anderson acceleration of the Sinkhorn update, per problem of a batch (docs/DESIGN.md, Acceleration).

The alternating update is a fixed-point map of the column potential alone,
    T(g) = A_b(S_y(A_a(S_x(g)))),
f being the exact update A_a(S_x(g)). :class:`Anderson` proposes the next g from the last k + 1 iterates;
:class:`Plain` takes T(g) itself (``accelerate=False``). Both work on (B, M) potentials and (B,) per-problem
state that stays on the device. The torch code of :meth:`Anderson.step` is the reference; with ``native`` (the
loop sets it for the backends built on the compiled CPU library, ``cpu`` and ``blocksparse``) on CPU tensors of
an unsharded solve, the same step runs as one call of ``srot_fast.kernels.cpu_ops.anderson_step`` (and the stall
watch and the test of proposals as calls of its ``track`` and ``replaced``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

DEPTH = 5  # potentials kept in the history
FAR = 1e6  # a proposal whose relative column error exceeds this (and twice the best error) is not taken
STALL = 100  # updates in which the stopping error did not halve: the problem has stalled ...
PLAIN_RUN = 60  # ... and takes this many plain steps before Anderson goes on
QUIT = 2  # partial OT: after this many stalls with no halving between them, plain steps to the end
QUIT_UNBALANCED = 1  # unbalanced OT (KL, TV): plain steps to the end after its first stall
RESTART_GAP = 2  # partial OT with offsets: a bad step in the RESTART_GAP + 1 updates after a restart keeps the history
WILD = 100  # partial OT: a proposal whose RMS distance from T(g) exceeds WILD (span + eps) is not taken (:meth:`wild`)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _cpu_ops():
    """The compiled CPU backend's module (imported on first use, not with the package)."""
    global _CPU_OPS
    if _CPU_OPS is None:
        from .kernels import cpu_ops

        _CPU_OPS = cpu_ops
    return _CPU_OPS


_CPU_OPS = None


class Plain:
    """Plain alternating Sinkhorn: g <- T(g) (frozen where ``done``)."""

    by_value = False
    proposes = False  # g is always T(g) (or frozen): the column marginal is exact

    def step(self, g, g_hat, err, done, value=None):
        return torch.where(done[:, None], g, g_hat)

    def subset(self, idx: torch.Tensor) -> "Plain":
        return self


class Anderson:
    """Anderson acceleration (type II) of g -> T(g), per problem.

    From the last k + 1 <= DEPTH + 1 iterates g_i (since the problem's last restart), their images T(g_i) and
    residuals r_i = T(g_i) - g_i, the next g is the combination sum_i alpha_i T(g_i) (sum alpha_i = 1) whose
    residuals' combination is smallest: with the newest entry w, T(g_w) - sum_c gamma_c (T(g_w) - T(g_c)),
    where gamma minimises |r_w - sum_c gamma_c (r_w - r_c)| (a least-squares solve per problem through its
    normal equations, in float64, with a relative ridge of 1e-10). The history is a ring buffer of DEPTH + 1
    slots with the Gram matrix of its residuals, <r_i, r_j>, kept up to date: an entry adds one row of inner
    products, and the normal equations follow from that matrix, so an update costs two products of the
    (DEPTH + 1, M) history with a vector and a handful of tensor operations for the whole batch.
    Safeguard: a proposal far from T(g) (:meth:`too_far`) is replaced by T(g) before any pass uses it; where
    the (row) marginal error rose above twice its best value since the last restart (or is NaN),
    the plain step T(g) is taken and that problem's history and best error restart -- unless ``by_value`` and
    the (B,) dual objective passed to :meth:`step` is at its best so far: the iterate then made progress on the
    objective Sinkhorn maximises and is kept. Unbalanced OT and partial OT with cost offsets use ``by_value``;
    balanced OT and partial OT without offsets keep the error test alone (docs/DESIGN.md, Acceleration). With
    ``restart_gap`` = k > 0 (the loop passes RESTART_GAP for partial OT with offsets), a bad step in the k + 1
    updates after a restart takes the plain step but keeps the (fresh) history: restarting again
    would leave two entries, whose extrapolation can overshoot the same way at every restart, a cycle that made
    no progress for thousands of updates there (elsewhere the gap cost updates; docs/DESIGN.md). Residuals
    count on points of positive weight only (``mask`` (B, M)), so zero-weight padding changes nothing.
    Stall watch (:meth:`track`, :attr:`resting`): a balanced OT problem whose stopping error has not halved in
    STALL updates takes PLAIN_RUN plain steps; a partial OT problem takes plain steps to the end after QUIT such
    stalls, an unbalanced one after QUIT_UNBALANCED. ``rank_sum`` completes sums over points taken on one shard
    of a sharded geometry (the identity otherwise)."""

    proposes = True  # g may differ from T(g): the loop measures the column marginal too

    def __init__(self, batch: int, like: torch.Tensor, mask: torch.Tensor, depth: int = DEPTH,
                 rank_sum=_identity, by_value: bool = False, restart_gap: int = 0, watch: bool = True,
                 quit: int = 0, native: bool = False, span: Optional[float] = None):
        self.depth = depth
        self.span = span  # partial OT: a bound on the cost's range (:meth:`wild`); None elsewhere
        self.watch, self.quit = watch, quit
        self.by_value = by_value
        self.restart_gap = restart_gap
        self.rank_sum = rank_sum
        self.mask = mask.double().contiguous()
        self.images = None  # (B, depth + 1, M) float64 T(g_i), a ring buffer (allocated at the first step)
        self.resid = None   # (B, depth + 1, M) float64 masked residuals r_i
        self.inner = None   # (B, depth + 1, depth + 1) float64 <r_i, r_j> over the slots
        self.slot = 0       # where the next entry goes
        self.valid = like.new_zeros((batch, depth + 1), dtype=torch.bool)  # (B, depth + 1) slots since restart
        self.best = like.new_full((batch,), math.inf, dtype=torch.float64)  # (B,) smallest error seen
        self.top = like.new_full((batch,), -math.inf, dtype=torch.float64)  # (B,) largest dual objective seen
        self.since = like.new_full((batch,), restart_gap + 1, dtype=torch.int64)  # (B,) updates since a restart
        self.low = like.new_full((batch,), math.inf, dtype=torch.float64)  # (B,) stopping error at its last halving
        self.flat = like.new_zeros((batch,), dtype=torch.int64)  # (B,) updates since then
        self.rest = like.new_zeros((batch,), dtype=torch.int64)  # (B,) plain steps left after a stall
        self.stalls = like.new_zeros((batch,), dtype=torch.int64)  # (B,) stalls since the error last halved
        # ``native`` (the loop passes it when the backend is built on the compiled CPU library): on CPU the
        # compiled step (kernels/cpu_ops.py, anderson_step), the same arithmetic in one call
        self.native = native and rank_sum is _identity and like.device.type == "cpu" and _cpu_ops().available()

    def subset(self, idx: torch.Tensor) -> "Anderson":
        """The state of problems ``idx`` (int64 (K,)), for a smaller batch that goes on from here."""
        out = Anderson(int(idx.numel()), self.best, self.mask[idx], depth=self.depth, rank_sum=self.rank_sum,
                       by_value=self.by_value, restart_gap=self.restart_gap, watch=self.watch,
                       quit=self.quit, native=self.native, span=self.span)
        if self.images is not None:
            out.images, out.resid, out.inner = self.images[idx], self.resid[idx], self.inner[idx]
        out.slot, out.valid, out.best, out.top = self.slot, self.valid[idx], self.best[idx], self.top[idx]
        out.since, out.low, out.flat, out.rest = self.since[idx], self.low[idx], self.flat[idx], self.rest[idx]
        out.stalls = self.stalls[idx]
        return out

    def track(self, err: torch.Tensor, done: torch.Tensor) -> None:
        """Stall watch, on the (B,) stopping error ``err`` of the current iterate (rows + columns; partial OT: its
        rows), once per update. A problem whose error has not halved in STALL updates has stalled: with
        ``watch`` (balanced OT) it takes PLAIN_RUN plain steps (``resting``), then Anderson goes on from a history
        of plain iterates; with ``quit`` = k > 0 (partial OT: QUIT, unbalanced OT: QUIT_UNBALANCED) it takes plain
        steps to the end after k stalls with no halving between them. It catches what the safeguard of :meth:`step`,
        which reads the row error alone, lets through: proposals that keep the error flat (small problems with
        uneven weights), and on unbalanced OT a cycle of restarts, each followed by a two-entry extrapolation that
        raises the error by orders of magnitude at an unchanged dual objective (docs/DESIGN.md, Acceleration). No
        rests on unbalanced OT, where a step whose error stays flat is kept while it raises the dual objective and
        plain steps in the middle of such a run cost updates, nor on partial OT, where they cost updates on the
        convergence grid."""
        if not (self.watch or self.quit):
            return
        if self.native:
            _cpu_ops().track(err, done, self.low, self.flat, self.rest, self.stalls, self.watch, self.quit, STALL,
                             PLAIN_RUN)
            return
        better = err <= 0.5 * self.low
        self.low = torch.where(better, err.double(), self.low)
        stalled = ~done & ~better & (self.flat + 1 >= STALL)
        self.flat = torch.where(better | done | stalled, torch.zeros_like(self.flat), self.flat + 1)
        if self.quit:  # read by ``resting`` only then
            self.stalls = torch.where(better, torch.zeros_like(self.stalls), self.stalls + stalled.long())
        if self.watch:
            self.rest = torch.where(stalled, torch.full_like(self.rest, PLAIN_RUN), (self.rest - 1).clamp_min(0))

    @property
    def resting(self) -> torch.Tensor:
        """(B,) bool: problems that take the plain step T(g) at this update (after a stall, :meth:`track`)."""
        if self.quit > 0:
            return (self.rest > 0) | (self.stalls >= self.quit)
        return self.rest > 0

    def too_far(self, col: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        """(B,) bool: the proposals just made (problems not ``done``) that the loop replaces by the plain step
        T(g), restarting their history from the entry just made: those whose relative column error ``col`` (B,),
        |pi^T 1 - b| / |b| for the plan of (f, proposal), is above both FAR and twice the best error, or NaN --
        a jump of some 14 eps or more away from T(g). Such proposals come from ill-conditioned least squares (tiny
        clouds with uneven weights) and can run g to overflow, where the row error reads 0; a proposal with a
        column error of a few units is kept, since one plain step after it still makes progress (why FAR is not
        smaller: docs/DESIGN.md, Acceleration). Never under ``by_value``, whose test may keep a step of large
        error that raised the dual objective."""
        if self.by_value:
            return torch.zeros_like(done)
        far = ~done & ~(col <= torch.clamp_min(2 * self.best, FAR))
        newest = torch.zeros_like(self.valid)  # the history restarts from the entry just made, (g, T(g))
        newest[:, (self.slot - 1) % (self.depth + 1)] = True
        self.valid.copy_(torch.where(far[:, None], self.valid & newest, self.valid))
        return far

    def wild(self, g: torch.Tensor, g_hat: torch.Tensor, eps: float) -> torch.Tensor:
        """(B,) bool: partial OT's proposals ``g`` (B, M) that the loop replaces by T(g) = ``g_hat``: those whose
        root-mean-square distance from T(g) over the points of positive weight exceeds WILD (span + eps), ``span``
        bounding the range of the costs (offsets included). Every potential the solve can reach lies within about
        span + a few eps of T(g) (the loop's rebalancing step fixes the constant shift); a farther proposal comes
        from an ill-conditioned least-squares solve, and once taken it can leave the real pairs with no mass and the
        potentials drifting by 1e13, where the rebalanced row error reads 0 (docs/DESIGN.md, Acceleration). No
        proposal is wild without ``span``. A distance that overflows (or is NaN) is wild."""
        if self.span is None:
            return torch.zeros(g.shape[0], dtype=torch.bool, device=g.device)
        sq = torch.where(self.mask > 0, (g.double() - g_hat.double()) ** 2, 0.0)  # (the dummy may be +-inf)
        sq = self.rank_sum(sq.sum(-1))
        count = self.rank_sum(self.mask.sum(-1))
        return ~(sq <= count * (WILD * (self.span + eps)) ** 2)

    def replaced(self, col: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        """(B,) bool: the proposals just made that the loop replaces by the plain step T(g): those :meth:`too_far`
        (whose history it restarts) and those of problems :attr:`resting`; never those of problems ``done``,
        whose potentials stay as they passed the test. ``native``: one call of the compiled library."""
        if self.native:
            return _cpu_ops().replaced(col, done, self.best, self.valid, self.rest, self.stalls,
                                       (self.slot - 1) % (self.depth + 1), FAR, self.by_value, self.quit)
        return (self.too_far(col, done) | self.resting) & ~done

    def allocate(self, g: torch.Tensor) -> None:
        """The history's ring buffers for (B, M) potentials like ``g`` (zeros), where not allocated yet."""
        if self.images is None:
            self.images = g.new_zeros((g.shape[0], self.depth + 1, g.shape[1]), dtype=torch.float64)
            self.resid = torch.zeros_like(self.images)
            self.inner = g.new_zeros((g.shape[0], self.depth + 1, self.depth + 1), dtype=torch.float64)

    def step(self, g, g_hat, err, done, value=None):
        """(B, M) next g from the current g, its image g_hat = T(g), the (B,) row marginal error at g and, when
        ``by_value``, the (B,) float64 dual objective at g (``value``)."""
        self.allocate(g)
        w, self.slot = self.slot, (self.slot + 1) % (self.depth + 1)
        if self.native and g.dtype in (torch.float32, torch.float64) and g_hat.dtype == g.dtype:
            return _cpu_ops().anderson_step(g, g_hat, err, done, value if self.by_value else None, self.mask,
                                            self.images, self.resid, self.inner, self.valid, self.best, self.top,
                                            self.since, w, self.restart_gap)
        bad = ~(err <= 2 * self.best)
        if self.by_value:
            rising = value >= self.top  # False where value is NaN
            bad = err.isnan() | (bad & ~rising)
            self.top = torch.maximum(self.top, value.nan_to_num(-math.inf))
        err_inf = err.nan_to_num(math.inf)
        # a restart also restarts the best error: measured against an older, lower one, every later step would
        # count as bad and the problem would crawl on plain updates
        restart = bad
        if self.restart_gap:
            restart = bad & (self.since > self.restart_gap)
            self.since = torch.where(restart, torch.zeros_like(self.since), self.since + 1)
        self.best = torch.where(restart, err_inf, torch.minimum(self.best, err_inf))
        gh = self.images[:, w]                           # (B, M) view: T(g_w) in float64
        gh.copy_(g_hat)
        r_w = self.resid[:, w]
        torch.sub(gh, g, out=r_w).mul_(self.mask)        # the masked residual, in place
        row = self.rank_sum(torch.bmm(self.resid, r_w[:, :, None])[..., 0])  # (B, k + 1) <r_i, r_w>
        self.inner[:, w], self.inner[:, :, w] = row, row
        self.valid &= ~restart[:, None]
        self.valid[:, w] = True
        keep = self.valid.double()                       # (B, k + 1); slot w gives a zero row
        # normal equations in the differences r_w - r_i: <r_w - r_i, r_w - r_j> = <r_i, r_j> - <r_i, r_w> + d_j
        # with d_j = <r_w - r_j, r_w>, the right-hand side
        d = row[:, w:w + 1] - row                        # (B, k + 1)
        rhs = d * keep
        gram = (self.inner - row[:, :, None] + d[:, None, :]) * (keep[:, :, None] * keep[:, None, :])
        gram.diagonal(dim1=-2, dim2=-1).add_((1e-10 * gram.diagonal(dim1=-2, dim2=-1).mean(-1) + 1e-300)[:, None])
        # solve_ex: no error check, hence no host synchronisation on CUDA (a failed solve is caught below)
        gamma = torch.linalg.solve_ex(gram, rhs[:, :, None])[0]  # (B, k + 1, 1)
        # gamma is 0 on the masked slots (their rows and columns of the normal equations are 0 but the ridge),
        # slot w included; T(g_w) - sum_c gamma_c (T(g_w) - T(g_c)) = (1 - sum gamma) T(g_w) + sum_c gamma_c T(g_c)
        gamma[:, w, 0] += 1 - gamma.sum((1, 2))
        g_new = torch.bmm(gamma.transpose(1, 2), self.images)[:, 0].to(g.dtype)  # (B, M)
        finite = torch.isfinite(g_new).all(-1)
        if self.rank_sum is not _identity:  # every shard's part finite
            finite = self.rank_sum((~finite).double()) == 0
        ok = finite & ~bad
        return torch.where(done[:, None], g, torch.where(ok[:, None], g_new, g_hat))
