"""Argument validation shared by the public functions: every error names the argument."""
from __future__ import annotations

import math
from typing import Optional

import torch

_FLOAT_DTYPES = (torch.float32, torch.float64)


def check_points(t, name: str, batched: bool = False) -> torch.Tensor:
    """A (N, D) — or (B, N, D) when ``batched`` — finite float32/float64 tensor."""
    if not torch.is_tensor(t):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32 or float64, got {t.dtype}")
    want = (2, 3) if batched else (2,)
    if t.dim() not in want:
        shape = "(N, D) or (B, N, D)" if batched else "(N, D)"
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.shape[-2] == 0 or t.shape[-1] == 0:
        raise ValueError(f"{name} must hold at least one point of dimension >= 1, got {tuple(t.shape)}")
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} contains NaN or inf")
    return t


def check_pair(x: torch.Tensor, y: torch.Tensor, xname: str = "x", yname: str = "y") -> None:
    """Same feature dimension, dtype and device for two point clouds (batch sizes too if batched)."""
    if x.shape[-1] != y.shape[-1]:
        raise ValueError(
            f"{xname} and {yname} must have the same feature dimension D, got {x.shape[-1]} and {y.shape[-1]}"
        )
    if x.dim() != y.dim():
        raise ValueError(f"{xname} and {yname} must both be batched or both not, got shapes "
                         f"{tuple(x.shape)} and {tuple(y.shape)}")
    if x.dim() == 3 and x.shape[0] != y.shape[0]:
        raise ValueError(f"{xname} and {yname} have different batch sizes {x.shape[0]} and {y.shape[0]}")
    if x.dtype != y.dtype:
        raise TypeError(f"{xname} and {yname} must have the same dtype, got {x.dtype} and {y.dtype}")
    if x.device != y.device:
        raise ValueError(f"{xname} and {yname} must be on the same device, got {x.device} and {y.device}")


def check_weights(w: Optional[torch.Tensor], like: torch.Tensor, name: str) -> torch.Tensor:
    """Non-negative finite weights of shape like.shape[:-1] with a positive total; None -> uniform 1/N."""
    shape = like.shape[:-1]
    if w is None:
        return torch.full(shape, 1.0 / shape[-1], dtype=like.dtype, device=like.device)
    if not torch.is_tensor(w):
        raise TypeError(f"{name} must be a torch.Tensor of weights, got {type(w).__name__}")
    if w.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)} (one weight per point), got {tuple(w.shape)}")
    if w.dtype != like.dtype:
        raise TypeError(f"{name} must have dtype {like.dtype} like the points, got {w.dtype}")
    if not torch.isfinite(w).all():
        raise ValueError(f"{name} contains NaN or inf")
    if (w < 0).any():
        raise ValueError(f"{name} has negative weights")
    if not (w.sum(-1) > 0).all():
        raise ValueError(f"{name} has zero total mass (all weights are zero)")
    return w


def check_offsets(o: Optional[torch.Tensor], like: torch.Tensor, name: str) -> Optional[torch.Tensor]:
    """Optional finite per-point cost offsets of shape like.shape[:-1]."""
    if o is None:
        return None
    if not torch.is_tensor(o):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(o).__name__}")
    if o.shape != like.shape[:-1]:
        raise ValueError(f"{name} must have shape {tuple(like.shape[:-1])}, got {tuple(o.shape)}")
    if not torch.isfinite(o).all():
        raise ValueError(f"{name} contains NaN or inf")
    return o.to(like.dtype)


def check_positive(value, name: str, allow_inf: bool = False) -> float:
    """A positive number (``inf`` allowed only when ``allow_inf``)."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}") from None
    if math.isnan(value) or value <= 0 or (math.isinf(value) and not allow_inf):
        kind = "a positive number or inf" if allow_inf else "a finite positive number"
        raise ValueError(f"{name} must be {kind}, got {value}")
    return value


def check_p(p) -> int:
    if p not in (1, 2):
        raise ValueError(f"p must be 1 (cost |x-y|) or 2 (cost |x-y|^2/2), got {p!r}")
    return int(p)


def pair_of(value, name: str, allow_inf: bool = True) -> tuple[float, float]:
    """A positive number or a pair (value_a, value_b)."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{name} must be a number or a pair (for_a, for_b), got {value!r}")
        return (check_positive(value[0], f"{name}[0]", allow_inf), check_positive(value[1], f"{name}[1]", allow_inf))
    v = check_positive(value, name, allow_inf)
    return v, v
