r"""Generated 2-D data sets of the paper (docs/DESIGN.md, Experiments), deterministic under a seed.

- :func:`make_toy_2d`: the 2-D plans example (paper Figs. 1 and 2): two uniform squares of ``n`` points each,
  each tainted with type-I outliers (far from both measures) and type-II outliers (inside the other measure).
- :func:`make_flow_2d`: the 2-D gradient-flow example (paper Fig. 3): a data measure ``alpha`` on an annulus
  tainted with type-II outliers drawn from the law of the initial flowing measure ``beta0``.
- :func:`make_cloud_3d`: a 3-D point-cloud example: a sphere shell tainted with type-II outliers drawn from
  the law of the other measure, a torus.

All randomness comes from a private ``torch.Generator`` seeded with ``seed`` (the global RNG is untouched).
Points are drawn in float64 and cast to ``dtype``, so float32 and float64 data agree up to rounding.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from . import _checks

__all__ = ["Toy2D", "Flow2D", "Cloud3D", "make_toy_2d", "make_flow_2d", "make_cloud_3d"]


class Toy2D(NamedTuple):
    """Toy 2-D example: ``x`` (n, 2) source, ``y`` (n, 2) target, boolean outlier masks (n,) per side.

    ``x_type1`` / ``y_type1``: type-I outliers (far from both measures);
    ``x_type2`` / ``y_type2``: type-II outliers (inside the other measure's support).
    """

    x: torch.Tensor
    y: torch.Tensor
    x_type1: torch.Tensor
    x_type2: torch.Tensor
    y_type1: torch.Tensor
    y_type2: torch.Tensor


class Flow2D(NamedTuple):
    """2-D gradient-flow example: ``alpha`` (n, 2) data measure (clean + type-II outliers),
    ``alpha_outlier`` (n,) boolean mask of its outliers, ``beta0`` (n, 2) initial flowing measure."""

    alpha: torch.Tensor
    alpha_outlier: torch.Tensor
    beta0: torch.Tensor


class Cloud3D(NamedTuple):
    """3-D point-cloud example: ``x`` (n, 3) source (clean sphere shell + type-II outliers), ``x_outlier`` (n,)
    boolean mask of its outliers, ``y`` (m, 3) target (torus)."""

    x: torch.Tensor
    x_outlier: torch.Tensor
    y: torch.Tensor


def _check_dtype(dtype) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a floating torch.dtype, got {type(dtype).__name__} {dtype!r}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    return dtype


def _generator(seed) -> torch.Generator:
    seed = _checks.check_int(seed, "seed", 0)
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _uniform_box(k: int, low: tuple, high: tuple, g: torch.Generator) -> torch.Tensor:
    """(k, 2) float64 points uniform on the box [low[0], high[0]] x [low[1], high[1]]."""
    lo = torch.tensor(low, dtype=torch.float64)
    hi = torch.tensor(high, dtype=torch.float64)
    return lo + (hi - lo) * torch.rand(k, 2, generator=g, dtype=torch.float64)


def make_toy_2d(
    n: int = 75, n_type1: int = 6, n_type2: int = 4, seed: int = 0, dtype: torch.dtype = torch.float32
) -> Toy2D:
    """Toy 2-D example of the paper: ``n`` source and ``n`` target points, ``n_type1`` type-I and ``n_type2``
    type-II outliers per side (the rest clean).

    Source clean: uniform on [0,1]x[0,1]; target clean: uniform on [2,3]x[0,1].
    Source type-II: uniform on the target square; target type-II: uniform on the source square.
    Source type-I: uniform on [1,2]x[3,4]; target type-I: uniform on [1,2]x[-4,-3].
    Order per side: clean points, then type-I, then type-II (use the masks, not the order).
    """
    n = _checks.check_int(n, "n", 1)
    n_type1 = _checks.check_int(n_type1, "n_type1", 0)
    n_type2 = _checks.check_int(n_type2, "n_type2", 0)
    if n_type1 + n_type2 >= n:
        raise ValueError(f"n_type1 + n_type2 must be < n (at least one clean point), got "
                         f"{n_type1} + {n_type2} >= {n}")
    dtype = _check_dtype(dtype)
    g = _generator(seed)
    n_clean = n - n_type1 - n_type2
    sq_s, sq_t = ((0.0, 0.0), (1.0, 1.0)), ((2.0, 0.0), (3.0, 1.0))
    x = torch.cat([
        _uniform_box(n_clean, *sq_s, g),
        _uniform_box(n_type1, (1.0, 3.0), (2.0, 4.0), g),
        _uniform_box(n_type2, *sq_t, g),
    ])
    y = torch.cat([
        _uniform_box(n_clean, *sq_t, g),
        _uniform_box(n_type1, (1.0, -4.0), (2.0, -3.0), g),
        _uniform_box(n_type2, *sq_s, g),
    ])
    idx = torch.arange(n)
    type1 = (idx >= n_clean) & (idx < n_clean + n_type1)
    type2 = idx >= n_clean + n_type1
    return Toy2D(x.to(dtype), y.to(dtype), type1, type2, type1.clone(), type2.clone())


def _split_outliers(n, outlier_frac) -> tuple:
    """(n, k): the checked number of points and of outliers among them, k = round(outlier_frac * n) < n."""
    n = _checks.check_int(n, "n", 1)
    outlier_frac = _checks.check_fraction(outlier_frac, "outlier_frac")
    k = int(round(outlier_frac * n))
    if k >= n:
        raise ValueError(f"outlier_frac={outlier_frac} leaves no clean point for n={n}")
    return n, k


def make_flow_2d(
    n: int = 1000, outlier_frac: float = 0.1, seed: int = 0, dtype: torch.dtype = torch.float32
) -> Flow2D:
    """2-D gradient-flow example: ``alpha`` = n - k clean points uniform on the annulus centred at (0, 0)
    with radii [0.7, 1.0], plus k = round(outlier_frac * n) type-II outliers drawn from the law of
    ``beta0`` = N((3, 0), 0.3^2 I) (n points). Outliers are the last k rows of ``alpha``.
    """
    n, k = _split_outliers(n, outlier_frac)
    dtype = _check_dtype(dtype)
    g = _generator(seed)
    r0, r1 = 0.7, 1.0
    u = torch.rand(n - k, generator=g, dtype=torch.float64)
    radius = torch.sqrt(r0 ** 2 + u * (r1 ** 2 - r0 ** 2))  # uniform in area
    theta = 2 * math.pi * torch.rand(n - k, generator=g, dtype=torch.float64)
    clean = torch.stack([radius * torch.cos(theta), radius * torch.sin(theta)], dim=1)
    centre = torch.tensor([3.0, 0.0], dtype=torch.float64)
    outliers = centre + 0.3 * torch.randn(k, 2, generator=g, dtype=torch.float64)
    beta0 = centre + 0.3 * torch.randn(n, 2, generator=g, dtype=torch.float64)
    alpha = torch.cat([clean, outliers])
    mask = torch.arange(n) >= n - k
    return Flow2D(alpha.to(dtype), mask, beta0.to(dtype))


TORUS_CENTRE = (3.0, 0.0, 0.0)
TORUS_RADII = (1.0, 0.25)  # major radius (centre to tube centre), minor radius (tube)


def _torus(k: int, g: torch.Generator) -> torch.Tensor:
    """(k, 3) float64 points uniform (in area) on the torus of :data:`TORUS_RADII` centred at
    :data:`TORUS_CENTRE`, its axis along z (rejection on the tube angle: area element (R + r cos v))."""
    big, small = TORUS_RADII
    v = torch.empty(0, dtype=torch.float64)
    while len(v) < k:
        cand = 2 * math.pi * torch.rand(2 * k + 16, generator=g, dtype=torch.float64)
        keep = torch.rand(len(cand), generator=g, dtype=torch.float64) * (big + small) < big + small * torch.cos(cand)
        v = torch.cat([v, cand[keep]])
    v = v[:k]
    u = 2 * math.pi * torch.rand(k, generator=g, dtype=torch.float64)
    ring = big + small * torch.cos(v)
    pts = torch.stack([ring * torch.cos(u), ring * torch.sin(u), small * torch.sin(v)], dim=1)
    return pts + torch.tensor(TORUS_CENTRE, dtype=torch.float64)


def make_cloud_3d(
    n: int = 40_000, m: Optional[int] = None, outlier_frac: float = 0.1, seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Cloud3D:
    """3-D point clouds: source ``x`` = n - k points uniform on the unit sphere (centre 0) plus
    k = round(outlier_frac * n) type-II outliers drawn from the target's law; target ``y`` = m points (default
    n) uniform on the torus of major radius 1 and tube radius 0.25 centred at (3, 0, 0), axis z. Outliers are
    the last k rows of ``x``. Every point lies in [-1, 4.25] x [-1.25, 1.25] x [-1, 1].
    """
    n, k = _split_outliers(n, outlier_frac)
    m = n if m is None else _checks.check_int(m, "m", 1)
    dtype = _check_dtype(dtype)
    g = _generator(seed)
    z = torch.randn(n - k, 3, generator=g, dtype=torch.float64)
    sphere = z / z.norm(dim=1, keepdim=True).clamp_min(1e-12)
    x = torch.cat([sphere, _torus(k, g)])
    y = _torus(m, g)
    mask = torch.arange(n) >= n - k
    return Cloud3D(x.to(dtype), mask, y.to(dtype))
