r"""Block-sparse backend of the kernel primitives for point clouds in dimension d <= 3 (docs/DESIGN.md,
Kernel primitive; "Block-sparse passes" under Backends): the C++ kernel below for CPU tensors; CUDA tensors go
to :mod:`srot_fast.kernels.triton.blocksparse` (same bounds, pruning in torch, Triton kernels).

Same functions and signatures as :mod:`srot_fast.kernels.tensorized`, unbatched and batched:

- ``softmin(x, y, h, eps, p)``             -> (N,)    out_i = -eps * LSE_j[h_j - C(x_i, y_j) / eps]
- ``weighted_mean(x, y, h, eps, p, phi)``  -> (N, D)  sum_j softmax_j(h_j - C_ij / eps) * phi(x_i, y_j)
- ``plan_argmax(x, y, h, eps, p)``         -> (N,)    int64, argmax_j (h_j - C_ij / eps)
- ``max_cost(x, y, p)``                    -> ()      max_ij C(x_i, y_j)

Every primitive receives the column log-weights h = log b + (g - v) / eps, with the potentials and the soft
offsets already folded in, so a block of columns can be dropped inside the primitive from h alone: the
solver, the penalties (balanced, KL, TV, partial) and soft SROT use this backend unchanged.

Algorithm. The points of each problem are sorted along a Morton (Z-order) curve of a 2^k grid over their
bounding box and cut into blocks of ``BLOCK`` = 64 consecutive points, each with its bounding box; 16
consecutive blocks form a super-block. For a row block I and a column block J let lse_J = LSE_{j in J} h_j
and Cmin(I, J), Cmax(I, J) the smallest / largest cost between the two boxes. Every row i of I has

    LSE_j[h_j - C_ij / eps] >= L_I = max_J (lse_J - Cmax(I, J) / eps),
    LSE_{j in J}[h_j - C_ij / eps] <= U_IJ = lse_J - Cmin(I, J) / eps,

At p = 2 a second upper bound removes the linear trend of h inside J (h = log b + g / eps varies by
|grad g| x block width / eps across a block, and the trend of g cancels that of the cost near the transport
target): with top_J = max_{j in J} [h_j - beta_J . (y_j - c_J)] + log |J| (beta_J the least-squares slope of h
over J, c_J the box centre, |J| its columns of finite h), LSE_{j in J} [h_j - beta_J . (y_j - c_J)] <= top_J and
U_IJ <= top_J + max over x in box I, y in box J of beta_J . (y - c_J) - |x - y|^2 / (2 eps), a separable
concave maximisation. J is dropped for I when U_IJ < L_I + log(THRESHOLD / 2) - REUSE_SLACK - log(number of
column blocks). The same test runs first on super-block pairs (with the number of column super-blocks; the lower
bound of a row super-block also takes the min over its blocks of their L_I against the four most promising
column super-blocks), then on the blocks of the kept super-block pairs, each level with half the budget.
Row bounds for wide blocks: when a row block is wide against eps (the cost across the median block's diagonal
above ``WIDE`` eps) and the box bounds keep more than ``TIGHTEN_ABOVE`` of the pairs, a second sweep takes, per
row block, the exact LSE l_i of each row over its ``NBEST`` column blocks of largest U_IJ (the soft-min kernel on
those ranges; a subset of the row's terms, so below its LSE): L_I >= min_i l_i, and at p = 2 the linear bound
LSE_i >= L0_I + alpha_I . (x_i - c_I) (least-squares alpha_I, L0_I the smallest l_i - alpha_I . (x_i - c_I))
also drops J when top_J (or lse_J with beta = 0) + max over the boxes of
beta_J . (y - c_J) - alpha_I . (x - c_I) - |x - y|^2 / (2 eps) is below L0_I + the same slack.
Kept blocks of consecutive columns form column ranges, and the compiled kernel of
:mod:`srot_fast.kernels.cpu_ops` (``csrc/cpu_ops.cpp``) streams each row block over its ranges only.

Guarantee (exact arithmetic). In every row, the terms exp(h_j - C_ij / eps) of the dropped columns sum to at
most ``THRESHOLD`` times the row's full sum (default 1e-12). Hence ``softmin`` is within eps * THRESHOLD
(absolute, cost units) of the dense value; ``weighted_mean`` within 2 * THRESHOLD * max_j |phi(x_i, y_j) - c|
for any c (at most 2 * THRESHOLD for ``phi="grad"`` at p = 1, 2 * THRESHOLD * max_j |x_i - y_j| otherwise);
``plan_argmax`` is exact (a dropped entry is below the row maximum as THRESHOLD <= 1 / BLOCK; among exactly
tied entries any maximal index may be returned); ``max_cost`` is exact (block pairs are dropped only when
their largest cost is below a cost that some pair attains). Rounding adds the usual kernel errors
(docs/DESIGN.md, Kernel primitive). ``THRESHOLD`` is read from ``SROT_BLOCKSPARSE_THRESHOLD`` at import
(a float in (0, 1e-3]) and may be set on the module.

When pruning does not pay. Nothing is dropped while eps is large against the spread of the clouds (the
first steps of eps-scaling): a pass whose kept pairs exceed ``DENSE_FRACTION`` (0.5) of N M, or a problem
with N M below ``MIN_PAIRS``, runs the dense kernel of :mod:`srot_fast.kernels.cpu_ops` on the original
order instead (the pruning sweep costs O(blocks^2 / 256 + block pairs of the kept super-block pairs) box
tests per pass, far below a dense pass).
The pruning gains as eps shrinks: at the target eps of small-blur problems most block pairs go. A cold solve
of one problem therefore runs the large-eps steps of eps-scaling on grid cells instead
(:mod:`srot_fast._multiscale`) and comes to the points only once eps is small against the cells. Dimension
d > 3 always runs the dense pass (a Morton order of 4 or more coordinates makes boxes that rarely separate at
the eps of interest; ``backend='cpu'`` says so directly). Other dtypes than float32 / float64, or no compiled
kernel, also run the dense ``cpu_ops`` functions (with their fallback).

Point ordering cache. The sorted points, permutations and block boxes of a point tensor are kept between
passes (the solver passes the same x and y hundreds of times): a least-recently-used cache of ``CACHE_SIZE``
entries, looked up by data pointer, shape, strides and dtype and used only if the stored copy of the points
equals the tensor (an O(N D) comparison per pass; version counters alone miss writes through ``.data``).
:func:`clear_cache` empties it.

Reuse across passes. Consecutive passes of a solve see the same points and eps and an h that changes less and
less. Every pruning is made with a margin of ``REUSE_SLACK`` (2) nats and stored on the row ordering with its h;
a later pass with the same column ordering, eps, p and settings, the same -inf entries of h, and a drift
h - h_ref spanning at most ``REUSE_SLACK`` nats in each problem (max_j - min_j) takes the stored column lists
(or dense decision) without pruning: its block bounds rose by at most the drift's maximum and the rows' LSE fell
by at most its minimum, so the margin covers them and the guarantee stands. The check costs O(M) per pass.

Memory: O(B (N + M) D) for the sorted copies and boxes, plus the kept column ranges (at most one per kept
block pair) -- never an N x M or blocks x blocks buffer.

Caution:
    - Outputs carry no autograd graph (the primitives are used under the envelope theorem).
    - A row whose ``h`` is all ``-inf`` gives ``+inf`` (softmin), NaN (weighted_mean), 0 (plan_argmax).
    - The gain depends on eps against the data's scale: at p = 1 the kernel e^{-C/eps} decays only
      exponentially in the distance, so far fewer pairs go than at p = 2 with the same blur.
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
import threading
from collections import OrderedDict
from typing import Optional

import torch

from . import cpu_ops
from ._common import check_operands

__all__ = ["BLOCK", "THRESHOLD", "DENSE_FRACTION", "MIN_PAIRS", "CACHE_SIZE", "softmin", "weighted_mean",
           "plan_argmax", "max_cost", "clear_cache", "last_kept_fraction"]

BLOCK = 64  # points per block (= RB in csrc/cpu_ops.cpp)
_PAD = cpu_ops._PAD_COLS  # = W in csrc/cpu_ops.cpp
CPU_LIBRARY = True  # on CPU this backend runs in the compiled library of cpu_ops (so does the solver's step)


def _threshold_from_env() -> float:
    """SROT_BLOCKSPARSE_THRESHOLD as a float (1e-12 where unset; NaN where it is no number: the passes of this
    backend then raise a ValueError naming it, and the other backends stay usable)."""
    raw = os.environ.get("SROT_BLOCKSPARSE_THRESHOLD")
    try:
        return 1e-12 if not raw else float(raw)
    except ValueError:
        return math.nan


THRESHOLD = _threshold_from_env()  # relative mass a pass may drop per row
DENSE_FRACTION = 0.5  # kept pairs above this fraction of N M: dense pass instead
NBEST = 4  # column blocks of each row block whose exact LSE gives the row bound (= NBEST in csrc/cpu_ops.cpp)
TIGHTEN_ABOVE = 0.02  # box bounds kept more than this fraction of the pairs ...
WIDE = 16.0  # ... and the median row block spans more than this cost / eps: a second sweep with row bounds
MIN_PAIRS = 1 << 18  # N M below this: dense pass
CACHE_SIZE = 8
REUSE_SLACK = 2.0  # nats of margin in every pruning: its kept lists hold while h drifts by less (_pruning)

_lock = threading.Lock()
_cache: "OrderedDict[tuple, _Order]" = OrderedDict()
_last_kept: Optional[float] = None


def clear_cache() -> None:
    """Forget every cached point ordering."""
    with _lock:
        _cache.clear()


def last_kept_fraction() -> Optional[float]:
    """Fraction of the N M row-column pairs the last pass of this process evaluated (1.0 for a dense pass;
    None before any pass). A diagnostic for benchmarks."""
    return _last_kept


# ------------------------------------------------------------------------------------------ ordering
def _spread(q: torch.Tensor, d: int) -> torch.Tensor:
    """Insert d - 1 zero bits between the bits of q (int64, < 2^31 for d = 2, < 2^21 for d = 3)."""
    if d == 2:
        masks = ((16, 0x0000FFFF0000FFFF), (8, 0x00FF00FF00FF00FF), (4, 0x0F0F0F0F0F0F0F0F),
                 (2, 0x3333333333333333), (1, 0x5555555555555555))
    else:
        masks = ((32, 0x001F00000000FFFF), (16, 0x001F0000FF0000FF), (8, 0x100F00F00F00F00F),
                 (4, 0x10C30C30C30C30C3), (2, 0x1249249249249249))
    for shift, mask in masks:
        q = (q | (q << shift)) & mask
    return q


def _morton(pts: torch.Tensor) -> torch.Tensor:
    """(B, N) int64 Morton codes of pts (B, N, d), d <= 3, on a grid over each problem's bounding box."""
    d = pts.shape[-1]
    bits = {1: 62, 2: 31, 3: 21}[d]
    lo = pts.amin(1, keepdim=True)
    span = pts.amax(1, keepdim=True) - lo
    top = float(2**bits - 1)
    scale = torch.where(span > 0, top / span, torch.zeros_like(span))
    q = ((pts - lo) * scale).clamp_(0, top).to(torch.int64)
    if d == 1:
        return q[..., 0]
    code = torch.zeros(q.shape[:-1], dtype=torch.int64, device=q.device)
    for k in range(d):
        code |= _spread(q[..., k], d) << k
    return code


