r"""Marginal penalties D(pi 1 | a) of unbalanced OT and what the Sinkhorn loop needs from them.

For a penalty of strength tau on one side (docs/DESIGN.md, Solver):
- ``aprox(s, eps)``: the update of a potential from its soft-min value s,
  A(s) = s (balanced, tau = inf), tau/(tau+eps) * s (KL), clamp(s, -tau, tau) (TV);
- ``phi(f)``: the term -D*(-f) of the dual objective per unit weight,
  f (balanced), tau * (1 - exp(-f/tau)) (KL), min(f, tau) (TV, valid for f >= -tau).
"""
from __future__ import annotations

import math

import torch

__all__ = ["Penalty"]

PENALTIES = ("balanced", "kl", "tv")


class Penalty:
    """One side's marginal penalty: ``kind`` in {'balanced', 'kl', 'tv'}, strength ``tau`` (inf = balanced)."""

    def __init__(self, kind: str, tau: float = math.inf):
        if kind not in PENALTIES:
            raise ValueError(f"penalty must be one of {PENALTIES}, got {kind!r}")
        self.kind = "balanced" if math.isinf(tau) else kind
        self.tau = tau

    @property
    def balanced(self) -> bool:
        return self.kind == "balanced"

    def aprox(self, s: torch.Tensor, eps: float) -> torch.Tensor:
        if self.kind == "kl":
            return s * (self.tau / (self.tau + eps))
        if self.kind == "tv":
            return s.clamp(-self.tau, self.tau)
        return s

    def phi(self, f: torch.Tensor) -> torch.Tensor:
        if self.kind == "kl":
            return -self.tau * torch.expm1(-f / self.tau)
        if self.kind == "tv":
            return f.clamp_max(self.tau)
        return f

    def __eq__(self, other) -> bool:
        return isinstance(other, Penalty) and (self.kind, self.tau) == (other.kind, other.tau)

    def __hash__(self) -> int:
        return hash((self.kind, self.tau))

    def __repr__(self) -> str:
        return f"Penalty({self.kind!r}, tau={self.tau})"
