"""Argument checks shared by the kernel backends (cpu_ops, keops_ops, triton_softmin)."""
from __future__ import annotations

import torch


def check_operands(x: torch.Tensor, y: torch.Tensor, h=None, p: int = 1, *, allow_empty: bool = False) -> None:
    """x (N, D), y (M, D), optional log-weights h (M,), cost exponent p in {1, 2}; ValueError otherwise."""
    if x.dim() != 2 or y.dim() != 2 or x.shape[1] != y.shape[1]:
        raise ValueError(f"x (N, D) and y (M, D) expected, got {tuple(x.shape)} and {tuple(y.shape)}")
    if h is not None and (h.dim() != 1 or h.shape[0] != y.shape[0]):
        raise ValueError(f"h (M,) = ({y.shape[0]},) expected, got {tuple(h.shape)}")
    if p not in (1, 2):
        raise ValueError(f"p must be 1 or 2, got {p}")
    if not allow_empty and (x.shape[0] == 0 or y.shape[0] == 0):
        raise ValueError("empty point cloud")
