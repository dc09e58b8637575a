"""Kernel implementations of the SROT primitives (docs/DESIGN.md, "Kernel primitive"), installed as
``srot_fast.kernels``.

Every backend implements the same four functions with the same signature as the torch
reference in :mod:`srot_fast.kernels.tensorized`:

- ``softmin(x, y, h, eps, p)``          -> (N,)   out_i = -eps * LSE_j[h_j - C(x_i, y_j) / eps]
- ``weighted_mean(x, y, h, eps, p, phi)`` -> (N, D) sum_j softmax_j(h_j - C_ij / eps) * phi(x_i, y_j)
- ``plan_argmax(x, y, h, eps, p)``      -> (N,)   argmax_j (h_j - C_ij / eps)
- ``max_cost(x, y, p)``                 -> ()     max_ij C(x_i, y_j)

with C = |x - y| (p = 1) or |x - y|^2 / 2 (p = 2). Each also takes one leading batch dimension: x (B, N, D),
y (B, M, D), h (B, M), one ``eps`` for the batch -> (B, N), (B, N, D), (B, N), (B,); every result equals,
per problem, the unbatched call (B = 0 gives empty outputs). Ragged problems: ``h_j = -inf`` for absent
columns, extra rows whose outputs the caller ignores. Every backend checks its arguments with
:func:`srot_fast.kernels._common.check_operands`. Importing this package imports neither triton nor pykeops.
"""
if __name__ != "srot_fast.kernels":  # pragma: no cover - guard against `import kernels` from the repo root
    raise ImportError(
        "This folder installs as 'srot_fast.kernels'; import 'srot_fast.kernels', not 'kernels' "
        "(a different PyPI project is called 'kernels')."
    )

