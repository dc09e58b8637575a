r"""The only place the Sinkhorn loop meets the points: soft-min operators of the (soft) cost.

A geometry holds row points x (N, D), column points y (M, D), the cost exponent p, optional
per-point cost offsets u (N,), v (M,) — the soft SROT cost c'_ij = C(x_i, y_j) + u_i + v_j — and
the primitives module of one backend. Offsets are free (SPEC §3):
    -eps * LSE_j[h_j - c'_ij / eps] = u_i - eps * LSE_j[h_j - v_j / eps - C_ij / eps],
so they ride on the plain kernel with shifted inputs and outputs, never on an N x M pass.

``PartialGeometry`` wraps a geometry with one dummy point per side (Chapel et al. 2020): cost 0
between a dummy and the real points of the other side, +inf between the two dummies. Balanced OT
on the augmented measures is partial OT. The dummy row and column are rank one, so the augmented
soft-min is the plain one plus a log-add-exp.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["Geometry", "PartialGeometry", "bbox_diameter"]


def bbox_diameter(x: torch.Tensor, y: torch.Tensor) -> float:
    """Diagonal length of the bounding box of both point clouds (GeomLoss's default), in data units."""
    pts = torch.cat([x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])])
    return float((pts.max(0).values - pts.min(0).values).norm())


class Geometry:
    """Soft-min operators for the cost C + u + v on (x, y) with the given backend ops."""

    def __init__(self, ops, x: torch.Tensor, y: torch.Tensor, p: int,
                 u: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None):
        self.ops, self.x, self.y, self.p, self.u, self.v = ops, x, y, p, u, v
        self.n, self.m = x.shape[0], y.shape[0]

    def softmin_x(self, h: torch.Tensor, eps: float) -> torch.Tensor:
        """(N,) -eps * LSE_j[h_j - c'_ij / eps] for column log-weights h (M,)."""
        if self.v is not None:
            h = h - self.v / eps
        out = self.ops.softmin(self.x, self.y, h, eps, self.p)
        return out if self.u is None else out + self.u

    def softmin_y(self, h: torch.Tensor, eps: float) -> torch.Tensor:
        """(M,) -eps * LSE_i[h_i - c'_ij / eps] for row log-weights h (N,)."""
        if self.u is not None:
            h = h - self.u / eps
        out = self.ops.softmin(self.y, self.x, h, eps, self.p)
        return out if self.v is None else out + self.v

    def transposed(self) -> "Geometry":
        return Geometry(self.ops, self.y, self.x, self.p, self.v, self.u)


class PartialGeometry:
    """``geom`` augmented with a dummy row (index N) and a dummy column (index M)."""

    def __init__(self, geom: Geometry):
        self.real = geom
        self.n, self.m = geom.n + 1, geom.m + 1

    @staticmethod
    def _augment(real_softmin, h: torch.Tensor, eps: float) -> torch.Tensor:
        real = real_softmin(h[:-1], eps)                        # real rows vs real columns
        rows = -eps * torch.logaddexp(-real / eps, h[-1])        # + dummy column at cost 0
        dummy = -eps * torch.logsumexp(h[:-1], 0, keepdim=True)  # dummy row: cost 0 to real, inf to dummy
        return torch.cat([rows, dummy])

    def softmin_x(self, h: torch.Tensor, eps: float) -> torch.Tensor:
        return self._augment(self.real.softmin_x, h, eps)

    def softmin_y(self, h: torch.Tensor, eps: float) -> torch.Tensor:
        return self._augment(self.real.softmin_y, h, eps)
