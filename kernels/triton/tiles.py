"""``@triton.jit`` tile helpers of the Triton kernels (inlined into the kernels of :mod:`.kernels` when they
compile): a program's problem and rows, a tile's columns, the squared distances of a tile (small-d path:
difference form over row-major or coordinate-major points; large-d path: ``tl.dot`` cross term), logits and
one online log-sum-exp step.

Points may be float16 / bfloat16 (loaded as such: half the memory traffic), float32 or float64; every tile is
computed in the compute dtype of the points (:func:`_up`: float32 for half and float32 points, float64 for
float64)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _up(v):
    """``v`` in its compute dtype: float16 / bfloat16 / float32 -> float32, float64 unchanged (exact)."""
    return v.to(tl.float64 if v.dtype == tl.float64 else tl.float32)


@triton.jit
def _cdt_zeros(ptr, shape: tl.constexpr):
    """Zeros of ``shape`` in the compute dtype of the points behind ``ptr`` (float64 or float32)."""
    return tl.zeros(shape, dtype=tl.float64 if ptr.dtype.element_ty == tl.float64 else tl.float32)


@triton.jit
def _program_rows(N, BLOCK_N: tl.constexpr):
    """(problem index, (BLOCK_N,) row indices, rows < N) of this program, both indices int64."""
    pid = tl.program_id(0)
    nblk = tl.cdiv(N, BLOCK_N)
    b = pid // nblk
    rows = (pid - b * nblk) * BLOCK_N + tl.arange(0, BLOCK_N)
    return b.to(tl.int64), rows.to(tl.int64), rows < N


@triton.jit
def _tile_cols(j0, M, BLOCK_M: tl.constexpr):
    """((BLOCK_M,) int64 column indices from ``j0``, cols < M)."""
    cols = j0 + tl.arange(0, BLOCK_M)
    return cols.to(tl.int64), cols < M


@triton.jit
def _coord_sq(xk_ptr, yk_ptr, xoff, rmask, yoff, cmask, TRANS: tl.constexpr):
    """One coordinate's squared differences over a tile: (x_i - y_j)^2 with x_i at ``xk_ptr + xoff`` and
    y_j at ``yk_ptr + yoff`` (pointer and offset: one of them per point, the other shared);
    (BLOCK_N, BLOCK_M), or (BLOCK_M, BLOCK_N) if ``TRANS``, in the compute dtype."""
    xk = _up(tl.load(xk_ptr + xoff, mask=rmask, other=0.0))
    yk = _up(tl.load(yk_ptr + yoff, mask=cmask, other=0.0))
    if TRANS:
        diff = yk[:, None] - xk[None, :]
    else:
        diff = xk[:, None] - yk[None, :]
    return diff * diff


@triton.jit
def _sq_dist_tile(
    x_ptr,  # (N, D) row points of this problem, rows stride_x apart, coordinates contiguous
    y_ptr,  # (M, D) column points of this problem, rows stride_y apart
    rows,  # (BLOCK_N,) int64 row indices of this program
    rmask,  # (BLOCK_N,) rows < N
    cols,  # (BLOCK_M,) int64 column indices of this tile
    cmask,  # (BLOCK_M,) cols < M
    stride_x,  # elements between two rows of x
    stride_y,  # elements between two rows of y
    D: tl.constexpr,  # number of coordinates
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """(BLOCK_N, BLOCK_M) squared distances, one coordinate at a time (small-d path; unrolled for D <= 16)."""
    sq = _cdt_zeros(x_ptr, (BLOCK_N, BLOCK_M))
    if D <= 16:
        for k in tl.static_range(D):
            sq += _coord_sq(x_ptr + rows * stride_x, y_ptr + cols * stride_y, k, rmask, k, cmask, False)
    else:
        for k in range(0, D):
            sq += _coord_sq(x_ptr + rows * stride_x, y_ptr + cols * stride_y, k, rmask, k, cmask, False)
    return sq


@triton.jit
def _sq_from_dot(xy, xx, yy, coinc):
    """Squared distances |x|^2 + |y|^2 - 2 x.y of a tile from its cross term ``xy`` (BLOCK_N, BLOCK_M) and
    the squared norms; below the rounding noise (relative ``coinc``) -> 0, which also clamps negatives."""
    nrm = xx[:, None] + yy[None, :]
    sq = nrm - 2.0 * xy
    return tl.where(sq > coinc * nrm, sq, 0.0)


@triton.jit
def _xy_dot_tile(
    x_ptr,  # (N, D) row points of this problem (centred by the launcher), coordinates contiguous
    y_ptr,  # (M, D) column points (same centring)
    rows,  # (BLOCK_N,) int64 row indices of this program
    rmask,  # (BLOCK_N,) rows < N
    cols,  # (BLOCK_M,) int64 column indices of this tile
    cmask,  # (BLOCK_M,) cols < M
    stride_x,  # elements between two rows of x
    stride_y,  # elements between two rows of y
    D: tl.constexpr,  # number of coordinates
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,  # coordinates per tl.dot step (>= 16)
    PREC: tl.constexpr,  # tl.dot input_precision of float32 points ("ieee", "tf32x3" or "tf32")
):
    """(BLOCK_N, BLOCK_M) float32 cross terms x_i.y_j by tl.dot over chunks of BLOCK_K coordinates (large-d
    path). float32 points: at ``PREC``. float16 / bfloat16 points: upcast in registers and multiplied in
    "tf32", which is exact for them (their 11- / 8-bit significands and their exponents fit TF32's), so
    every product is exact and the sums are float32."""
    xy = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    ks = tl.arange(0, BLOCK_K)
    for k0 in range(0, D, BLOCK_K):
        kk = k0 + ks
        kmask = kk < D
        x_t = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        y_t = tl.load(y_ptr + cols[:, None] * stride_y + kk[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)
        xy = tl.dot(_up(x_t), tl.trans(_up(y_t)), xy, input_precision=PREC if x_t.dtype == tl.float32 else "tf32")
    return xy


@triton.jit
def _sq_dist_dot_tile(
    x_ptr, y_ptr,  # (N, D), (M, D) points of this problem (centred by the launcher)
    xx_ptr, yy_ptr,  # (N,) |x_i|^2, (M,) |y_j|^2 of this problem
    rows, rmask, cols, cmask, stride_x, stride_y,
    coinc,  # relative threshold: |x - y|^2 <= coinc * (|x|^2 + |y|^2) counts as 0 (rounding noise)
    D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
):
    """(BLOCK_N, BLOCK_M) squared distances |x|^2 + |y|^2 - 2 x.y (large-d path)."""
    xy = _xy_dot_tile(x_ptr, y_ptr, rows, rmask, cols, cmask, stride_x, stride_y, D, BLOCK_N, BLOCK_M, BLOCK_K,
                      PREC)
    xx = tl.load(xx_ptr + rows, mask=rmask, other=0.0)
    yy = tl.load(yy_ptr + cols, mask=cmask, other=0.0)
    return _sq_from_dot(xy, xx, yy, coinc)


@triton.jit
def _sq_tile(
    x_ptr, y_ptr, xx_ptr, yy_ptr, rows, rmask, cols, cmask, stride_x, stride_y, coinc,
    D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
    PREC: tl.constexpr,
):
    """Squared distances of one tile by the large-d (``DOT``, tl.dot at ``PREC``) or the small-d path."""
    if DOT:
        sq = _sq_dist_dot_tile(x_ptr, y_ptr, xx_ptr, yy_ptr, rows, rmask, cols, cmask, stride_x, stride_y,
                               coinc, D, BLOCK_N, BLOCK_M, BLOCK_K, PREC)
    else:
        sq = _sq_dist_tile(x_ptr, y_ptr, rows, rmask, cols, cmask, stride_x, stride_y, D, BLOCK_N, BLOCK_M)
    return sq


@triton.jit
def _logits_tile(sq, h_ptr, cols, cmask, cscale, P: tl.constexpr, TRANS: tl.constexpr = False):
    """(BLOCK_N, BLOCK_M) logits h_j - C_ij / eps from the squared distances ``sq`` of the tile, in the units of
    ``h`` (base 2 or e; ``cscale`` = the matching 1 / eps for p = 1, 1 / (2 eps) for p = 2); -inf on padding
    columns. ``TRANS``: ``sq`` and the logits are (BLOCK_M, BLOCK_N), columns along axis 0."""
    h = tl.load(h_ptr + cols, mask=cmask, other=float("-inf"))
    if P == 1:
        c = tl.sqrt(sq) * cscale
    else:
        c = sq * cscale
    if TRANS:
        logit = h[:, None] - c
    else:
        logit = h[None, :] - c
    return logit


@triton.jit
def _phi_sum(w, sq, x_t, y_t, UNIT: tl.constexpr):
    """(BLOCK_N, BLOCK_D) sum over a tile's columns of w_ij phi(x_i, y_j): phi = (x_i - y_j) / |x_i - y_j| (0 at
    x_i = y_j) if ``UNIT``, else y_j; w and sq (BLOCK_N, BLOCK_M), x_t (BLOCK_N, BLOCK_D), y_t (BLOCK_M,
    BLOCK_D), by broadcast products."""
    if UNIT:
        w = tl.where(sq > 0, w / tl.sqrt(tl.where(sq > 0, sq, 1.0)), 0.0)
        contrib = tl.sum(w[:, :, None] * (x_t[:, None, :] - y_t[None, :, :]), 1)
    else:
        contrib = tl.sum(w[:, :, None] * y_t[None, :, :], 1)
    return contrib


@triton.jit
def _cost_scale(prm_ptr, P: tl.constexpr):
    """log2(e) / eps (p = 1) or log2(e) / (2 eps) (p = 2), from prm = [log2(e) / eps, eps ln 2]."""
    inv2 = tl.load(prm_ptr)
    if P == 2:
        inv2 = 0.5 * inv2
    return inv2


@triton.jit
def _load_points(ptr, idx, imask, dims, dmask, stride):
    """(len(idx), len(dims)) tile of points (rows ``stride`` apart, int64 ``idx``), 0 outside the masks, in
    the points' own dtype (callers upcast with :func:`_up`)."""
    return tl.load(ptr + idx[:, None] * stride + dims[None, :], mask=imask[:, None] & dmask[None, :], other=0.0)


