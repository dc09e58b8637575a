r"""Torch reference of every kernel primitive (SPEC §4): materialises the N x M cost matrix.

This is the ground truth the KeOps and Triton kernels are tested against, and the backend for
small problems (it is exact and supports float32, float64 and autograd through torch ops).

Shapes: ``x`` (N, D) row points, ``y`` (M, D) column points, ``h`` (M,) column log-weights
(may hold ``-inf`` for zero-weight points), ``eps`` > 0 a Python float in cost units.
Cost: ``p = 1`` -> C = |x - y|,  ``p = 2`` -> C = |x - y|^2 / 2.

Caution:
    Memory is O(N * M); use an online backend beyond a few tens of thousands of points.
"""
from __future__ import annotations

import torch

__all__ = ["cost_matrix", "softmin", "weighted_mean", "plan_argmax", "max_cost"]

_DIFF_FORM_LIMIT = 1 << 24  # N*M*D below which distances use the exact difference form


def _sq_dist(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(N, M) squared Euclidean distances, exact (difference form) when small, else matmul form."""
    n, d = x.shape
    m = y.shape[0]
    if n * m * d <= _DIFF_FORM_LIMIT:
        return ((x[:, None, :] - y[None, :, :]) ** 2).sum(-1)
    xx = (x * x).sum(-1)[:, None]
    yy = (y * y).sum(-1)[None, :]
    return (xx + yy - 2 * x @ y.T).clamp_min_(0)


def cost_matrix(x: torch.Tensor, y: torch.Tensor, p: int) -> torch.Tensor:
    """(N, M) ground cost: |x_i - y_j| for p = 1, |x_i - y_j|^2 / 2 for p = 2."""
    d2 = _sq_dist(x, y)
    if p == 1:
        return d2.sqrt()
    if p == 2:
        return d2 / 2
    raise ValueError(f"p must be 1 or 2, got {p}")


def _logits(x, y, h, eps, p):
    return h[None, :] - cost_matrix(x, y, p) / eps


def softmin(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int) -> torch.Tensor:
    r"""(N,) soft-min  out_i = -eps * log sum_j exp(h_j - C(x_i, y_j) / eps).

    A row whose every ``h_j`` is ``-inf`` gives ``+inf``.
    """
    return -eps * torch.logsumexp(_logits(x, y, h, eps, p), dim=1)


def weighted_mean(
    x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int, phi: str = "y"
) -> torch.Tensor:
    r"""(N, D) mean of phi(x_i, y_j) under the row softmax w_ij = softmax_j(h_j - C_ij / eps).

    ``phi="y"``: y_j (barycentric projection; with p = 2 the gradient is x_i - this).
    ``phi="grad"``: nabla_x C(x_i, y_j) = (x_i - y_j)/|x_i - y_j| for p = 1 (0 where x_i = y_j),
    x_i - y_j for p = 2.
    """
    w = torch.softmax(_logits(x, y, h, eps, p), dim=1)  # (N, M)
    if phi == "y":
        return w @ y
    if phi != "grad":
        raise ValueError(f"phi must be 'y' or 'grad', got {phi!r}")
    if p == 2:
        return x - w @ y
    diff = x[:, None, :] - y[None, :, :]  # (N, M, D)
    norm = diff.norm(dim=-1, keepdim=True)
    unit = torch.where(norm > 0, diff / norm.clamp_min(torch.finfo(x.dtype).tiny), torch.zeros_like(diff))
    return (w[:, :, None] * unit).sum(1)


def plan_argmax(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int) -> torch.Tensor:
    """(N,) int64 index of the largest plan entry in each row: argmax_j (h_j - C_ij / eps)."""
    return _logits(x, y, h, eps, p).argmax(dim=1)


def max_cost(x: torch.Tensor, y: torch.Tensor, p: int) -> torch.Tensor:
    """() largest ground cost max_ij C(x_i, y_j)."""
    return cost_matrix(x, y, p).max()
