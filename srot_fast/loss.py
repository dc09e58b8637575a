r"""``SROTLoss``: a drop-in for ``geomloss.SamplesLoss('sinkhorn')`` with hard / soft SROT outlier reweighting.

Conventions (the same as GeomLoss's): cost C = |x - y| (p = 1) or |x - y|^2 / 2 (p = 2); eps = blur**p;
tau = reach**p (KL or TV marginal penalty; balanced OT when reach is None); eps-scaling from ``diameter``
by ``scaling``; ``debias=True`` (the default) returns the Sinkhorn divergence
OT(a, b) - OT(a, a) / 2 - OT(b, b) / 2 (+ eps (|a| - |b|)^2 / 2), as ``SamplesLoss()`` does. Each OT term is
the dual objective of the entropic problem at potentials solved to ``tol``.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Optional

import torch
from torch import nn

from . import _checks
from .backends import BACKENDS, available_backends, get_ops, resolve_backend
from .geometry import Geometry, bbox_diameter
from .kernels.triton.options import check_autotune, check_precision, kernel_options
from .sinkhorn import SinkhornResult, _solve
from .weights import _hard_weights, soft_offsets

__all__ = ["SROTLoss"]

STRATEGIES = (None, "hard", "soft")
_GEOMLOSS_ONLY = {  # SamplesLoss arguments srot_fast has no counterpart for -> what to use instead
    "cost": "a custom cost is not supported: srot_fast's kernels compute |x - y| (p=1) or |x - y|^2/2 (p=2)",
    "kernel": "kernel losses are not OT: use geomloss.SamplesLoss('gaussian' / 'laplacian' / 'energy')",
    "cluster_scale": "GeomLoss's multiscale clusters are not used: backend='blocksparse' (d <= 3) picks its own "
                     "blocks; or use backend='online' (streaming kernels)",
}


class SROTLoss(nn.Module):
    r"""Outlier-robust OT loss between weighted point clouds.

    Call as ``loss(x, y)`` or ``loss(a, x, b, y)``, with x (N, D) or (B, N, D), y (M, D) or (B, M, D),
    a (N,) / (B, N), b (M,) / (B, M) non-negative weights (default uniform 1/N, 1/M). A batch is solved as one
    problem set (one kernel launch per pass); ragged batches are padded with zero-weight points, which change
    nothing (not the diameter, not gamma). Returns a scalar (or (B,) values), or the potentials (f, g) when
    ``potentials=True``. float16 / bfloat16 inputs are computed in float32; the value has the input dtype.

    The first arguments are ``geomloss.SamplesLoss``'s, with the same defaults, so ``SROTLoss()`` means
    ``SamplesLoss()`` (balanced, p = 2, blur 0.05, scaling 0.5, debias=True); README.md has the table.

    Args:
        loss: 'sinkhorn' (the only OT loss; other GeomLoss names are refused).
        p: 1 (cost |x - y|, the paper's choice) or 2 (cost |x - y|^2 / 2).
        blur: eps = blur**p, the entropic regularisation (blur in data units).
        reach: None (balanced OT), a number, or a pair (reach_a, reach_b) (None in it: balanced on that side);
            tau = reach**p.
        diameter, scaling: eps-scaling from diameter**p down to eps by factors scaling**p.
        truncate, cost, kernel, cluster_scale: GeomLoss's; only their defaults are accepted.
        debias: subtract the self-transport terms (Sinkhorn divergence, Séjourné et al.); on by default as in
            GeomLoss. The paper's losses are not debiased (debias=False). With a pair of reaches the
            self-transport terms keep the pair, so that the loss of a measure to itself is 0.
        potentials: return (f, g) instead of the value (minus the self-transport potentials when debiased).
            They are returned detached: the solver's gradients come from the envelope theorem on the value,
            not from back-propagation through the iterations, so the potentials carry no graph.
        verbose: print the solver's diagnostics after each call.
        backend: 'auto' | 'online' (streaming: 'cpu' on CPU, 'triton'/'keops' on CUDA) | 'tensorized' | 'cpu' |
            'keops' | 'triton' | 'blocksparse'.
        strategy: None (plain OT), 'hard' (drop detected outliers' mass, renormalise) or 'soft'
            (add gamma / CE offsets to the cost; pair it with reach or mass so OT may refuse to move them).
        penalty: 'kl' (unbalanced OT) or 'tv' (partial-like), used when reach is set; 'balanced'
            (or reach=None) for hard marginals.
        mass: transport only this mass (entropic partial OT); needs reach None and debias=False.
        tol, max_iter: Sinkhorn stopping rule (relative L1 marginal error) and cap on all updates; tol=None
            runs GeomLoss's fixed schedule instead (max_iter not read). The value's error is second order in
            the marginal error (it is a dual objective at near-optimal potentials): at tol = 1e-3 with
            ``value_tol=None`` it is typically ~1e-6 relative. With the default value test a solve stops once
            its value has settled to about value_tol (= tol / 10) relative.
        value_tol: a solve also stops once its value has converged to about this relative accuracy (see
            :func:`srot_fast.sinkhorn`), which is what a loss needs: where Sinkhorn crawls (d = 64, small
            blur) the value settles long before the marginals reach tol. The gradient's error is first order
            in the marginal error (``last_result.marginal_error``): where accurate gradients matter more than
            time, pass None (the marginal test alone). 'auto' (default): tol / 10.
        gamma: offset scale in cost units; None -> max_ij C(x_i, y_j) per problem and call (detached).
        detector: a fitted :class:`srot_fast.OutlierDetector`; or pass ``scores=(s_x, s_y)`` (P(target))
            to the call. Scores are detached (a one-time warning says so if they require grad).
        ce_floor: smallest cross-entropy in the soft offsets (offsets <= gamma / ce_floor).
        warm_start: start each call's solves (the transport and, with ``debias``, the two debiasing terms) from
            the previous call's potentials when the shapes match (gradient flows, where consecutive problems are
            close); skips eps-scaling. Call ``reset()`` to forget them. Off by default: a start from an unrelated
            batch (fresh minibatches, rescaled points) can cost several times a cold solve's updates, and where
            it does not converge within max_iter the call solves cold (both costs are spent). With ``tol=None``
            the fixed schedule without eps-scaling is one update per call, at the target eps: the value then lags
            the problem (2 % on a slowly moving flow); pair warm starts with a tolerance.
        precision, autotune: the Triton backend's ``tl.dot`` precision ('tf32x3', 'ieee' or 'tf32'; None:
            ``SROT_TRITON_DOT_PRECISION``, else 'tf32x3') and block-size autotuning (None:
            ``SROT_TRITON_AUTOTUNE``), as in :func:`srot_fast.sinkhorn`. The other backends ignore them
            (they compute in the input dtype).

    After a call, ``last_result`` holds the :class:`SinkhornResult` of the cross problem (for a batch,
    per-problem ``n_iter`` and ``marginal_error`` tensors), e.g. to read ``backend`` or ``row_mass``; its
    ``value`` is detached, so that it keeps no autograd graph (and no activations) alive between calls.
    Second-order derivatives (double backward) raise a RuntimeError; forward-mode AD and torch.func transforms
    (vmap, grad, jvp) a NotImplementedError.

    Example:
        >>> loss = SROTLoss("sinkhorn", p=1, blur=0.01, reach=1.0, strategy="soft")
        >>> value = loss(x, y, scores=(detector.predict_proba(x), detector.predict_proba(y)))
    """

    def __init__(self, loss: str = "sinkhorn", p: int = 2, blur: float = 0.05, reach=None,
                 diameter: Optional[float] = None, scaling: float = 0.5, truncate: float = 5, cost=None,
                 kernel=None, cluster_scale=None, debias: bool = True, potentials: bool = False,
                 verbose: bool = False, backend: str = "auto", *, strategy: Optional[str] = None,
                 penalty: str = "kl", mass: Optional[float] = None, tol: Optional[float] = 1e-3,
                 max_iter: int = 1000, value_tol="auto", gamma: Optional[float] = None,
                 detector=None, ce_floor: float = 1e-6,
                 warm_start: bool = False, precision: Optional[str] = None, autotune: Optional[bool] = None):
        super().__init__()
        if not isinstance(loss, str):
            raise TypeError(f"loss must be the loss name 'sinkhorn' (the first argument, as in geomloss.SamplesLoss); "
                            f"got {loss!r}: pass p=... by keyword")
        if loss != "sinkhorn":
            raise ValueError(f"loss must be 'sinkhorn' (SROT is an OT loss), got {loss!r}; for kernel or "
                             "Hausdorff losses use geomloss.SamplesLoss")
        for name, value in (("cost", cost), ("kernel", kernel), ("cluster_scale", cluster_scale)):
            if value is not None:
                raise ValueError(f"{name}: {_GEOMLOSS_ONLY[name]}")
        if truncate != 5:
            raise ValueError("truncate only acts in GeomLoss's multiscale backend; srot_fast's counterpart, "
                             "backend='blocksparse' (d <= 3), bounds what it drops itself: leave truncate at 5 "
                             "(or use backend='online')")
        self.p = _checks.check_p(p)
        self.blur = _checks.check_positive(blur, "blur")
        self.eps = _checks.power(self.blur, self.p, "blur")
        if penalty not in ("kl", "tv", "balanced"):
            raise ValueError(f"penalty must be 'kl', 'tv' (with reach) or 'balanced', got {penalty!r}")
        if reach is None or penalty == "balanced":
            if reach is not None:
                raise ValueError("penalty='balanced' takes no reach; set reach=None")
            self.penalty, self.tau = "balanced", None
        else:
            ra, rb = _checks.pair_of(reach, "reach")
            self.penalty, self.tau = penalty, (_checks.power(ra, self.p, "reach"), _checks.power(rb, self.p, "reach"))
        if mass is not None:
            if reach is not None:
                raise ValueError("mass (partial OT) and reach (unbalanced OT) are exclusive; set one")
            mass = _checks.check_positive(mass, "mass")
            if debias:
                raise ValueError("debias is not defined for partial OT (mass); pass debias=False")
        self.mass = mass
        self.diameter = None if diameter is None else _checks.check_positive(diameter, "diameter")
        self.scaling = _checks.check_scaling(scaling)
        if backend == "multiscale":
            raise ValueError("backend='multiscale' is GeomLoss's; srot_fast's counterpart is 'blocksparse' (d <= 3: "
                             "skips the block pairs a bound proves negligible), or use 'online' (streaming) or 'auto'")
        if backend != "auto" and backend != "online" and backend not in BACKENDS:
            raise ValueError(f"backend must be 'auto', 'online' or one of {BACKENDS}, got {backend!r}")
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
        if tol is not None:
            tol = _checks.check_positive(tol, "tol")
        max_iter = _checks.non_negative_int(max_iter, "max_iter")
        if isinstance(value_tol, str) and value_tol == "auto":
            value_tol = None if tol is None else tol / 10
        elif value_tol is not None:
            value_tol = _checks.check_positive(value_tol, "value_tol")
        self.value_tol = value_tol
        self.debias = _checks.check_flag(debias, "debias")
        self.potentials = _checks.check_flag(potentials, "potentials")
        self.backend, self.verbose = backend, _checks.check_flag(verbose, "verbose")
        self.strategy, self.detector = strategy, detector
        self.tol, self.max_iter = tol, max_iter
        self.warm_start = _checks.check_flag(warm_start, "warm_start")
        self.precision, self.autotune = check_precision(precision), check_autotune(autotune)
        self.last_result: Optional[SinkhornResult] = None
        self._warm: Optional[tuple] = None  # (f, g) of the previous call
        self._warm_debias: Optional[tuple] = None  # the (f, g) of its two debiasing solves
        self._warned_grad_scores = False

    def reset(self) -> None:
        """Forget the potentials kept for ``warm_start``."""
        self._warm = self._warm_debias = None

    def extra_repr(self) -> str:
        return (f"p={self.p}, blur={self.blur}, penalty={self.penalty!r}, tau={self.tau}, mass={self.mass}, "
                f"strategy={self.strategy!r}, debias={self.debias}, backend={self.backend!r}")

    # -- call -------------------------------------------------------------------------------------
    @staticmethod
    def _split_args(args) -> tuple:
        """(a, x, b, y) from the call's positional arguments (x, y) or (a, x, b, y); a, b None when not given."""
        if len(args) == 2:
            return None, args[0], None, args[1]
        if len(args) == 4:
            return tuple(args)
        raise TypeError(f"SROTLoss takes (x, y) or (a, x, b, y), got {len(args)} positional arguments")

    def forward(self, *args, scores=None):
        a, x, b, y = self._split_args(args)
        x = _checks.check_points(x, "x", batched=True)
        y = _checks.check_points(y, "y", batched=True)
        if x.dtype != y.dtype and torch.is_autocast_enabled(x.device.type):  # e.g. a bfloat16 network output
            common = torch.promote_types(x.dtype, y.dtype)  # against float32 data: both in the wider dtype
            x, y = x.to(common), y.to(common)
        _checks.check_pair(x, y)
        a = _checks.check_weights(a, x, "a")
        b = _checks.check_weights(b, y, "b")
        batched = x.dim() == 3
        if not batched:
            x, y, a, b = x[None], y[None], a[None], b[None]
        s_x, s_y = self._scores(x, y, scores, batched)
        return self._batch(a, x, b, y, s_x, s_y, batched)

    def _scores(self, x, y, scores, batched: bool = True):
        """(B, N), (B, M) P(target) per point, detached, or (None, None) without a strategy. ``batched=False``:
        the call was unbatched (x, y made (1, N, D), (1, M, D)); errors name the unbatched shapes."""
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
            return s_x.to(x.device, torch.float64), s_y.to(y.device, torch.float64)
        if not (isinstance(scores, (tuple, list)) and len(scores) == 2):
            raise TypeError("scores must be a pair (s_x, s_y) of P(target) tensors")
        out = []
        for given, pts, name in ((scores[0], x, "scores[0]"), (scores[1], y, "scores[1]")):
            s = given
            if torch.is_tensor(s) and s.dim() == pts.dim() - 2:  # unbatched scores for an unbatched call
                s = s[None]
            if not torch.is_tensor(s) or s.shape != pts.shape[:-1]:
                want = tuple(pts.shape[0 if batched else 1:-1])
                raise ValueError(f"{name} must be a tensor of shape {want} (one P(target) per point), got "
                                 f"{tuple(given.shape) if torch.is_tensor(given) else type(given).__name__}")
            if s.device != pts.device:
                raise ValueError(f"{name} is on {s.device} but the points are on {pts.device}; move it there")
            d = _checks.check_probabilities(s.detach(), name, one_dim=False).double()
            if s.requires_grad and not self._warned_grad_scores:
                warnings.warn("SROTLoss detaches the outlier scores: no gradient flows to the detector through "
                              "the loss (the SROT weights and offsets are constants of the OT problem)",
                              UserWarning, stacklevel=3)
                self._warned_grad_scores = True
            out.append(d)
        return out[0], out[1]

    def _gamma(self, x, y, a, b) -> torch.Tensor:
        """(B,) gamma per problem: the largest ground cost between points of positive weight (detached)."""
        if self.gamma is not None:
            return x.new_full((x.shape[0],), self.gamma, dtype=torch.float64)
        xs, ys = _fill_padding(x.detach(), a), _fill_padding(y.detach(), b)
        xs, ys = xs.to(_compute(xs.dtype)), ys.to(_compute(ys.dtype))
        name = resolve_backend(self._backend(x), x.shape[-2], y.shape[-2], x.device)
        geom = Geometry(get_ops(name), xs, ys, self.p, options=kernel_options(name, self.precision, self.autotune))
        gam = geom.max_cost().double().reshape(-1)
        return torch.where(gam > 0, gam, torch.ones_like(gam))

    def _backend(self, x) -> str:
        """The backend name for points ``x``: 'online' is the streaming kernel of their device ('cpu' on CPU;
        'triton', else 'keops', on CUDA), never the dense 'tensorized' pass."""
        if self.backend != "online":
            return self.backend
        if x.device.type == "cpu":
            return "cpu"
        installed = available_backends()
        for name in ("triton", "keops"):
            if name in installed:
                return name
        raise ImportError("backend='online' on CUDA needs the streaming kernels of triton or pykeops: pip install "
                          "'srot_fast[triton]' (or 'srot_fast[keops]'); backend='tensorized' is the dense pass")

    def _symmetric(self) -> bool:
        """Whether the debiasing terms OT(a, a), OT(b, b) are symmetric problems (one penalty on both
        marginals), solved by the symmetric loop; with reach = (ra, rb), ra != rb, they keep the pair of
        penalties of OT(a, b) and take the alternating loop, so that the loss of a measure to itself is 0."""
        return self.tau is None or self.tau[0] == self.tau[1]

    def _solve(self, x, y, a, b, u, v, diam, init=None, self_transport=False):
        """One term's solve; a warm start (``init``) that does not converge is dropped for a cold solve, so that
        potentials kept from an unrelated batch (a fresh minibatch, rescaled points) cost at most one cold solve
        more and are never passed on (at blur 0.01 such starts ran to max_iter, each from the last one's
        unconverged potentials)."""
        def solve(start):
            return _solve(x, y, a, b, p=self.p, eps=self.eps, penalty=self.penalty, tau=self.tau, mass=self.mass,
                          u=u, v=v, scaling=self.scaling, diameter=diam, tol=self.tol, max_iter=self.max_iter,
                          backend=self._backend(x), init=start, self_transport=self_transport,
                          value_tol=self.value_tol, precision=self.precision, autotune=self.autotune, checked=True)

        if init is None:
            return solve(None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = solve(init)
        if bool(torch.as_tensor(res.converged).all()):
            for w in caught:  # the warm solve's warnings, as they were
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            return res
        return solve(None)

    def _init(self, kept: Optional[tuple], a: torch.Tensor, b: torch.Tensor) -> Optional[tuple]:
        """With ``warm_start``, the potentials ``kept`` from the previous call's solve of the same term where they fit
        weights a, b (shapes, dtype, device); else None (a cold solve)."""
        if not self.warm_start or kept is None:
            return None
        f0, g0 = kept
        fits = (f0.shape == a.shape and g0.shape == b.shape and f0.dtype == _compute(a.dtype)
                and f0.device == a.device)
        return kept if fits else None

    def _batch(self, a, x, b, y, s_x, s_y, batched: bool):
        """Values (B,) (or potentials) of B problems (x (B, N, D), ...), solved as one batch; with
        ``batched=False`` (B = 1) the solve and the outputs drop the batch dimension."""
        u = v = None
        if self.strategy == "hard":
            pairs = [_hard_weights(a[k], s_x[k], b[k], s_y[k]) for k in range(a.shape[0])]  # float64 scores
            if pairs:  # rescaled weights: checked again (the solves take them as checked)
                a = _checks.check_weights(torch.stack([w for w, _ in pairs]), x, "a (after the hard SROT reweighting)")
                b = _checks.check_weights(torch.stack([w for _, w in pairs]), y, "b (after the hard SROT reweighting)")
        elif self.strategy == "soft":
            gam = self._gamma(x, y, a, b)
            pairs = [soft_offsets(s_x[k], s_y[k], float(gam[k]), self.ce_floor) for k in range(x.shape[0])]
            if pairs:
                u = torch.stack([o for o, _ in pairs]).to(_compute(x.dtype))
                v = torch.stack([o for _, o in pairs]).to(_compute(y.dtype))
                if not bool(torch.isfinite(u).all() & torch.isfinite(v).all()):  # the solves take them as checked
                    raise ValueError(f"the soft SROT offsets gamma / CE overflow {_compute(x.dtype)}: gamma "
                                     f"(largest {float(gam.max()):.3g}) / ce_floor ({self.ce_floor:g}) is too large; "
                                     f"lower gamma or raise ce_floor")
            else:
                u, v = x.new_zeros(x.shape[:-1]), y.new_zeros(y.shape[:-1])
        diam = self.diameter
        if diam is None:
            diam = bbox_diameter(x.detach(), y.detach(), a.detach(), b.detach())
        if not batched:
            x, y, a, b = x[0], y[0], a[0], b[0]
            u = None if u is None else u[0]
            v = None if v is None else v[0]
        res = self._solve(x, y, a, b, u, v, diam, self._init(self._warm, a, b))
        if self.warm_start:
            self._warm = (res.f.detach(), res.g.detach())
        self.last_result = dataclasses.replace(res, value=res.value.detach())  # (it must not keep the graph alive)
        if self.verbose:
            its, err = torch.as_tensor(res.n_iter), torch.as_tensor(res.marginal_error)
            print(f"SROTLoss: {res.backend}, updates {its.tolist()}, marginal error {float(err.max()):.2e}, "
                  f"{res.passes} passes, {res.syncs} syncs")
        if not self.debias:
            return (res.f.detach(), res.g.detach()) if self.potentials else res.value
        sym = self._symmetric()
        kept = self._warm_debias or (None, None)
        rxx = self._solve(x, x, a, a, u, u, diam, self._init(kept[0], a, a), self_transport=sym)
        ryy = self._solve(y, y, b, b, v, v, diam, self._init(kept[1], b, b), self_transport=sym)
        if self.warm_start:
            self._warm_debias = tuple((r.f.detach(), r.g.detach()) for r in (rxx, ryy))
        if self.potentials:
            return (res.f - rxx.f).detach(), (res.g - ryy.g).detach()
        value = res.value - 0.5 * (rxx.value + ryy.value)
        if self.tol is None:  # GeomLoss's value formula already holds the mass-gap term
            return value
        mass_gap = (a.sum(-1) - b.sum(-1)) ** 2
        return value + (0.5 * self.eps * mass_gap).to(res.value.dtype)


def _compute(dtype: torch.dtype) -> torch.dtype:
    """The dtype the solver runs in for inputs of ``dtype`` (float32 for float16 / bfloat16)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _fill_padding(pts: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(B, N, D) points with each zero-weight point replaced by the problem's first point of positive weight,
    so that max_ij C over all pairs equals the max over pairs of positive weight."""
    first = (w > 0).to(torch.int8).argmax(-1)  # (B,)
    rep = pts[torch.arange(pts.shape[0], device=pts.device), first]  # (B, D)
    return torch.where((w > 0)[..., None], pts, rep[:, None, :])
