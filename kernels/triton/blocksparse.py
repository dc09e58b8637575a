r"""Block-sparse Triton backend of the kernel primitives for point clouds in dimension d <= 3: the GPU
counterpart of :mod:`srot_fast.kernels.blocksparse` (same functions, signatures, threshold and guarantee),
which calls it for CUDA tensors.

- ``softmin(x, y, h, eps, p)``             -> (N,)    out_i = -eps * LSE_j[h_j - C(x_i, y_j) / eps]
- ``weighted_mean(x, y, h, eps, p, phi)``  -> (N, D)  sum_j softmax_j(h_j - C_ij / eps) * phi(x_i, y_j)
- ``plan_argmax(x, y, h, eps, p)``         -> (N,)    int64, argmax_j (h_j - C_ij / eps)
- ``max_cost(x, y, p)``                    -> ()      max_ij C(x_i, y_j) (the dense Triton pass)

Batches (B, N, D) / (B, M, D) / (B, M) are one launch per kernel.

Algorithm. Each problem's points are sorted along the Morton curve of :mod:`srot_fast.kernels.blocksparse` and
cut into blocks of ``BLOCK`` = 64 consecutive points, ``SUPER`` = 16 consecutive blocks forming a super-block,
each with its bounding box (cached per point tensor, as there). The pruning runs in torch on the points'
device, in float64. For a row group I and a column group J (blocks or super-blocks) with lse_J = LSE_{j in J}
h_j and Cmin, Cmax the smallest / largest cost between the boxes,

    every row i of I:  LSE_j[h_j - C_ij / eps] >= L_I = max_J (lse_J - Cmax(I, J) / eps),
    LSE_{j in J}[h_j - C_ij / eps] <= U_IJ = lse_J - Cmin(I, J) / eps,

and at p = 2 also U_IJ <= top_J + sum_k max_{x_k in I, y_k in J} [beta_Jk (y_k - c_Jk) - (x_k - y_k)^2 / (2 eps)]
(beta_J the least-squares slope of h over J about its box centre c_J, top_J = max_j [h_j - beta_J . (y_j - c_J)]
+ log |J|; a concave maximisation per coordinate, solved in closed form by :func:`trend_max`). First every
super-block pair of a problem is tested (in chunks of row super-blocks): S is dropped for R when
U_RS < L_R + log(THRESHOLD / 2) - REUSE_SLACK - log(number of column super-blocks). Then the block pairs inside
the kept super-block pairs (in chunks): L_I is the maximum over those candidates (a subset of the columns, so
still a lower bound) and J is dropped for I when U_IJ < L_I + log(THRESHOLD / 2) - REUSE_SLACK - log(number of
column blocks); the margin ``blocksparse.REUSE_SLACK`` lets later passes reuse the lists while h drifts by less
(the reuse rule of :mod:`srot_fast.kernels.blocksparse`). So
the dropped terms of a row weigh at most THRESHOLD of its sum: the guarantee of
:mod:`srot_fast.kernels.blocksparse` (its docstring has the bound of each primitive). The kept column blocks
of each row block form a CSR list (int64 offsets and block indices, sorted; O(kept block pairs)); the kernels
of :mod:`.sparse_kernels` stream each row block over them.

When pruning does not pay: problems with N M below ``blocksparse.MIN_PAIRS``, d > 3, float16 / bfloat16
points, or a pass that keeps more than ``blocksparse.DENSE_FRACTION`` of the pairs (judged first on the kept
super-block pairs, an upper bound, then on the kept block pairs) run the dense Triton kernels instead
(``THRESHOLD``, ``MIN_PAIRS`` and ``DENSE_FRACTION`` are read from :mod:`srot_fast.kernels.blocksparse` at each
call).

Caution:
    - The pruning costs O((N / 1024) (M / 1024)) super-block tests plus 256 block tests per kept super-block
      pair, per pass, in torch; there are no row bounds for wide blocks (the C++ path's second sweep).
    - Outputs carry no autograd graph; an all ``-inf`` row of ``h`` gives ``+inf`` / NaN / 0 as the dense
      kernels do.
    - The coarse-to-fine start of :mod:`srot_fast._multiscale` (cells in torch on the device) uses these
      passes for the cells, the lift and the points alike.
"""
from __future__ import annotations

import math
from collections import OrderedDict

import torch

