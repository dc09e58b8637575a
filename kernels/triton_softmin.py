r"""Triton backend of the kernel primitives (docs/DESIGN.md, "Kernel primitive"), the module that
``srot_fast.backends`` loads for ``backend="triton"``: streaming (online log-sum-exp) kernels over column
tiles, O((N + M) * D) memory. Same functions and signatures as :mod:`srot_fast.kernels.tensorized`:

- ``softmin(x, y, h, eps, p)``             -> (N,)    out_i = -eps * LSE_j[h_j - C(x_i, y_j) / eps]
- ``weighted_mean(x, y, h, eps, p, phi)``  -> (N, D)  sum_j softmax_j(h_j - C_ij / eps) * phi(x_i, y_j)
- ``plan_argmax(x, y, h, eps, p)``         -> (N,)    int64, argmax_j (h_j - C_ij / eps)
- ``max_cost(x, y, p)``                    -> ()      max_ij C(x_i, y_j)

with C = |x - y| (p = 1) or |x - y|^2 / 2 (p = 2), one leading batch dimension allowed; also the launchers
``softmin_fwd``, ``weighted_mean_fwd``, ``plan_argmax_fwd``, ``max_sq_fwd`` (path, block sizes, dot
precision) and ``tuned_configs()`` (the block sizes autotuned so far in this process).

The implementation is the subpackage :mod:`srot_fast.kernels.triton` (paths, precision, autotuning and
limits in its docstring); this module re-exports its public names and imports triton.
"""

from __future__ import annotations

from .triton.autotune import tuned_configs
from .triton.launchers import (
    max_cost,
    max_sq_fwd,
    plan_argmax,
    plan_argmax_fwd,
    softmin,
    softmin_fwd,
    weighted_mean,
    weighted_mean_fwd,
)

__all__ = [
    "softmin",
    "weighted_mean",
    "plan_argmax",
    "max_cost",
    "softmin_fwd",
    "weighted_mean_fwd",
    "plan_argmax_fwd",
    "max_sq_fwd",
    "tuned_configs",
]
