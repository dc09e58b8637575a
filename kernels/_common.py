"""Argument checks and the cache folder shared by the kernel backends (cpu_ops, keops_ops, triton_softmin)."""
from __future__ import annotations

import os
from pathlib import Path

import torch


def cache_dir() -> Path:
    """Where built kernels and probe results live: ``$SROT_FAST_CACHE``, else ``$XDG_CACHE_HOME/srot_fast``,
    else ``~/.cache/srot_fast``."""
    root = os.environ.get("SROT_FAST_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "srot_fast"


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
