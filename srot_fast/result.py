"""The result object of :func:`srot_fast.sinkhorn`: potentials, value, diagnostics, and the plan's accessors
(dense plan, barycentric projection, arg-max), each one pass of the backend's primitives through the
solve's :class:`srot_fast.geometry.Geometry`."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Union

import torch

from . import _checks
from .geometry import Geometry
from .kernels.tensorized import cost_matrix

__all__ = ["SinkhornResult"]


@dataclass(frozen=True)
class SinkhornResult:
    r"""Output of :func:`srot_fast.sinkhorn`. Shapes below are for one problem; a batched call adds a leading B.

    Attributes:
        f (N,), g (M,): dual potentials, in cost units (plan pi_ij = a_i b_j exp((f_i+g_j-c'_ij)/eps)).
        value (): the dual objective, differentiable w.r.t. x, y, a, b, u, v (envelope theorem).
        n_iter: updates spent (eps-scaling included); an int, or a (B,) int64 tensor for a batch.
        marginal_error: L1 gap between the plan's row marginal and the one the penalty prescribes, relative
            to the mass of a, plus the same gap on the columns relative to the mass of b (for balanced OT:
            |pi 1 - a|_1 / |a| + |pi^T 1 - b|_1 / |b|; partial OT: the rows of its augmented problem; with
            ``tol=None`` the rows alone); a float, or (B,) for a batch.
        converged: whether the solve met ``tol`` or ``value_tol`` (always True with ``tol=None``); a bool,
            or (B,) for a batch.
        row_mass (N,): mass transported from each source point, pi 1 (computed from f when first read, as the plan
            accessors below read f and g: change those in place and they change).
        col_mass (M,): mass transported to each target point, pi^T 1 (from g, when first read).
        eps, p, backend: the entropic regularisation (cost units), cost exponent and backend used.
        passes: soft-min kernel passes launched (each covers the whole batch); syncs: host
            synchronisations spent on the stopping test.
    """

    f: torch.Tensor
    g: torch.Tensor
    value: torch.Tensor
    n_iter: Union[int, torch.Tensor]
    marginal_error: Union[float, torch.Tensor]
    converged: Union[bool, torch.Tensor]
    eps: float
    p: int
    backend: str
    passes: int
    syncs: int
    _geom: Geometry
    _a: torch.Tensor
    _b: torch.Tensor
    _s: torch.Tensor  # (B, N) row soft-mins at the final g: pi 1 = a exp((f - s) / eps)
    _t: torch.Tensor  # (B, M) column soft-mins at the final f
    _batched: bool

    @cached_property
    def row_mass(self) -> torch.Tensor:
        with torch.inference_mode(False):  # a normal tensor, even when first read under inference_mode
            return self._out(_checks.masses(self._a, self._f.detach(), self._s, self.eps))

    @cached_property
    def col_mass(self) -> torch.Tensor:
        with torch.inference_mode(False):
            return self._out(_checks.masses(self._b, self._g.detach(), self._t, self.eps))

    @property
    def transported_mass(self):
        """Total mass of the plan restricted to real points, sum_ij pi_ij (a float, or (B,) for a batch)."""
        m = self.row_mass.sum(-1)
        return m if self._batched else float(m)

    def _out(self, t: torch.Tensor) -> torch.Tensor:
        return t if self._batched else t[0]

    def plan(self, max_entries: int = 1 << 26) -> torch.Tensor:
        """Dense (N, M) plan over real points ((B, N, M) for a batch); refuses above ``max_entries`` entries."""
        geom = self._geom
        if geom.batch * geom.n * geom.m > max_entries:
            shape = f"{geom.batch} x {geom.n} x {geom.m}" if self._batched else f"{geom.n} x {geom.m}"
            raise ValueError(f"a dense {shape} plan exceeds max_entries={max_entries}; "
                             "use row_mass / barycentric_projection instead")
        c = cost_matrix(geom.x, geom.y, geom.p)
        if geom.u is not None:
            c = c + geom.u[..., :, None]
        if geom.v is not None:
            c = c + geom.v[..., None, :]
        f, g = self._f.detach(), self._g.detach()
        logits = (f[..., :, None] + g[..., None, :] - c) / self.eps
        pi = self._a[..., :, None] * self._b[..., None, :] * torch.exp(logits)
        return self._out(pi)

    @property
    def _f(self) -> torch.Tensor:
        return self.f if self._batched else self.f[None]

    @property
    def _g(self) -> torch.Tensor:
        return self.g if self._batched else self.g[None]

    def _col_logits(self) -> torch.Tensor:
        """(B, M) column log-weights h_j such that pi_ij ∝_j exp(h_j - C_ij / eps) within each row."""
        h = torch.log(self._b) + self._g.detach() / self.eps
        return h if self._geom.v is None else h - self._geom.v / self.eps

    def barycentric_projection(self) -> torch.Tensor:
        """(N, D) sum_j pi_ij y_j / sum_j pi_ij: where the plan sends each source point (one kernel pass)."""
        return self._out(self._geom.weighted_mean("x", self._col_logits(), self.eps, "y"))

    def plan_argmax(self) -> torch.Tensor:
        """(N,) int64 index j of the largest plan entry in each row (label propagation: point i takes
        the label of y_j); one kernel pass, no N x M matrix."""
        return self._out(self._geom.plan_argmax(self._col_logits(), self.eps))
