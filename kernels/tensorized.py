r"""Torch reference of every kernel primitive (docs/DESIGN.md, "Kernel primitive"): materialises the N x M
cost matrix.

This is the ground truth the KeOps and Triton kernels are tested against, and the backend for
small problems (it is exact and supports autograd through torch ops).

Shapes: ``x`` (N, D) row points, ``y`` (M, D) column points, ``h`` (M,) column log-weights
(may hold ``-inf`` for zero-weight points), ``eps`` > 0 a Python float in cost units; or, batched,
x (B, N, D), y (B, M, D), h (B, M) with one ``eps`` for all B problems (outputs gain the leading B, computed
by broadcasting; B = 0 gives empty outputs). Cost: ``p = 1`` -> C = |x - y|,  ``p = 2`` -> C = |x - y|^2 / 2.

dtypes: float32 and float64 are computed and returned as given; float16 and bfloat16 inputs are upcast to
float32 copies and the results returned in float32 (the solver upcasts the points once for this backend;
only the Triton backend reads half points as they are).

Caution:
    Memory is O(B * N * M); use an online backend beyond a few tens of thousands of points.
"""
from __future__ import annotations

import torch

from ._common import check_operands

__all__ = ["cost_matrix", "softmin", "weighted_mean", "plan_argmax", "max_cost"]

_DIFF_FORM_LIMIT = 1 << 24  # B*N*M*D below which distances use the exact difference form
_LOW = (torch.float16, torch.bfloat16)  # computed in float32


def _upcast(*ts):
    """float16 / bfloat16 tensors -> float32 (None and other dtypes unchanged)."""
    return tuple(t.float() if t is not None and t.dtype in _LOW else t for t in ts)


def _sq_dist(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(..., N, M) squared Euclidean distances, exact (difference form) when small, else matmul form."""
    if x.numel() * y.shape[-2] <= _DIFF_FORM_LIMIT:
        return ((x[..., :, None, :] - y[..., None, :, :]) ** 2).sum(-1)
    xx = (x * x).sum(-1)[..., :, None]
    yy = (y * y).sum(-1)[..., None, :]
    return (xx + yy - 2 * x @ y.transpose(-1, -2)).clamp_min_(0)


def cost_matrix(x: torch.Tensor, y: torch.Tensor, p: int) -> torch.Tensor:
    """(N, M) (or (B, N, M)) ground cost: |x_i - y_j| for p = 1, |x_i - y_j|^2 / 2 for p = 2."""
    if p not in (1, 2):
        raise ValueError(f"p must be 1 or 2, got {p}")
    x, y = _upcast(x, y)
    d2 = _sq_dist(x, y)
    return d2.sqrt() if p == 1 else d2 / 2


def _logits(x, y, h, eps, p):
    return h[..., None, :] - cost_matrix(x, y, p) / eps


def softmin(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int) -> torch.Tensor:
    r"""(N,) (or (B, N)) soft-min  out_i = -eps * log sum_j exp(h_j - C(x_i, y_j) / eps).

    A row whose every ``h_j`` is ``-inf`` gives ``+inf``.
    """
    check_operands(x, y, h, p, allow_empty=True, allow_batch=True)
    x, y, h = _upcast(x, y, h)
    return -eps * torch.logsumexp(_logits(x, y, h, eps, p), dim=-1)


def weighted_mean(
    x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int, phi: str = "y"
) -> torch.Tensor:
    r"""(N, D) (or (B, N, D)) mean of phi(x_i, y_j) under the row softmax w_ij = softmax_j(h_j - C_ij / eps).

    ``phi="y"``: y_j (barycentric projection; with p = 2 the gradient is x_i - this).
    ``phi="grad"``: nabla_x C(x_i, y_j) = (x_i - y_j)/|x_i - y_j| for p = 1 (0 where x_i = y_j),
    x_i - y_j for p = 2.
    """
    check_operands(x, y, h, p, allow_empty=True, allow_batch=True)
    if phi not in ("y", "grad"):
        raise ValueError(f"phi must be 'y' or 'grad', got {phi!r}")
    x, y, h = _upcast(x, y, h)
    w = torch.softmax(_logits(x, y, h, eps, p), dim=-1)  # (..., N, M)
    if phi == "y":
        return w @ y
    if p == 2:
        return x - w @ y
    diff = x[..., :, None, :] - y[..., None, :, :]  # (..., N, M, D)
    norm = diff.norm(dim=-1, keepdim=True)
    unit = torch.where(norm > 0, diff / norm.clamp_min(torch.finfo(x.dtype).tiny), torch.zeros_like(diff))
    return (w[..., None] * unit).sum(-2)


def plan_argmax(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int) -> torch.Tensor:
    """(N,) (or (B, N)) int64 index of the largest plan entry in each row: argmax_j (h_j - C_ij / eps)."""
    check_operands(x, y, h, p, allow_empty=True, allow_batch=True)
    x, y, h = _upcast(x, y, h)
    return _logits(x, y, h, eps, p).argmax(dim=-1)


def max_cost(x: torch.Tensor, y: torch.Tensor, p: int) -> torch.Tensor:
    """() (or (B,), one per problem) largest ground cost max_ij C(x_i, y_j)."""
    check_operands(x, y, None, p, allow_empty=True, allow_batch=True)
    return cost_matrix(x, y, p).amax(dim=(-2, -1))
