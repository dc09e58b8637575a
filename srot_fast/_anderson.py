r"""Safeguarded Anderson acceleration of the Sinkhorn update, per problem of a batch (docs/DESIGN.md, Acceleration).

The alternating update is a fixed-point map of the column potential alone,
    T(g) = A_b(S_y(A_a(S_x(g)))),
f being the exact update A_a(S_x(g)). :class:`Anderson` proposes the next g from the last k + 1 iterates;
:class:`Plain` takes T(g) itself (``accelerate=False``). Both work on (B, M) potentials and (B,) per-problem
state that stays on the device.
"""
from __future__ import annotations

import math

import torch

DEPTH = 5  # potentials kept in the history


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class Plain:
    """Plain alternating Sinkhorn: g <- T(g) (frozen where ``done``)."""

    def step(self, g, g_hat, err, done):
        return torch.where(done[:, None], g, g_hat)

    def subset(self, idx: torch.Tensor) -> "Plain":
        return self


class Anderson:
    """Anderson acceleration (type II) of g -> T(g), per problem.

    With the last k + 1 iterates g_i, their images T(g_i) and residuals r_i = T(g_i) - g_i, the next g is
    T(g) - dG gamma, where dG, dR hold the differences of consecutive images and residuals and gamma
    minimises |r - dR gamma| (a (k, k) least-squares solve per problem through its normal equations, in
    float64, with a relative ridge of 1e-10). Safeguard: where the marginal error rose above twice its best
    value (or is NaN), the plain step T(g) is taken and that problem's history restarts. Residuals count on
    points of positive weight only (``mask`` (B, M)), so zero-weight padding changes nothing. ``rank_sum``
    completes sums over points taken on one shard of a sharded geometry (the identity otherwise)."""

    def __init__(self, batch: int, like: torch.Tensor, mask: torch.Tensor, depth: int = DEPTH,
                 rank_sum=_identity):
        self.depth = depth
        self.rank_sum = rank_sum
        self.mask = mask.double()
        self.images: list = []   # T(g_i), (B, M) each
        self.resid: list = []    # r_i, (B, M) each
        self.valid = like.new_zeros(batch, dtype=torch.int64)  # (B,) entries since the problem's last restart
        self.best = like.new_full((batch,), math.inf, dtype=torch.float64)  # (B,) smallest error seen

    def subset(self, idx: torch.Tensor) -> "Anderson":
        """The state of problems ``idx`` (int64 (K,)), for a smaller batch that goes on from here."""
        out = Anderson(int(idx.numel()), self.best, self.mask[idx], self.depth, self.rank_sum)
        out.images, out.resid = [t[idx] for t in self.images], [t[idx] for t in self.resid]
        out.valid, out.best = self.valid[idx], self.best[idx]
        return out

    def step(self, g, g_hat, err, done):
        """(B, M) next g from the current g, its image g_hat = T(g) and the (B,) marginal error at g."""
        bad = ~(err <= 2 * self.best)
        self.best = torch.minimum(self.best, err.nan_to_num(math.inf))
        self.images.append(g_hat)
        self.resid.append(g_hat - g)
        if len(self.resid) > self.depth + 1:
            self.images.pop(0)
            self.resid.pop(0)
        self.valid = torch.where(bad, torch.ones_like(self.valid), (self.valid + 1).clamp_max(self.depth + 1))
        k = len(self.resid) - 1
        if k == 0:
            return torch.where(done[:, None], g, g_hat)
        # column c of dR / dG is the difference of entries c and c + 1: kept if both are since the last restart
        keep = (torch.arange(k, device=g.device)[None, :] >= (k + 1 - self.valid)[:, None]).double()  # (B, k)
        dR = torch.stack([b - a for a, b in zip(self.resid[:-1], self.resid[1:])], -1).double()
        dR = dR * keep[:, None] * self.mask[..., None]
        dG = torch.stack([b - a for a, b in zip(self.images[:-1], self.images[1:])], -1).double() * keep[:, None]
        rhs = (self.resid[-1].double() * self.mask)[..., None]
        normal = self.rank_sum(dR.transpose(-1, -2) @ torch.cat([dR, rhs], -1))  # (B, k, k + 1): [gram | dR^T r]
        gram, rhs = normal[..., :k], normal[..., k:]
        reg = 1e-10 * gram.diagonal(dim1=-2, dim2=-1).mean(-1) + 1e-300
        gram = gram + reg[:, None, None] * torch.eye(k, dtype=gram.dtype, device=g.device)
        # solve_ex: no error check, hence no host synchronisation on CUDA (a failed solve is caught below)
        gamma = torch.linalg.solve_ex(gram, rhs)[0]
        g_new = (g_hat.double() - (dG @ gamma)[..., 0]).to(g.dtype)
        ok = ~bad & (self.rank_sum((~torch.isfinite(g_new)).sum(-1).double()) == 0)
        return torch.where(done[:, None], g, torch.where(ok[:, None], g_new, g_hat))
