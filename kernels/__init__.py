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
columns, extra rows whose outputs the caller ignores. Importing this package imports neither triton nor pykeops.
"""
if __name__ != "srot_fast.kernels":  # pragma: no cover - guard against `import kernels` from the repo root
    raise ImportError(
        "This folder installs as 'srot_fast.kernels'; import 'srot_fast.kernels', not 'kernels' "
        "(a different PyPI project is called 'kernels')."
    )


def check_batch(x, y, h=None, p: int = 1, *, allow_empty: bool = False) -> bool:
    """Shape checks of the batched contract; True when the operands carry a leading batch dimension.

    Unbatched: x (N, D), y (M, D), optional h (M,); batched: x (B, N, D), y (B, M, D), h (B, M) with one
    B >= 0. Mixing the two, or a shape mismatch, is a ValueError naming the arguments; so is p not in
    {1, 2} and (unless ``allow_empty``) N = 0 or M = 0."""
    from ._common import check_operands

    if x.dim() != 3 and y.dim() != 3 and (h is None or h.dim() != 2):
        check_operands(x, y, h, p, allow_empty=allow_empty)
        return False
    hs = "" if h is None else f", h {tuple(h.shape)}"
    if x.dim() != 3 or y.dim() != 3 or (h is not None and h.dim() != 2):
        raise ValueError("x, y and h must be all unbatched ((N, D), (M, D), (M,)) or all batched ((B, N, D), "
                         f"(B, M, D), (B, M)), got x {tuple(x.shape)}, y {tuple(y.shape)}{hs}")
    b, n, d = x.shape
    if y.shape[0] != b or y.shape[2] != d:
        raise ValueError(f"x (B, N, D) and y (B, M, D) expected, got {tuple(x.shape)} and {tuple(y.shape)}")
    if h is not None and tuple(h.shape) != (b, y.shape[1]):
        raise ValueError(f"h (B, M) = ({b}, {y.shape[1]}) expected, got {tuple(h.shape)}")
    if p not in (1, 2):
        raise ValueError(f"p must be 1 or 2, got {p}")
    if not allow_empty and (n == 0 or y.shape[1] == 0):
        raise ValueError("empty point cloud")
    return True
