r"""The Sinkhorn iteration itself: eps-scaling, then accelerated alternating updates (docs/DESIGN.md, Acceleration).

Everything here works on a batch of B problems at once: potentials are (B, N) / (B, M) tensors, log-weights
too, and the geometry's soft-min operators take and return batched tensors (one kernel launch per pass for
the whole batch). Per-problem quantities (marginal error, acceleration state, "done") are (B,) tensors that
stay on the device; the host only looks at them every ``check_every`` updates (see :class:`_Checks`).

One update = one row pass and one column pass:
    f <- A_a(S_x(g)),     g <- A_b(S_y(f)),
the new g accelerated by :class:`srot_fast._anderson.Anderson` (Anderson acceleration of the map
g -> A_b(S_y(A_a(S_x(g))))). An accelerated g is not the exact column update, so the stopping test adds the
column marginal's error to the row one (from the column pass just run; at the first look, before any update,
from one extra column pass). A problem whose error stalls takes plain steps for a while (partial OT: after a
second stall, to the end; ``Anderson.track``).
For partial OT (dummy points) each update ends with the geometry's exact rebalancing step (accelerated: then
:func:`recentre`), and the stopping test reads the rows of its augmented problem; for KL penalties with the exact
step along (f + c, g - c) (:func:`kl_translation`).
On CPU with the compiled library, where the geometry keeps its squared distances (small problems, or D >= 8:
``Geometry._stored``), the loop at the target eps -- every look and update until the problem is done -- runs as
one call of ``cpu_ops.alternating_loop`` (``symmetric_loop`` for self-transport), each problem on its own
(:func:`_compiled_loop`), and a cold solve runs whole, eps-scaling and its loose solves included, as one such
call (:func:`_compiled_solve`); the torch code below is their reference, with the same arithmetic
(``COMPILED_LOOP = False`` runs it instead).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ._anderson import (
    FAR,
    PLAIN_RUN,
    QUIT,
    QUIT_UNBALANCED,
    RESTART_GAP,
    STALL,
    WILD,
    Anderson,
    Plain,
    _cpu_ops,
    _identity,
)
from .geometry import compiled_library
from .penalties import Penalty

WINDOW = 8         # updates between two readings of the value test
COMPACT_MIN = 4    # batches of at least this many problems drop their finished half (see _compact)
SCALE_TOL = 1e-2   # eps-scaling: each intermediate eps is solved to this relative marginal error ...
SCALE_CAP = 50     # ... in at most this many updates ...
SCALE_ENTER = 3e-2  # ... where its averaged step left the error above this (else it takes no update) ...
SCALE_NEAR = 2.0   # ... and unless it lies within this factor of the target and the loose solve before took
                   # at most one update (an easy problem: the target's solve would repeat that work)
VALUE_SPAN = 100   # the value test may stop a solve at a marginal error of at most this many times tol
COMPILED_LOOP = True  # loops and cold solves as one call of the compiled library where they apply (_compiled_*)


@dataclass
class Solution:
    """Final state of the loop for B problems."""

    f: torch.Tensor               # (B, N') potentials of the (possibly augmented) problem
    g: torch.Tensor               # (B, M')
    s: torch.Tensor               # (B, N') row soft-min at the final g (so pi 1 = a exp((f - s)/eps))
    t: Optional[torch.Tensor]     # (B, M') column soft-min at the final f (None: see need_t of alternating)
    n_iter: torch.Tensor          # (B,) int64 updates spent on each problem (eps-scaling included)
    marginal_error: torch.Tensor  # (B,) relative L1 marginal error at the end
    passes: int                   # soft-min passes launched (each covers the whole batch)
    syncs: int                    # host synchronisations spent on the stopping test
    converged: torch.Tensor       # (B,) bool: the problem met tol or value_tol
    warned: Optional[torch.Tensor] = None  # (B,) bool: not converged, with a warning of its own (partial OT)


def _local_sum(t: torch.Tensor) -> torch.Tensor:
    return t.sum(-1)


def _comm(geom):
    """The ``comm`` of a sharded geometry, or of the geometry a partial one wraps (srot_fast.distributed); None
    for an unsharded one."""
    return getattr(geom, "comm", None) or getattr(getattr(geom, "real", None), "comm", None)


def _rank_sum(geom):
    """Completes sums over points already taken on this shard: summed over the ranks of a sharded geometry, the
    identity otherwise."""
    comm = _comm(geom)
    return comm.sum if comm is not None else _identity


def _rank_max(geom):
    """Maximum over the ranks of a sharded geometry, else the identity."""
    comm = _comm(geom)
    return comm.max if comm is not None else _identity


def _point_sum(geom):
    """The sum over the point axis (-1) of (B, N) tensors: the geometry's ``point_sum`` when it has one (a
    sharded geometry all-reduces it, srot_fast.distributed), else the local sum."""
    return getattr(geom, "point_sum", None) or _local_sum


def _native(geom) -> bool:
    """Whether the loop's per-update bookkeeping (marginal errors, dual objective, KL translation, Anderson's step,
    stall watch and test of proposals) runs in the compiled CPU library (:func:`srot_fast.geometry.compiled_library`:
    the ``cpu`` and ``blocksparse`` backends on CPU points, unsharded)."""
    return compiled_library(geom) is not None


def _one_dtype(*ts) -> bool:
    """Whether the tensors share one float32 / float64 dtype (what the compiled bookkeeping reads)."""
    dtype = ts[0].dtype
    return dtype in (torch.float32, torch.float64) and all(t.dtype == dtype for t in ts)


def marginal_error(log_a: torch.Tensor, f, s, f_hat, eps: float, point_sum=_local_sum,
                   native: bool = False) -> torch.Tensor:
    r"""(B,) sum_i a_i |exp((f_i - s_i)/eps) - exp((f_hat_i - s_i)/eps)|: L1 gap between the plan's row marginal
    and the one the penalty prescribes (|pi 1 - a| when balanced). Computed in float64 from log-weights,
    so it does not overflow where float32 exponentials would. ``native`` (see :func:`_native`): the same sums
    in one call of the compiled library, where log_a, f, s and f_hat share a float32 / float64 dtype."""
    if native and point_sum is _local_sum and _one_dtype(log_a, f, s, f_hat):
        return _cpu_ops().marginal_error(log_a, f, s, None if f_hat is s else f_hat, eps)
    la = log_a.double()
    e1 = (la + (f - s).double() / eps).exp()
    e2 = la.exp() if f_hat is s else (la + (f_hat - s).double() / eps).exp()  # balanced: f_hat is s
    return point_sum((e1 - e2).abs().nan_to_num(nan=0.0))


def dual_value(log_a, log_b, f_hat, g, s, pen_a: Penalty, pen_b: Penalty, eps: float,
               point_sum=_local_sum, native: bool = False) -> torch.Tensor:
    r"""(B,) float64 dual objective at (f_hat, g), f_hat = A_a(s) the exact row update for g (s = S_x(g)):
    <a, phi_a(f_hat)> + <b, phi_b(g)> - eps (<pi, 1> - |a| |b|). Zero weights contribute nothing. ``native``
    (see :func:`_native`): the same sums in one call of the compiled library."""
    if native and point_sum is _local_sum and _one_dtype(log_a, log_b, f_hat, g, s):
        return _cpu_ops().dual_value(log_a, log_b, f_hat, g, s, pen_a.kind, pen_a.tau, pen_b.kind, pen_b.tau, eps)
    a, b = log_a.double().exp(), log_b.double().exp()
    fh, gd = f_hat.double(), g.double()
    rows = torch.stack([(a * ((fh - s.double()) / eps).exp()).nan_to_num(nan=0.0),
                        (a * pen_a.phi(fh)).nan_to_num(nan=0.0), a])
    plan, side_a, mass_a = point_sum(rows).unbind(0)  # one reduction for the three row sums
    cols = torch.stack([(b * pen_b.phi(gd)).nan_to_num(nan=0.0), b])
    side_b, mass_b = point_sum(cols).unbind(0)
    return side_a + side_b - eps * (plan - mass_a * mass_b)


def kl_translation(pen_a: Penalty, pen_b: Penalty, log_a, f, log_b, g, point_sum=_local_sum,
                   native: bool = False) -> torch.Tensor:
    r"""(B,) float64 c maximising the dual objective along (f + c, g - c) when a side has a KL penalty (one side
    may be balanced). The plan, exp((f_i + g_j - C_ij)/eps), does not change along that line, so the dual moves
    by <a, phi_a(f + c)> + <b, phi_b(g - c)> only, with phi(f) = tau (1 - exp(-f/tau)) (balanced: phi(f) = f):
    its derivative A e^{-c/tau_a} - B e^{c/tau_b}, A = <a, e^{-f/tau_a}>, B = <b, e^{-g/tau_b}>, vanishes at
        c = (log A - log B) / (1/tau_a + 1/tau_b)   (1/tau = 0 on a balanced side, where A = |a|).
    The translation-invariant Sinkhorn of Séjourné et al.: it removes the slow drift of the total mass that
    alternating updates correct only by eps / (eps + tau) per update. Zero weights count for nothing; the sums
    are ``point_sum`` (all ranks of a sharded geometry), centred at the weighted mean potential; a sum that
    overflows gives c = 0. ``native`` (see :func:`_native`): the same sums in one call of the compiled library."""
    if native and point_sum is _local_sum and _one_dtype(log_a, f, log_b, g):
        return _cpu_ops().kl_translation(log_a, f, log_b, g, 0.0 if pen_a.balanced else 1.0 / pen_a.tau,
                                         0.0 if pen_b.balanced else 1.0 / pen_b.tau)

    def log_mass(log_w, pot, pen):
        w = log_w.double().exp()
        pot = torch.where(w > 0, pot.double(), torch.zeros_like(w))
        if pen.balanced:
            return point_sum(w).log(), 0.0
        rate = 1.0 / pen.tau
        mean = point_sum(w * pot) / point_sum(w)
        return (point_sum(w * torch.exp(-(pot - mean[:, None]) * rate)).log() - mean * rate), rate

    log_A, rate_a = log_mass(log_a, f, pen_a)
    log_B, rate_b = log_mass(log_b, g, pen_b)
    return ((log_A - log_B) / (rate_a + rate_b)).nan_to_num(0.0, 0.0, 0.0)


class _ValueTest:
    """Stopping on the value: the dual objective D, read every WINDOW updates, rises by d_k per window; when
    the rises shrink, the remaining rise is estimated by the geometric tail d_k r / (1 - r), with r the larger
    of the last two ratios d_k / d_{k-1} (one sharp drop, the end of a fast transient, is not trusted alone).
    A problem passes when that estimate is <= value_tol |D|; the loop accepts a pass only at a marginal
    error <= VALUE_SPAN tol (the estimate is a heuristic; this bounds how far it can stop from the marginal
    test)."""

    def __init__(self, value_tol: Optional[float]):
        self.tol = value_tol
        self.prev: Optional[torch.Tensor] = None   # (B,) D at the last window boundary
        self.rise: Optional[torch.Tensor] = None   # (B,) its rise over the window before
        self.ratio: Optional[torch.Tensor] = None  # (B,) the ratio of the two rises before
        self.read_at = -1                           # updates at the target eps at the last reading

    def subset(self, idx: torch.Tensor) -> "_ValueTest":
        out = _ValueTest(self.tol)
        out.prev, out.rise, out.ratio = (None if t is None else t[idx] for t in (self.prev, self.rise, self.ratio))
        out.read_at = self.read_at
        return out

    def due(self, steps: int) -> bool:
        """Whether D is read after ``steps`` updates at the target eps: every WINDOW updates, once (a batch
        compacted right after a reading goes on without reading again)."""
        if self.tol is None or steps % WINDOW or steps == self.read_at:
            return False
        self.read_at = steps
        return True

    def passed(self, value: torch.Tensor) -> torch.Tensor:
        """(B,) bool: the estimated remaining rise of D is within value_tol |D| (never at the first 4 looks)."""
        out = torch.zeros_like(value, dtype=torch.bool)
        if self.tol is None:
            return out
        if self.prev is not None:
            rise = value - self.prev
            if self.rise is not None:
                r = torch.where(self.rise > 0, rise / self.rise.clamp_min(1e-300), torch.full_like(rise, math.inf))
                if self.ratio is not None:
                    r_max = torch.maximum(r, self.ratio)
                    tail = rise * r_max / (1 - r_max).clamp_min(1e-300)
                    out = (rise >= 0) & (r_max < 1) & (tail <= self.tol * value.abs())
                self.ratio = r
            self.rise = rise
        self.prev = value
        return out


def epsilon_schedule(p: int, diam: float, blur: float, scaling: float) -> list[float]:
    """eps values from diam**p down to blur**p by factors scaling**p (GeomLoss's schedule)."""
    if diam <= blur:
        return [blur**p]
    steps = torch.arange(p * math.log(diam), p * math.log(blur), p * math.log(scaling), dtype=torch.float64)
    return [diam**p] + [math.exp(float(e)) for e in steps] + [blur**p]


def fit_schedule(eps_list: Sequence[float], budget: int) -> list[float]:
    """At most ``budget`` (>= 1) values of ``eps_list``, geometrically spread, always ending at the target."""
    eps_list = list(eps_list)
    if len(eps_list) <= budget:
        return eps_list
    if budget == 1:
        return eps_list[-1:]
    idx = torch.linspace(0, len(eps_list) - 1, budget).round().long().tolist()
    return [eps_list[i] for i in idx]


class _Checks:
    """When the host looks at the (device-side) stopping test: every update on the CPU; on a GPU every
    ``k`` updates, k chosen from the observed decay so that about two looks are spent per solve."""

    def __init__(self, device: torch.device, check_every: Optional[int]):
        self.fixed = check_every
        self.cuda = device.type == "cuda"
        self.next_at = 0
        self.syncs = 0
        self.last = None  # (iteration, max error) at the previous look

    def due(self, it: int) -> bool:
        return it >= self.next_at

    def poll(self, it: int, max_iter: int, done: torch.Tensor, err: torch.Tensor, tol: float) -> Optional[int]:
        """The number of problems done, read from the device in one synchronisation when the host looks at
        this update (always at ``max_iter``); None when it does not look."""
        if it < max_iter and not self.due(it):
            return None
        if not self.cuda:  # no synchronisation to save: two reads
            count, err_max = int(done.sum()), float(err.max())
        else:
            count, err_max = torch.stack([done.sum().to(err.dtype), err.max()]).tolist()
        self._schedule(it, err_max, tol)
        return int(count)

    def _schedule(self, it: int, err_max: float, tol: float) -> None:
        """When to look next, from the error's decay since the last look."""
        self.syncs += 1
        if self.fixed is not None:
            k = self.fixed
        elif not self.cuda:
            k = 1
        else:
            k = 4
            if self.last is not None and err_max > tol and 0 < err_max < self.last[1]:
                rate = (err_max / self.last[1]) ** (1.0 / max(it - self.last[0], 1))
                k = int(min(64, max(4, 0.5 * math.log(tol / err_max) / math.log(rate))))
        self.last = (it, err_max)
        self.next_at = it + k


def alternating(geom, log_a, log_b, pen_a: Penalty, pen_b: Penalty, eps_list: Sequence[float],
                tol: Optional[float], max_iter: int, init=None, accelerate: bool = True,
                check_every: Optional[int] = None, value_tol: Optional[float] = None, stepper=None,
                vtest: Optional[_ValueTest] = None, steps: int = 0, need_t: bool = True,
                enter_tol: Optional[float] = None, col: Optional[torch.Tensor] = None) -> Solution:
    """Solve B problems: eps-scaling (symmetric, averaged, as GeomLoss), then accelerated
    alternating updates at the last eps until every problem's relative marginal error (rows plus columns;
    partial OT: rows) is <= tol (or its
    value passed the ``value_tol`` test of :class:`_ValueTest`), or ``max_iter`` updates ran in all
    (eps-scaling included). ``tol=None``: GeomLoss's fixed schedule (eps-scaling, then one simultaneous
    extrapolation step). ``init=(f0, g0)`` skips eps-scaling; ``init=(f0, g0, s0)`` also gives the row
    soft-min at g0 (after the rebalancing step for partial OT), as a compacted batch goes on.
    ``need_t=False``: the solution's ``t`` may be None and the first look reads the rows only (the loose
    solves of eps-scaling use only f and g; this saves a pass). ``enter_tol`` (>= tol): a problem within it at
    the first look takes no update at all (the loose solves: an error the next eps and the final solve absorb
    anyway).
    ``col``: (B,) the column error of ``init``'s (f, g), as a compacted batch goes on (None: measured at the
    first look, one column pass; 0 for partial OT and where ``need_t`` is False)."""
    batch = log_a.shape[0]
    passes = 0
    psum = _point_sum(geom)
    native = _native(geom)
    mass_a, mass_b = psum(log_a.double().exp()), psum(log_b.double().exp())
    fresh = stepper is None and vtest is None and col is None  # a loop that starts here (not a compacted batch)
    compiled = COMPILED_LOOP and native and fresh and check_every in (None, 1)  # (where the operands allow it)
    if (compiled and init is None and tol is not None and max_iter > 0
            and (accelerate or getattr(geom, "real", None) is None)):  # (partial OT's plain updates: torch)
        sol = _compiled_solve(geom, log_a, log_b, pen_a, pen_b, eps_list, tol, max_iter, accelerate, value_tol,
                              enter_tol, need_t, mass_a, mass_b)
        if sol is not None:
            return sol
    if init is not None:
        eps = eps_list[-1]
        f, g, s = init if len(init) == 3 else (*init, None)
        n_done = 0
    else:
        budget = max(max_iter, 1) if tol is not None else len(eps_list)
        eps_list = fit_schedule(eps_list, budget)
        eps = eps_list[0]
        f = pen_a.aprox(geom.softmin_x(log_b, eps), eps)
        g = pen_b.aprox(geom.softmin_y(log_a, eps), eps)
        passes += 2
        if tol is not None and max_iter == 0:  # no update at all: the initial potentials at the target eps
            eps_list = []
        extra = torch.zeros(batch, dtype=torch.int64, device=f.device)  # updates of the loose solves
        last = 0  # updates of the last loose solve (the most of any problem)
        for k, eps in enumerate(eps_list):  # eps-scaling: symmetric, averaged (stable while eps shrinks)
            ft = pen_a.aprox(geom.softmin_x(log_b + g / eps, eps), eps)
            gt = pen_b.aprox(geom.softmin_y(log_a + f / eps, eps), eps)
            f, g = 0.5 * (f + ft), 0.5 * (g + gt)
            passes += 2
            if accelerate and tol is not None and k < len(eps_list) - 1:
                left = max_iter - len(eps_list) - int(extra.max())
                sub = loose_solve(geom, log_a, log_b, pen_a, pen_b, f, g, eps, eps_list[-1], last, left, check_every)
                if sub is not None:
                    f, g, passes, extra = sub.f, sub.g, passes + sub.passes, extra + sub.n_iter
                    last = int(sub.n_iter.max())
        n_done = len(eps_list)
    # partial OT: exact dual ascent along its drifting direction (part of the acceleration); after an averaged
    # step or a warm start also on the dummy potentials
    rebalance = getattr(geom, "rebalance", None) if accelerate else None
    # KL penalties: the exact step along (f + c, g - c) after each update (also part of the acceleration)
    translate = accelerate and rebalance is None and "kl" in (pen_a.kind, pen_b.kind)
    if init is None or len(init) == 2:
        s = geom.softmin_x(log_b + g / eps, eps)
        passes += 1
        if rebalance is not None:
            f, g, s = rebalance(f, g, log_b, eps, log_a, dummies=True)
    if init is None and tol is not None and max_iter == 0:  # no update: f and g came from the zero potential
        # independently and their plan's mass can overflow; the exact row update for g makes the rows right (a
        # finite value, a lower bound), the columns tell how far it is, and it is never a solution
        f = pen_a.aprox(s, eps)
        t = geom.softmin_y(log_a + f / eps, eps)
        err = marginal_error(log_b, g, t, pen_b.aprox(t, eps), eps, psum) / mass_b
        n_iter = torch.zeros(batch, dtype=torch.int64, device=f.device)
        return Solution(f, g, s, t, n_iter, err, passes + 1, 0, torch.zeros_like(err, dtype=torch.bool))
    if tol is None:  # GeomLoss's last extrapolation: both potentials from the previous pair
        t = geom.softmin_y(log_a + f / eps, eps)
        f, g = pen_a.aprox(s, eps), pen_b.aprox(t, eps)
        s, t = geom.softmin_x(log_b + g / eps, eps), geom.softmin_y(log_a + f / eps, eps)
        passes += 3
        err = marginal_error(log_a, f, s, pen_a.aprox(s, eps), eps, psum) / mass_a
        n_iter = torch.full((batch,), n_done + 1, dtype=torch.int64, device=f.device)
        return Solution(f, g, s, t, n_iter, err, passes, 0, torch.ones_like(err, dtype=torch.bool))

    if stepper is None:
        stepper = _stepper(geom, log_b, pen_a, pen_b, f, accelerate, native)
    vtest = _ValueTest(value_tol) if vtest is None else vtest
    checks = _Checks(f.device, check_every)
    done = torch.zeros(batch, dtype=torch.bool, device=f.device)
    n_iter = torch.full((batch,), n_done, dtype=torch.int64, device=f.device)
    if init is None and tol is not None:
        n_iter += extra
    t = err = None
    resumed = col is not None  # a compacted batch goes on: its first look was the last look of the batch before
    if col is None and need_t:  # the first look reads the columns of (f, g) too: one pass, which serves as the
        # final t where the solve stops there (a start, warm or after eps-scaling, is no update). Partial OT too,
        # whose later looks read its rows only: after its start's dummy updates and rebalancing step the rows of a
        # problem with one real row read exact whatever g is
        t = geom.softmin_y(log_a + f / eps, eps)
        col = marginal_error(log_b, g, t, pen_b.aprox(t, eps), eps, psum, native) / mass_b
        passes += 1
    elif col is None:  # a loose solve: the first look reads the rows only
        col = torch.zeros_like(mass_a)
    it = it0 = int(n_iter.max())
    partial = getattr(geom, "real", None) is not None  # (plain updates of partial OT: no rebalancing step)
    if (compiled
            and (not partial or (rebalance is not None and pen_a.balanced and pen_b.balanced))):  # the loop, compiled
        sol = _compiled_loop(geom, log_a, log_b, pen_a, pen_b, eps, tol, enter_tol, vtest.tol, max_iter, it0,
                             steps, stepper, translate, f, g, s, t, col, n_iter, mass_a, mass_b, passes, need_t,
                             partial)
        if sol is not None:
            return sol
    while True:  # ``steps``: updates at the target eps, carried over by _compact (the value test's windows)
        f_hat = pen_a.aprox(s, eps)
        row = marginal_error(log_a, f, s, f_hat, eps, psum, native) / mass_a
        # a finished problem keeps the error it stopped at (without need_t its first look read no columns)
        err = row + col if err is None else torch.where(done, err, row + col)
        read = vtest.due(steps)  # the value test and, where by_value, Anderson's safeguard use D
        value = (dual_value(log_a, log_b, f_hat, g, s, pen_a, pen_b, eps, psum, native) if read or stepper.by_value
                 else None)
        if read:
            done = done | (vtest.passed(value) & (err <= VALUE_SPAN * tol))
        done = done | (err <= (tol if enter_tol is None or it > it0 else max(tol, enter_tol)))
        if stepper.proposes and not (resumed and it == it0):  # stall watch, once per update
            stepper.track(err, done)
        n_fin = checks.poll(it, max_iter, done, err, tol)
        if n_fin is not None:
            if n_fin == batch or it >= max_iter:
                break
            if batch >= COMPACT_MIN and 2 * n_fin >= batch and it > it0:  # the rest as a smaller batch
                return _compact(geom, log_a, log_b, pen_a, pen_b, eps, tol, max_iter - it, accelerate, stepper,
                                vtest, steps, need_t, check_every, done, f, g, s, t, n_iter, err, col, passes,
                                checks.syncs)
        idle = n_fin == 0  # no problem done (known where the host looked, every update on CPU): nothing to mask
        kept = (f, g, s, t)  # a finished problem's iterate as it passed its test
        f = f_hat if idle else torch.where(done[:, None], f, f_hat)
        t = geom.softmin_y(log_a + f / eps, eps)
        g_hat = pen_b.aprox(t, eps)
        g = stepper.step(g, g_hat, row, done, value)
        if translate:  # KL: no far steps under its safeguard, resting ones after its stalls (Anderson.track); the
            # columns are measured after its step
            g = torch.where(stepper.resting[:, None] & ~done[:, None], g_hat, g)
        elif stepper.proposes and rebalance is None:  # an accelerated g leaves the column marginal off: measured
            col = marginal_error(log_b, g, t, g_hat, eps, psum, native) / mass_b
            far = stepper.replaced(col, done)  # take T(g) instead
            g = torch.where(far[:, None], g_hat, g)
            col = torch.where(far, torch.zeros_like(col), col)
        else:  # g = T(g) (or frozen): exact columns; partial OT reads its rows only
            if stepper.proposes:  # partial OT after a stall, or a wild proposal: T(g)
                plain = stepper.resting | stepper.wild(g, g_hat, eps)
                g = torch.where(plain[:, None] & ~done[:, None], g_hat, g)
            col = torch.zeros_like(col) if idle else torch.where(done, col, torch.zeros_like(col))
        s = geom.softmin_x(log_b + g / eps, eps)
        if rebalance is not None:
            f, g, s = rebalance(f, g, log_b, eps, log_a)
            if stepper.proposes:
                f, g, s, t = recentre(geom, stepper, log_a, f, g, s, t, done, _rank_max(geom))
        elif translate:  # the soft-mins shift with the potentials (S_x(g - c) = S_x(g) + c): no pass
            c = kl_translation(pen_a, pen_b, log_a, f, log_b, g, psum, native)
            c = torch.where(done, 0.0, c).to(f.dtype)[:, None]
            f, g, s, t = f + c, g - c, s + c, t - c
            col = torch.where(done, col, marginal_error(log_b, g, t, pen_b.aprox(t, eps), eps, psum, native) / mass_b)
        if not idle:  # a finished problem keeps its iterate: potentials and soft-mins (the rebalancing step of
            # partial OT and the translation of KL would move them by roundings; a pass recomputes them so)
            f, g, s, t = (new if old is None else torch.where(done[:, None], old, new)
                          for old, new in zip(kept, (f, g, s, t)))
        passes += 2
        n_iter += 1 if idle else (~done).long()
        it += 1
        steps += 1
    if t is None and need_t:  # no update ran: the column soft-min for the final f (g is kept), one pass
        t = geom.softmin_y(log_a + f / eps, eps)
        passes += 1
    return Solution(f, g, s, t, n_iter, err, passes, checks.syncs, done)


def _stepper(geom, log_b, pen_a, pen_b, f, accelerate: bool, native: bool):
    """A new Anderson acceleration (partial OT: of the update followed by its rebalancing step) for the loop of
    :func:`alternating` from (B, N) potentials like ``f``; :class:`Plain` without ``accelerate``."""
    if not accelerate:
        return Plain()
    rebalance = getattr(geom, "rebalance", None)
    mask = log_b > -math.inf
    if rebalance is not None:  # the dummy point stays out of the least squares (every rank holds a copy)
        mask[:, -1] = False
    real = getattr(geom, "real", geom)  # partial OT: the geometry of the real points
    offsets = getattr(real, "u", None) is not None or getattr(real, "v", None) is not None
    by_value = not (pen_a.balanced and pen_b.balanced) or (rebalance is not None and offsets)
    gap = RESTART_GAP if rebalance is not None and offsets else 0
    partial = rebalance is not None  # stall watch: rests on balanced OT, quitting on partial and unbalanced OT
    quit = QUIT if partial else QUIT_UNBALANCED if by_value else 0
    return Anderson(f.shape[0], f, mask, rank_sum=_rank_sum(geom), by_value=by_value, restart_gap=gap,
                    watch=not (partial or by_value), quit=quit, native=native,
                    span=_span(real) if partial else None)


def recentre(geom, stepper, log_a, f, g, s, t, done, rank_max=_identity):
    """Partial OT, accelerated: (f, g, s, t) moved along the direction the augmented problem leaves free.

    The augmented problem is balanced, so (f + k, g - k) is the same solution for any constant k, and Anderson's
    extrapolation can walk the iterate along that direction for thousands of updates. In float32 the potentials
    then outgrow the precision that resolves eps: the plan's mass goes off by percents while the rebalanced rows
    still read exact (docs/DESIGN.md, Acceleration). After each update, every potential moves by k = (mid g -
    mid f) / 2, mid the midpoint of the range over the real points of positive weight: f, the row soft-min s and
    the rebalancing step's real row soft-min by +k, g, the column soft-min t and Anderson's images T(g_i) by -k --
    the same iteration in exact arithmetic, no pass. (A range, not a mean: maxima round the same in any order, so
    the compiled loop shifts by the same k.) f, s (B, N); g, t (B, M) (t may be None); problems ``done`` (B,)
    stay where they are; ``rank_max`` takes the maximum over the ranks of a sharded geometry."""
    mask_a, mask_b = log_a[:, :-1] > -math.inf, stepper.mask > 0  # (the dummy points left out)
    none = f.new_full((f.shape[0], 1), -math.inf, dtype=torch.float64)  # (a rank may hold no point)

    def top(v, mask):  # (B,) the largest entry of v where mask, -inf where none
        return torch.cat([none, torch.where(mask, v, -math.inf)], -1).amax(-1)

    fr, gd = f[:, :-1].double(), g.double()
    ext = rank_max(torch.stack([top(fr, mask_a), top(-fr, mask_a), top(gd, mask_b), top(-gd, mask_b)], -1))
    k = 0.25 * ((ext[:, 2] - ext[:, 3]) - (ext[:, 0] - ext[:, 1]))
    k = torch.where(torch.isfinite(k) & ~done, k, 0.0).to(f.dtype)  # (B,)
    if stepper.images is not None:
        stepper.images -= k.double()[:, None, None]
    geom.shift_last(k)
    k = k[:, None]
    return f + k, g - k, s + k, None if t is None else t - k


def _span(geom) -> float:
    """A bound on the range of the costs C(x_i, y_j) + u_i + v_j of a geometry's problems (one float for the
    batch, agreed over the ranks of a sharded geometry): the diagonal of the bounding box of all its points to the
    power p, plus the largest |u| and |v|."""
    d = geom.x.shape[-1]
    pts = torch.cat([geom.x.reshape(-1, d), geom.y.reshape(-1, d)]).double()
    none = pts.new_full((d,), -math.inf)
    ext = [pts.amax(0) if len(pts) else none, -pts.amin(0) if len(pts) else none]
    ext += [t.abs().amax().double().reshape(1) if t is not None and t.numel() else pts.new_zeros(1)
            for t in (geom.u, geom.v)]
    ext = _rank_max(geom)(torch.cat(ext))  # the same bound on every rank
    diam = float((ext[:d] + ext[d:2 * d]).clamp_min(0).norm())
    return diam ** geom.p + float(ext[2 * d:].sum())


def _anderson_state(stepper, g) -> Optional[dict]:
    """The state of an :class:`Anderson` stepper (its history allocated for (B, M) potentials like ``g``) as
    ``cpu_ops.alternating_loop`` reads it; None for plain updates."""
    if not isinstance(stepper, Anderson):
        return None
    stepper.allocate(g)
    state = {name: getattr(stepper, name) for name in (
        "mask", "images", "resid", "inner", "valid", "best", "top", "low", "since", "flat", "rest", "stalls", "slot",
        "by_value", "watch", "quit", "restart_gap")}
    state.update(stall=STALL, plain_run=PLAIN_RUN, far=FAR, span=stepper.span, wild=WILD)
    return state


def _stored_operands(geom, transpose: bool, *ts):
    """(sq, u, v) for a compiled loop: the geometry's stored distances (:meth:`Geometry.stored_distances`) and its
    offsets (contiguous, or None), where it keeps them and they share one float32 / float64 dtype with the tensors
    ``ts``; else None."""
    stored = getattr(geom, "stored_distances", None)
    sq = stored(transpose) if stored is not None else None
    if sq is None:
        return None
    u, v = (None if o is None else o.detach().contiguous() for o in (geom.u, geom.v))
    if not _one_dtype(*ts, *(t for t in (*sq, u, v) if t is not None)):
        return None
    return sq, u, v


def _compiled_loop(geom, log_a, log_b, pen_a, pen_b, eps, tol, enter_tol, value_tol, max_iter, it0, steps, stepper,
                   translate, f, g, s, t, col, n_iter, mass_a, mass_b, passes, need_t,
                   partial: bool) -> Optional[Solution]:
    """The update loop of :func:`alternating` from its first look on, as one call of the compiled library
    (``cpu_ops.alternating_loop``: the same arithmetic, each problem of the batch looking and updating until it is
    done or the cap), where the geometry (``partial``: the real one of a PartialGeometry) keeps its squared
    distances and every operand shares a float32 / float64 dtype; None elsewhere (the torch loop runs). A batch
    is not compacted: each problem stops on its own. Counts passes and looks as the torch loop does without
    compaction: two passes an update, one look more than the updates of the problem that ran the most, and one
    pass for t where no problem took an update and t is due (where only some did, the t of the others is computed
    here but counts as the torch loop counts it: part of the column passes of its updates)."""
    real = geom.real if partial else geom
    operands = _stored_operands(real, True, log_a, log_b, f, g, s)
    if operands is None:
        return None
    sq, u, v = operands
    last = None
    if partial:  # the real part of the row soft-min at g (rebalanced), as the rebalancing step reads it
        last = (torch.empty_like(f[:, :-1]) if geom._last_real is None else geom._last_real).contiguous().clone()
    t_none = t is None  # (loose solves: the first look reads the rows only)
    state = {"f": f.contiguous().clone(), "g": g.contiguous().clone(), "s": s.contiguous().clone(),
             "t": torch.zeros_like(g).contiguous() if t_none else t.contiguous().clone(),
             "col": col.double().contiguous().clone(), "err": torch.zeros_like(mass_a),
             "done": torch.zeros(log_a.shape[0], dtype=torch.bool), "n_iter": n_iter.contiguous().clone()}
    updates = _cpu_ops().alternating_loop(
        sq[0], sq[1], log_a.contiguous(), log_b.contiguous(), u, v, mass_a.contiguous(), mass_b.contiguous(), state,
        _anderson_state(stepper, g), real.p, pen_a.kind, pen_a.tau, pen_b.kind, pen_b.tau, eps, tol, enter_tol,
        value_tol, VALUE_SPAN, WINDOW, steps, it0, max_iter, translate, last, geom.mass if partial else 1.0)
    if partial:
        geom._last_real = last
    most = int(updates.max()) if updates.numel() else 0
    t = state["t"] if need_t else None
    if need_t and t_none and bool((updates == 0).any()):  # the column soft-min where a problem took no update
        t = torch.where((updates == 0)[:, None], geom.softmin_y(log_a + state["f"] / eps, eps), t)
        passes += int(most == 0)  # (where others updated, the torch loop's column passes computed it: no pass more)
    return Solution(state["f"], state["g"], state["s"], t, state["n_iter"], state["err"], passes + 2 * most,
                    most + 1, state["done"])


def _compiled_solve(geom, log_a, log_b, pen_a, pen_b, eps_list, tol, max_iter, accelerate, value_tol, enter_tol,
                    need_t, mass_a, mass_b) -> Optional[Solution]:
    """:func:`alternating` without ``init`` -- eps-scaling with its loose solves, then the loop at the target eps -- as
    one call of the compiled library (``cpu_ops.alternating_loop`` with ``scaling``: the same arithmetic, stage by
    stage, each problem on its own within a stage), where the geometry (partial OT: the real one, accelerated
    updates only) keeps its squared distances and the operands share a float32 / float64 dtype (what
    :func:`_compiled_loop` needs); None elsewhere. Counts passes and looks as the torch code with its compiled
    loops does."""
    partial = getattr(geom, "real", None) is not None
    real = geom.real if partial else geom
    operands = _stored_operands(real, True, log_a, log_b)
    if operands is None:
        return None
    sq, u, v = operands
    eps_list = fit_schedule(eps_list, max_iter)
    batch, log_a, log_b = log_a.shape[0], log_a.contiguous(), log_b.contiguous()
    f, s, g, t = torch.empty_like(log_a), torch.empty_like(log_a), torch.empty_like(log_b), torch.empty_like(log_b)
    state = {"f": f, "g": g, "s": s, "t": t, "col": torch.zeros_like(mass_a), "err": torch.zeros_like(mass_a),
             "done": torch.zeros(batch, dtype=torch.bool), "n_iter": torch.zeros(batch, dtype=torch.int64)}
    passes = torch.zeros(1, dtype=torch.int64)
    last = torch.empty_like(f[:, :-1]) if partial else None  # the real row soft-min, as the rebalancing step reads it
    translate = accelerate and not partial and "kl" in (pen_a.kind, pen_b.kind)  # as the loop's
    updates = _cpu_ops().alternating_loop(
        sq[0], sq[1], log_a, log_b, u, v, mass_a.contiguous(), mass_b.contiguous(), state,
        _anderson_state(_stepper(geom, log_b, pen_a, pen_b, f, accelerate, True), g), real.p, pen_a.kind, pen_a.tau,
        pen_b.kind, pen_b.tau, eps_list[-1], tol, enter_tol, value_tol, VALUE_SPAN, WINDOW, 0, 0, max_iter,
        translate, last, geom.mass if partial else 1.0,
        scaling=(eps_list, SCALE_TOL, SCALE_CAP, SCALE_ENTER, SCALE_NEAR, need_t, passes))
    if partial:
        geom._last_real = last
    most = int(updates.max()) if updates.numel() else 0
    return Solution(f, g, s, t if need_t else None, state["n_iter"], state["err"], int(passes), most + 1,
                    state["done"])


def _compiled_symmetric(geom, log_a, pen, eps, tol, value_tol, max_iter, it0, f, n_iter, mass_a,
                        passes, eps_list=None) -> Optional[Solution]:
    """The update loop of :func:`symmetric` as one call of the compiled library (``cpu_ops.symmetric_loop``), as
    :func:`_compiled_loop`; one pass a look. ``eps_list`` (the fitted schedule, ``f`` None): a cold solve, the
    eps-scaling in the same call."""
    operands = _stored_operands(geom, False, log_a, *(() if f is None else (f,)))
    if operands is None:
        return None
    sq, u, v = operands
    f = torch.empty_like(log_a).contiguous() if f is None else f.contiguous().clone()
    state = {"f": f, "s": torch.empty_like(f).contiguous(), "err": torch.zeros_like(mass_a),
             "done": torch.zeros(log_a.shape[0], dtype=torch.bool), "n_iter": n_iter.contiguous().clone()}
    updates = _cpu_ops().symmetric_loop(sq[0], log_a.contiguous(), u, v, mass_a.contiguous(), state, geom.p,
                                        pen.kind, pen.tau, eps, tol, value_tol, VALUE_SPAN, WINDOW, it0, max_iter,
                                        eps_list)
    looks = (int(updates.max()) if updates.numel() else 0) + 1
    f, s = state["f"], state["s"]
    return Solution(f, f, s, s, state["n_iter"], state["err"], passes + looks, looks, state["done"])


def centred(sol: Solution, a: torch.Tensor, b: torch.Tensor, pen_a: Penalty, pen_b: Penalty, tol: Optional[float],
            point_sum=_local_sum) -> Solution:
    """Balanced OT (with a tolerance) determines its potentials up to (f + c, g - c): ``sol`` with, per problem,
    the c that makes <a, f> = <b, g> for the (B, N), (B, M) weights a, b; any other solution as it is. Applied at
    the end of a solve, so that solves of one problem that reach the same f - g along different paths (sharded
    or not, warm-started or cold, rounded differently) return the same potentials and weight gradients; the
    plan, the marginal error and (for equal masses) the value are unchanged. Points of zero weight count for
    nothing. The fixed schedule (``tol`` None) keeps GeomLoss's potentials."""
    if not (pen_a.balanced and pen_b.balanced) or tol is None:
        return sol
    a, b = a.double(), b.double()
    fa = torch.where(a > 0, a * sol.f.double(), 0.0)
    gb = torch.where(b > 0, b * sol.g.double(), 0.0)
    c = ((point_sum(gb) - point_sum(fa)) / (point_sum(a) + point_sum(b)))[:, None].to(sol.f.dtype)
    return Solution(sol.f + c, sol.g - c, sol.s + c, None if sol.t is None else sol.t - c, sol.n_iter,
                    sol.marginal_error, sol.passes, sol.syncs, sol.converged)


def loose_solve(geom, log_a, log_b, pen_a, pen_b, f, g, eps: float, target: float, last: int, budget: int,
                check_every: Optional[int] = None) -> Optional[Solution]:
    """The loose solve of eps-scaling at the intermediate ``eps`` from (f, g), so that the next eps starts near its
    own solution: to SCALE_TOL in at most min(SCALE_CAP, budget) updates, none where the averaged step left the
    error within SCALE_ENTER. None (skipped) without budget, or when ``eps`` lies within SCALE_NEAR of the
    ``target`` eps and the loose solve before took ``last`` <= 1 updates."""
    if budget <= 0 or (eps <= SCALE_NEAR * target and last <= 1):
        return None
    return alternating(geom, log_a, log_b, pen_a, pen_b, [eps], SCALE_TOL, min(SCALE_CAP, budget), (f, g), True,
                       check_every, need_t=False, enter_tol=SCALE_ENTER)


def _compact(geom, log_a, log_b, pen_a, pen_b, eps, tol, budget, accelerate, stepper, vtest, steps, need_t,
             check_every, done, f, g, s, t, n_iter, err, col, passes, syncs) -> Solution:
    """Finish the problems not yet ``done`` as a batch of their own (warm-started at their potentials), so
    that finished problems stop costing kernel work; then put the results back in place."""
    idx = (~done).nonzero()[:, 0]
    sub = alternating(geom.subset(idx), log_a[idx], log_b[idx], pen_a, pen_b, [eps], tol, budget,
                      (f[idx], g[idx], s[idx]), accelerate, check_every, vtest.tol, stepper.subset(idx),
                      vtest.subset(idx), steps, need_t, col=col[idx])
    f, g, s, t, err, n_iter = f.clone(), g.clone(), s.clone(), t.clone(), err.clone(), n_iter.clone()
    f[idx], g[idx], s[idx], err[idx] = sub.f, sub.g, sub.s, sub.marginal_error
    if sub.t is not None:
        t[idx] = sub.t
    n_iter[idx] += sub.n_iter
    done = done.clone()
    done[idx] = sub.converged
    return Solution(f, g, s, t, n_iter, err, passes + sub.passes, syncs + sub.syncs, done)


def symmetric(geom, log_a, pen: Penalty, eps_list: Sequence[float], tol: Optional[float], max_iter: int,
              init=None, check_every: Optional[int] = None, value_tol: Optional[float] = None) -> Solution:
    """Self-transport OT(a, a) (x = y, u = v): the optimal f equals g, and the averaged update
    f <- (f + A(S(f))) / 2 converges fast even where alternating updates crawl (isolated points): it
    cancels the oscillating constant mode of the symmetric map, and the slow modes of the plain
    map contract by (1 - lambda) / 2 instead of lambda."""
    batch = log_a.shape[0]
    psum = _point_sum(geom)
    native = _native(geom)
    mass_a = psum(log_a.double().exp())
    compiled = COMPILED_LOOP and native and check_every in (None, 1)  # (where the operands allow it)
    passes = 0
    if init is not None:
        eps_list = eps_list[-1:]
        f = init[0]
    else:
        if tol is not None:
            eps_list = fit_schedule(eps_list, max(max_iter, 1))
            if compiled:  # the whole solve, compiled
                n_done = len(eps_list) - 1
                sol = _compiled_symmetric(geom, log_a, pen, eps_list[-1], tol, value_tol, max_iter, n_done, None,
                                          torch.full((batch,), n_done, dtype=torch.int64), mass_a, len(eps_list),
                                          eps_list)
                if sol is not None:
                    return sol
        f = pen.aprox(geom.softmin_x(log_a, eps_list[0]), eps_list[0])
        passes += 1
    if tol is None:  # GeomLoss's fixed schedule: averaged updates at every eps, then one plain update
        for eps in eps_list:
            f = 0.5 * (f + pen.aprox(geom.softmin_x(log_a + f / eps, eps), eps))
        f = pen.aprox(geom.softmin_x(log_a + f / eps, eps), eps)
        s = geom.softmin_x(log_a + f / eps, eps)
        err = marginal_error(log_a, f, s, pen.aprox(s, eps), eps, psum) / mass_a
        n_iter = torch.full((batch,), len(eps_list) + 1, dtype=torch.int64, device=f.device)
        return Solution(f, f, s, s, n_iter, err, passes + len(eps_list) + 2, 0, torch.ones_like(err, dtype=torch.bool))
    for eps in eps_list[:-1]:
        f = 0.5 * (f + pen.aprox(geom.softmin_x(log_a + f / eps, eps), eps))
        passes += 1
    n_done = len(eps_list) - 1
    eps = eps_list[-1]
    checks = _Checks(f.device, check_every)
    done = torch.zeros(batch, dtype=torch.bool, device=f.device)
    n_iter = torch.full((batch,), n_done, dtype=torch.int64, device=f.device)
    vtest = _ValueTest(value_tol)
    it = n_done
    if compiled:  # the loop below, compiled
        sol = _compiled_symmetric(geom, log_a, pen, eps, tol, value_tol, max_iter, n_done, f, n_iter, mass_a, passes)
        if sol is not None:
            return sol
    while True:
        s = geom.softmin_x(log_a + f / eps, eps)
        passes += 1
        f_hat = pen.aprox(s, eps)
        err = marginal_error(log_a, f, s, f_hat, eps, psum, native) / mass_a
        if value_tol is not None and (it - n_done) % WINDOW == 0:
            value = dual_value(log_a, log_a, f_hat, f, s, pen, pen, eps, psum, native)
            done = done | (vtest.passed(value) & (err <= VALUE_SPAN * tol))
        done = done | (err <= tol)
        n_fin = checks.poll(it, max_iter, done, err, tol)
        if n_fin is not None and (n_fin == batch or it >= max_iter):
            break
        half = torch.where(done, torch.zeros_like(err), torch.full_like(err, 0.5)).to(f.dtype)[:, None]
        f = f + half * (f_hat - f)
        n_iter += (~done).long()
        it += 1
    return Solution(f, f, s, s, n_iter, err, passes, checks.syncs, done)