SUPER = 16  # blocks per super-block (= KS in csrc/cpu_ops.cpp)


def _super(t: torch.Tensor, fill: float) -> torch.Tensor:
    """(B, nblk, ...) per-block values -> (B, nsup, SUPER, ...), the last super-block padded with ``fill``."""
    B, nblk = t.shape[:2]
    nsup = -(-nblk // SUPER)
    pad = t.new_full((B, nsup * SUPER - nblk, *t.shape[2:]), fill)
    return torch.cat([t, pad], 1).view(B, nsup, SUPER, *t.shape[2:])


def _col_stats(lib, hs: torch.Tensor, oy: "_Order", level: int, trend: bool, threads: int):
    """Per column block (level 0) or super-block (level 1): lse (B, ng) = LSE of h and, with ``trend``, the
    linear trend of h about the box centre, top (B, ng) and beta (B, ng, d) (csrc/cpu_ops.cpp,
    srot_bs_col_stats). float64."""
    lo, hi = (oy.lo, oy.hi) if level == 0 else (oy.slo, oy.shi)
    B, ng, d = lo.shape
    lse = torch.empty(B, ng, dtype=torch.float64)
    top = torch.empty(B, ng, dtype=torch.float64) if trend else None
    beta = torch.empty(B, ng, d, dtype=torch.float64) if trend else None
    size = BLOCK if level == 0 else BLOCK * SUPER
    y64 = oy.pts64()  # held here: the kernel reads it through a raw pointer
    lib.srot_bs_col_stats(_ptr(hs), _ptr(y64), _ptr(lo), _ptr(hi), B, hs.shape[1], d, size, _ptr(lse),
                          None if top is None else _ptr(top), None if beta is None else _ptr(beta),
                          1 if B * hs.shape[1] < 1 << 18 else threads)
    return lse, top, beta


class _Order:
    """A point tensor (B, N, D) sorted along the Morton curve: ``perm`` (B, N) (sorted -> original index),
    ``inv`` (B, N), ``pts`` (B, N, D) sorted points, ``lo``, ``hi`` (B, nblk, D) float64 block boxes, and
    ``yt`` (B, D, ld) the transposed sorted points for the column role, built on first use."""

    def __init__(self, t: torch.Tensor):
        self.src = t.detach().clone()
        B, N, D = t.shape
        self.perm = _morton(self.src.double()).argsort(dim=1, stable=True)
        self.inv = torch.empty_like(self.perm).scatter_(1, self.perm, torch.arange(N).expand(B, N))
        self.pts = self.src.gather(1, self.perm[..., None].expand(B, N, D)).contiguous()
        nblk = -(-N // BLOCK)
        idx = torch.arange(nblk * BLOCK).clamp_max_(N - 1)  # the last block padded with its last point
        blocks = self.pts[:, idx].double().view(B, nblk, BLOCK, D)
        self.lo = blocks.amin(2).contiguous()
        self.hi = blocks.amax(2).contiguous()
        self.nblk = nblk
        self.diag = float((self.hi - self.lo).norm(dim=-1).median())  # median block diagonal
        self.slo = _super(self.lo, math.inf).amin(2).contiguous()  # super-block boxes
        self.shi = _super(self.hi, -math.inf).amax(2).contiguous()
        self._yt = None
        self.pruned = None  # the last pruning with these points as rows (see _pruning)

    def pts64(self):
        """(B, N, D) float64 sorted points."""
        return self.pts if self.pts.dtype == torch.float64 else self.pts.double()

    def yt(self):
        """(B, D, ld) transposed sorted points, ld = N rounded up to the SIMD width, plus one width (a column
        range may start anywhere and the kernel reads whole widths)."""
        if self._yt is None:
            B, N, D = self.pts.shape
            ld = -(-N // _PAD) * _PAD + _PAD
            yt = self.pts.new_zeros(B, D, ld)
            yt[:, :, :N] = self.pts.transpose(1, 2)
            self._yt = yt
        return self._yt


def _cached(t: torch.Tensor, build, cache: "OrderedDict") -> object:
    """``build(t)`` from ``cache`` (least recently used, ``CACHE_SIZE`` entries), looked up by data pointer,
    shape, strides, dtype and device and used only if its stored copy ``src`` equals ``t``."""
    key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
    with _lock:
        hit = cache.get(key)
        if hit is not None and torch.equal(hit.src, t.detach()):
            cache.move_to_end(key)
            return hit
    entry = build(t)
    with _lock:
        cache[key] = entry
        cache.move_to_end(key)
        while len(cache) > CACHE_SIZE:
            cache.popitem(last=False)
    return entry


def _order(t: torch.Tensor) -> _Order:
    return _cached(t, _Order, _cache)


def _pruning(ox, oy, hs: torch.Tensor, eps: float, p: int, prune, extra: tuple = ()):
    """The pruning of rows ``ox`` against columns ``oy`` at the sorted log-weights ``hs`` (B, M): the one stored on
    ``ox`` when it was made for the same column order, eps, p and settings (``extra``: the caller's own) and still
    holds, else ``prune()``, which is then stored with its h. It holds when h has the same -inf entries and, in
    each problem, h - h_ref spans at most ``REUSE_SLACK`` (max_j - min_j): every block upper bound then rose by at
    most max_j (h - h_ref)_j and every row's LSE fell by at most -min_j (h - h_ref)_j, so a drop decided with a
    margin of ``REUSE_SLACK`` nats still meets the guarantee. A stored decision to run the dense pass is reused
    alike (the dense pass is exact)."""
    settings = _settings(eps, p, extra)
    fin = torch.isfinite(hs)
    entry = ox.pruned
    if entry is not None and entry[0] is oy and entry[1] == settings and torch.equal(entry[3], fin):
        drift = hs.double() - entry[2]
        span = torch.where(fin, drift, -math.inf).amax(1) - torch.where(fin, drift, math.inf).amin(1)
        if bool((span <= REUSE_SLACK).all()):
            return entry[4]
    result = prune()
    ox.pruned = (oy, settings, hs.double().clone(), fin, result)
    return result


def _settings(eps: float, p: int, extra: tuple) -> tuple:
    """What a pruning depends on besides the points and h: eps, p, the module settings (read at each call) and
    the caller's ``extra`` ones."""
    return (float(eps), p, THRESHOLD, DENSE_FRACTION, TIGHTEN_ABOVE, WIDE, REUSE_SLACK, *extra)


def _slope(xc: torch.Tensor, v: torch.Tensor, fin: torch.Tensor) -> torch.Tensor:
    """(..., d) float64 least-squares slope of v (..., k) in the points xc (..., k, d), over the entries where
    ``fin`` (..., k) holds (relative ridge 1e-12; 0 where nothing is fitted or the fit is not finite). Any slope
    gives valid bounds; a good one gives tight ones."""
    w = fin.double()
    cnt = w.sum(-1, keepdim=True).clamp_min(1)
    vf = torch.where(fin, v, 0.0)
    xm = (xc - (xc * w[..., None]).sum(-2, keepdim=True) / cnt[..., None]) * w[..., None]
    vm = (vf - (vf * w).sum(-1, keepdim=True) / cnt) * w
    gram = xm.transpose(-1, -2) @ xm
    # the ridge's floor stays a normal float64: a subnormal one reads as a zero pivot to the CUDA solver
    ridge = (1e-12 * gram.diagonal(dim1=-2, dim2=-1).sum(-1)).clamp_min(1e-200)
    eye = torch.eye(xc.shape[-1], dtype=torch.float64, device=xc.device)
    out, info = torch.linalg.solve_ex(gram + ridge[..., None, None] * eye, xm.transpose(-1, -2) @ vm[..., None])
    out = out[..., 0]
    return torch.where(torch.isfinite(out).all(-1, keepdim=True) & (info == 0)[..., None], out, 0.0)


# ------------------------------------------------------------------------------------------- pruning
def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


_capacity: dict = {}  # (B, nrb, ncb) -> column ranges buffer size that fitted last time


def _row_lower(lib, ox: _Order, oy: _Order, hs: torch.Tensor, best: torch.Tensor, eps: float, p: int, threads: int):
    """Row bounds for the second pruning sweep (csrc/cpu_ops.cpp, RowBounds), per row block I: l_i the LSE_j
    [h_j - C_ij / eps] over the columns of the column blocks ``best`` (B, nrb, NBEST) (-1: none), computed by the
    soft-min kernel on those ranges -- a sum over a subset of a row's terms, so below the row's full LSE (less a
    margin of 1e-5 (|l_i| + 1) for the kernel's rounding). ``hs`` (B, M) the sorted log-weights in the points'
    dtype. Returns (lrow, lrow0, alpha), float64: lrow (B, nrb) the smallest l_i of I; at p = 2 alpha (B, nrb, d)
    the least-squares slope of l_i in x_i - c_I (c_I the box centre) and lrow0 (B, nrb) the smallest
    l_i - alpha . (x_i - c_I), so that every row has LSE_i >= lrow0 + alpha . (x_i - c_I); at p = 1 alpha = 0
    and lrow0 = lrow. Costs one pass over N x NBEST x BLOCK pairs."""
    B, n, d = ox.pts.shape
    m = oy.pts.shape[1]
    nb = best.reshape(-1, NBEST).sort(-1).values                              # (B * nrb, NBEST), -1 first
    valid = nb >= 0
    offs = torch.zeros(nb.shape[0] + 1, dtype=torch.int64)
    offs[1:] = valid.sum(-1).cumsum(0)
    start = nb[valid] * BLOCK
    rng = torch.stack([start, (start + BLOCK).clamp_max(m)], -1).contiguous()
    out = torch.empty(B, n, dtype=ox.pts.dtype)
    getattr(lib, f"srot_bs_softmin_{cpu_ops._suffix(ox.pts)}")(*_args(ox, oy, hs, offs, rng), p, float(eps), _ptr(out),
                                                               n, threads)
    low = -out.double() / eps
    low = low - 1e-5 * (low.abs() + 1)                                        # rounding of the kernel
    rows = torch.arange(ox.nblk * BLOCK).clamp_max_(n - 1)
    low = low[:, rows].view(B, ox.nblk, BLOCK)                                # the last block padded with its last row
    lrow = low.amin(-1)
    if p != 2:
        return lrow, lrow, torch.zeros(B, ox.nblk, d, dtype=torch.float64)
    xc = ox.pts64()[:, rows].view(B, ox.nblk, BLOCK, d) - (0.5 * (ox.lo + ox.hi))[:, :, None, :]
    fin = torch.isfinite(low).all(-1, keepdim=True).expand_as(low)            # fitted where every l_i is finite
    alpha = _slope(xc, low, fin)                                               # (B, nrb, d)
    lrow0 = (low - (xc @ alpha[..., None])[..., 0]).amin(-1)
    return lrow, lrow0, alpha.contiguous()


def _prune(lib, ox: _Order, oy: _Order, hs: Optional[torch.Tensor], eps: float, p: int, threads: int):
    """Column ranges (offs (B * nrb + 1,), rng (R, 2)) of every row block, and the fraction of pairs kept.
    ``hs`` (B, M) the sorted log-weights, or None for the max-cost mode. In LSE mode the box bounds run first;
    when they keep more than ``TIGHTEN_ABOVE`` of the pairs and the row blocks are wide against eps (the cost
    across the median block's diagonal above ``WIDE`` eps: the box bound lse_J - Cmax / eps then lies far below
    the rows' LSE), a second sweep adds the row bounds of :func:`_row_lower`."""
    B, n, d = ox.pts.shape
    m = oy.pts.shape[1]
    stats = [None] * 6
    if hs is not None:
        trend = p == 2
        h64 = hs.double().contiguous()
        stats = [*_col_stats(lib, h64, oy, 0, trend, threads), *_col_stats(lib, h64, oy, 1, trend, threads)]
    offs = torch.empty(B * ox.nblk + 1, dtype=torch.int64)
    kept = torch.zeros(1, dtype=torch.float64)
    key = (B, ox.nblk, oy.nblk)
    log_thr = math.log(THRESHOLD) - (REUSE_SLACK if hs is not None else 0.0)
    lrow = None
    wide = (ox.diag if p == 1 else 0.5 * ox.diag ** 2) > WIDE * eps
    while True:
        best = torch.empty(B, ox.nblk, NBEST, dtype=torch.int64) if hs is not None and lrow is None and wide else None
        cap = _capacity.get(key, 4 * B * ox.nblk)
        while True:
            rng = torch.empty(max(cap, 1), 2, dtype=torch.int64)
            total = lib.srot_bs_prune(_ptr(ox.lo), _ptr(ox.hi), _ptr(ox.slo), _ptr(ox.shi), ox.nblk, _ptr(oy.lo),
                                      _ptr(oy.hi), _ptr(oy.slo), _ptr(oy.shi), oy.nblk,
                                      *(None if t is None else _ptr(t) for t in stats),
                                      *(None if lrow is None else _ptr(t) for t in (lrow or [None] * 3)),
                                      None if best is None else _ptr(best),
                                      B, n, m, d, p, float(eps), log_thr, _ptr(offs), _ptr(rng), cap, _ptr(kept),
                                      1 if B * ox.nblk * oy.nblk < 1 << 16 else threads)
            if total <= cap:
                break
            cap = int(total * 1.25) + 16
        _capacity[key] = cap
        frac = float(kept) / max(B * n * m, 1)
        if best is None or frac <= TIGHTEN_ABOVE or not wide:
            break
        lrow = [t.contiguous() for t in _row_lower(lib, ox, oy, hs, best, eps, p, threads)]
    return offs, rng[:total], frac


# -------------------------------------------------------------------------------------------- passes
def _on_gpu(x: torch.Tensor):
    """The Triton block-sparse module for CUDA tensors, else None."""
    if x.device.type != "cuda":
        return None
    from .triton import blocksparse as gpu

    return gpu


def _check(x, y, h=None, p=1) -> Optional[int]:
    B = check_operands(x, y, h, p, allow_empty=True, allow_batch=True)
    if not 0 < THRESHOLD <= 1e-3:
        got = THRESHOLD if THRESHOLD == THRESHOLD else repr(os.environ.get("SROT_BLOCKSPARSE_THRESHOLD"))
        raise ValueError(f"blocksparse.THRESHOLD (SROT_BLOCKSPARSE_THRESHOLD) must be a number in (0, 1e-3], "
                         f"got {got}")
    return B


def _sparse_setup(x, y, h, eps, p):
    """(lib, ox, oy, hs, offs, rng, threads) for a block-sparse pass, or None when the dense pass runs: other
    dtypes / no compiled kernel, empty or small problems, d > 3, or too few pairs dropped."""
    global _last_kept
    lib = cpu_ops._native(x, y) if h is None else cpu_ops._native(x, y, h)
    B, n, m = x.shape[0], x.shape[1], y.shape[1]
    if lib is None or B == 0 or n == 0 or m == 0 or n * m < MIN_PAIRS or not 1 <= x.shape[2] <= 3:
        _last_kept = 1.0
        return None
    threads = cpu_ops._threads(B * n, m, x.shape[2])
    ox, oy = _order(x), _order(y)
    hs = None if h is None else h.detach().gather(1, oy.perm).contiguous()
    prune = functools.partial(_prune, lib, ox, oy, hs, eps, p, threads)
    offs, rng, frac = prune() if hs is None else _pruning(ox, oy, hs, eps, p, prune)
    _last_kept = frac
    if h is not None and frac > DENSE_FRACTION:
        _last_kept = 1.0
        return None
    return lib, ox, oy, hs, offs, rng, threads


def _unsort(out_sorted: torch.Tensor, ox: _Order) -> torch.Tensor:
    inv = ox.inv if out_sorted.dim() == 2 else ox.inv[..., None].expand_as(out_sorted)
    return out_sorted.gather(1, inv)


def _args(ox: _Order, oy: _Order, hs, offs, rng):
    B, n, d = ox.pts.shape
    m = oy.pts.shape[1]
    yt = oy.yt()
    return (_ptr(ox.pts), _ptr(yt), None if hs is None else _ptr(hs), B, n, m, d, n * d, yt.shape[1] * yt.shape[2],
            m, yt.shape[2], _ptr(offs), _ptr(rng))


def softmin(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int) -> torch.Tensor:
    r"""(N,) | (B, N) soft-min ``out_i = -eps * log sum_j exp(h_j - C(x_i, y_j) / eps)``, within eps * THRESHOLD
    of the dense value; ``+inf`` if all ``h = -inf``."""
    gpu = _on_gpu(x)
    if gpu is not None:
        return gpu.softmin(x, y, h, eps, p)
    B = _check(x, y, h, p)
    xb, yb, hb = cpu_ops._batched(B, x, y, h)
    setup = _sparse_setup(xb, yb, hb, eps, p)
    if setup is None:
        return cpu_ops.softmin(x, y, h, eps, p)
    lib, ox, oy, hs, offs, rng, threads = setup
    out = torch.empty(ox.pts.shape[:2], dtype=x.dtype)
    getattr(lib, f"srot_bs_softmin_{cpu_ops._suffix(x)}")(*_args(ox, oy, hs, offs, rng), p, float(eps), _ptr(out),
                                                          out.shape[1], threads)
    out = _unsort(out, ox)
    return out if B is not None else out[0]


def weighted_mean(
    x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int, phi: str = "y"
) -> torch.Tensor:
    r"""(N, D) | (B, N, D) mean of phi(x_i, y_j) under w_ij = softmax_j(h_j - C_ij / eps) (see the module
    docstring for the truncation bound). ``phi="y"``: y_j. ``phi="grad"``: nabla_x C = (x_i - y_j) / |x_i - y_j|
    (p = 1, 0 where x_i = y_j) or x_i - y_j (p = 2)."""
    gpu = _on_gpu(x)
    if gpu is not None:
        return gpu.weighted_mean(x, y, h, eps, p, phi)
    B = _check(x, y, h, p)
    if phi not in ("y", "grad"):
        raise ValueError(f"phi must be 'y' or 'grad', got {phi!r}")
    xb, yb, hb = cpu_ops._batched(B, x, y, h)
    setup = _sparse_setup(xb, yb, hb, eps, p)
    if setup is None:
        return cpu_ops.weighted_mean(x, y, h, eps, p, phi)
    lib, ox, oy, hs, offs, rng, threads = setup
    out = torch.empty(ox.pts.shape, dtype=x.dtype)
    code = 1 if (phi == "grad" and p == 1) else 0
    getattr(lib, f"srot_bs_wmean_{cpu_ops._suffix(x)}")(*_args(ox, oy, hs, offs, rng), p, float(eps), code,
                                                        _ptr(out), out.shape[1] * out.shape[2], threads)
    out = _unsort(out, ox)
    if phi == "grad" and p == 2:
        out = xb.detach() - out
    return out if B is not None else out[0]


def plan_argmax(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int) -> torch.Tensor:
    """(N,) | (B, N) int64 index of the largest plan entry per row, argmax_j (h_j - C_ij / eps) (exact; one of
    the maximal indices on exact ties)."""
    gpu = _on_gpu(x)
    if gpu is not None:
        return gpu.plan_argmax(x, y, h, eps, p)
    B = _check(x, y, h, p)
    if y.shape[-2] == 0:
        raise ValueError("plan_argmax needs at least one column (M >= 1)")
    xb, yb, hb = cpu_ops._batched(B, x, y, h)
    setup = _sparse_setup(xb, yb, hb, eps, p)
    if setup is None:
        return cpu_ops.plan_argmax(x, y, h, eps, p)
    lib, ox, oy, hs, offs, rng, threads = setup
    arg = torch.empty(ox.pts.shape[:2], dtype=torch.int64)
    getattr(lib, f"srot_bs_argmax_{cpu_ops._suffix(x)}")(*_args(ox, oy, hs, offs, rng), p, float(eps), _ptr(arg),
                                                         arg.shape[1], threads)
    idx = oy.perm.gather(1, arg.clamp_min(0)).masked_fill_(arg < 0, 0)  # no column (all h = -inf): 0
    out = _unsort(idx, ox)
    return out if B is not None else out[0]


def max_cost(x: torch.Tensor, y: torch.Tensor, p: int) -> torch.Tensor:
    """() | (B,) largest ground cost max_ij C(x_i, y_j) per problem, of x's dtype (exact)."""
    gpu = _on_gpu(x)
    if gpu is not None:
        return gpu.max_cost(x, y, p)
    B = _check(x, y, None, p)
    if x.shape[-2] == 0 or y.shape[-2] == 0:
        raise ValueError("max_cost of an empty point cloud")
    xb, yb = cpu_ops._batched(B, x, y)
    setup = _sparse_setup(xb, yb, None, 1.0, p)
    if setup is None:
        return cpu_ops.max_cost(x, y, p)
    lib, ox, oy, _, offs, rng, threads = setup
    B_, n, d = ox.pts.shape
    m = oy.pts.shape[1]
    yt = oy.yt()
    s = torch.zeros(B_, dtype=torch.float64)
    getattr(lib, f"srot_bs_max_sq_{cpu_ops._suffix(x)}")(_ptr(ox.pts), _ptr(yt), B_, n, m, d, n * d,
                                                         yt.shape[1] * yt.shape[2], yt.shape[2], _ptr(offs), _ptr(rng),
                                                         _ptr(s), threads)
    s = s.to(x.dtype)
    out = s.sqrt() if p == 1 else s / 2
    return out if B is not None else out[0]
