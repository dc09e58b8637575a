r"""SROT reweighting from detector scores (paper §3; docs/DESIGN.md, Problem).

Scores are P(target | point) in [0, 1]: ``s_x`` (N,) for the source points, ``s_y`` (M,) for the
target points. A source point is an outlier when s_x > 1/2, a target point when s_y < 1/2.

- hard: a'_i ∝ a_i * 1[clean_i], rescaled to the original total mass (same for b).
- soft: per-point cost offsets u_i = gamma / CE(y_t, s_x_i) = gamma / (-log s_x_i) and
  v_j = gamma / CE(y_s, s_y_j) = gamma / (-log(1 - s_y_j)), with the CE floored so the
  offsets stay finite (at most gamma / ce_floor).
"""
from __future__ import annotations

import torch

from . import _checks

__all__ = ["outlier_masks", "hard_weights", "soft_offsets"]


def outlier_masks(s_x: torch.Tensor, s_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean outlier masks: source points with s_x > 1/2, target points with s_y < 1/2."""
    s_x = _checks.check_probabilities(s_x, "s_x")
    s_y = _checks.check_probabilities(s_y, "s_y")
    return s_x > 0.5, s_y < 0.5


def _renormalised(w: torch.Tensor, keep: torch.Tensor, name: str) -> torch.Tensor:
    kept = w * keep.to(w.dtype)
    total = kept.sum()
    if not total > 0:
        raise ValueError(
            f"hard SROT: the detector flags every point of {name} (or all kept points have zero "
            "weight); nothing would be left to transport. Check the detector or use strategy='soft'."
        )
    return kept * (w.sum() / total)


def hard_weights(
    a: torch.Tensor, s_x: torch.Tensor, b: torch.Tensor, s_y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hard SROT weights (a', b'): outliers' weights set to 0, the rest rescaled to the same mass.

    Args: a (N,), b (M,) weights (finite, non-negative, a positive total); s_x (N,), s_y (M,) scores, thresholded
    as given (in their own dtype). Raises ValueError for weights that are not, or when every point of one side is
    flagged.
    """
    a = _checks.check_weights(a, a[..., None], "a")  # (like: one "point" of dimension 1 per weight)
    b = _checks.check_weights(b, b[..., None], "b")
    return _hard_weights(a, s_x, b, s_y)


def _hard_weights(a, s_x, b, s_y) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`hard_weights` for weights already checked (SROTLoss checks them once for the batch)."""
    out_x, out_y = outlier_masks(s_x, s_y)
    if out_x.shape != a.shape:
        raise ValueError(f"s_x has shape {tuple(out_x.shape)} but a has shape {tuple(a.shape)}")
    if out_y.shape != b.shape:
        raise ValueError(f"s_y has shape {tuple(out_y.shape)} but b has shape {tuple(b.shape)}")
    return _renormalised(a, ~out_x, "the source (a)"), _renormalised(b, ~out_y, "the target (b)")


def soft_offsets(
    s_x: torch.Tensor, s_y: torch.Tensor, gamma: float, ce_floor: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Soft SROT cost offsets (u, v), in cost units: u_i = gamma / max(-log s_x_i, ce_floor),
    v_j = gamma / max(-log(1 - s_y_j), ce_floor).

    Args:
        s_x: (N,) P(target) of the source points.
        s_y: (M,) P(target) of the target points.
        gamma: > 0, scale of the offsets (the paper uses max_ij C(x_i, y_j)).
        ce_floor: > 0, smallest cross-entropy used, so offsets are at most gamma / ce_floor.
    """
    s_x = _checks.check_probabilities(s_x, "s_x")
    s_y = _checks.check_probabilities(s_y, "s_y")
    gamma = float(gamma)
    if not gamma > 0 or gamma == float("inf"):
        raise ValueError(f"gamma must be a finite positive number, got {gamma}")
    if not ce_floor > 0:
        raise ValueError(f"ce_floor must be > 0, got {ce_floor}")
    ce_x = (-torch.log(s_x)).clamp_min(ce_floor)      # CE of the target label at a source point
    ce_y = (-torch.log1p(-s_y)).clamp_min(ce_floor)   # CE of the source label at a target point
    return gamma / ce_x, gamma / ce_y