@triton.jit
def _lse_step(m_i, logit, AXIS: tl.constexpr):
    """One online log-sum-exp step in base 2 over a tile's ``AXIS`` (1: columns of (rows, cols) tiles, 0: of
    transposed ones): (new running max, rescale factor of the old sum, the tile's weights 2^(l - max)).
    A row whose logits are all -inf so far keeps max -inf and weights 0."""
    m_new = tl.maximum(m_i, tl.max(logit, AXIS))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    if AXIS == 1:
        w = tl.exp2(logit - m_safe[:, None])
    else:
        w = tl.exp2(logit - m_safe[None, :])
    return m_new, tl.exp2(m_i - m_safe), w



@triton.jit
def _sq_dist_tile_soa(
    xt_ptr,  # (D, N) row points of this problem, coordinate-major: coordinates stride_xk apart, rows contiguous
    yt_ptr,  # (D, M) column points, coordinate-major
    rows, rmask, cols, cmask,
    stride_xk,  # elements between two coordinates of xt
    stride_yk,
    D: tl.constexpr,
    TRANS: tl.constexpr,  # True: the tile is (BLOCK_M, BLOCK_N), columns along axis 0
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Squared distances of a tile from coordinate-major points (contiguous loads along rows / columns). The
    pointers advance one coordinate stride per coordinate (no k * stride product: no 32-bit overflow)."""
    if TRANS:
        sq = _cdt_zeros(xt_ptr, (BLOCK_M, BLOCK_N))
    else:
        sq = _cdt_zeros(xt_ptr, (BLOCK_N, BLOCK_M))
    xk_ptr = xt_ptr
    yk_ptr = yt_ptr
    if D <= 16:
        for _ in tl.static_range(D):
            sq += _coord_sq(xk_ptr, yk_ptr, rows, rmask, cols, cmask, TRANS)
            xk_ptr += stride_xk
            yk_ptr += stride_yk
    else:
        for _ in range(0, D):
            sq += _coord_sq(xk_ptr, yk_ptr, rows, rmask, cols, cmask, TRANS)
            xk_ptr += stride_xk
            yk_ptr += stride_yk
    return sq


@triton.jit
def _soa_lse_tile(xt_ptr, yt_ptr, h_ptr, rows, rmask, cols, cmask, stride_xk, stride_yk, cscale, m_i, s_i,
                  D: tl.constexpr, P: tl.constexpr, TRANS: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_M: tl.constexpr):
    """One online log-sum-exp step of the small-d soft-min over the tile (rows, cols) from coordinate-major
    points (:func:`_sq_dist_tile_soa`) and base-2 log-weights ``h_ptr``: the running (max, sum) of every row
    after the tile's logits h_j - C_ij / eps (``cscale``: :func:`_cost_scale`)."""
    sq = _sq_dist_tile_soa(xt_ptr, yt_ptr, rows, rmask, cols, cmask, stride_xk, stride_yk, D, TRANS, BLOCK_N,
                           BLOCK_M)
    logit = _logits_tile(sq, h_ptr, cols, cmask, cscale, P, TRANS)
    if TRANS:
        m_i, alpha, w = _lse_step(m_i, logit, 0)
        s_i = s_i * alpha + tl.sum(w, 0)
    else:
        m_i, alpha, w = _lse_step(m_i, logit, 1)
        s_i = s_i * alpha + tl.sum(w, 1)
    return m_i, s_i


@triton.jit
def _coord(ptr, idx, mask, k: tl.constexpr, stride, D: tl.constexpr):
    """Coordinate ``k`` of the coordinate-major points at ``idx`` (coordinates ``stride`` apart), in the compute
    dtype; zeros of the points' dtype when k >= D (the weighted-mean tile step keeps three coordinates, D <= 3;
    they promote to the compute dtype where they meet the other coordinates)."""
    if k < D:
        v = _up(tl.load(ptr + k * stride + idx, mask=mask, other=0.0))
    else:
        v = tl.zeros(idx.shape, dtype=ptr.dtype.element_ty)
    return v


@triton.jit
def _soa_wmean_start(xt_ptr, rows, rmask, stride_xk, prm_ptr, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """The state of :func:`_soa_wmean_tile` before the first tile: the rows' coordinates x0, x1, x2 (zeros past
    D), running max -inf, sum 0 and accumulators 0, in the compute dtype (that of ``prm_ptr``)."""
    x0 = _coord(xt_ptr, rows, rmask, 0, stride_xk, D)
    x1 = _coord(xt_ptr, rows, rmask, 1, stride_xk, D)
    x2 = _coord(xt_ptr, rows, rmask, 2, stride_xk, D)
    m_i = tl.full((BLOCK_N,), float("-inf"), dtype=prm_ptr.dtype.element_ty)
    zero = tl.zeros((BLOCK_N,), dtype=prm_ptr.dtype.element_ty)
    return x0, x1, x2, m_i, zero, zero, zero, zero


@triton.jit
def _soa_wmean_tile(yt_ptr, h_ptr, cols, cmask, stride_yk, x0, x1, x2, cscale, m_i, s_i, a0, a1, a2,
                    D: tl.constexpr, P: tl.constexpr, UNIT: tl.constexpr):
    """One online step of the small-d weighted mean (D <= 3) over the columns ``cols`` of coordinate-major points
    (coordinates ``stride_yk`` apart), for the rows whose coordinates are x0, x1, x2 ((BLOCK_N,), zeros past D):
    (BLOCK_M, BLOCK_N) tiles reduced over axis 0, so that with BLOCK_N = 32 x num_warps each thread owns a row.
    Returns the running max and sum of the rows' weights exp(h_j - C_ij / eps) (computed in base 2: ``h_ptr``
    holds h log2(e), ``cscale`` from :func:`_cost_scale`) and one accumulator per coordinate of
    sum_j w_ij phi_ij (``UNIT``: phi = (x - y) / |x - y|, 0 at x = y; else phi = y), all rescaled to the new
    max."""
    y0 = _coord(yt_ptr, cols, cmask, 0, stride_yk, D)
    y1 = _coord(yt_ptr, cols, cmask, 1, stride_yk, D)
    y2 = _coord(yt_ptr, cols, cmask, 2, stride_yk, D)
    d0 = y0[:, None] - x0[None, :]  # y - x, (BLOCK_M, BLOCK_N)
    d1 = y1[:, None] - x1[None, :]
    d2 = y2[:, None] - x2[None, :]
    sq = d0 * d0 + d1 * d1 + d2 * d2
    m_i, alpha, w = _lse_step(m_i, _logits_tile(sq, h_ptr, cols, cmask, cscale, P, True), 0)
    s_i = s_i * alpha + tl.sum(w, 0)
    if UNIT:  # sum_j w_ij (x_i - y_j) / |x_i - y_j|
        w = tl.where(sq > 0, -w / tl.sqrt(tl.where(sq > 0, sq, 1.0)), 0.0)
        a0 = a0 * alpha + tl.sum(w * d0, 0)
        a1 = a1 * alpha + tl.sum(w * d1, 0)
        a2 = a2 * alpha + tl.sum(w * d2, 0)
    else:  # sum_j w_ij y_j
        a0 = a0 * alpha + tl.sum(w * y0[:, None], 0)
        a1 = a1 * alpha + tl.sum(w * y1[:, None], 0)
        a2 = a2 * alpha + tl.sum(w * y2[:, None], 0)
    return m_i, s_i, a0, a1, a2


@triton.jit
def _store_coords(out_ptr, rows, rmask, a0, a1, a2, s_i, D: tl.constexpr):
    """Store the weighted means a_k / s_i of rows ``rows`` into a row-major (N, D) output (D <= 3)."""
    base = out_ptr + rows * D
    tl.store(base, a0 / s_i, mask=rmask)
    if D > 1:
        tl.store(base + 1, a1 / s_i, mask=rmask)
    if D > 2:
        tl.store(base + 2, a2 / s_i, mask=rmask)
