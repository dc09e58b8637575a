"""The ``@triton.jit`` kernels of the block-sparse Triton backend (:mod:`.blocksparse`): softmin, weighted mean
and plan argmax over the kept column blocks of each row block.

Points are sorted (Morton order) and cut into blocks of ``BLOCK`` consecutive points; the pruning gives, for
row block I of problem b, the kept column blocks ``cblk[offs[b nrb + I] : offs[b nrb + I + 1]]`` (CSR). One
program owns ``BLOCK_N`` rows of one row block (``BLOCK / BLOCK_N`` programs per row block) and streams the
columns of each kept column block in sub-tiles of ``BLOCK_M``, with the online log-sum-exp of the dense
kernels (base 2: the launcher passes h log2(e) and prm = [log2(e) / eps, eps ln 2]). Small-d difference form
(D <= 3); the accumulators are in the compute dtype (float32, or float64 for float64 points), the dtype of
``prm``. The soft-min and weighted-mean kernels read coordinate-major points (B, D, N) and reduce
(BLOCK_M, BLOCK_N) tiles over their columns (axis 0), so that with BLOCK_N = 32 x num_warps each thread owns one
row, as in the dense small-d soft-min; the plan arg-max kernel (one pass per solve) reads row-major points."""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import (
    _cost_scale,
    _logits_tile,
    _soa_lse_tile,
    _soa_wmean_start,
    _soa_wmean_tile,
    _sq_dist_tile,
    _store_coords,
    _tile_cols,
)


