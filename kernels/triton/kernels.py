"""The seven ``@triton.jit`` kernels of the Triton backend (tile helpers in :mod:`.tiles`, launched by
:mod:`.launchers`, autotuned by :mod:`.autotune`): softmin (large-d / row-major and small-d / coordinate-major),
weighted mean (small-d one pass, ``tl.dot`` one pass, second pass of the two-pass form), plan argmax and the
largest squared distance.

Points may be float16 / bfloat16: their tiles are loaded in half precision and upcast in registers
(:func:`.tiles._up`); ``h``, ``prm``, the accumulators and the outputs are in the compute dtype (float32, or
float64 for float64 points), the dtype of ``prm``."""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import (
    _cost_scale,
    _load_points,
    _logits_tile,
    _lse_step,
    _phi_sum,
    _program_rows,
    _soa_lse_tile,
    _soa_wmean_start,
    _soa_wmean_tile,
    _sq_dist_tile,
    _sq_from_dot,
    _sq_tile,
    _store_coords,
    _tile_cols,
    _up,
    _xy_dot_tile,
)


# Logits are carried in base 2 (exp2 / log2 are single hardware instructions): the launchers pass
# h * log2(e) and prm = [log2(e) / eps, eps * ln(2)], so every tile computes
# l_ij = log2(e) * (h_j - C_ij / eps) and out_i = -eps ln(2) (max_j l_ij + log2 sum_j 2^(l_ij - max)).
# D is a compile-time constant (one compiled kernel per D): the coordinate loop of the small-d path unrolls.
# Batches: the grid is one axis of cdiv(N, BLOCK_N) row blocks per problem, problem after problem; each
# program moves its pointers to its problem by the batch strides. Every element offset that can exceed
# 2^31 (batch, row, column and coordinate offsets) is computed in int64: row and column indices are int64,
# coordinate-major pointers advance one coordinate stride at a time.
@triton.jit
def _softmin_fwd_kernel(
    x_ptr,  # (B, N, D) row points, coordinates contiguous
    y_ptr,  # (B, M, D) column points, coordinates contiguous
    xx_ptr,  # (B, N) |x_i|^2, contiguous (large-d path only; unused otherwise)
    yy_ptr,  # (B, M) |y_j|^2, contiguous (large-d path only)
    h_ptr,  # (B, M) column log-weights times log2(e), may hold -inf; columns contiguous
    prm_ptr,  # (2,) [log2(e) / eps, eps ln 2] in the input dtype
    out_ptr,  # (B, N) contiguous output: -eps * LSE_j[h_j - C_ij / eps]
    N,
    M,
    stride_xb,  # elements between two problems of x
    stride_x,  # elements between two rows of x
    stride_yb,
    stride_y,
    stride_hb,  # elements between two problems of h
    coinc,  # large-d path: relative |x - y|^2 below which a pair counts as coincident
    SIZE_KEY,  # unused by the kernel: the autotuner's size bucket
    D: tl.constexpr,  # number of coordinates
    P: tl.constexpr,  # cost exponent, 1 or 2
    DOT: tl.constexpr,  # True: large-d path (tl.dot cross term); False: small-d path
    FOLD: tl.constexpr,  # DOT and P == 2: |x_i|^2 and |y_j|^2 folded out of the per-pair work
    PREC: tl.constexpr,  # DOT: tl.dot input_precision ("ieee", "tf32x3" or "tf32")
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    b, rows, rmask = _program_rows(N, BLOCK_N)
    x_ptr += b * stride_xb
    y_ptr += b * stride_yb
    xx_ptr += b * N
    yy_ptr += b * M
    h_ptr += b * stride_hb
    cscale = _cost_scale(prm_ptr, P)
    eps_ln2 = tl.load(prm_ptr + 1)
    m_i = tl.full((BLOCK_N,), float("-inf"), dtype=prm_ptr.dtype.element_ty)  # running max (base 2)
    s_i = tl.zeros((BLOCK_N,), dtype=prm_ptr.dtype.element_ty)  # running sum of 2^(l - m_i)
    for j0 in range(0, M, BLOCK_M):
        cols, cmask = _tile_cols(j0, M, BLOCK_M)
        if FOLD:  # one FMA per pair after the dot: l_ij = (h_j - c |y_j|^2) + 2 c x_i.y_j, row term later
            xy = _xy_dot_tile(x_ptr, y_ptr, rows, rmask, cols, cmask, stride_x, stride_y, D, BLOCK_N, BLOCK_M,
                              BLOCK_K, PREC)
            yy = tl.load(yy_ptr + cols, mask=cmask, other=0.0)
            bias = tl.load(h_ptr + cols, mask=cmask, other=float("-inf")) - cscale * yy
            logit = bias[None, :] + xy * (2.0 * cscale)
        else:
            sq = _sq_tile(x_ptr, y_ptr, xx_ptr, yy_ptr, rows, rmask, cols, cmask, stride_x, stride_y, coinc,
                          D, BLOCK_N, BLOCK_M, BLOCK_K, DOT, PREC)
            logit = _logits_tile(sq, h_ptr, cols, cmask, cscale, P)
        m_i, alpha, w = _lse_step(m_i, logit, 1)
        s_i = s_i * alpha + tl.sum(w, 1)
    if FOLD:  # the row term -c |x_i|^2 of every logit
        m_i = m_i - cscale * tl.load(xx_ptr + rows, mask=rmask, other=0.0)
    out = tl.where(s_i > 0, -eps_ln2 * (m_i + tl.log2(tl.where(s_i > 0, s_i, 1.0))), float("inf"))
    tl.store(out_ptr + b * N + rows, out, mask=rmask)



@triton.jit
def _softmin_small_kernel(
    xt_ptr,  # (B, D, N) row points, coordinate-major, rows contiguous
    yt_ptr,  # (B, D, M) column points, coordinate-major, columns contiguous
    h_ptr,  # (B, M) column log-weights times log2(e), may hold -inf; columns contiguous
    prm_ptr,  # (2,) [log2(e) / eps, eps ln 2] in the input dtype
    out_ptr,  # (B, N) contiguous output: -eps * LSE_j[h_j - C_ij / eps]
    N,
    M,
    stride_xb,  # elements between two problems of xt
    stride_xk,  # elements between two coordinates of xt
    stride_yb,
    stride_yk,
    stride_hb,
    SIZE_KEY,  # unused: the autotuner's size bucket
    D: tl.constexpr,
    P: tl.constexpr,
    TRANS: tl.constexpr,  # True: (BLOCK_M, BLOCK_N) tiles reduced over axis 0 (a thread's columns in registers)
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Small-d softmin (exact difference form). Two tile orientations, both candidates of the autotuner: with
    ``TRANS`` and BLOCK_N = 32 x num_warps each thread owns one row and reduces its columns without shuffles."""
    b, rows, rmask = _program_rows(N, BLOCK_N)
    xt_ptr += b * stride_xb
    yt_ptr += b * stride_yb
    h_ptr += b * stride_hb
    cscale = _cost_scale(prm_ptr, P)
    eps_ln2 = tl.load(prm_ptr + 1)
    m_i = tl.full((BLOCK_N,), float("-inf"), dtype=prm_ptr.dtype.element_ty)
    s_i = tl.zeros((BLOCK_N,), dtype=prm_ptr.dtype.element_ty)
    for j0 in range(0, M, BLOCK_M):
        cols, cmask = _tile_cols(j0, M, BLOCK_M)
        m_i, s_i = _soa_lse_tile(xt_ptr, yt_ptr, h_ptr, rows, rmask, cols, cmask, stride_xk, stride_yk, cscale, m_i,
                                 s_i, D, P, TRANS, BLOCK_N, BLOCK_M)
    out = tl.where(s_i > 0, -eps_ln2 * (m_i + tl.log2(tl.where(s_i > 0, s_i, 1.0))), float("inf"))
    tl.store(out_ptr + b * N + rows, out, mask=rmask)


@triton.jit
def _weighted_mean_fwd_kernel(
    x_ptr,  # (B, N, D) row points, coordinates contiguous
    y_ptr,  # (B, M, D) column points, coordinates contiguous
    h_ptr,  # (B, M) column log-weights times log2(e), may hold -inf
    prm_ptr,  # (2,) [log2(e) / eps, eps ln 2]
    out_ptr,  # (B, N, D) output, contiguous
    N,
    M,
    stride_xb,
    stride_x,
    stride_yb,
    stride_y,
    stride_hb,
    SIZE_KEY,  # unused: the autotuner's size bucket
    D: tl.constexpr,
    P: tl.constexpr,
    UNIT: tl.constexpr,  # True: phi = (x - y) / |x - y| (0 at x = y); False: phi = y
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,  # power of two >= D
):
    """Small-d weighted mean (D <= 64): one pass, running max and rescaled (BLOCK_N, BLOCK_D) accumulator,
    products summed by broadcasting (float64, and float32 below the tl.dot path's D)."""
    b, rows, rmask = _program_rows(N, BLOCK_N)
    x_ptr += b * stride_xb
    y_ptr += b * stride_yb
    h_ptr += b * stride_hb
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < D
    cscale = _cost_scale(prm_ptr, P)
    x_t = _up(_load_points(x_ptr, rows, rmask, dims, dmask, stride_x))  # (BLOCK_N, BLOCK_D)
    m_i = tl.full((BLOCK_N,), float("-inf"), dtype=prm_ptr.dtype.element_ty)
    s_i = tl.zeros((BLOCK_N,), dtype=prm_ptr.dtype.element_ty)
    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=prm_ptr.dtype.element_ty)  # running sum of w_ij phi_ij
    for j0 in range(0, M, BLOCK_M):
        cols, cmask = _tile_cols(j0, M, BLOCK_M)
        sq = _sq_dist_tile(x_ptr, y_ptr, rows, rmask, cols, cmask, stride_x, stride_y, D, BLOCK_N, BLOCK_M)
        logit = _logits_tile(sq, h_ptr, cols, cmask, cscale, P)
        m_i, alpha, w = _lse_step(m_i, logit, 1)  # w: (BLOCK_N, BLOCK_M)
        s_i = s_i * alpha + tl.sum(w, 1)
        y_t = _up(_load_points(y_ptr, cols, cmask, dims, dmask, stride_y))  # (BLOCK_M, BLOCK_D)
        acc = acc * alpha[:, None] + _phi_sum(w, sq, x_t, y_t, UNIT)
    out = acc / s_i[:, None]
    out_ptr += b * N * D
    tl.store(out_ptr + rows[:, None] * D + dims[None, :], out, mask=rmask[:, None] & dmask[None, :])


@triton.jit
def _weighted_mean_soa_kernel(
    xt_ptr,  # (B, D, N) row points, coordinate-major, rows contiguous
    yt_ptr,  # (B, D, M) column points, coordinate-major, columns contiguous
    h_ptr,  # (B, M) column log-weights times log2(e), may hold -inf
    prm_ptr,  # (2,) [log2(e) / eps, eps ln 2]
    out_ptr,  # (B, N, D) output, contiguous
    N,
    M,
    stride_xb,  # elements between two problems of xt
    stride_xk,  # elements between two coordinates of xt
    stride_yb,
    stride_yk,
    stride_hb,
    D: tl.constexpr,  # <= 3
    P: tl.constexpr,
    UNIT: tl.constexpr,  # True: phi = (x - y) / |x - y| (0 at x = y); False: phi = y
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Small-d weighted mean for D <= 3 with the block-sparse kernel's tile step (:func:`.tiles._soa_wmean_tile`:
    (BLOCK_M, BLOCK_N) tiles reduced over columns, a thread per row when BLOCK_N = 32 x num_warps, one
    accumulator per coordinate) over every column."""
    b, rows, rmask = _program_rows(N, BLOCK_N)
    xt_ptr += b * stride_xb
    yt_ptr += b * stride_yb
    h_ptr += b * stride_hb
    cscale = _cost_scale(prm_ptr, P)
    x0, x1, x2, m_i, s_i, a0, a1, a2 = _soa_wmean_start(xt_ptr, rows, rmask, stride_xk, prm_ptr, D, BLOCK_N)
    for j0 in range(0, M, BLOCK_M):
        cols, cmask = _tile_cols(j0, M, BLOCK_M)
        m_i, s_i, a0, a1, a2 = _soa_wmean_tile(yt_ptr, h_ptr, cols, cmask, stride_yk, x0, x1, x2, cscale, m_i, s_i,
                                               a0, a1, a2, D, P, UNIT)
    _store_coords(out_ptr + b * N * D, rows, rmask, a0, a1, a2, s_i, D)


@triton.jit
def _weighted_mean_dot_kernel(
    x_ptr,  # (B, N, D) row points (centred by the launcher), coordinates contiguous
    y_ptr,  # (B, M, D) column points (same centring)
    xx_ptr,  # (B, N) |x_i|^2, contiguous
    yy_ptr,  # (B, M) |y_j|^2, contiguous
    h_ptr,  # (B, M) column log-weights times log2(e), may hold -inf
    prm_ptr,  # (2,) [log2(e) / eps, eps ln 2]
    out_ptr,  # (B, N, D) contiguous output: sum_j w_ij y_j (centred) or sum_j w_ij (x_i - y_j) / |x_i - y_j|
    N,
    M,
    stride_xb,
    stride_x,
    stride_yb,
    stride_y,
    stride_hb,
    coinc,
    SIZE_KEY,  # unused: the autotuner's size bucket
    D: tl.constexpr,
    P: tl.constexpr,
    UNIT: tl.constexpr,  # True: phi = (x - y) / |x - y| (0 at x = y); False: phi = y
    PREC: tl.constexpr,  # tl.dot input_precision ("ieee", "tf32x3" or "tf32"); half points: "tf32" (exact) for x.y
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,  # power of two >= max(D, 16)
):
    """float32 weighted mean for 16 <= BLOCK_D <= 128, one pass (the FlashAttention pattern): each column
    tile of y is loaded once, forms the cross term x.y^T with tl.dot and adds tl.dot(w, y) into a
    rescaled (BLOCK_N, BLOCK_D) register accumulator; both dots at ``PREC`` (for float16 / bfloat16 points
    the cross term in "tf32", exact for them: see :func:`.tiles._xy_dot_tile`)."""
    b, rows, rmask = _program_rows(N, BLOCK_N)
    x_ptr += b * stride_xb
    y_ptr += b * stride_yb
    xx_ptr += b * N
    yy_ptr += b * M
    h_ptr += b * stride_hb
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < D
    cscale = _cost_scale(prm_ptr, P)
    x_h = _load_points(x_ptr, rows, rmask, dims, dmask, stride_x)  # (BLOCK_N, BLOCK_D), loaded once
    x_t = _up(x_h)
    xx = tl.load(xx_ptr + rows, mask=rmask, other=0.0)
    m_i = tl.full((BLOCK_N,), float("-inf"), dtype=prm_ptr.dtype.element_ty)
    s_i = tl.zeros((BLOCK_N,), dtype=prm_ptr.dtype.element_ty)  # sum of w
    u_i = tl.zeros((BLOCK_N,), dtype=prm_ptr.dtype.element_ty)  # UNIT: sum of w / |x - y|
    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=prm_ptr.dtype.element_ty)
    for j0 in range(0, M, BLOCK_M):
        cols, cmask = _tile_cols(j0, M, BLOCK_M)
        y_t = _up(_load_points(y_ptr, cols, cmask, dims, dmask, stride_y))  # (BLOCK_M, BLOCK_D)
        yy = tl.load(yy_ptr + cols, mask=cmask, other=0.0)
        xy = tl.dot(x_t, tl.trans(y_t), input_precision=PREC if x_h.dtype == tl.float32 else "tf32")
        sq = _sq_from_dot(xy, xx, yy, coinc)
        logit = _logits_tile(sq, h_ptr, cols, cmask, cscale, P)
        m_i, alpha, w = _lse_step(m_i, logit, 1)
        s_i = s_i * alpha + tl.sum(w, 1)
        if UNIT:
            w = tl.where(sq > 0, w / tl.sqrt(tl.where(sq > 0, sq, 1.0)), 0.0)
            u_i = u_i * alpha + tl.sum(w, 1)
        acc = tl.dot(w, y_t, acc * alpha[:, None], input_precision=PREC)
    if UNIT:  # sum_j w'_ij (x_i - y_j) = x_i sum_j w'_ij - sum_j w'_ij y_j (the centring cancels)
        acc = x_t * u_i[:, None] - acc
    out = acc / s_i[:, None]
    out_ptr += b * N * D
    tl.store(out_ptr + rows[:, None] * D + dims[None, :], out, mask=rmask[:, None] & dmask[None, :])


@triton.jit
def _weighted_sum_dot_kernel(
    x_ptr,  # (B, N, D) row points (centred), coordinates contiguous
    y_ptr,  # (B, M, D) column points (centred)
    xx_ptr,  # (B, N) |x_i|^2, contiguous
    yy_ptr,  # (B, M) |y_j|^2, contiguous
    h_ptr,  # (B, M) column log-weights times log2(e), may hold -inf
    lse_ptr,  # (B, N) contiguous, log2 sum_j 2^(l_ij) from a first (softmin) pass: normalises the weights
    prm_ptr,  # (2,) [log2(e) / eps, eps ln 2]
    acc_ptr,  # (B, N, D) contiguous output, zero-initialised: sum_j w'_ij y_j
    wsum_ptr,  # (B, N) contiguous output: sum_j w'_ij
    N,
    M,
    stride_xb,
    stride_x,
    stride_yb,
    stride_y,
    stride_hb,
    coinc,
    D: tl.constexpr,
    P: tl.constexpr,
    UNIT: tl.constexpr,  # True: w'_ij = w_ij / |x_i - y_j| (0 at x = y); False: w'_ij = w_ij
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT: tl.constexpr,  # True (float32): tl.dot; False (float64): broadcast products summed over the tile
    PREC: tl.constexpr,  # DOT: tl.dot input_precision ("ieee", "tf32x3" or "tf32")
):
    """Large-d weighted sum, second pass: with w_ij = 2^(l_ij - lse_i) already normalised, each column
    tile adds w' @ y_tile into the program's own rows of ``acc`` chunk by chunk of BLOCK_K coordinates
    (read-modify-write in global memory: no (BLOCK_N, D) register accumulator)."""
    b, rows, rmask = _program_rows(N, BLOCK_N)
    x_ptr += b * stride_xb
    y_ptr += b * stride_yb
    xx_ptr += b * N
    yy_ptr += b * M
    h_ptr += b * stride_hb
    acc_ptr += b * N * D
    cscale = _cost_scale(prm_ptr, P)
    lse = tl.load(lse_ptr + b * N + rows, mask=rmask, other=0.0)
    wsum = tl.zeros((BLOCK_N,), dtype=prm_ptr.dtype.element_ty)
    ks = tl.arange(0, BLOCK_K)
    for j0 in range(0, M, BLOCK_M):
        cols, cmask = _tile_cols(j0, M, BLOCK_M)
        sq = _sq_tile(x_ptr, y_ptr, xx_ptr, yy_ptr, rows, rmask, cols, cmask, stride_x, stride_y, coinc,
                      D, BLOCK_N, BLOCK_M, BLOCK_K, DOT, PREC)
        logit = _logits_tile(sq, h_ptr, cols, cmask, cscale, P)
        w = tl.exp2(logit - lse[:, None])  # (BLOCK_N, BLOCK_M), rows sum to 1 over all tiles
        if UNIT:
            w = tl.where(sq > 0, w / tl.sqrt(tl.where(sq > 0, sq, 1.0)), 0.0)
        wsum += tl.sum(w, 1)
        tl.debug_barrier()  # the previous tile's stores to acc are visible to every thread of the program
        for k0 in range(0, D, BLOCK_K):
            kk = k0 + ks
            kmask = kk < D
            y_t = tl.load(y_ptr + cols[:, None] * stride_y + kk[None, :], mask=cmask[:, None] & kmask[None, :],
                          other=0.0)  # (BLOCK_M, BLOCK_K)
            a_ptrs = acc_ptr + rows[:, None] * D + kk[None, :]
            amask = rmask[:, None] & kmask[None, :]
            acc = tl.load(a_ptrs, mask=amask, other=0.0)
            if DOT:
                acc = tl.dot(w, _up(y_t), acc, input_precision=PREC)
            else:
                acc += tl.sum(w[:, :, None] * _up(y_t)[None, :, :], 1)
            tl.store(a_ptrs, acc, mask=amask)
    tl.store(wsum_ptr + b * N + rows, wsum, mask=rmask)


@triton.jit
def _plan_argmax_fwd_kernel(
    x_ptr,  # (B, N, D) row points, coordinates contiguous
    y_ptr,  # (B, M, D) column points, coordinates contiguous
    xx_ptr,  # (B, N) |x_i|^2, contiguous (large-d path only)
    yy_ptr,  # (B, M) |y_j|^2, contiguous (large-d path only)
    h_ptr,  # (B, M) column log-weights times log2(e)
    prm_ptr,  # (2,) [log2(e) / eps, eps ln 2]
    out_ptr,  # (B, N) contiguous int64 output
    N,
    M,
    stride_xb,
    stride_x,
    stride_yb,
    stride_y,
    stride_hb,
    coinc,
    D: tl.constexpr,
    P: tl.constexpr,
    DOT: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    b, rows, rmask = _program_rows(N, BLOCK_N)
    x_ptr += b * stride_xb
    y_ptr += b * stride_yb
    xx_ptr += b * N
    yy_ptr += b * M
    h_ptr += b * stride_hb
    cscale = _cost_scale(prm_ptr, P)
    best = tl.full((BLOCK_N,), float("-inf"), dtype=prm_ptr.dtype.element_ty)
    arg = tl.zeros((BLOCK_N,), dtype=tl.int64)
    for j0 in range(0, M, BLOCK_M):
        cols, cmask = _tile_cols(j0, M, BLOCK_M)
        sq = _sq_tile(x_ptr, y_ptr, xx_ptr, yy_ptr, rows, rmask, cols, cmask, stride_x, stride_y, coinc,
                      D, BLOCK_N, BLOCK_M, BLOCK_K, DOT, PREC)
        logit = _logits_tile(sq, h_ptr, cols, cmask, cscale, P)
        t_max = tl.max(logit, 1)
        t_arg = tl.argmax(logit, 1, tie_break_left=True).to(tl.int64) + j0
        upd = t_max > best  # strict: the first maximal index wins, as torch.argmax
        arg = tl.where(upd, t_arg, arg)
        best = tl.where(upd, t_max, best)
    tl.store(out_ptr + b * N + rows, arg, mask=rmask)


@triton.jit
def _max_sq_fwd_kernel(
    x_ptr,  # (B, N, D) row points, coordinates contiguous
    y_ptr,  # (B, M, D) column points, coordinates contiguous
    xx_ptr,  # (B, N) |x_i|^2, contiguous (large-d path only)
    yy_ptr,  # (B, M) |y_j|^2, contiguous (large-d path only)
    out_ptr,  # (B, N) contiguous output: max_j |x_i - y_j|^2
    N,
    M,
    stride_xb,
    stride_x,
    stride_yb,
    stride_y,
    coinc,
    D: tl.constexpr,
    DOT: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    b, rows, rmask = _program_rows(N, BLOCK_N)
    x_ptr += b * stride_xb
    y_ptr += b * stride_yb
    xx_ptr += b * N
    yy_ptr += b * M
    best = tl.zeros((BLOCK_N,), dtype=out_ptr.dtype.element_ty)
    for j0 in range(0, M, BLOCK_M):
        cols, cmask = _tile_cols(j0, M, BLOCK_M)
        sq = _sq_tile(x_ptr, y_ptr, xx_ptr, yy_ptr, rows, rmask, cols, cmask, stride_x, stride_y, coinc,
                      D, BLOCK_N, BLOCK_M, BLOCK_K, DOT, PREC)
        best = tl.maximum(best, tl.max(tl.where(cmask[None, :], sq, 0.0), 1))
    tl.store(out_ptr + b * N + rows, best, mask=rmask)