from .. import blocksparse as _cpu_bs
from .. import cpu_ops
from . import launchers as _dense
from .sparse_kernels import _bs_argmax_kernel, _bs_softmin_kernel, _bs_wmean_kernel

__all__ = ["BLOCK", "softmin", "weighted_mean", "plan_argmax", "max_cost", "clear_cache", "block_pairs", "trend_max"]

BLOCK = 64  # points per block: row blocks and column blocks
SUPER = 16  # blocks per super-block (the first pruning level)
_CHUNK = 1 << 22  # box pairs x d float64 entries per pruning chunk

_cache: "OrderedDict[tuple, _Order]" = OrderedDict()


def clear_cache() -> None:
    """Forget every cached point ordering."""
    with _cpu_bs._lock:
        _cache.clear()


class _Groups:
    """Groups of ``size`` consecutive sorted points (B, N, D): ``pts`` (B, ng, size, D) float64 (the last group
    padded with the last point), boxes ``lo``, ``hi`` (B, ng, D) and ``sizes`` (ng,) float64 points per group."""

    def __init__(self, pts: torch.Tensor, size: int):
        B, N, D = pts.shape
        ng = -(-N // size)
        idx = torch.arange(ng * size, device=pts.device).clamp_max_(N - 1)
        self.pts = pts[:, idx].double().view(B, ng, size, D)
        self.lo, self.hi = self.pts.amin(2), self.pts.amax(2)
        self.sizes = (N - torch.arange(ng, device=pts.device) * size).clamp_max(size).double()
        self.size, self.n = size, ng


class _Order:
    """Points (B, N, D) sorted along the Morton curve: ``perm`` (B, N) sorted -> original index, ``inv``,
    ``pts`` (B, N, D) contiguous, ``blocks`` (:class:`_Groups` of ``BLOCK``) and ``supers`` (of
    ``BLOCK * SUPER``; built for the ``SUPER`` of the first use), ``nblk`` blocks."""

    def __init__(self, t: torch.Tensor):
        self.src = t.detach().clone()
        B, N, D = t.shape
        dev = t.device
        self.perm = _cpu_bs._morton(self.src.double()).argsort(dim=1, stable=True)
        self.inv = torch.empty_like(self.perm).scatter_(1, self.perm, torch.arange(N, device=dev).expand(B, N))
        self.pts = self.src.gather(1, self.perm[..., None].expand(B, N, D)).contiguous()
        self.blocks = _Groups(self.pts, BLOCK)
        self.nblk = self.blocks.n
        self._supers = None
        self.pruned = None  # the last pruning with these points as rows (blocksparse._pruning)
        self._pts_t = None

    def pts_t(self) -> torch.Tensor:
        """(B, D, N) the sorted points, coordinate-major (the layout of the soft-min and weighted-mean kernels),
        built on first use."""
        if self._pts_t is None:
            self._pts_t = self.pts.transpose(1, 2).contiguous()
        return self._pts_t

    def supers(self) -> _Groups:
        if self._supers is None or self._supers.size != BLOCK * SUPER:
            self._supers = _Groups(self.pts, BLOCK * SUPER)
        return self._supers


def _order(t: torch.Tensor) -> _Order:
    return _cpu_bs._cached(t, _Order, _cache)


# ------------------------------------------------------------------------------------------- pruning
def _col_stats(grp: _Groups, hs: torch.Tensor, p: int):
    """Per column group: lse (B, ng); at p = 2 also top (B, ng), beta (B, ng, d) and the box centres (B, ng, d)
    of the linear-trend bound (None at p = 1); float64."""
    B, ng, size, _ = grp.pts.shape
    m = hs.shape[1]
    hb = torch.full((B, ng * size), -math.inf, dtype=torch.float64, device=hs.device)
    hb[:, :m] = hs.double()
    hb = hb.view(B, ng, size)
    lse = torch.logsumexp(hb, -1)
    if p != 2:
        return lse, None, None, None
    centre = 0.5 * (grp.lo + grp.hi)
    yr = grp.pts - centre[:, :, None, :]                                    # (B, ng, size, d)
    fin = torch.isfinite(hb)
    beta = _cpu_bs._slope(yr, hb, fin)
    top = (hb - (yr @ beta[..., None])[..., 0]).amax(-1) + fin.sum(-1).double().log()
    return lse, top, beta, centre


def _cost(sq: torch.Tensor, p: int) -> torch.Tensor:
    return sq.sqrt() if p == 1 else 0.5 * sq


def _bounds(a, e, c, f, stats, eps: float, p: int):
    """(lower, upper) for row boxes [a, e] against column boxes [c, f] (broadcast, last dim d) with the column
    statistics ``stats`` (lse, top, beta, centre) broadcast like c: lower = lse - Cmax / eps (a lower bound of
    every row's LSE when maximised over the columns), upper >= the LSE of the column group for every row."""
    lse, top, beta, centre = stats
    gap = torch.maximum(c - e, a - f).clamp_min(0)
    far = torch.maximum((f - a).abs(), (e - c).abs())
    cmin, cmax = _cost((gap * gap).sum(-1), p), _cost((far * far).sum(-1), p)
    upper = lse - cmin / eps
    if top is not None:  # p = 2: the linear-trend bound
        upper = torch.minimum(upper, top + trend_max(a, e, c, f, beta, centre, eps).sum(-1))
    return lse - cmax / eps, upper


def trend_max(a, e, c, f, beta, mid, eps):
    """max over x in [a, e], y in [c, f] of beta (y - mid) - (x - y)^2 / (2 eps), elementwise (broadcast): the
    best x is the point of [a, e] nearest y, and the resulting function of y is concave with its unconstrained
    maximum at e + beta eps (beta > 0), a + beta eps (beta < 0) or anywhere in [a, e] (beta = 0); clamped to
    [c, f]."""
    inside = torch.minimum(torch.maximum(mid, a), e)
    free = torch.where(beta > 0, e + beta * eps, torch.where(beta < 0, a + beta * eps, inside))
    ys = torch.minimum(torch.maximum(free, c), f)
    dist = (a - ys).clamp_min(0) + (ys - e).clamp_min(0)                      # from ys to [a, e]
    return beta * (ys - mid) - dist * dist / (2 * eps)


def _take(stats, b: int, idx: torch.Tensor):
    """The statistics of problem b at column groups ``idx``."""
    return tuple(None if t is None else t[b][idx] for t in stats)


def _super_pairs(rs: _Groups, cs: _Groups, stats, b: int, eps: float, p: int, slack: float) -> torch.Tensor:
    """(K, 2) int64 (row super-block, column super-block) pairs of problem b the bounds cannot drop, in chunks
    of row super-blocks."""
    step = max(1, _CHUNK // (cs.n * rs.lo.shape[-1]))
    out = []
    for r0 in range(0, rs.n, step):
        a, e = rs.lo[b, r0:r0 + step, None, :], rs.hi[b, r0:r0 + step, None, :]
        lower, upper = _bounds(a, e, cs.lo[b][None], cs.hi[b][None], tuple(None if t is None else t[b][None]
                                                                            for t in stats), eps, p)
        keep = upper >= lower.amax(-1, keepdim=True) + slack
        pairs = keep.nonzero()
        pairs[:, 0] += r0
        out.append(pairs)
    return torch.cat(out)


def _candidates(sp: torch.Tensor, nrb: int, ncb: int):
    """The block pairs inside the super-block pairs ``sp`` (K, 2): rows (K, SUPER, 1) and columns (K, 1, SUPER)
    int64 block indices (clamped into range) and ``valid`` (K, SUPER, SUPER), False where a padded super-block
    reaches past the last block."""
    k = torch.arange(SUPER, device=sp.device)
    rows = sp[:, 0, None] * SUPER + k                                         # (K, SUPER)
    cols = sp[:, 1, None] * SUPER + k
    valid = (rows < nrb)[:, :, None] & (cols < ncb)[:, None, :]
    return rows.clamp_max(nrb - 1)[:, :, None], cols.clamp_max(ncb - 1)[:, None, :], valid


def block_pairs(ox: _Order, oy: _Order, hs: torch.Tensor, eps: float, p: int):
    """(offs (B nrb + 1,) int64, cblk (K,) int64, kept fraction of the N M pairs) -- the column blocks of every
    row block that the bounds of the module docstring cannot drop -- or (None, None, fraction) once the kept
    pairs exceed ``DENSE_FRACTION`` of N M (the dense pass runs). ``hs`` (B, M) the log-weights in the sorted
    column order. Two levels, each with half the budget THRESHOLD: super-block pairs (all of them), then the
    block pairs inside the kept super-block pairs (in chunks; L_I over those candidates, a subset of the
    columns, so still a lower bound). When the kept super-block pairs already hold more than ``DENSE_FRACTION``
    of the pairs, the block level is skipped and the dense pass runs."""
    B, nrb, ncb = hs.shape[0], ox.nblk, oy.nblk
    n, m = ox.pts.shape[1], oy.pts.shape[1]
    rs, cs = ox.supers(), oy.supers()
    rb, cb = ox.blocks, oy.blocks
    sstats, bstats = _col_stats(cs, hs, p), _col_stats(cb, hs, p)
    log_half = math.log(_cpu_bs.THRESHOLD / 2) - _cpu_bs.REUSE_SLACK  # the margin that lets later passes reuse it
    limit = _cpu_bs.DENSE_FRACTION * B * n * m
    rows_all, cols_all = [], []
    kept = 0.0
    sps = [_super_pairs(rs, cs, sstats, b, eps, p, log_half - math.log(cs.n)) for b in range(B)]
    # the kept super-block pairs bound the kept pairs from above: past the limit, the dense pass runs without
    # the block-level test (at large eps, early in eps-scaling, that test would cost more than the dense pass)
    if sum(float((rs.sizes[sp[:, 0]] * cs.sizes[sp[:, 1]]).sum()) for sp in sps) > limit:
        return None, None, 1.0
    for b, sp in enumerate(sps):
        chunk = max(1, _CHUNK // (SUPER * SUPER * rb.lo.shape[-1]))
        best = torch.full((nrb,), -math.inf, dtype=torch.float64, device=hs.device)
        for sweep in (0, 1):  # 0: L_I over the candidates; 1: the drop test
            for k0 in range(0, sp.shape[0], chunk):
                i, j, valid = _candidates(sp[k0:k0 + chunk], nrb, ncb)
                lower, upper = _bounds(rb.lo[b, i], rb.hi[b, i], cb.lo[b, j], cb.hi[b, j], _take(bstats, b, j),
                                       eps, p)
                if sweep == 0:  # each row block's best over its SUPER candidates first: SUPER times fewer scatters
                    lower = torch.where(valid, lower, -math.inf).amax(-1)     # (K, SUPER)
                    best.scatter_reduce_(0, i[..., 0].reshape(-1), lower.reshape(-1), "amax")
                    continue
                keep = valid & (upper >= best[i] + log_half - math.log(ncb))
                k, a, c = keep.nonzero(as_tuple=True)
                i, j = i[k, a, 0], j[k, 0, c]
                kept += float((rb.sizes[i] * cb.sizes[j]).sum())
                if kept > limit:
                    return None, None, 1.0
                rows_all.append(i + b * nrb)
                cols_all.append(j)
    rows = torch.cat(rows_all) if rows_all else torch.zeros(0, dtype=torch.int64, device=hs.device)
    cols = torch.cat(cols_all) if cols_all else torch.zeros(0, dtype=torch.int64, device=hs.device)
    key = rows * ncb + cols
    order = torch.argsort(key.int() if B * nrb * ncb < 1 << 31 else key)     # 32-bit keys sort faster on a GPU
    offs = torch.zeros(B * nrb + 1, dtype=torch.int64, device=hs.device)
    torch.cumsum(torch.bincount(rows, minlength=B * nrb), 0, out=offs[1:])
    return offs, cols[order], kept / max(B * n * m, 1)


# -------------------------------------------------------------------------------------------- passes
def _setup(x, y, h, eps, p):
    """(ox, oy, hs2, offs, cblk, prm) for a block-sparse pass on (B, ...) operands, or None when the dense
    Triton pass runs (see the module docstring)."""
    B, n, d = x.shape
    m = y.shape[1]
    if (x.dtype not in (torch.float32, torch.float64) or not 1 <= d <= 3 or B == 0 or n == 0 or m == 0
            or n * m < _cpu_bs.MIN_PAIRS):
        return None
    ox, oy = _order(x), _order(y)
    hs = h.detach().gather(1, oy.perm)
    offs, cblk, frac = _cpu_bs._pruning(ox, oy, hs, eps, p, lambda: block_pairs(ox, oy, hs, eps, p), (SUPER,))
    _cpu_bs._last_kept = frac
    if offs is None:
        return None
    return ox, oy, _dense._h2(hs, x.dtype), offs, cblk, _dense._prm(x, eps)


# soft-min and weighted-mean tiles (BLOCK_N, BLOCK_M, TRANS, num_warps): with TRANS and BLOCK_N = 32 num_warps
# each thread owns one row (the fastest on an H200: benchmarks/README.md)
TILE = (64, 64, True, 2)


def _launch(kernel, setup, out, p, block_n, block_m, coord_major=False, num_warps=4, **const):
    ox, oy, hs2, offs, cblk, prm = setup
    B, n, d = ox.pts.shape
    nrb = ox.nblk
    xs, ys = (ox.pts_t(), oy.pts_t()) if coord_major else (ox.pts, oy.pts)
    kernel[(B * nrb * (BLOCK // block_n),)](xs, ys, hs2, offs, cblk, prm, out, n, oy.pts.shape[1], nrb, D=d, P=p,
                                            BLOCK=BLOCK, BLOCK_N=block_n, BLOCK_M=block_m, num_warps=num_warps,
                                            **const)


def _prepare(x, y, h, eps, p):
    """(B or None for unbatched operands, batched x, the pass's setup or None for the dense pass)."""
    B = _cpu_bs._check(x, y, h, p)
    xb, yb, hb = cpu_ops._batched(B, x, y, h)
    return B, xb, _setup(xb, yb, hb, eps, p)


def softmin(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int, **options) -> torch.Tensor:
    r"""(N,) | (B, N) soft-min ``out_i = -eps * log sum_j exp(h_j - C(x_i, y_j) / eps)``, within eps * THRESHOLD
    of the dense value; ``+inf`` if all ``h = -inf``. ``options``: the dense Triton kernels' (``precision``,
    ``autotune``), used where the dense pass runs."""
    B, xb, setup = _prepare(x, y, h, eps, p)
    if setup is None:
        return _dense.softmin(x, y, h, eps, p, **options)
    out = torch.empty(xb.shape[:2], dtype=x.dtype, device=x.device)
    block_n, block_m, trans, warps = TILE
    _launch(_bs_softmin_kernel, setup, out, p, block_n, block_m, coord_major=True, num_warps=warps, TRANS=trans)
    out = _cpu_bs._unsort(out, setup[0])
    return out if B is not None else out[0]


def weighted_mean(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int, phi: str = "y",
                  **options) -> torch.Tensor:
    r"""(N, D) | (B, N, D) mean of phi(x_i, y_j) under w_ij = softmax_j(h_j - C_ij / eps) (truncation bound:
    :mod:`srot_fast.kernels.blocksparse`). ``phi="y"``: y_j. ``phi="grad"``: (x_i - y_j) / |x_i - y_j| (p = 1,
    0 where x_i = y_j) or x_i - y_j (p = 2)."""
    if phi not in ("y", "grad"):
        raise ValueError(f"phi must be 'y' or 'grad', got {phi!r}")
    B, xb, setup = _prepare(x, y, h, eps, p)
    if setup is None:
        return _dense.weighted_mean(x, y, h, eps, p, phi, **options)
    out = torch.empty(xb.shape, dtype=x.dtype, device=x.device)
    unit = phi == "grad" and p == 1
    block_n, block_m, _, warps = TILE
    _launch(_bs_wmean_kernel, setup, out, p, block_n, block_m, coord_major=True, num_warps=warps, UNIT=unit)
    out = _cpu_bs._unsort(out, setup[0])
    if phi == "grad" and p == 2:
        out = xb.detach() - out
    return out if B is not None else out[0]


def plan_argmax(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int, **options) -> torch.Tensor:
    """(N,) | (B, N) int64 index of the largest plan entry per row, argmax_j (h_j - C_ij / eps) (exact; one of
    the maximal indices on exact ties)."""
    if y.shape[-2] == 0:
        raise ValueError("plan_argmax needs at least one column (M >= 1)")
    B, xb, setup = _prepare(x, y, h, eps, p)
    if setup is None:
        return _dense.plan_argmax(x, y, h, eps, p, **options)
    arg = torch.empty(xb.shape[:2], dtype=torch.int64, device=x.device)
    _launch(_bs_argmax_kernel, setup, arg, p, 32, 64)
    idx = setup[1].perm.gather(1, arg.clamp_min(0)).masked_fill_(arg < 0, 0)  # no finite logit: 0
    out = _cpu_bs._unsort(idx, setup[0])
    return out if B is not None else out[0]


def max_cost(x: torch.Tensor, y: torch.Tensor, p: int, **options) -> torch.Tensor:
    """() | (B,) largest ground cost max_ij C(x_i, y_j) per problem (the dense Triton pass: once per solve)."""
    return _dense.max_cost(x, y, p, **options)