@triton.jit
def _bs_program(x_ptr, y_ptr, h_ptr, offs_ptr, N, M, nrb, D: tl.constexpr, BLOCK: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """This program's (problem b, (BLOCK_N,) int64 rows, rows < N, the pointers moved to problem b, and the
    range [k0, k1) of its row block in the CSR list). ``BLOCK / BLOCK_N`` programs share a row block."""
    pid = tl.program_id(0)
    per = BLOCK // BLOCK_N
    rb = pid // per  # b * nrb + I
    b = rb // nrb
    rows = ((rb - b * nrb) * BLOCK + (pid - rb * per) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    b = b.to(tl.int64)
    return (b, rows, rows < N, x_ptr + b * N * D, y_ptr + b * M * D, h_ptr + b * M, tl.load(offs_ptr + rb),
            tl.load(offs_ptr + rb + 1))


@triton.jit
def _bs_tile(x_ptr, y_ptr, h_ptr, cblk_ptr, k, t, rows, rmask, cscale, M, D: tl.constexpr, P: tl.constexpr,
             BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """Sub-tile ``t`` of the ``k``-th kept column block: (first column j0, (BLOCK_M,) int64 columns, cols < M,
    (BLOCK_N, BLOCK_M) squared distances and logits h_j - C_ij / eps in base 2)."""
    j0 = tl.load(cblk_ptr + k) * BLOCK + t * BLOCK_M
    cols = j0 + tl.arange(0, BLOCK_M).to(tl.int64)
    cmask = cols < M
    sq = _sq_dist_tile(x_ptr, y_ptr, rows, rmask, cols, cmask, D, D, D, BLOCK_N, BLOCK_M)
    return j0, cols, cmask, sq, _logits_tile(sq, h_ptr, cols, cmask, cscale, P)


@triton.jit
def _bs_softmin_kernel(
    xt_ptr,  # (B, D, N) sorted row points, coordinate-major, contiguous
    yt_ptr,  # (B, D, M) sorted column points, coordinate-major, contiguous
    h_ptr,  # (B, M) sorted column log-weights times log2(e), contiguous
    offs_ptr,  # (B nrb + 1,) int64 CSR offsets
    cblk_ptr,  # (K,) int64 kept column blocks
    prm_ptr,  # (2,) [log2(e) / eps, eps ln 2] in the compute dtype
    out_ptr,  # (B, N) output in the sorted row order: -eps * LSE_j[h_j - C_ij / eps]
    N, M, nrb,
    D: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    TRANS: tl.constexpr,  # True: (BLOCK_M, BLOCK_N) tiles reduced over axis 0, as the dense small-d kernel's
):
    """Coordinate-major points (contiguous loads along a block), the tile step of the dense small-d kernel."""
    # (B, D, N) and (B, N, D) put problem b at the same offset
    b, rows, rmask, xt_ptr, yt_ptr, h_ptr, k0, k1 = _bs_program(xt_ptr, yt_ptr, h_ptr, offs_ptr, N, M, nrb, D,
                                                                BLOCK, BLOCK_N)
    cscale = _cost_scale(prm_ptr, P)
    eps_ln2 = tl.load(prm_ptr + 1)
    m_i = tl.full((BLOCK_N,), float("-inf"), dtype=prm_ptr.dtype.element_ty)
    s_i = tl.zeros((BLOCK_N,), dtype=prm_ptr.dtype.element_ty)
    for k in range(k0, k1):
        j0 = tl.load(cblk_ptr + k) * BLOCK
        for t in tl.static_range(BLOCK // BLOCK_M):
            cols, cmask = _tile_cols(j0 + t * BLOCK_M, M, BLOCK_M)
            m_i, s_i = _soa_lse_tile(xt_ptr, yt_ptr, h_ptr, rows, rmask, cols, cmask, N, M, cscale, m_i, s_i, D, P,
                                     TRANS, BLOCK_N, BLOCK_M)
    out = tl.where(s_i > 0, -eps_ln2 * (m_i + tl.log2(tl.where(s_i > 0, s_i, 1.0))), float("inf"))
    tl.store(out_ptr + b * N + rows, out, mask=rmask)


@triton.jit
def _bs_wmean_kernel(
    xt_ptr, yt_ptr, h_ptr, offs_ptr, cblk_ptr, prm_ptr,  # as _bs_softmin_kernel (coordinate-major points)
    out_ptr,  # (B, N, D) output in the sorted row order, row-major
    N, M, nrb,
    D: tl.constexpr, P: tl.constexpr,
    UNIT: tl.constexpr,  # True: phi = (x - y) / |x - y| (0 at x = y); False: phi = y
    BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Coordinate-major points, the tile step :func:`.tiles._soa_wmean_tile` (a thread per row with BLOCK_N = 32
    num_warps, one accumulator per coordinate, D <= 3)."""
    # (B, D, N) and (B, N, D) put problem b at the same offset
    b, rows, rmask, xt_ptr, yt_ptr, h_ptr, k0, k1 = _bs_program(xt_ptr, yt_ptr, h_ptr, offs_ptr, N, M, nrb, D,
                                                                BLOCK, BLOCK_N)
    cscale = _cost_scale(prm_ptr, P)
    x0, x1, x2, m_i, s_i, a0, a1, a2 = _soa_wmean_start(xt_ptr, rows, rmask, N, prm_ptr, D, BLOCK_N)
    for k in range(k0, k1):
        j0 = tl.load(cblk_ptr + k) * BLOCK
        for t in tl.static_range(BLOCK // BLOCK_M):
            cols, cmask = _tile_cols(j0 + t * BLOCK_M, M, BLOCK_M)
            m_i, s_i, a0, a1, a2 = _soa_wmean_tile(yt_ptr, h_ptr, cols, cmask, M, x0, x1, x2, cscale, m_i, s_i, a0,
                                                   a1, a2, D, P, UNIT)
    _store_coords(out_ptr + b * N * D, rows, rmask, a0, a1, a2, s_i, D)


@triton.jit
def _bs_argmax_kernel(
    x_ptr, y_ptr, h_ptr, offs_ptr, cblk_ptr, prm_ptr,  # as _bs_softmin_kernel
    out_ptr,  # (B, N) int64 output in the sorted row order: sorted column index, -1 where no logit is finite
    N, M, nrb,
    D: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
):
    b, rows, rmask, x_ptr, y_ptr, h_ptr, k0, k1 = _bs_program(x_ptr, y_ptr, h_ptr, offs_ptr, N, M, nrb, D, BLOCK,
                                                              BLOCK_N)
    cscale = _cost_scale(prm_ptr, P)
    best = tl.full((BLOCK_N,), float("-inf"), dtype=prm_ptr.dtype.element_ty)
    arg = tl.full((BLOCK_N,), -1, dtype=tl.int64)
    for k in range(k0, k1):
        for t in tl.static_range(BLOCK // BLOCK_M):
            j0, _, _, _, logit = _bs_tile(x_ptr, y_ptr, h_ptr, cblk_ptr, k, t, rows, rmask, cscale, M, D, P, BLOCK,
                                          BLOCK_N, BLOCK_M)
            t_max = tl.max(logit, 1)
            t_arg = tl.argmax(logit, 1, tie_break_left=True).to(tl.int64) + j0
            upd = t_max > best
            arg = tl.where(upd, t_arg, arg)
            best = tl.where(upd, t_max, best)
    tl.store(out_ptr + b * N + rows, arg, mask=rmask)
