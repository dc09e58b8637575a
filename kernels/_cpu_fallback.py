"""The blocked-torch fallback of :mod:`srot_fast.kernels.cpu_ops` (no compiler, a failed build,
``SROT_FAST_NO_COMPILE=1``, other dtypes or devices): the four primitives on row blocks of at most
``2**22 / M`` rows with ``torch.cdist(..., compute_mode="donot_use_mm_for_euclid_dist")`` (exact difference
form), so the largest temporary is ~2**22 elements whatever N and M; float16 / bfloat16 are computed in
float32; batched operands are solved one problem after another. Any device and float dtype."""

from __future__ import annotations

import torch

from ._common import check_operands

__all__ = ["torch_softmin", "torch_weighted_mean", "torch_plan_argmax", "torch_max_cost"]

_BLOCK_ELEMS = 1 << 22  # rows per block * M <= this


def _check(x, y, h=None, p=1):
    """Batch size B of batched operands, None for unbatched ones; ValueError for bad shapes or p."""
    return check_operands(x, y, h, p, allow_empty=True, allow_batch=True)


def _row_blocks(n: int, m: int):
    step = max(1, _BLOCK_ELEMS // max(m, 1))
    for i0 in range(0, n, step):
        yield slice(i0, min(n, i0 + step))


def _cost_block(xb: torch.Tensor, y: torch.Tensor, p: int) -> torch.Tensor:
    dist = torch.cdist(xb, y, compute_mode="donot_use_mm_for_euclid_dist")  # (B, M), exact form
    return dist if p == 1 else dist.square_().mul_(0.5)


def _logits_block(xb, y, h, eps, p):
    return _cost_block(xb, y, p).div_(-eps).add_(h)


def _upcast(*ts):
    """float16 / bfloat16 -> float32 (torch.cdist has no CPU half kernels); other dtypes unchanged."""
    return tuple(t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in ts)


def _per_problem(fn, B: int, x: torch.Tensor, *args, shape, dtype=None) -> torch.Tensor:
    """Stack ``fn(x[b], *(a[b] for tensor args), *other args)`` over the B problems; ``shape`` is the empty
    result's shape for B = 0."""
    if B == 0:
        return torch.empty(shape, dtype=dtype or x.dtype, device=x.device)
    return torch.stack([fn(x[b], *(a[b] if isinstance(a, torch.Tensor) else a for a in args)) for b in range(B)])


@torch.no_grad()
def torch_softmin(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int) -> torch.Tensor:
    """Blocked-torch :func:`softmin` (any device and float dtype; temporaries of ~2**22 elements; batched
    operands are solved one problem after another)."""
    B = _check(x, y, h, p)
    if B is not None:
        return _per_problem(torch_softmin, B, x, y, h, eps, p, shape=(0, x.shape[1]))
    out = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
    x, y, h = _upcast(x, y, h)
    for blk in _row_blocks(x.shape[0], y.shape[0]):
        out[blk] = torch.logsumexp(_logits_block(x[blk], y, h, eps, p), dim=1).mul_(-eps)
    return out


@torch.no_grad()
def torch_weighted_mean(
    x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int, phi: str = "y"
) -> torch.Tensor:
    """Blocked-torch :func:`weighted_mean`."""
    B = _check(x, y, h, p)
    if phi not in ("y", "grad"):
        raise ValueError(f"phi must be 'y' or 'grad', got {phi!r}")
    if B is not None:
        return _per_problem(torch_weighted_mean, B, x, y, h, eps, p, phi, shape=x.shape)
    out = torch.empty_like(x)
    x, y, h = _upcast(x, y, h)
    for blk in _row_blocks(x.shape[0], y.shape[0]):
        xb = x[blk]
        if phi == "grad" and p == 1:
            dist = _cost_block(xb, y, 1)
            w = torch.softmax(dist / -eps + h, dim=1)
            w = torch.where(dist > 0, w / dist, torch.zeros_like(w))  # w_ij / |x_i - y_j|, 0 at x_i = y_j
            # sum_j w_ij (x_ik - y_jk), one coordinate at a time (exact, no (B, M, D) buffer)
            for k in range(x.shape[1]):
                out[blk, k] = (w * (xb[:, k, None] - y[None, :, k])).sum(1)
        else:
            wy = torch.softmax(_logits_block(xb, y, h, eps, p), dim=1) @ y
            out[blk] = xb - wy if phi == "grad" else wy
    return out


@torch.no_grad()
def torch_plan_argmax(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int) -> torch.Tensor:
    """Blocked-torch :func:`plan_argmax`."""
    B = _check(x, y, h, p)
    if B is not None:
        return _per_problem(torch_plan_argmax, B, x, y, h, eps, p, shape=(0, x.shape[1]), dtype=torch.int64)
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    x, y, h = _upcast(x, y, h)
    for blk in _row_blocks(x.shape[0], y.shape[0]):
        out[blk] = _logits_block(x[blk], y, h, eps, p).argmax(dim=1)
    return out


@torch.no_grad()
def torch_max_cost(x: torch.Tensor, y: torch.Tensor, p: int) -> torch.Tensor:
    """Blocked-torch :func:`max_cost`."""
    B = _check(x, y, None, p)
    if B is not None:
        return _per_problem(torch_max_cost, B, x, y, p, shape=(0,))
    dtype = x.dtype
    x, y = _upcast(x, y)
    best = torch.full((), -float("inf"), dtype=x.dtype, device=x.device)
    for blk in _row_blocks(x.shape[0], y.shape[0]):
        best = torch.maximum(best, _cost_block(x[blk], y, p).max())
    return best.to(dtype)
