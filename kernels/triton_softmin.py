r"""Triton backend of the kernel primitives (docs/DESIGN.md, "Kernel primitive"): streaming (online
log-sum-exp) kernels over column tiles, O((N + M) * D) memory.

Same functions and signatures as :mod:`srot_fast.kernels.tensorized`:

- ``softmin(x, y, h, eps, p)``             -> (N,)    out_i = -eps * LSE_j[h_j - C(x_i, y_j) / eps]
- ``weighted_mean(x, y, h, eps, p, phi)``  -> (N, D)  sum_j softmax_j(h_j - C_ij / eps) * phi(x_i, y_j)
- ``plan_argmax(x, y, h, eps, p)``         -> (N,)    int64, argmax_j (h_j - C_ij / eps)
- ``max_cost(x, y, p)``                    -> ()      max_ij C(x_i, y_j)

with C = |x - y| (p = 1) or |x - y|^2 / 2 (p = 2). Batches: x (B, N, D), y (B, M, D), h (B, M) with one
``eps`` give (B, N), (B, N, D), (B, N), (B,) in one launch per kernel: the grid holds cdiv(N, BLOCK_N) row
blocks per problem and each program moves to its problem by the batch strides (points are read in place
when their coordinates are contiguous). Element offsets are 64-bit, so N * D, B * N * D and the outputs may
exceed 2^31 elements.

Layers: ``_*_kernel`` (``@triton.jit``) -> ``*_fwd`` launchers (checks, path, block sizes, grid,
allocation; keyword arguments) -> the four primitives above. One program owns ``BLOCK_N`` rows of one
problem and streams the columns in tiles of ``BLOCK_M`` with a running max / rescaled sum per row, in base 2
(``exp2`` / ``log2``: the launchers pass h log2(e) and log2(e) / eps). D is a compile-time constant (one
compiled kernel per D). Two ways to form a tile of squared distances:

- *small-d path* (D < 32, and every D in float64): exact difference form, one coordinate at a time
  (unrolled for D <= 16). The softmin reads coordinate-major (B, D, N) views of x and y and has two tile
  orientations: (BLOCK_N, BLOCK_M) reduced over columns across threads, or transposed (BLOCK_M, BLOCK_N)
  where each thread owns a row and reduces its columns in registers (no warp shuffles);
- *large-d path* (float32, D >= 32, any D): |x|^2 + |y|^2 - 2 x.y with the cross term from ``tl.dot`` over
  chunks of ``BLOCK_K`` coordinates at fp32 accuracy, never plain TF32 (whose 10-bit mantissa gives ~5e-5
  relative error on squared distances at D = 300 against ~2e-7 for fp32). ``input_precision`` is "ieee"
  (fp32 FMA, the default) or "tf32x3" (``SROT_TRITON_DOT_PRECISION=tf32x3`` or ``precision=``: each operand
  split into a TF32 high part and a TF32 remainder, hi.hi + hi.lo + lo.hi on the tensor cores with fp32
  accumulation: the accuracy of "ieee", faster on GPUs with tensor cores). Each problem's two clouds are
  centred on their common mean first; pairs closer than the rounding noise (relative 2 sqrt(D) u) count as
  coincident (p = 1). For p = 2 the softmin folds the norms out of the pair loop:
  l_ij = (h_j - c |y_j|^2) + 2 c x_i.y_j, the row term -c |x_i|^2 added at the end (one FMA per pair
  after the dot).

``weighted_mean``: small-d path (D <= 64): one streaming pass with a (BLOCK_N, D) register accumulator and
broadcast products; float32 at 32 <= D <= 128: one pass with both x.y^T and w @ y by ``tl.dot`` (the
FlashAttention pattern); D > 128 (and float64 D > 64): two passes, the softmin gives each row's normaliser,
then a second kernel adds ``w @ y_tile`` chunk by chunk into the program's own rows of the (B, N, D) output
(``tl.dot`` in float32, broadcast products summed in registers in float64).
``eps`` travels as a tensor of the input dtype (a Python float would be specialised to float32).

Block sizes: on a GPU, the first launch of at least ``_TUNE_MIN_PAIRS`` (2^26) pairs (B * N * M) per
(kernel, D, p, path, phi, precision, dtype, size bucket of B, N and M) is autotuned among ``_CFG_DOT`` /
``_CFG_SMALL`` / ``_CFG_WMEAN_DOT`` / ``_CFG_WMEAN_SMALL`` (CUDA-event timing, no extra memory;
``SROT_TRITON_AUTOTUNE=0`` turns it off; ``tuned_configs()`` reports the choices); smaller launches, the
interpreter and explicit block sizes use fixed defaults.

Supported: float32 and float64, any D for every primitive; the four primitives also take float16 /
bfloat16, upcast to float32 before the launch (float32 results); the ``*_fwd`` launchers take float32 and
float64 only.

Tests: tests/test_kernels.py and tests/test_batched_kernels.py (marker ``triton``) run under the CPU
interpreter (``TRITON_INTERPRET=1``) or on a GPU against the torch reference. The interpreter computes
``tl.dot`` with numpy in the input dtype, so it cannot show TF32: the GPU-only test
``test_triton_dot_path_is_fp32_accurate`` can. benchmarks/triton_aot_check.py compiles every configuration
for sm_90 without a GPU (shared memory, register spills).

Caution:
    - Large-d path: distances below the rounding noise of |x|^2 + |y|^2 - 2 x.y (relative 2 sqrt(D) u,
      e.g. 2.6e-5 of |x - c|^2 + |y - c|^2 at D = 12288 in float32) are set to 0 (p = 1 and every
      primitive but the p = 2 softmin, where the fold leaves them at their rounding value).
    - At D in the thousands the "ieee" softmin is slower than a dense cuBLAS cost matrix (without TF32);
      "tf32x3" closes the gap.
    - Autotuning compiles every candidate on the first large launch of each key (tens of seconds).
    - Inputs must live on a CUDA device, or on the CPU with ``TRITON_INTERPRET=1`` set before triton is
      imported. triton is imported by this module only.
    - No autograd graph: outputs are plain tensors (the package uses the envelope theorem).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ._common import check_operands

__all__ = [
    "softmin",
    "weighted_mean",
    "plan_argmax",
    "max_cost",
    "softmin_fwd",
    "weighted_mean_fwd",
    "plan_argmax_fwd",
    "max_sq_fwd",
    "tuned_configs",
]

_MAX_D_WMEAN = 64  # largest D of the one-pass (small-d) weighted_mean
_MAX_D_WMEAN_DOT = 128  # largest D of the one-pass tl.dot weighted_mean (float32)
_DOT_MIN_D = 32  # D from which 'auto' forms distances with tl.dot (large-d path)


# ------------------------------------------------------------------------------------------ kernels
# Logits are carried in base 2 (exp2 / log2 are single hardware instructions): the launchers pass
# h * log2(e) and prm = [log2(e) / eps, eps * ln(2)], so every tile computes
# l_ij = log2(e) * (h_j - C_ij / eps) and out_i = -eps ln(2) (max_j l_ij + log2 sum_j 2^(l_ij - max)).
# D is a compile-time constant (one compiled kernel per D): the coordinate loop of the small-d path unrolls.
# Batches: the grid is one axis of cdiv(N, BLOCK_N) row blocks per problem, problem after problem; each
# program moves its pointers to its problem by the batch strides. Every element offset that can exceed
# 2^31 (batch, row, column and coordinate offsets) is computed in int64: row and column indices are int64,
# coordinate-major pointers advance one coordinate stride at a time.
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
    (BLOCK_N, BLOCK_M), or (BLOCK_M, BLOCK_N) if ``TRANS``."""
    xk = tl.load(xk_ptr + xoff, mask=rmask, other=0.0)
    yk = tl.load(yk_ptr + yoff, mask=cmask, other=0.0)
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
    sq = tl.zeros((BLOCK_N, BLOCK_M), dtype=x_ptr.dtype.element_ty)
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
    PREC: tl.constexpr,  # tl.dot input_precision: "ieee" (fp32 FMA) or "tf32x3" (fp32 split over 3 TF32 MMAs)
):
    """(BLOCK_N, BLOCK_M) cross terms x_i.y_j by tl.dot over chunks of BLOCK_K coordinates at fp32 accuracy
    (``PREC``: never plain TF32; large-d path)."""
    xy = tl.zeros((BLOCK_N, BLOCK_M), dtype=x_ptr.dtype.element_ty)
    ks = tl.arange(0, BLOCK_K)
    for k0 in range(0, D, BLOCK_K):
        kk = k0 + ks
        kmask = kk < D
        x_t = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        y_t = tl.load(y_ptr + cols[:, None] * stride_y + kk[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)
        xy = tl.dot(x_t, tl.trans(y_t), xy, input_precision=PREC)
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
def _logits_tile(sq, h_ptr, cols, cmask, cscale, P: tl.constexpr):
    """(BLOCK_N, BLOCK_M) logits h_j - C_ij / eps in the units of ``h`` (base 2 or e; ``cscale`` = the
    matching 1 / eps for p = 1, 1 / (2 eps) for p = 2); -inf on padding columns."""
    h = tl.load(h_ptr + cols, mask=cmask, other=float("-inf"))
    if P == 1:
        logit = h[None, :] - tl.sqrt(sq) * cscale
    else:
        logit = h[None, :] - sq * cscale
    return logit


@triton.jit
def _cost_scale(prm_ptr, P: tl.constexpr):
    """log2(e) / eps (p = 1) or log2(e) / (2 eps) (p = 2), from prm = [log2(e) / eps, eps ln 2]."""
    inv2 = tl.load(prm_ptr)
    if P == 2:
        inv2 = 0.5 * inv2
    return inv2


@triton.jit
def _load_points(ptr, idx, imask, dims, dmask, stride):
    """(len(idx), len(dims)) tile of points (rows ``stride`` apart, int64 ``idx``), 0 outside the masks."""
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
    PREC: tl.constexpr,  # DOT: tl.dot input_precision ("ieee" or "tf32x3")
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
    m_i = tl.full((BLOCK_N,), float("-inf"), dtype=x_ptr.dtype.element_ty)  # running max (base 2)
    s_i = tl.zeros((BLOCK_N,), dtype=x_ptr.dtype.element_ty)  # running sum of 2^(l - m_i)
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
        sq = tl.zeros((BLOCK_M, BLOCK_N), dtype=xt_ptr.dtype.element_ty)
    else:
        sq = tl.zeros((BLOCK_N, BLOCK_M), dtype=xt_ptr.dtype.element_ty)
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
    m_i = tl.full((BLOCK_N,), float("-inf"), dtype=xt_ptr.dtype.element_ty)
    s_i = tl.zeros((BLOCK_N,), dtype=xt_ptr.dtype.element_ty)
    for j0 in range(0, M, BLOCK_M):
        cols, cmask = _tile_cols(j0, M, BLOCK_M)
        sq = _sq_dist_tile_soa(xt_ptr, yt_ptr, rows, rmask, cols, cmask, stride_xk, stride_yk, D, TRANS, BLOCK_N,
                               BLOCK_M)
        if P == 1:
            c = tl.sqrt(sq) * cscale
        else:
            c = sq * cscale
        h = tl.load(h_ptr + cols, mask=cmask, other=float("-inf"))
        if TRANS:
            logit = h[:, None] - c
            m_i, alpha, w = _lse_step(m_i, logit, 0)
            s_i = s_i * alpha + tl.sum(w, 0)
        else:
            logit = h[None, :] - c
            m_i, alpha, w = _lse_step(m_i, logit, 1)
            s_i = s_i * alpha + tl.sum(w, 1)
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
    x_t = _load_points(x_ptr, rows, rmask, dims, dmask, stride_x)  # (BLOCK_N, BLOCK_D)
    m_i = tl.full((BLOCK_N,), float("-inf"), dtype=x_ptr.dtype.element_ty)
    s_i = tl.zeros((BLOCK_N,), dtype=x_ptr.dtype.element_ty)
    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=x_ptr.dtype.element_ty)  # running sum of w_ij phi_ij
    for j0 in range(0, M, BLOCK_M):
        cols, cmask = _tile_cols(j0, M, BLOCK_M)
        sq = _sq_dist_tile(x_ptr, y_ptr, rows, rmask, cols, cmask, stride_x, stride_y, D, BLOCK_N, BLOCK_M)
        logit = _logits_tile(sq, h_ptr, cols, cmask, cscale, P)
        m_i, alpha, w = _lse_step(m_i, logit, 1)  # w: (BLOCK_N, BLOCK_M)
        s_i = s_i * alpha + tl.sum(w, 1)
        y_t = _load_points(y_ptr, cols, cmask, dims, dmask, stride_y)  # (BLOCK_M, BLOCK_D)
        if UNIT:
            w = tl.where(sq > 0, w / tl.sqrt(tl.where(sq > 0, sq, 1.0)), 0.0)
            contrib = tl.sum(w[:, :, None] * (x_t[:, None, :] - y_t[None, :, :]), 1)
        else:
            contrib = tl.sum(w[:, :, None] * y_t[None, :, :], 1)
        acc = acc * alpha[:, None] + contrib
    out = acc / s_i[:, None]
    out_ptr += b * N * D
    tl.store(out_ptr + rows[:, None] * D + dims[None, :], out, mask=rmask[:, None] & dmask[None, :])


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
    PREC: tl.constexpr,  # tl.dot input_precision of both dots ("ieee" or "tf32x3")
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,  # power of two >= max(D, 16)
):
    """float32 weighted mean for 16 <= BLOCK_D <= 128, one pass (the FlashAttention pattern): each column
    tile of y is loaded once, forms the cross term x.y^T with tl.dot and adds tl.dot(w, y) into a
    rescaled (BLOCK_N, BLOCK_D) register accumulator; both dots at fp32 accuracy (``PREC``)."""
    b, rows, rmask = _program_rows(N, BLOCK_N)
    x_ptr += b * stride_xb
    y_ptr += b * stride_yb
    xx_ptr += b * N
    yy_ptr += b * M
    h_ptr += b * stride_hb
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < D
    cscale = _cost_scale(prm_ptr, P)
    x_t = _load_points(x_ptr, rows, rmask, dims, dmask, stride_x)  # (BLOCK_N, BLOCK_D), loaded once
    xx = tl.load(xx_ptr + rows, mask=rmask, other=0.0)
    m_i = tl.full((BLOCK_N,), float("-inf"), dtype=x_ptr.dtype.element_ty)
    s_i = tl.zeros((BLOCK_N,), dtype=x_ptr.dtype.element_ty)  # sum of w
    u_i = tl.zeros((BLOCK_N,), dtype=x_ptr.dtype.element_ty)  # UNIT: sum of w / |x - y|
    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=x_ptr.dtype.element_ty)
    for j0 in range(0, M, BLOCK_M):
        cols, cmask = _tile_cols(j0, M, BLOCK_M)
        y_t = _load_points(y_ptr, cols, cmask, dims, dmask, stride_y)  # (BLOCK_M, BLOCK_D)
        yy = tl.load(yy_ptr + cols, mask=cmask, other=0.0)
        xy = tl.dot(x_t, tl.trans(y_t), input_precision=PREC)
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
    PREC: tl.constexpr,  # DOT: tl.dot input_precision ("ieee" or "tf32x3")
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
    wsum = tl.zeros((BLOCK_N,), dtype=x_ptr.dtype.element_ty)
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
                acc = tl.dot(w.to(y_t.dtype), y_t, acc, input_precision=PREC)
            else:
                acc += tl.sum(w[:, :, None] * y_t[None, :, :], 1)
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
    best = tl.full((BLOCK_N,), float("-inf"), dtype=x_ptr.dtype.element_ty)
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
    best = tl.zeros((BLOCK_N,), dtype=x_ptr.dtype.element_ty)
    for j0 in range(0, M, BLOCK_M):
        cols, cmask = _tile_cols(j0, M, BLOCK_M)
        sq = _sq_tile(x_ptr, y_ptr, xx_ptr, yy_ptr, rows, rmask, cols, cmask, stride_x, stride_y, coinc,
                      D, BLOCK_N, BLOCK_M, BLOCK_K, DOT, PREC)
        best = tl.maximum(best, tl.max(tl.where(cmask[None, :], sq, 0.0), 1))
    tl.store(out_ptr + b * N + rows, best, mask=rmask)


