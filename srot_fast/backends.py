"""Backend resolution: a name -> the module implementing the kernel primitives (docs/DESIGN.md, Kernel primitive).

=============  ======================================================  ==================
backend        implementation (srot_fast.kernels.*)                    memory
=============  ======================================================  ==================
tensorized     torch, dense N x M (reference; exact; small problems)   O(N M)
cpu            C++/OpenMP streaming LSE built on first use; blocked     O((N + M) D)
               torch fallback without a compiler
keops          pykeops LazyTensor reductions (CPU and CUDA)             O((N + M) D)
triton         hand-written Triton kernels (CUDA; TRITON_INTERPRET=1)   O((N + M) D)
blocksparse    the cpu kernel (CPU) or Triton kernels (CUDA) on the     O((N + M) D + kept
               block pairs a bound cannot drop (d <= 3; small eps       block pairs)
               against the data's scale); cold solves start on
               grid cells (srot_fast._multiscale)
=============  ======================================================  ==================

Optional backends are imported lazily, on first use, never at ``import srot_fast``. An explicitly
requested backend that is not installed raises ``ImportError`` naming the extra to install;
``"auto"`` picks among what is available (see :func:`resolve_backend`).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

__all__ = ["BACKENDS", "available_backends", "get_ops", "resolve_backend"]

BACKENDS = ("tensorized", "cpu", "keops", "triton", "blocksparse")

# backend name -> (module of srot_fast.kernels, python package it needs, pip extra)
_IMPL = {
    "tensorized": ("tensorized", None, None),
    "cpu": ("cpu_ops", None, None),
    "keops": ("keops_ops", "pykeops", "srot_fast[keops]"),
    "triton": ("triton_softmin", "triton", "srot_fast[triton]"),
    "blocksparse": ("blocksparse", None, None),
}
_SMALL = 1 << 12  # N * M below which 'auto' keeps the dense reference on CPU when the compiled kernel is
# unavailable (the blocked-torch fallback's per-call overheads dominate there)
# 'auto' on CPU takes 'blocksparse' for d <= 3, N * M >= SPARSE_PAIRS and blur <= SPARSE_BLUR[p] x diameter
# (benchmarks/results/2026-11-26-blocksparse2/NOTES.md has the measurements behind these values)
SPARSE_PAIRS = 10**9
SPARSE_BLUR = {1: 0.01, 2: 0.05}


def _installed(package) -> bool:
    return package is None or importlib.util.find_spec(package) is not None


def available_backends() -> list[str]:
    """Backends whose Python package is installed (the 'cpu' one always is: it has a torch fallback)."""
    return [n for n, (_, pkg, _) in _IMPL.items() if _installed(pkg)]


def _is_cuda(device) -> bool:
    return getattr(device, "type", str(device)) == "cuda"


def _sparse_pays(n: int, m: int, points, eps, p) -> bool:
    """'auto' on CPU: do the block-sparse passes pay (see :func:`resolve_backend`)?"""
    if points is None or eps is None or p not in SPARSE_BLUR or n * m < SPARSE_PAIRS:
        return False
    x, y = points
    if not 1 <= x.shape[-1] <= 3:
        return False
    from .geometry import bbox_diameter
    from .kernels import cpu_ops

    if not cpu_ops.available():
        return False
    return eps ** (1.0 / p) <= SPARSE_BLUR[p] * bbox_diameter(x.detach(), y.detach())


def resolve_backend(name: str, n: int, m: int, device, points=None, eps=None, p=None) -> str:
    """Concrete backend for ``name`` in {'auto', 'tensorized', 'cpu', 'keops', 'triton', 'blocksparse'}.

    'auto': on CUDA, 'triton' if installed, else 'keops', else 'tensorized'; on CPU, 'tensorized'
    for N * M < 4096 when the compiled kernel is unavailable (with it, 'cpu' is faster there too: its
    Anderson step and stored distances), 'blocksparse' when the caller passes ``points`` = (x, y), ``eps`` and ``p`` and
    the points have d <= 3, N * M >= ``SPARSE_PAIRS`` (1e9), the blur eps^(1/p) is at most
    ``SPARSE_BLUR[p]`` (0.01 at p = 1, 0.05 at p = 2) times the bounding-box diagonal of x and y, and
    the C++ kernel compiles; else 'cpu' (the compiled kernel when a C++ compiler is present).
    """
    if name == "auto":
        if _is_cuda(device):
            for cand in ("triton", "keops"):
                if _installed(_IMPL[cand][1]):
                    return cand
            return "tensorized"
        if n * m < _SMALL:
            from .kernels import cpu_ops

            if not cpu_ops.available():
                return "tensorized"
        return "blocksparse" if _sparse_pays(n, m, points, eps, p) else "cpu"
    if name not in _IMPL:
        raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {name!r}")
    _, pkg, extra = _IMPL[name]
    if not _installed(pkg):
        raise ImportError(f"backend={name!r} needs the package {pkg!r}: pip install '{extra}'")
    if name == "triton" and not _is_cuda(device) and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend='triton' needs CUDA tensors (set TRITON_INTERPRET=1 only to test on CPU)")
    if name == "cpu" and _is_cuda(device):
        raise ValueError("backend='cpu' needs CPU tensors; use 'triton', 'keops', 'blocksparse' or 'auto' on CUDA")
    if name == "blocksparse" and _is_cuda(device) and not _installed("triton"):
        raise ImportError("backend='blocksparse' on CUDA needs the package 'triton': pip install 'srot_fast[triton]'")
    return name


def get_ops(name: str) -> ModuleType:
    """The primitives module (softmin, weighted_mean, plan_argmax, max_cost) of a concrete backend."""
    return importlib.import_module(f"srot_fast.kernels.{_IMPL[name][0]}")
