r"""Triton backend of the kernel primitives (SPEC §4): streaming (online log-sum-exp) kernels over
column tiles, O((N + M) * D) memory.

Same functions and signatures as :mod:`srot_fast.kernels.tensorized`:

- ``softmin(x, y, h, eps, p)``             -> (N,)    out_i = -eps * LSE_j[h_j - C(x_i, y_j) / eps]
- ``weighted_mean(x, y, h, eps, p, phi)``  -> (N, D)  sum_j softmax_j(h_j - C_ij / eps) * phi(x_i, y_j)
- ``plan_argmax(x, y, h, eps, p)``         -> (N,)    int64, argmax_j (h_j - C_ij / eps)
- ``max_cost(x, y, p)``                    -> ()      max_ij C(x_i, y_j)

with C = |x - y| (p = 1) or |x - y|^2 / 2 (p = 2). Layers (STYLE §12.2): ``_*_kernel`` (``@triton.jit``)
-> ``*_fwd`` launchers (checks, block sizes, grid, allocation; block sizes are keyword arguments) ->
the four primitives above. One program owns ``BLOCK_N`` rows and streams the columns in tiles of
``BLOCK_M``: squared distances in the exact difference form, accumulated one coordinate at a time in
registers (the *small-d path*), then a running max / rescaled sum per row. ``eps`` travels as a tensor
of the input dtype (a Python float would be specialised to float32 and break float64 accuracy).

Supported: float32 and float64, any D for softmin / plan_argmax / max_cost (the loop over coordinates
costs D scalar-column loads per tile: fine for small D, slow for large D), D <= 64 for weighted_mean.
Not yet: a large-d path that tiles D and uses ``tl.dot`` for the cross term and for the weighted sum;
weighted_mean with D > 64 raises ``NotImplementedError``.

Tested (tests/test_kernels.py) only under the CPU interpreter (``TRITON_INTERPRET=1``, triton 3.9,
torch 2.13 CPU) against the torch reference, 37 x 53 points (several tiles with small blocks) with
coincident pairs and ``-inf`` columns, p in {1, 2}, float32 and float64: softmin at D in {1, 2, 3}
(+ D = 64 and D = 300 single cases, tiny / huge eps, log-weights shifted by up to 1e6),
weighted_mean at D in {1, 3} (+ D = 64), plan_argmax and max_cost at D in {2, 3} (+ D = 64).

Caution:
    - Never run on a GPU yet: block sizes and ``num_warps`` are untuned guesses, float64 ``tl.exp`` /
      ``tl.sqrt`` on GPU untested.
    - Inputs must live on a CUDA device, or on the CPU with ``TRITON_INTERPRET=1`` set before triton is
      imported. triton is imported by this module only.
    - No autograd graph: outputs are plain tensors (the package uses the envelope theorem).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

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

_MAX_D_WMEAN = 64


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
    h_ptr,  # (M,) column log-weights, may hold -inf
    prm_ptr,  # (2,) [1 / eps, eps] in the input dtype
    out_ptr,  # (N,) output: -eps * LSE_j[h_j - C_ij / eps]
    N,
    M,
    D,
    stride_x,
    stride_y,
    P: tl.constexpr,  # cost exponent, 1 or 2
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
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
        sq = _sq_dist_tile(x_ptr, y_ptr, rows, rmask, cols, cmask, D, stride_x, stride_y, BLOCK_N, BLOCK_M)
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
def _plan_argmax_fwd_kernel(
    x_ptr,  # (N, D) row points
    y_ptr,  # (M, D) column points
    h_ptr,  # (M,) column log-weights
    prm_ptr,  # (2,) [1 / eps, eps]
    out_ptr,  # (N,) int64 output
    N,
    M,
    D,
    stride_x,
    stride_y,
    P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
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
        sq = _sq_dist_tile(x_ptr, y_ptr, rows, rmask, cols, cmask, D, stride_x, stride_y, BLOCK_N, BLOCK_M)
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
    out_ptr,  # (N,) output: max_j |x_i - y_j|^2
    N,
    M,
    D,
    stride_x,
    stride_y,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    best = tl.zeros((BLOCK_N,), dtype=x_ptr.dtype.element_ty)
    for j0 in range(0, M, BLOCK_M):
        cols = j0 + tl.arange(0, BLOCK_M)
        cmask = cols < M
        sq = _sq_dist_tile(x_ptr, y_ptr, rows, rmask, cols, cmask, D, stride_x, stride_y, BLOCK_N, BLOCK_M)
        best = tl.maximum(best, tl.max(tl.where(cmask[None, :], sq, 0.0), 1))
    tl.store(out_ptr + rows, best, mask=rmask)


# ---------------------------------------------------------------------------------------- launchers
def _check(x, y, h=None, p=1):
    if x.dim() != 2 or y.dim() != 2 or x.shape[1] != y.shape[1]:
        raise ValueError(f"x (N, D) and y (M, D) expected, got {tuple(x.shape)} and {tuple(y.shape)}")
    if h is not None and (h.dim() != 1 or h.shape[0] != y.shape[0]):
        raise ValueError(f"h (M,) = ({y.shape[0]},) expected, got {tuple(h.shape)}")
    if p not in (1, 2):
        raise ValueError(f"p must be 1 or 2, got {p}")
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


def softmin_fwd(x, y, h, eps, p, *, block_n=32, block_m=64, num_warps=4):
    """Launcher of :func:`softmin` with explicit block sizes (powers of two)."""
    _check(x, y, h, p)
    x, y, h = x.detach().contiguous(), y.detach().contiguous(), h.detach().contiguous()
    n, d = x.shape
    m = y.shape[0]
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, block_n),)
    _softmin_fwd_kernel[grid](
        x,
        y,
        h,
        _prm(x, eps),
        out,
        n,
        m,
        d,
        x.stride(0),
        y.stride(0),
        P=p,
        BLOCK_N=block_n,
        BLOCK_M=block_m,
        num_warps=num_warps,
    )
    return out


def weighted_mean_fwd(x, y, h, eps, p, phi="y", *, block_n=16, block_m=32, num_warps=4):
    """Launcher of :func:`weighted_mean` (D <= 64) with explicit block sizes (powers of two)."""
    _check(x, y, h, p)
    if phi not in ("y", "grad"):
        raise ValueError(f"phi must be 'y' or 'grad', got {phi!r}")
    n, d = x.shape
    if d > _MAX_D_WMEAN:
        raise NotImplementedError(
            f"triton weighted_mean supports D <= {_MAX_D_WMEAN} (got {d}); the large-d tl.dot path is "
            "not written yet: use backend 'keops' or 'tensorized'"
        )
    x, y, h = x.detach().contiguous(), y.detach().contiguous(), h.detach().contiguous()
    m = y.shape[0]
    out = torch.empty(n, d, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, block_n),)
    unit = phi == "grad" and p == 1
    _weighted_mean_fwd_kernel[grid](
        x,
        y,
        h,
        _prm(x, eps),
        out,
        n,
        m,
        d,
        x.stride(0),
        y.stride(0),
        P=p,
        UNIT=unit,
        BLOCK_N=block_n,
        BLOCK_M=block_m,
        BLOCK_D=max(2, triton.next_power_of_2(d)),
        num_warps=num_warps,
    )
    if phi == "grad" and p == 2:
        out = x - out
    return out


def plan_argmax_fwd(x, y, h, eps, p, *, block_n=32, block_m=64, num_warps=4):
    """Launcher of :func:`plan_argmax` with explicit block sizes (powers of two)."""
    _check(x, y, h, p)
    x, y, h = x.detach().contiguous(), y.detach().contiguous(), h.detach().contiguous()
    n, d = x.shape
    m = y.shape[0]
    out = torch.empty(n, dtype=torch.int64, device=x.device)
    grid = (triton.cdiv(n, block_n),)
    _plan_argmax_fwd_kernel[grid](
        x,
        y,
        h,
        _prm(x, eps),
        out,
        n,
        m,
        d,
        x.stride(0),
        y.stride(0),
        P=p,
        BLOCK_N=block_n,
        BLOCK_M=block_m,
        num_warps=num_warps,
    )
    return out


def max_sq_fwd(x, y, *, block_n=32, block_m=64, num_warps=4):
    """(N,) max_j |x_i - y_j|^2 (launcher behind :func:`max_cost`)."""
    _check(x, y)
    x, y = x.detach().contiguous(), y.detach().contiguous()
    n, d = x.shape
    m = y.shape[0]
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, block_n),)
    _max_sq_fwd_kernel[grid](
        x, y, out, n, m, d, x.stride(0), y.stride(0), BLOCK_N=block_n, BLOCK_M=block_m, num_warps=num_warps
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
    r"""(N, D) mean of phi(x_i, y_j) under w_ij = softmax_j(h_j - C_ij / eps); D <= 64.

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
