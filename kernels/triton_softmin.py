r"""Triton backend of the kernel primitives (SPEC §4): streaming (online log-sum-exp) kernels over
column tiles, O((N + M) * D) memory.

Same functions and signatures as :mod:`srot_fast.kernels.tensorized`:

- ``softmin(x, y, h, eps, p)``             -> (N,)    out_i = -eps * LSE_j[h_j - C(x_i, y_j) / eps]
- ``weighted_mean(x, y, h, eps, p, phi)``  -> (N, D)  sum_j softmax_j(h_j - C_ij / eps) * phi(x_i, y_j)
- ``plan_argmax(x, y, h, eps, p)``         -> (N,)    int64, argmax_j (h_j - C_ij / eps)
- ``max_cost(x, y, p)``                    -> ()      max_ij C(x_i, y_j)

with C = |x - y| (p = 1) or |x - y|^2 / 2 (p = 2). Layers (STYLE §12.2): ``_*_kernel`` (``@triton.jit``)
-> ``*_fwd`` launchers (checks, path, block sizes, grid, allocation; keyword arguments) -> the four
primitives above. One program owns ``BLOCK_N`` rows and streams the columns in tiles of ``BLOCK_M``
with a running max / rescaled sum per row. Two ways to form a tile of squared distances:

- *small-d path* (D < 32, and every D in float64): exact difference form, one coordinate at a time;
- *large-d path* (float32, D >= 32, any D; tested up to 300 here, meant for up to 12288 = 64 x 64 x 3 images):
  |x|^2 + |y|^2 - 2 x.y with the cross term from ``tl.dot`` over chunks of ``BLOCK_K`` coordinates at
  full fp32 accuracy (``input_precision="ieee"``: no TF32, whose 10-bit mantissa gives ~5e-5 relative
  error on squared distances at D = 300 against ~2e-7 for fp32). Both clouds are centred on their
  common mean first; pairs closer than the rounding noise (relative 2 sqrt(D) u) count as coincident.

``weighted_mean`` for D <= 64 is one streaming pass with a (BLOCK_N, D) register accumulator; for
D > 64 it is two passes: the softmin gives each row's normaliser, then a second kernel adds
``w @ y_tile`` chunk by chunk into the program's own rows of the (N, D) output (``tl.dot`` in float32,
broadcast products summed in registers in float64).
``eps`` travels as a tensor of the input dtype (a Python float would be specialised to float32).

Supported: float32 and float64, any D for every primitive.

Tested (tests/test_kernels.py, tests/test_backends.py) under the CPU interpreter (``TRITON_INTERPRET=1``,
triton 3.9, torch 2.13 CPU) against the torch reference, 37 x 53 points (several tiles with small blocks)
with coincident pairs and ``-inf`` columns, p in {1, 2}, float32 and float64: small-d path at D in
{1, 2, 3} (+ D = 64), large-d path at D in {3, 37, 64, 300} (forced with ``path="dot"`` at small D), tiny
/ huge eps, log-weights shifted by up to 1e6; Sinkhorn and SROTLoss end to end. The interpreter
computes ``tl.dot`` with numpy in the input dtype, so it cannot show TF32: the GPU-only test
``test_triton_dot_path_is_fp32_accurate`` can (run by benchmarks/gpu_suite.py).

GPU: one run on an H200 (Triton 3.6, torch 2.11+cu130, 2026-11-26, benchmarks/results/2026-11-26-h200):
84 of the 96 GPU/Triton tests passed; the 11 that forced float64 through ``tl.dot`` failed to compile
(hence float64 never takes that path since; the change itself has not run on a GPU) and one float32
d = 64 SROTLoss comparison missed its tolerance; the large-d path's float32 distances were within
1.6e-7 relative of float64 at D = 64 / 3072 / 12288.

Caution:
    - Block sizes and ``num_warps`` are untuned guesses. On the H200 at n = m = 8192 the softmin ran at
      6.5e10 pairs/s at D = 64 (dense torch formula: 3.8e10) but 3.6x / 4.1x slower than the dense torch
      formula (cuBLAS matmul) at D = 3072 / 12288 (benchmarks/README.md).
    - Large-d path: distances below the rounding noise of |x|^2 + |y|^2 - 2 x.y (relative 2 sqrt(D) u,
      e.g. 2.6e-5 of |x - c|^2 + |y - c|^2 at D = 12288 in float32) are set to 0.
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
]

_MAX_D_WMEAN = 64  # largest D of the one-pass (small-d) weighted_mean
_DOT_MIN_D = 32  # D from which 'auto' forms distances with tl.dot (large-d path)


# ------------------------------------------------------------------------------------------ kernels
@triton.jit
def _sq_dist_tile(
    x_ptr,  # (N, D) row points, row-major
    y_ptr,  # (M, D) column points, row-major
    rows,  # (BLOCK_N,) row indices of this program
    rmask,  # (BLOCK_N,) rows < N
    cols,  # (BLOCK_M,) column indices of this tile
    cmask,  # (BLOCK_M,) cols < M
    D,  # number of coordinates
    stride_x,  # elements between two rows of x
    stride_y,  # elements between two rows of y
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """(BLOCK_N, BLOCK_M) squared distances, one coordinate at a time (small-d path)."""
    sq = tl.zeros((BLOCK_N, BLOCK_M), dtype=x_ptr.dtype.element_ty)
    for k in range(0, D):
        xk = tl.load(x_ptr + rows * stride_x + k, mask=rmask, other=0.0)
        yk = tl.load(y_ptr + cols * stride_y + k, mask=cmask, other=0.0)
        diff = xk[:, None] - yk[None, :]
        sq += diff * diff
    return sq


@triton.jit
def _sq_dist_dot_tile(
    x_ptr,  # (N, D) row points (centred by the launcher), row-major
    y_ptr,  # (M, D) column points (same centring), row-major
    xx_ptr,  # (N,) |x_i|^2
    yy_ptr,  # (M,) |y_j|^2
    rows,  # (BLOCK_N,) row indices of this program
    rmask,  # (BLOCK_N,) rows < N
    cols,  # (BLOCK_M,) column indices of this tile
    cmask,  # (BLOCK_M,) cols < M
    D,  # number of coordinates
    stride_x,  # elements between two rows of x
    stride_y,  # elements between two rows of y
    coinc,  # relative threshold: |x - y|^2 <= coinc * (|x|^2 + |y|^2) counts as 0 (rounding noise)
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,  # coordinates per tl.dot step (>= 16)
):
    """(BLOCK_N, BLOCK_M) squared distances |x|^2 + |y|^2 - 2 x.y, the cross term by tl.dot over chunks
    of BLOCK_K coordinates at full fp32 (or fp64) accuracy: input_precision="ieee", never TF32 (large-d path)."""
    xy = tl.zeros((BLOCK_N, BLOCK_M), dtype=x_ptr.dtype.element_ty)
    ks = tl.arange(0, BLOCK_K)
    for k0 in range(0, D, BLOCK_K):
        kk = k0 + ks
        kmask = kk < D
        x_t = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        y_t = tl.load(y_ptr + cols[:, None] * stride_y + kk[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)
        xy = tl.dot(x_t, tl.trans(y_t), xy, input_precision="ieee")
    xx = tl.load(xx_ptr + rows, mask=rmask, other=0.0)
    yy = tl.load(yy_ptr + cols, mask=cmask, other=0.0)
    nrm = xx[:, None] + yy[None, :]
    sq = nrm - 2.0 * xy
    return tl.where(sq > coinc * nrm, sq, 0.0)  # also clamps the negative rounding residue at 0


@triton.jit
def _sq_tile(
    x_ptr, y_ptr, xx_ptr, yy_ptr, rows, rmask, cols, cmask, D, stride_x, stride_y, coinc,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
):
    """Squared distances of one tile by the large-d (``DOT``) or the small-d path."""
    if DOT:
        sq = _sq_dist_dot_tile(x_ptr, y_ptr, xx_ptr, yy_ptr, rows, rmask, cols, cmask, D, stride_x, stride_y,
                               coinc, BLOCK_N, BLOCK_M, BLOCK_K)
    else:
        sq = _sq_dist_tile(x_ptr, y_ptr, rows, rmask, cols, cmask, D, stride_x, stride_y, BLOCK_N, BLOCK_M)
    return sq


@triton.jit
def _logits_tile(sq, h_ptr, cols, cmask, inv_eps, P: tl.constexpr):
    """(BLOCK_N, BLOCK_M) logits h_j - C_ij / eps; -inf on padding columns."""
    if P == 1:
        c = tl.sqrt(sq)
    else:
        c = 0.5 * sq
    h = tl.load(h_ptr + cols, mask=cmask, other=float("-inf"))
    return h[None, :] - c * inv_eps


@triton.jit
def _softmin_fwd_kernel(
    x_ptr,  # (N, D) row points
    y_ptr,  # (M, D) column points
    xx_ptr,  # (N,) |x_i|^2 (large-d path only; unused otherwise)
    yy_ptr,  # (M,) |y_j|^2 (large-d path only)
    h_ptr,  # (M,) column log-weights, may hold -inf
    prm_ptr,  # (2,) [1 / eps, eps] in the input dtype
    out_ptr,  # (N,) output: -eps * LSE_j[h_j - C_ij / eps]
    N,
    M,
    D,
    stride_x,
    stride_y,
    coinc,  # large-d path: relative |x - y|^2 below which a pair counts as coincident
    P: tl.constexpr,  # cost exponent, 1 or 2
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT: tl.constexpr,  # True: large-d path (tl.dot cross term); False: small-d path
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    inv_eps = tl.load(prm_ptr)
    eps = tl.load(prm_ptr + 1)
    m_i = tl.full((BLOCK_N,), float("-inf"), dtype=x_ptr.dtype.element_ty)  # running max
    s_i = tl.zeros((BLOCK_N,), dtype=x_ptr.dtype.element_ty)  # running sum of exp(l - m_i)
    for j0 in range(0, M, BLOCK_M):
        cols = j0 + tl.arange(0, BLOCK_M)
        cmask = cols < M
        sq = _sq_tile(x_ptr, y_ptr, xx_ptr, yy_ptr, rows, rmask, cols, cmask, D, stride_x, stride_y, coinc,
                      BLOCK_N, BLOCK_M, BLOCK_K, DOT)
        logit = _logits_tile(sq, h_ptr, cols, cmask, inv_eps, P)
        m_new = tl.maximum(m_i, tl.max(logit, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: keep exp(-inf) = 0
        s_i = s_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(logit - m_safe[:, None]), 1)
        m_i = m_new
    out = tl.where(s_i > 0, -eps * (m_i + tl.log(tl.where(s_i > 0, s_i, 1.0))), float("inf"))
    tl.store(out_ptr + rows, out, mask=rmask)


@triton.jit
def _weighted_mean_fwd_kernel(
    x_ptr,  # (N, D) row points
    y_ptr,  # (M, D) column points
    h_ptr,  # (M,) column log-weights, may hold -inf
    prm_ptr,  # (2,) [1 / eps, eps]
    out_ptr,  # (N, D) output, row-major
    N,
    M,
    D,
    stride_x,
    stride_y,
    P: tl.constexpr,
    UNIT: tl.constexpr,  # True: phi = (x - y) / |x - y| (0 at x = y); False: phi = y
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,  # power of two >= D
):
    """Small-d weighted mean (D <= 64): one pass, running max and rescaled (BLOCK_N, BLOCK_D) accumulator."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < D
    inv_eps = tl.load(prm_ptr)
    x_t = tl.load(
        x_ptr + rows[:, None] * stride_x + dims[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0
    )  # (BLOCK_N, BLOCK_D)
    m_i = tl.full((BLOCK_N,), float("-inf"), dtype=x_ptr.dtype.element_ty)
    s_i = tl.zeros((BLOCK_N,), dtype=x_ptr.dtype.element_ty)
    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=x_ptr.dtype.element_ty)  # running sum of w_ij phi_ij
    for j0 in range(0, M, BLOCK_M):
        cols = j0 + tl.arange(0, BLOCK_M)
        cmask = cols < M
        sq = _sq_dist_tile(x_ptr, y_ptr, rows, rmask, cols, cmask, D, stride_x, stride_y, BLOCK_N, BLOCK_M)
        logit = _logits_tile(sq, h_ptr, cols, cmask, inv_eps, P)
        m_new = tl.maximum(m_i, tl.max(logit, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        w = tl.exp(logit - m_safe[:, None])  # (BLOCK_N, BLOCK_M)
        s_i = s_i * alpha + tl.sum(w, 1)
        y_t = tl.load(
            y_ptr + cols[:, None] * stride_y + dims[None, :], mask=cmask[:, None] & dmask[None, :], other=0.0
        )  # (BLOCK_M, BLOCK_D)
        if UNIT:
            w = tl.where(sq > 0, w / tl.sqrt(tl.where(sq > 0, sq, 1.0)), 0.0)
            contrib = tl.sum(w[:, :, None] * (x_t[:, None, :] - y_t[None, :, :]), 1)
        else:
            contrib = tl.sum(w[:, :, None] * y_t[None, :, :], 1)
        acc = acc * alpha[:, None] + contrib
        m_i = m_new
    out = acc / s_i[:, None]
    tl.store(out_ptr + rows[:, None] * D + dims[None, :], out, mask=rmask[:, None] & dmask[None, :])


@triton.jit
def _weighted_sum_dot_kernel(
    x_ptr,  # (N, D) row points (centred)
    y_ptr,  # (M, D) column points (centred)
    xx_ptr,  # (N,) |x_i|^2
    yy_ptr,  # (M,) |y_j|^2
    h_ptr,  # (M,) column log-weights, may hold -inf
    lse_ptr,  # (N,) LSE_j[h_j - C_ij / eps] from a first (softmin) pass: normalises the weights
    prm_ptr,  # (2,) [1 / eps, eps]
    acc_ptr,  # (N, D) output, zero-initialised: sum_j w'_ij y_j, row-major
    wsum_ptr,  # (N,) output: sum_j w'_ij
    N,
    M,
    D,
    stride_x,
    stride_y,
    coinc,
    P: tl.constexpr,
    UNIT: tl.constexpr,  # True: w'_ij = w_ij / |x_i - y_j| (0 at x = y); False: w'_ij = w_ij
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT: tl.constexpr,  # True (float32): tl.dot; False (float64): broadcast products summed over the tile
):
    """Large-d weighted sum, second pass: with w_ij = exp(h_j - C_ij / eps - lse_i) already normalised,
    each column tile adds w' @ y_tile into the program's own rows of ``acc`` chunk by chunk of BLOCK_K
    coordinates (read-modify-write in global memory: no (BLOCK_N, D) register accumulator)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    inv_eps = tl.load(prm_ptr)
    lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)
    wsum = tl.zeros((BLOCK_N,), dtype=x_ptr.dtype.element_ty)
    ks = tl.arange(0, BLOCK_K)
    for j0 in range(0, M, BLOCK_M):
        cols = j0 + tl.arange(0, BLOCK_M)
        cmask = cols < M
        sq = _sq_tile(x_ptr, y_ptr, xx_ptr, yy_ptr, rows, rmask, cols, cmask, D, stride_x, stride_y, coinc,
                      BLOCK_N, BLOCK_M, BLOCK_K, DOT)
        logit = _logits_tile(sq, h_ptr, cols, cmask, inv_eps, P)
        w = tl.exp(logit - lse[:, None])  # (BLOCK_N, BLOCK_M), rows sum to 1 over all tiles
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
                acc = tl.dot(w.to(y_t.dtype), y_t, acc, input_precision="ieee")
            else:
                acc += tl.sum(w[:, :, None] * y_t[None, :, :], 1)
            tl.store(a_ptrs, acc, mask=amask)
    tl.store(wsum_ptr + rows, wsum, mask=rmask)


@triton.jit
def _plan_argmax_fwd_kernel(
    x_ptr,  # (N, D) row points
    y_ptr,  # (M, D) column points
    xx_ptr,  # (N,) |x_i|^2 (large-d path only)
    yy_ptr,  # (M,) |y_j|^2 (large-d path only)
    h_ptr,  # (M,) column log-weights
    prm_ptr,  # (2,) [1 / eps, eps]
    out_ptr,  # (N,) int64 output
    N,
    M,
    D,
    stride_x,
    stride_y,
    coinc,
    P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    inv_eps = tl.load(prm_ptr)
    best = tl.full((BLOCK_N,), float("-inf"), dtype=x_ptr.dtype.element_ty)
    arg = tl.zeros((BLOCK_N,), dtype=tl.int64)
    for j0 in range(0, M, BLOCK_M):
        cols = j0 + tl.arange(0, BLOCK_M)
        cmask = cols < M
        sq = _sq_tile(x_ptr, y_ptr, xx_ptr, yy_ptr, rows, rmask, cols, cmask, D, stride_x, stride_y, coinc,
                      BLOCK_N, BLOCK_M, BLOCK_K, DOT)
        logit = _logits_tile(sq, h_ptr, cols, cmask, inv_eps, P)
        t_max = tl.max(logit, 1)
        t_arg = tl.argmax(logit, 1, tie_break_left=True).to(tl.int64) + j0
        upd = t_max > best  # strict: the first maximal index wins, as torch.argmax
        arg = tl.where(upd, t_arg, arg)
        best = tl.where(upd, t_max, best)
    tl.store(out_ptr + rows, arg, mask=rmask)


@triton.jit
def _max_sq_fwd_kernel(
    x_ptr,  # (N, D) row points
    y_ptr,  # (M, D) column points
    xx_ptr,  # (N,) |x_i|^2 (large-d path only)
    yy_ptr,  # (M,) |y_j|^2 (large-d path only)
    out_ptr,  # (N,) output: max_j |x_i - y_j|^2
    N,
    M,
    D,
    stride_x,
    stride_y,
    coinc,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    best = tl.zeros((BLOCK_N,), dtype=x_ptr.dtype.element_ty)
    for j0 in range(0, M, BLOCK_M):
        cols = j0 + tl.arange(0, BLOCK_M)
        cmask = cols < M
        sq = _sq_tile(x_ptr, y_ptr, xx_ptr, yy_ptr, rows, rmask, cols, cmask, D, stride_x, stride_y, coinc,
                      BLOCK_N, BLOCK_M, BLOCK_K, DOT)
        best = tl.maximum(best, tl.max(tl.where(cmask[None, :], sq, 0.0), 1))
    tl.store(out_ptr + rows, best, mask=rmask)


# ---------------------------------------------------------------------------------------- launchers
def _check(x, y, h=None, p=1):
    check_operands(x, y, h, p, allow_empty=True)  # empty clouds: refused below, after the dtype checks
    if x.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"triton kernels take float32 or float64, got {x.dtype}")
    for name, t in (("y", y), ("h", h)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise ValueError(f"{name} must have x's dtype and device ({x.dtype}, {x.device})")
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError("triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before importing triton)")
    if x.shape[0] == 0 or y.shape[0] == 0:
        raise ValueError("empty point cloud")


def _prm(x, eps):
    return torch.tensor([1.0 / eps, eps], dtype=x.dtype, device=x.device)


def _use_dot(path: str, d: int, dtype: torch.dtype) -> bool:
    """tl.dot distances for float32 at D >= 32 ('auto') or when asked; never for float64: on an H200
    (Triton 3.6) float64 tl.dot failed to compile, so float64 always takes the exact difference form."""
    if path not in ("auto", "small", "dot"):
        raise ValueError(f"path must be 'auto', 'small' or 'dot', got {path!r}")
    if dtype == torch.float64:
        if path == "dot":
            raise ValueError("path='dot' is float32 only (float64 uses the exact difference form)")
        return False
    return path == "dot" or (path == "auto" and d >= _DOT_MIN_D)


def _operands(x, y, dot: bool):
    """Contiguous detached (x, y, xx, yy, coinc, centre) for a launch. Large-d path: both clouds are centred
    on their common mean (distances are unchanged, the cancellation in |x|^2 + |y|^2 - 2 x.y shrinks) and
    the squared norms computed once; ``coinc`` = 2 sqrt(D) * machine epsilon, above the relative rounding
    noise of that cancellation (~2 u measured at D = 300..12288 on CPU; sqrt(D / BLOCK_K) u for sequential
    chunks), so exactly coincident points get distance 0 (the p = 1 kink). Small-d path: ``xx``/``yy``
    are unused placeholders (x itself)."""
    x, y = x.detach(), y.detach()
    if not dot:
        x, y = x.contiguous(), y.contiguous()
        return x, y, x, x, 0.0, None
    n, m = x.shape[0], y.shape[0]
    centre = (x.sum(0) + y.sum(0)) / (n + m)
    xc, yc = (x - centre).contiguous(), (y - centre).contiguous()
    coinc = 2.0 * math.sqrt(x.shape[1]) * torch.finfo(x.dtype).eps
    return xc, yc, (xc * xc).sum(1), (yc * yc).sum(1), coinc, centre


def softmin_fwd(x, y, h, eps, p, *, path="auto", block_n=None, block_m=None, block_k=32, num_warps=4):
    """Launcher of :func:`softmin`. ``path``: 'small' (coordinate loop), 'dot' (tl.dot, fp32-exact) or
    'auto' ('dot' for D >= 32). Block sizes are powers of two (>= 16 on the dot path); defaults
    32 x 64 (small), 64 x 64 x 32 (dot)."""
    _check(x, y, h, p)
    n, d = x.shape
    m = y.shape[0]
    dot = _use_dot(path, d, x.dtype)
    block_n = block_n or (64 if dot else 32)
    block_m = block_m or 64
    x, y, xx, yy, coinc, _ = _operands(x, y, dot)
    h = h.detach().contiguous()
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, block_n),)
    _softmin_fwd_kernel[grid](
        x, y, xx, yy, h, _prm(x, eps), out, n, m, d, x.stride(0), y.stride(0), coinc,
        P=p, BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_K=block_k, DOT=dot, num_warps=num_warps,
    )
    return out


def weighted_mean_fwd(x, y, h, eps, p, phi="y", *, path="auto", block_n=None, block_m=None, block_k=32,
                      num_warps=4):
    """Launcher of :func:`weighted_mean`. 'small' path (D <= 64): one streaming pass. 'dot' path (any D;
    'auto' takes it for D > 64): a softmin pass for the row normalisers, then a pass accumulating
    tl.dot(w, y) into the (N, D) output. Defaults 16 x 32 (small), 64 x 64 x 32 (dot)."""
    _check(x, y, h, p)
    if phi not in ("y", "grad"):
        raise ValueError(f"phi must be 'y' or 'grad', got {phi!r}")
    n, d = x.shape
    m = y.shape[0]
    _use_dot(path, d, x.dtype)  # argument check: path='dot' is float32 only
    if path == "auto":
        path = "dot" if d > _MAX_D_WMEAN else "small"
    if path == "small" and d > _MAX_D_WMEAN:
        raise ValueError(f"the small-d weighted_mean path takes D <= {_MAX_D_WMEAN} (got {d}); use path='dot'")
    unit = phi == "grad" and p == 1
    x0 = x
    if path == "dot":  # two passes; float32: tl.dot, float64: exact differences and broadcast sums
        dot = _use_dot("auto" if x.dtype == torch.float64 else "dot", d, x.dtype)
        block_n, block_m = block_n or (64 if dot else 16), block_m or (64 if dot else 16)
        block_k = block_k if dot else min(block_k, 16)
        lse = softmin_fwd(x, y, h, eps, p, path="dot" if dot else "small", block_n=block_n, block_m=block_m,
                          block_k=block_k, num_warps=num_warps) / -eps
        x, y, xx, yy, coinc, centre = _operands(x, y, dot)
        h = h.detach().contiguous()
        acc = torch.zeros(n, d, dtype=x.dtype, device=x.device)
        wsum = torch.empty(n, dtype=x.dtype, device=x.device)
        _weighted_sum_dot_kernel[(triton.cdiv(n, block_n),)](
            x, y, xx, yy, h, lse.contiguous(), _prm(x, eps), acc, wsum, n, m, d, x.stride(0), y.stride(0), coinc,
            P=p, UNIT=unit, BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_K=block_k, DOT=dot, num_warps=num_warps,
        )
        if unit:  # sum_j w'_ij (x_i - y_j) = x_i sum_j w'_ij - sum_j w'_ij y_j (centring cancels)
            out = x * wsum[:, None] - acc
        elif centre is not None:  # mean of y_j: undo the centring (the weights sum to wsum = 1 up to rounding)
            out = acc + centre * wsum[:, None]
        else:
            out = acc
    else:
        block_n, block_m = block_n or 16, block_m or 32
        x, y, h = x.detach().contiguous(), y.detach().contiguous(), h.detach().contiguous()
        out = torch.empty(n, d, dtype=x.dtype, device=x.device)
        _weighted_mean_fwd_kernel[(triton.cdiv(n, block_n),)](
            x, y, h, _prm(x, eps), out, n, m, d, x.stride(0), y.stride(0),
            P=p, UNIT=unit, BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_D=max(2, triton.next_power_of_2(d)),
            num_warps=num_warps,
        )
    if phi == "grad" and p == 2:
        out = x0.detach() - out
    return out


def plan_argmax_fwd(x, y, h, eps, p, *, path="auto", block_n=None, block_m=None, block_k=32, num_warps=4):
    """Launcher of :func:`plan_argmax` (paths and block sizes as :func:`softmin_fwd`)."""
    _check(x, y, h, p)
    n, d = x.shape
    m = y.shape[0]
    dot = _use_dot(path, d, x.dtype)
    block_n = block_n or (64 if dot else 32)
    block_m = block_m or 64
    x, y, xx, yy, coinc, _ = _operands(x, y, dot)
    h = h.detach().contiguous()
    out = torch.empty(n, dtype=torch.int64, device=x.device)
    _plan_argmax_fwd_kernel[(triton.cdiv(n, block_n),)](
        x, y, xx, yy, h, _prm(x, eps), out, n, m, d, x.stride(0), y.stride(0), coinc,
        P=p, BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_K=block_k, DOT=dot, num_warps=num_warps,
    )
    return out


def max_sq_fwd(x, y, *, path="auto", block_n=None, block_m=None, block_k=32, num_warps=4):
    """(N,) max_j |x_i - y_j|^2 (launcher behind :func:`max_cost`; paths as :func:`softmin_fwd`)."""
    _check(x, y)
    n, d = x.shape
    m = y.shape[0]
    dot = _use_dot(path, d, x.dtype)
    block_n = block_n or (64 if dot else 32)
    block_m = block_m or 64
    x, y, xx, yy, coinc, _ = _operands(x, y, dot)
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    _max_sq_fwd_kernel[(triton.cdiv(n, block_n),)](
        x, y, xx, yy, out, n, m, d, x.stride(0), y.stride(0), coinc,
        BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_K=block_k, DOT=dot, num_warps=num_warps,
    )
    return out


# ---------------------------------------------------------------------------------------- primitives
def softmin(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int) -> torch.Tensor:
    r"""(N,) soft-min ``out_i = -eps * log sum_j exp(h_j - C(x_i, y_j) / eps)``; ``+inf`` if all ``h = -inf``.

    Example:
        >>> x, y = torch.randn(1000, 2, device="cuda"), torch.randn(800, 2, device="cuda")
        >>> h = torch.zeros(800, device="cuda")
        >>> softmin(x, y, h, 0.01, 2).shape  # doctest: +SKIP
        torch.Size([1000])
    """
    return softmin_fwd(x, y, h, eps, p)


def weighted_mean(
    x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int, phi: str = "y"
) -> torch.Tensor:
    r"""(N, D) mean of phi(x_i, y_j) under w_ij = softmax_j(h_j - C_ij / eps); any D (two passes for D > 64).

    ``phi="y"``: y_j. ``phi="grad"``: (x_i - y_j) / |x_i - y_j| for p = 1 (0 where x_i = y_j),
    x_i - y_j for p = 2 (computed as x_i - mean of y_j).
    """
    return weighted_mean_fwd(x, y, h, eps, p, phi)


def plan_argmax(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int) -> torch.Tensor:
    """(N,) int64 index of the largest plan entry per row, argmax_j (h_j - C_ij / eps), first on ties."""
    return plan_argmax_fwd(x, y, h, eps, p)


def max_cost(x: torch.Tensor, y: torch.Tensor, p: int) -> torch.Tensor:
    """() largest ground cost max_ij C(x_i, y_j) (0-dim tensor of x's dtype)."""
    if p not in (1, 2):
        raise ValueError(f"p must be 1 or 2, got {p}")
    s = max_sq_fwd(x, y).max()
    return s.sqrt() if p == 1 else s / 2