# -------------------------------------------------------------------------------------- autotuning
def _configs(blocks, names=("BLOCK_N", "BLOCK_M", "BLOCK_K")):
    """triton.Config list from (block sizes..., num_warps, num_stages) tuples."""
    return [triton.Config(dict(zip(names, b[:-2])), num_warps=b[-2], num_stages=b[-1]) for b in blocks]


# Candidates benchmarked on the first large call per (kernel, D, P, path, phi, precision, dtype, size bucket)
# on a GPU.
# (BLOCK_N, BLOCK_M, BLOCK_K, num_warps, num_stages); BLOCK_K is unused on the small-d path.
_CFG_DOT = _configs([
    (64, 64, 32, 4, 2), (64, 64, 32, 4, 3), (128, 64, 32, 8, 3), (128, 64, 32, 4, 3), (64, 128, 32, 4, 3),
    (64, 128, 32, 8, 3), (128, 128, 32, 8, 3), (128, 128, 32, 8, 2), (128, 64, 16, 8, 3), (64, 64, 16, 4, 3),
    (128, 32, 32, 4, 3), (64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (64, 128, 32, 4, 4),
    # 8-warp tiles with 16-coordinate steps (0-16 B of register spill for sm_90 at D = 64 with "ieee")
    (64, 128, 16, 8, 3), (128, 128, 16, 8, 3), (64, 256, 16, 8, 3),
])
# small-d softmin: (BLOCK_N, BLOCK_M, TRANS, num_warps, num_stages)
_CFG_SMALL = _configs([
    (32, 64, False, 4, 1), (64, 64, False, 4, 1), (64, 128, False, 4, 1), (128, 64, False, 4, 1),
    (128, 128, False, 8, 1), (64, 256, False, 8, 1), (32, 128, False, 4, 1),
    (128, 32, True, 4, 1), (128, 64, True, 4, 1), (256, 32, True, 8, 1), (256, 64, True, 8, 1),
    (128, 16, True, 4, 1), (512, 32, True, 8, 1),
], names=("BLOCK_N", "BLOCK_M", "TRANS"))
# weighted means: (BLOCK_N, BLOCK_M, num_warps, num_stages)
_CFG_WMEAN_DOT = _configs([  # the 8-warp and 32-row ones compile without register spills for sm_90 at D = 64
    (64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 3), (32, 64, 4, 3), (64, 32, 8, 2), (32, 64, 8, 2),
    (32, 32, 4, 2), (32, 32, 4, 3),
], names=("BLOCK_N", "BLOCK_M"))
_CFG_WMEAN_SMALL = _configs([
    (16, 32, 4, 1), (32, 64, 4, 1), (64, 64, 4, 1), (64, 128, 8, 1), (128, 64, 8, 1), (32, 128, 4, 1),
], names=("BLOCK_N", "BLOCK_M"))
_TUNE_MIN_PAIRS = 1 << 26  # N * M from which a launch is tuned (~67M pairs, e.g. 8192^2); fixed blocks below


def _prune_register_tiles(configs, named_args, **kwargs):
    """Small-d weighted mean: drop configs whose (BLOCK_N, BLOCK_M, BLOCK_D) broadcast exceeds 16k values."""
    bd = kwargs.get("BLOCK_D", named_args.get("BLOCK_D", 1))
    keep = [c for c in configs if c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_M"] * bd <= 16384]
    return keep or configs[:1]


def _bench(fn, quantiles=None):
    """Autotuner timing: one call (compile, warm-up), then the median / min / max of 3 timed calls (ms).
    Not triton.testing.do_bench: it allocates a 256 MB buffer to flush the L2 cache, which would break
    the O(N + M) memory promise on the first call."""
    fn()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return [times[1], times[0], times[2]] if quantiles else times[1]


def _autotune(kernel, configs, key, prune=None):
    kw = dict(configs=configs, key=key, do_bench=_bench)
    if prune is not None:
        kw["prune_configs_by"] = {"early_config_prune": prune}
    return triton.autotune(**kw)(kernel)


_TUNED = {
    "softmin_dot": _autotune(_softmin_fwd_kernel, _CFG_DOT, ["D", "P", "DOT", "PREC", "SIZE_KEY"]),
    "softmin_small": _autotune(_softmin_small_kernel, _CFG_SMALL, ["D", "P", "SIZE_KEY"]),
    "wmean_dot": _autotune(_weighted_mean_dot_kernel, _CFG_WMEAN_DOT, ["D", "P", "UNIT", "PREC", "SIZE_KEY"]),
    "wmean_small": _autotune(_weighted_mean_fwd_kernel, _CFG_WMEAN_SMALL, ["D", "P", "UNIT", "SIZE_KEY"],
                             prune=_prune_register_tiles),
}


def _tune(x: torch.Tensor, pairs: int, fixed) -> bool:
    """Autotune this launch? Only on a GPU (not the interpreter), from ``_TUNE_MIN_PAIRS`` pairs (B * N * M),
    when no block size was given and ``SROT_TRITON_AUTOTUNE`` is not '0'."""
    return (x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1" and pairs >= _TUNE_MIN_PAIRS
            and not any(fixed) and os.environ.get("SROT_TRITON_AUTOTUNE", "1") != "0")


def _size_key(b: int, n: int, m: int) -> int:
    """Autotuning bucket: problems within a factor 2 in each of B, N and M share a tuned config."""
    return (b.bit_length() * 64 + n.bit_length()) * 64 + m.bit_length()


def tuned_configs() -> dict:
    """{kernel: {tuning key: chosen config}} of the launches autotuned so far in this process."""
    return {name: {str(k): str(c) for k, c in kern.cache.items()} for name, kern in _TUNED.items()}


# ---------------------------------------------------------------------------------------- launchers
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


def _check(x, y, h=None, p=1):
    """Argument checks of every launcher; returns whether the operands are batched (see _common.check_operands)."""
    batched = check_operands(x, y, h, p, allow_empty=True, allow_batch=True) is not None  # empty: refused below
    if x.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"triton kernels take float32 or float64, got {x.dtype} (the primitives softmin, "
                        "weighted_mean, plan_argmax and max_cost also take float16 / bfloat16)")
    for name, t in (("y", y), ("h", h)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise ValueError(f"{name} must have x's dtype and device ({x.dtype}, {x.device})")
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError("triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before importing triton)")
    if x.shape[-2] == 0 or y.shape[-2] == 0:
        raise ValueError("empty point cloud")
    return batched


def _lead(*ts):
    """Add the leading batch dimension of size 1 to each tensor (None passes)."""
    return tuple(None if t is None else t.unsqueeze(0) for t in ts)


def _rows(t):
    """``t`` detached, with its last dimension contiguous (other strides kept: a view is not copied)."""
    t = t.detach()
    return t if t.stride(-1) == 1 else t.contiguous()


def _prm(x, eps):
    """[log2(e) / eps, eps ln 2] in x's dtype and device (a Python float would be specialised to float32).
    Filled on the device: ``torch.tensor(..., device='cuda')`` copies from pageable memory, which waits for
    the queued kernels (a host-device sync per launch)."""
    prm = torch.empty(2, dtype=x.dtype, device=x.device)
    prm[0].fill_(_LOG2E / eps)
    prm[1].fill_(eps * _LN2)
    return prm


def _h2(h):
    """(B, M) column log-weights in base 2 (-inf stays -inf), columns contiguous."""
    return _rows(h.detach() * _LOG2E)


def _use_dot(path: str, d: int, dtype: torch.dtype) -> bool:
    """tl.dot distances for float32 at D >= 32 ('auto') or when asked; never for float64: float64 tl.dot
    failed to compile with Triton 3.6 on sm_90, so float64 always takes the exact difference form."""
    if path not in ("auto", "small", "dot"):
        raise ValueError(f"path must be 'auto', 'small' or 'dot', got {path!r}")
    if dtype == torch.float64:
        if path == "dot":
            raise ValueError("path='dot' is float32 only (float64 uses the exact difference form)")
        return False
    return path == "dot" or (path == "auto" and d >= _DOT_MIN_D)


_PRECISIONS = ("ieee", "tf32x3")


def _precision(precision) -> str:
    """tl.dot input precision of the large-d path: ``precision`` if given, else the environment variable
    ``SROT_TRITON_DOT_PRECISION``, else "ieee" (checked at every launch, small-d ones included, so that a
    wrong value shows at once). "ieee": fp32 FMA; "tf32x3": each fp32 operand split into a
    TF32 high part and a TF32 low part, three tensor-core products (hi.hi + hi.lo + lo.hi) with fp32
    accumulation, fp32-accurate (plain TF32 is never used)."""
    name = "precision"
    if precision is None:
        precision, name = os.environ.get("SROT_TRITON_DOT_PRECISION", "ieee"), "SROT_TRITON_DOT_PRECISION"
    if precision not in _PRECISIONS:
        raise ValueError(f"{name} must be one of {_PRECISIONS}, got {precision!r}")
    return precision


def _operands(x, y, dot: bool):
    """Detached (x, y, xx, yy, coinc, centre) of a batched (B, N, D), (B, M, D) launch. Large-d path: each
    problem's two clouds are centred on their common mean (distances are unchanged, the cancellation in
    |x|^2 + |y|^2 - 2 x.y shrinks) and the squared norms computed once ((B, N) and (B, M), contiguous);
    ``coinc`` = 2 sqrt(D) * machine epsilon, above the relative rounding noise of that cancellation (~2 u
    at D = 300..12288 on CPU; sqrt(D / BLOCK_K) u for sequential chunks), so exactly coincident points get
    distance 0 (the p = 1 kink). Small-d path: the points as given when their coordinates are contiguous
    (no copy), ``xx``/``yy`` unused placeholders (x itself)."""
    x, y = _rows(x), _rows(y)
    if not dot:
        return x, y, x, x, 0.0, None
    n, m = x.shape[-2], y.shape[-2]
    centre = (x.sum(-2, keepdim=True) + y.sum(-2, keepdim=True)) / (n + m)  # (B, 1, D)
    xc, yc = (x - centre).contiguous(), (y - centre).contiguous()
    coinc = 2.0 * math.sqrt(x.shape[-1]) * torch.finfo(x.dtype).eps
    return xc, yc, (xc * xc).sum(-1), (yc * yc).sum(-1), coinc, centre


def _grid(n, nb):
    """Launch grid: cdiv(N, BLOCK_N) row blocks for each of the ``nb`` problems (``meta``: the block sizes)."""
    return lambda meta: (triton.cdiv(n, meta["BLOCK_N"]) * nb,)


def softmin_fwd(x, y, h, eps, p, *, path="auto", block_n=None, block_m=None, block_k=None, num_warps=None,
                trans=None, precision=None):
    """Launcher of :func:`softmin`: x (N, D) or (B, N, D) -> (N,) or (B, N), one launch for the batch.
    ``path``: 'small' (coordinate loop), 'dot' (tl.dot, fp32-exact) or 'auto' ('dot' for D >= 32);
    ``precision``: the dot path's tl.dot precision (:func:`_precision`). Block sizes are powers of two
    (>= 16 on the dot path); ``trans`` picks the small-d tile orientation. On a GPU from ``_TUNE_MIN_PAIRS``
    pairs (B * N * M) with no block size given, the blocks are autotuned (``_CFG_DOT`` / ``_CFG_SMALL``);
    otherwise defaults 32 x 64 (small), 64 x 64 x 32 (dot), 4 warps."""
    batched = _check(x, y, h, p)
    if not batched:
        return softmin_fwd(*_lead(x, y, h), eps, p, path=path, block_n=block_n, block_m=block_m,
                           block_k=block_k, num_warps=num_warps, trans=trans, precision=precision)[0]
    nb, n, d = x.shape
    m = y.shape[1]
    dot = _use_dot(path, d, x.dtype)
    prec = _precision(precision)
    out = torch.empty(nb, n, dtype=x.dtype, device=x.device)
    if nb == 0:
        return out
    h2 = _h2(h)
    tune = _tune(x, nb * n * m, (block_n, block_m, block_k, num_warps, trans))
    if not dot:  # coordinate-major views (B, D, N) with contiguous rows: contiguous loads along rows and columns
        xt, yt = _rows(x.detach().transpose(-1, -2)), _rows(y.detach().transpose(-1, -2))
        args = (xt, yt, h2, _prm(x, eps), out, n, m, xt.stride(0), xt.stride(1), yt.stride(0), yt.stride(1),
                h2.stride(0), _size_key(nb, n, m))
        if tune:
            _TUNED["softmin_small"][_grid(n, nb)](*args, D=d, P=p)
        else:
            block_n = block_n or 32
            _softmin_small_kernel[(triton.cdiv(n, block_n) * nb,)](
                *args, D=d, P=p, TRANS=bool(trans), BLOCK_N=block_n, BLOCK_M=block_m or 64, num_warps=num_warps or 4)
        return out
    x, y, xx, yy, coinc, _ = _operands(x, y, dot)
    args = (x, y, xx, yy, h2, _prm(x, eps), out, n, m, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
            h2.stride(0), coinc, _size_key(nb, n, m))
    if tune:
        _TUNED["softmin_dot"][_grid(n, nb)](*args, D=d, P=p, DOT=True, FOLD=p == 2, PREC=prec)
        return out
    block_n = block_n or 64
    _softmin_fwd_kernel[(triton.cdiv(n, block_n) * nb,)](
        *args, D=d, P=p, DOT=True, FOLD=p == 2, PREC=prec, BLOCK_N=block_n, BLOCK_M=block_m or 64,
        BLOCK_K=block_k or 32, num_warps=num_warps or 4,
    )
    return out


def weighted_mean_fwd(x, y, h, eps, p, phi="y", *, path="auto", block_n=None, block_m=None, block_k=None,
                      num_warps=None, precision=None):
    """Launcher of :func:`weighted_mean`: x (N, D) or (B, N, D) -> (N, D) or (B, N, D). Paths: 'small'
    (D <= 64): one streaming pass, products summed by broadcasting; 'dot' (float32 only; 'auto' takes it
    for 32 <= D): for D <= 128 one streaming pass with both x.y^T and w @ y by tl.dot, for D > 128 a softmin
    pass for the row normalisers then a pass adding tl.dot(w, y) into the (B, N, D) output. float64 above
    D = 64: the two passes with exact differences and register sums. One launch per pass for the whole batch.
    ``precision`` as :func:`softmin_fwd`. Autotuned on a GPU as :func:`softmin_fwd` (one-pass kernels);
    defaults 16 x 32 (small), 64 x 64 (dot, one pass), 64 x 64 x 32 (two passes)."""
    batched = _check(x, y, h, p)
    if phi not in ("y", "grad"):
        raise ValueError(f"phi must be 'y' or 'grad', got {phi!r}")
    if not batched:
        return weighted_mean_fwd(*_lead(x, y, h), eps, p, phi, path=path, block_n=block_n, block_m=block_m,
                                 block_k=block_k, num_warps=num_warps, precision=precision)[0]
    nb, n, d = x.shape
    m = y.shape[1]
    dot = _use_dot(path, d, x.dtype)  # also the argument check: path='dot' is float32 only
    prec = _precision(precision)
    if path == "small" and d > _MAX_D_WMEAN:
        raise ValueError(f"the small-d weighted_mean path takes D <= {_MAX_D_WMEAN} (got {d}); use path='dot'")
    if nb == 0:
        return torch.empty(0, n, d, dtype=x.dtype, device=x.device)
    unit = phi == "grad" and p == 1
    fixed = (block_n, block_m, block_k, num_warps)
    x0 = x
    h2 = _h2(h)
    if dot and d <= _MAX_D_WMEAN_DOT:  # float32, one pass, tl.dot
        x, y, xx, yy, coinc, centre = _operands(x, y, True)
        out = torch.empty(nb, n, d, dtype=x.dtype, device=x.device)
        args = (x, y, xx, yy, h2, _prm(x, eps), out, n, m, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
                h2.stride(0), coinc, _size_key(nb, n, m))
        const = dict(D=d, P=p, UNIT=unit, PREC=prec, BLOCK_D=max(16, triton.next_power_of_2(d)))
        if _tune(x, nb * n * m, fixed):
            _TUNED["wmean_dot"][_grid(n, nb)](*args, **const)
        else:
            block_n = block_n or 64
            _weighted_mean_dot_kernel[(triton.cdiv(n, block_n) * nb,)](
                *args, **const, BLOCK_N=block_n, BLOCK_M=block_m or 64, num_warps=num_warps or 4)
        if not unit and centre is not None:  # mean of the centred y_j: undo the centring
            out += centre
    elif dot or d > _MAX_D_WMEAN:  # two passes: float32 tl.dot, or float64 exact differences and broadcast sums
        block_n, block_m = block_n or (64 if dot else 16), block_m or (64 if dot else 16)
        block_k = block_k or (32 if dot else 16)
        lse2 = softmin_fwd(x, y, h, eps, p, path="dot" if dot else "small", block_n=block_n, block_m=block_m,
                           block_k=block_k, num_warps=num_warps, precision=prec) / -(eps * _LN2)
        x, y, xx, yy, coinc, centre = _operands(x, y, dot)
        acc = torch.zeros(nb, n, d, dtype=x.dtype, device=x.device)
        wsum = torch.empty(nb, n, dtype=x.dtype, device=x.device)
        _weighted_sum_dot_kernel[(triton.cdiv(n, block_n) * nb,)](
            x, y, xx, yy, h2, lse2.contiguous(), _prm(x, eps), acc, wsum, n, m, x.stride(0), x.stride(1),
            y.stride(0), y.stride(1), h2.stride(0), coinc, D=d, P=p, UNIT=unit, BLOCK_N=block_n, BLOCK_M=block_m,
            BLOCK_K=block_k, DOT=dot, PREC=prec, num_warps=num_warps or 4,
        )
        if unit:  # sum_j w'_ij (x_i - y_j) = x_i sum_j w'_ij - sum_j w'_ij y_j (centring cancels)
            out = x * wsum[..., None] - acc
        elif centre is not None:  # mean of y_j: undo the centring (the weights sum to wsum = 1 up to rounding)
            out = acc + centre * wsum[..., None]
        else:
            out = acc
    else:  # small path, one pass
        x, y = _rows(x), _rows(y)
        out = torch.empty(nb, n, d, dtype=x.dtype, device=x.device)
        args = (x, y, h2, _prm(x, eps), out, n, m, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
                h2.stride(0), _size_key(nb, n, m))
        const = dict(D=d, P=p, UNIT=unit, BLOCK_D=max(2, triton.next_power_of_2(d)))
        if _tune(x, nb * n * m, fixed):
            _TUNED["wmean_small"][_grid(n, nb)](*args, **const)
        else:
            block_n = block_n or 16
            _weighted_mean_fwd_kernel[(triton.cdiv(n, block_n) * nb,)](
                *args, **const, BLOCK_N=block_n, BLOCK_M=block_m or 32, num_warps=num_warps or 4)
    if phi == "grad" and p == 2:
        out = x0.detach() - out
    return out


def plan_argmax_fwd(x, y, h, eps, p, *, path="auto", block_n=None, block_m=None, block_k=None, num_warps=None,
                    precision=None):
    """Launcher of :func:`plan_argmax`: x (N, D) or (B, N, D) -> int64 (N,) or (B, N) (paths and default
    block sizes as :func:`softmin_fwd`; not tuned)."""
    batched = _check(x, y, h, p)
    if not batched:
        return plan_argmax_fwd(*_lead(x, y, h), eps, p, path=path, block_n=block_n, block_m=block_m,
                               block_k=block_k, num_warps=num_warps, precision=precision)[0]
    nb, n, d = x.shape
    m = y.shape[1]
    dot = _use_dot(path, d, x.dtype)
    prec = _precision(precision)
    out = torch.empty(nb, n, dtype=torch.int64, device=x.device)
    if nb == 0:
        return out
    block_n = block_n or (64 if dot else 32)
    h2 = _h2(h)
    x, y, xx, yy, coinc, _ = _operands(x, y, dot)
    _plan_argmax_fwd_kernel[(triton.cdiv(n, block_n) * nb,)](
        x, y, xx, yy, h2, _prm(x, eps), out, n, m, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
        h2.stride(0), coinc, D=d, P=p, DOT=dot, PREC=prec, BLOCK_N=block_n, BLOCK_M=block_m or 64,
        BLOCK_K=block_k or 32, num_warps=num_warps or 4,
    )
    return out


def max_sq_fwd(x, y, *, path="auto", block_n=None, block_m=None, block_k=None, num_warps=None, precision=None):
    """(N,) or (B, N) max_j |x_i - y_j|^2 (launcher behind :func:`max_cost`; paths as :func:`softmin_fwd`;
    not tuned)."""
    batched = _check(x, y)
    if not batched:
        return max_sq_fwd(*_lead(x, y), path=path, block_n=block_n, block_m=block_m, block_k=block_k,
                          num_warps=num_warps, precision=precision)[0]
    nb, n, d = x.shape
    m = y.shape[1]
    dot = _use_dot(path, d, x.dtype)
    prec = _precision(precision)
    out = torch.empty(nb, n, dtype=x.dtype, device=x.device)
    if nb == 0:
        return out
    block_n = block_n or (64 if dot else 32)
    x, y, xx, yy, coinc, _ = _operands(x, y, dot)
    _max_sq_fwd_kernel[(triton.cdiv(n, block_n) * nb,)](
        x, y, xx, yy, out, n, m, x.stride(0), x.stride(1), y.stride(0), y.stride(1), coinc,
        D=d, DOT=dot, PREC=prec, BLOCK_N=block_n, BLOCK_M=block_m or 64, BLOCK_K=block_k or 32,
        num_warps=num_warps or 4,
    )
    return out


# ---------------------------------------------------------------------------------------- primitives
_LOW = (torch.float16, torch.bfloat16)  # upcast to float32 by the primitives (not by the *_fwd launchers)


def _upcast(*ts):
    return tuple(t.float() if t is not None and t.dtype in _LOW else t for t in ts)


def softmin(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int) -> torch.Tensor:
    r"""(N,) or (B, N) soft-min ``out_i = -eps * log sum_j exp(h_j - C(x_i, y_j) / eps)``; ``+inf`` if all
    ``h = -inf``.

    Example:
        >>> x, y = torch.randn(1000, 2, device="cuda"), torch.randn(800, 2, device="cuda")
        >>> h = torch.zeros(800, device="cuda")
        >>> softmin(x, y, h, 0.01, 2).shape  # doctest: +SKIP
        torch.Size([1000])
    """
    return softmin_fwd(*_upcast(x, y, h), eps, p)


def weighted_mean(
    x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int, phi: str = "y"
) -> torch.Tensor:
    r"""(N, D) or (B, N, D) mean of phi(x_i, y_j) under w_ij = softmax_j(h_j - C_ij / eps); any D (two
    passes for D > 64).

    ``phi="y"``: y_j. ``phi="grad"``: (x_i - y_j) / |x_i - y_j| for p = 1 (0 where x_i = y_j),
    x_i - y_j for p = 2 (computed as x_i - mean of y_j).
    """
    return weighted_mean_fwd(*_upcast(x, y, h), eps, p, phi)


def plan_argmax(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int) -> torch.Tensor:
    """(N,) or (B, N) int64 index of the largest plan entry per row, argmax_j (h_j - C_ij / eps), first on
    ties."""
    return plan_argmax_fwd(*_upcast(x, y, h), eps, p)


def max_cost(x: torch.Tensor, y: torch.Tensor, p: int) -> torch.Tensor:
    """() largest ground cost max_ij C(x_i, y_j) (0-dim tensor of x's dtype), or (B,) one per problem."""
    if p not in (1, 2):
        raise ValueError(f"p must be 1 or 2, got {p}")
    s = max_sq_fwd(*_upcast(x, y)).amax(dim=-1)
    return s.sqrt() if p == 1 else s / 2
