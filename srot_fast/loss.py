r"""``SROTLoss``: a GeomLoss-style OT loss module with hard / soft SROT outlier reweighting.

Conventions (same as ``geomloss.SamplesLoss('sinkhorn')`` where the meaning is the same):
cost C = |x - y| (p = 1) or |x - y|^2 / 2 (p = 2); eps = blur**p; tau = reach**p (KL or TV marginal
penalty; balanced OT when reach is None); eps-scaling from ``diameter`` by ``scaling``.
The value is the dual objective of the entropic problem (the Sinkhorn divergence with debias=True).
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import nn

from . import _checks
from .backends import BACKENDS, get_ops, resolve_backend
from .geometry import bbox_diameter
from .sinkhorn import SinkhornResult, sinkhorn
from .weights import hard_weights, soft_offsets

__all__ = ["SROTLoss"]

STRATEGIES = (None, "hard", "soft")


class SROTLoss(nn.Module):
    r"""Outlier-robust OT loss between weighted point clouds.

    Call as ``loss(x, y)`` or ``loss(a, x, b, y)``, with x (N, D) or (B, N, D), y (M, D) or (B, M, D),
    a (N,) / (B, N), b (M,) / (B, M) non-negative weights (default uniform 1/N, 1/M). Returns a scalar
    (or (B,) values), or the potentials (f, g) when ``potentials=True``.

    Args:
        p: 1 (cost |x - y|, the paper's choice) or 2 (cost |x - y|^2 / 2).
        blur: eps = blur**p, the entropic regularisation (blur in data units).
        reach: None (balanced OT), a number, or a pair (reach_a, reach_b); tau = reach**p.
        penalty: 'kl' (unbalanced OT) or 'tv' (partial-like), used when reach is set; 'balanced'
            (or reach=None) for hard marginals.
        mass: transport only this mass (entropic partial OT); needs reach None.
        diameter, scaling: eps-scaling from diameter**p down to eps by factors scaling**p.
        debias: subtract the self-transport terms (Sinkhorn divergence, Séjourné et al.); off by default.
        potentials: return (f, g) instead of the value.
        backend: 'auto' | 'tensorized' | 'keops' | 'triton'.
        strategy: None (plain OT), 'hard' (drop detected outliers' mass, renormalise) or 'soft'
            (add gamma / CE offsets to the cost; pair it with reach or mass so OT may refuse to move them).
        gamma: offset scale in cost units; None -> max_ij C(x_i, y_j) per call (detached).
        detector: a fitted :class:`srot_fast.OutlierDetector`; or pass ``scores=(s_x, s_y)`` (P(target))
            to the call.
        ce_floor: smallest cross-entropy in the soft offsets (offsets <= gamma / ce_floor).
        tol, max_iter: Sinkhorn stopping rule (relative L1 marginal error) and cap.
        warm_start: start each call from the previous call's potentials when the shapes match
            (gradient flows, where consecutive problems are close); skips eps-scaling. Call
            ``reset()`` to forget them. Off by default (unrelated batches gain nothing).

    After a call, ``last_result`` holds the :class:`SinkhornResult` of the (last) cross problem,
    e.g. to read ``n_iter``, ``backend`` or ``row_mass``.

    Example:
        >>> loss = SROTLoss(p=1, blur=0.01, reach=1.0, strategy="soft")
        >>> value = loss(x, y, scores=(detector.predict_proba(x), detector.predict_proba(y)))
    """

    def __init__(self, p: int = 2, blur: float = 0.05, reach=None, diameter: Optional[float] = None,
                 scaling: float = 0.5, debias: bool = False, potentials: bool = False, backend: str = "auto",
                 strategy: Optional[str] = None, penalty: str = "kl", mass: Optional[float] = None,
                 tol: float = 1e-4, max_iter: int = 1000, gamma: Optional[float] = None,
                 detector=None, ce_floor: float = 1e-6, warm_start: bool = False):
        super().__init__()
        self.p = _checks.check_p(p)
        self.blur = _checks.check_positive(blur, "blur")
        self.eps = self.blur**self.p
        if penalty not in ("kl", "tv", "balanced"):
            raise ValueError(f"penalty must be 'kl', 'tv' (with reach) or 'balanced', got {penalty!r}")
        if reach is None or penalty == "balanced":
            if reach is not None:
                raise ValueError("penalty='balanced' takes no reach; set reach=None")
            self.penalty, self.tau = "balanced", None
        else:
            ra, rb = _checks.pair_of(reach, "reach")
            self.penalty, self.tau = penalty, (ra**self.p, rb**self.p)
        if mass is not None:
            if reach is not None:
                raise ValueError("mass (partial OT) and reach (unbalanced OT) are exclusive; set one")
            mass = _checks.check_positive(mass, "mass")
        self.mass = mass
        self.diameter = None if diameter is None else _checks.check_positive(diameter, "diameter")
        self.scaling = _checks.check_positive(scaling, "scaling")
        if not self.scaling < 1:
            raise ValueError(f"scaling must be in (0, 1), got {scaling}")
        if backend != "auto" and backend not in BACKENDS:
            raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be None, 'hard' or 'soft', got {strategy!r}")
        if strategy == "soft" and self.penalty == "balanced" and mass is None:
            warnings.warn("strategy='soft' with balanced marginals (reach=None, mass=None) has no effect: "
                          "separable cost offsets cannot change a balanced plan. Set reach or mass.",
                          UserWarning, stacklevel=2)
        if detector is not None and not hasattr(detector, "predict_proba"):
            raise TypeError("detector must be a fitted OutlierDetector (with predict_proba)")
        self.gamma = None if gamma is None else _checks.check_positive(gamma, "gamma")
        self.ce_floor = _checks.check_positive(ce_floor, "ce_floor")
        self.debias, self.potentials, self.backend = bool(debias), bool(potentials), backend
        self.strategy, self.detector = strategy, detector
        self.tol, self.max_iter = tol, max_iter
        self.warm_start = bool(warm_start)
        self.last_result: Optional[SinkhornResult] = None
        self._warm: dict = {}  # batch index -> (f, g) of the previous call

    def reset(self) -> None:
        """Forget the potentials kept for ``warm_start``."""
        self._warm.clear()

    def extra_repr(self) -> str:
        return (f"p={self.p}, blur={self.blur}, penalty={self.penalty!r}, tau={self.tau}, mass={self.mass}, "
                f"strategy={self.strategy!r}, debias={self.debias}, backend={self.backend!r}")

    # -- call -------------------------------------------------------------------------------------
    def forward(self, *args, scores=None):
        if len(args) == 2:
            a, x, b, y = None, args[0], None, args[1]
        elif len(args) == 4:
            a, x, b, y = args
        else:
            raise TypeError(f"SROTLoss takes (x, y) or (a, x, b, y), got {len(args)} positional arguments")
        x = _checks.check_points(x, "x", batched=True)
        y = _checks.check_points(y, "y", batched=True)
        _checks.check_pair(x, y)
        a = _checks.check_weights(a, x, "a")
        b = _checks.check_weights(b, y, "b")
        s_x, s_y = self._scores(x, y, scores)
        if x.dim() == 2:
            return self._single(a, x, b, y, s_x, s_y, 0)
        outs = [self._single(a[k], x[k], b[k], y[k], None if s_x is None else s_x[k],
                             None if s_y is None else s_y[k], k) for k in range(x.shape[0])]
        if self.potentials:
            return torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])
        return torch.stack(outs)

    def _scores(self, x, y, scores):
        if self.strategy is None:
            if scores is not None:
                warnings.warn("scores are ignored with strategy=None; set strategy='hard' or 'soft'",
                              UserWarning, stacklevel=3)
            return None, None
        if scores is None:
            if self.detector is None:
                raise ValueError(f"strategy={self.strategy!r} needs a fitted detector (SROTLoss(detector=...)) "
                                 "or scores=(s_x, s_y) passed to the call")
            if not getattr(self.detector, "is_fitted", True):
                raise ValueError("the detector is not fitted; call detector.fit(source, target) first")
            s_x = self.detector.predict_proba(x.detach().reshape(-1, x.shape[-1])).reshape(x.shape[:-1])
            s_y = self.detector.predict_proba(y.detach().reshape(-1, y.shape[-1])).reshape(y.shape[:-1])
            return s_x.to(x.dtype), s_y.to(y.dtype)
        if not (isinstance(scores, (tuple, list)) and len(scores) == 2):
            raise TypeError("scores must be a pair (s_x, s_y) of P(target) tensors")
        s_x, s_y = scores
        for s, pts, name in ((s_x, x, "scores[0]"), (s_y, y, "scores[1]")):
            if not torch.is_tensor(s) or s.shape != pts.shape[:-1]:
                raise ValueError(f"{name} must be a tensor of shape {tuple(pts.shape[:-1])} (one P(target) per "
                                 f"point), got {tuple(s.shape) if torch.is_tensor(s) else type(s).__name__}")
        return s_x.detach().to(x.dtype), s_y.detach().to(y.dtype)

    def _solve(self, x, y, a, b, u, v, diam, init=None):
        return sinkhorn(x, y, a, b, p=self.p, eps=self.eps, penalty=self.penalty, tau=self.tau, mass=self.mass,
                        u=u, v=v, scaling=self.scaling, diameter=diam, tol=self.tol, max_iter=self.max_iter,
                        backend=self.backend, init=init)

    def _single(self, a, x, b, y, s_x, s_y, k):
        u = v = None
        if self.strategy == "hard":
            a, b = hard_weights(a, s_x, b, s_y)
        elif self.strategy == "soft":
            gamma = self.gamma
            if gamma is None:  # the paper's default: the largest ground cost (treated as a constant)
                ops = get_ops(resolve_backend(self.backend, x.shape[0], y.shape[0], x.device))
                gamma = float(ops.max_cost(x.detach(), y.detach(), self.p)) or 1.0
            u, v = soft_offsets(s_x, s_y, gamma, self.ce_floor)
        diam = self.diameter if self.diameter is not None else bbox_diameter(x.detach(), y.detach())
        init = None
        if self.warm_start:
            prev = self._warm.get(k)
            if prev is not None and prev[0].shape == a.shape and prev[1].shape == b.shape \
                    and prev[0].dtype == a.dtype and prev[0].device == a.device:
                init = prev
        res = self._solve(x, y, a, b, u, v, diam, init)
        if self.warm_start:
            self._warm[k] = (res.f.detach(), res.g.detach())
        self.last_result = res
        if not self.debias:
            return (res.f, res.g) if self.potentials else res.value
        if self.mass is not None:
            raise ValueError("debias is not defined for partial OT (mass); use debias=False")
        rxx = self._solve(x, x, a, a, u, u, diam)
        ryy = self._solve(y, y, b, b, v, v, diam)
        if self.potentials:
            return res.f - rxx.f, res.g - ryy.g
        mass_gap = (a.sum() - b.sum()) ** 2
        return res.value - 0.5 * (rxx.value + ryy.value) + 0.5 * self.eps * mass_gap
