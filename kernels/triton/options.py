"""Run-time options of the Triton backend, checked without importing triton.

The solver (:func:`srot_fast.sinkhorn`, :class:`srot_fast.SROTLoss`, :mod:`srot_fast.distributed`) takes
them as arguments and the geometry passes them to every Triton primitive as keyword arguments; the
environment variables only give the defaults when an argument is None:

- ``precision``: the ``tl.dot`` input precision of the large-d path for float32 points, one of
  :data:`PRECISIONS` (None: ``SROT_TRITON_DOT_PRECISION``, else "tf32x3"; see :mod:`srot_fast.kernels.triton`);
- ``autotune``: True / False, whether a large launch autotunes its block sizes (None:
  ``SROT_TRITON_AUTOTUNE``, on unless '0').
"""
from __future__ import annotations

from typing import Optional

__all__ = ["PRECISIONS", "check_precision", "check_autotune", "kernel_options"]

PRECISIONS = ("ieee", "tf32x3", "tf32")


def check_precision(precision: Optional[str], name: str = "precision") -> Optional[str]:
    """``precision`` if it is None or one of :data:`PRECISIONS`, else a ValueError naming ``name``."""
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"{name} must be one of {PRECISIONS}, got {precision!r}")
    return precision


def check_autotune(autotune: Optional[bool]) -> Optional[bool]:
    """``autotune`` if it is None, True or False, else a TypeError naming the argument."""
    if autotune is not None and not isinstance(autotune, bool):
        raise TypeError(f"autotune must be None, True or False, got {autotune!r}")
    return autotune


def kernel_options(backend: str, precision: Optional[str] = None, autotune: Optional[bool] = None) -> dict:
    """The keyword options the primitives of ``backend`` receive: for 'triton', the given (not None) ones
    of ``precision`` and ``autotune``, checked; for every other backend, {} (after the same checks: a bad
    value is refused whatever the backend)."""
    check_precision(precision)
    check_autotune(autotune)
    if backend != "triton":
        return {}
    return {k: v for k, v in (("precision", precision), ("autotune", autotune)) if v is not None}
