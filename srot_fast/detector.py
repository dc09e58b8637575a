r"""Outlier detector of SROT (paper §3; docs/DESIGN.md, Detector): a source-vs-target classifier trained with virtual
adversarial training (VAT), whose disagreements with the labels flag type-II outliers.

f(x) = P(x comes from the target) = sigmoid(logit(x)). Labels: 0 = source, 1 = target.
Loss per sample (``method="vat"``, the paper's L_AR):

    omega * CE(f(x), y) + KL(f(x) || f(x + r_adv)),     f(x) detached inside the Bernoulli KL,
    r_adv = eta * d / |d|,   d = one power-iteration step on the Hessian H of r -> KL(f(x) || f(x + r)) at 0

(:mod:`srot_fast.vat`). ``power="fused"`` takes the step exactly, H d0 = J^T F J d0 with F = sigma (1 - sigma),
from one jvp and one vjp (for the built-in nets, whose logits are per sample, that is the input gradient of
the logit, the exact dominant eigenvector); ``power="fd"`` is the finite-difference reference of Miyato et al.
(grad of the KL at r = xi d0). ``method="ce"`` trains the same classifier with the CE term only (the paper's
SROT-CE baseline, which memorises the outliers' labels).

Inputs are points (N, D) (default classifier: :class:`srot_fast.nets.MLP`) or images (N, C, H, W) (default:
the paper's :class:`srot_fast.nets.ConvNet`), standardised with the pooled mean and standard deviation
(computed in float64; per coordinate for points, per channel for images). The adversarial perturbation lives
in standardised units for points (so every coordinate counts alike, whatever its scale) and in data units for
images (one scale per channel). Batch-norm statistics are frozen during the perturbed passes
(:class:`srot_fast.vat.FrozenBatchNorm`): they normalise by the clean batch's statistics and never update the
running ones.

A source point is an outlier when f(x_i) > 1/2, a target point when f(y_j) < 1/2; see
:mod:`srot_fast.weights` for the hard weights and soft cost offsets built from these scores.

This module is the public API (construction, fit, inference, save / load); the training loop and the
standardisation live in :mod:`srot_fast._detector_train`, the detector file format and its validation in
:mod:`srot_fast._detector_file`.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
from torch import nn

from . import _checks
from . import weights as _weights
from ._detector_file import (
    _FORMAT,
    _FORMAT_VERSION,
    DetectorFileError,
    _arch_of,
    _build_classifier,
    _read_detector_file,
    _validate_detector_file,
)
from ._detector_train import _PREDICT_ELEMENTS, _standardised, _stat_dtype, _Training

__all__ = ["OutlierDetector", "DetectorFileError"]

_METHODS = ("vat", "ce")
_POWERS = ("fused", "fd")


class OutlierDetector(_Training):
    r"""Source-vs-target classifier f(x) = P(target | x) used to flag type-II outliers (SROT, paper §3).

    Args:
        model: ``None`` -> built at :meth:`fit` with weights from ``seed``: a ReLU MLP with widths ``hidden``
            for points (N, D), the paper's :class:`~srot_fast.nets.ConvNet` (6 conv layers 32, 32, 64, 64, 128,
            128 + batch-norm + ReLU, one linear layer) for images (N, C, H, W). Otherwise an ``nn.Module``
            mapping standardised inputs (B, D) or (B, C, H, W) to (B,) or (B, 1) logits; it is trained in place
            (its initial weights are yours, so re-fitting continues from the trained weights).
        hidden: hidden widths of the default MLP (points only).
        method: ``"vat"`` (CE + virtual adversarial KL, the paper's AR classifier) or ``"ce"`` (CE only).
        eta: radius of the adversarial perturbation (Euclidean norm of the whole perturbation of one point or
            image). Points: in standardised units (each coordinate divided by its pooled standard deviation);
            ``None`` -> 0.1 x the median distance between two standardised training points (pooled source +
            target, at most 1000 of them), which is about 0.14 sqrt(D) for D independent coordinates. Images:
            in data units; ``None`` -> 0.15 x sqrt(C H W) x the rms per-channel standard deviation (28x28 MNIST
            in [0, 1]: about 1.4). The value used is stored in ``eta_``. It must exceed the size of an outlier
            cluster for VAT to override its labels and stay below the gap between the two measures
            (docs/DETECTOR.md, "Defaults on points").
        xi: finite-difference step of ``power="fd"``, in standardised input units. Where the finite difference
            underflows to an exactly zero gradient, the random direction is used instead.
        omega: weight of the CE term in the VAT loss (the KL term has weight 1); ``None`` -> 3e-2 for points and
            images (the paper uses 1e-3 with about 20 times more optimiser steps; smaller values let the KL
            term collapse short trainings onto one side of 1/2, docs/DETECTOR.md). The value used is stored in
            ``omega_``. Ignored for ``method="ce"``.
        epochs: passes over the data. ``None`` -> enough epochs for about 2000 optimiser steps (at least 20),
            points and images alike.
        batch_size: points per mini-batch (drawn from the shuffled union of source and target; paper: 64).
        lr: Adam learning rate. ``None`` -> 3e-3 for points, 2e-4 for images (paper).
        seed: seeds a private generator for the built-in nets' init, the shuffling and the random directions.
        progress: show a tqdm bar over epochs.
        device: training device; ``None`` -> the device of the source points, except that images on the CPU
            train on CUDA when it is available.
        num_threads: torch intra-op CPU threads while :meth:`fit` runs (``torch.set_num_threads``, set for
            the duration of the call and restored afterwards; process-wide). Default 1: the training step on
            points works on tiny tensors, where extra OpenMP threads cost more than they gain. ``None`` leaves
            torch's setting.
        power: power-iteration step of VAT: ``"fused"`` (exact, no xi; default) or ``"fd"`` (reference).
            See :mod:`srot_fast.vat` and docs/DETECTOR.md for the comparison.
        early_stopping: ``None`` or a patience in epochs: stop when the mean training loss of an epoch has not
            improved on the best one by more than 0.1 % for that many epochs (``n_epochs_`` records the count).

    Classes are balanced in the loss: each point's loss is weighted by (N + M) / (2 * its class size).
    For a user model, the first VAT batch checks whether its logits are per sample (with batch-norm frozen);
    if so (``per_sample_``) the fused step takes the one-vjp rank-one shortcut, else the jvp + vjp product.
    Power iteration refuses float16 / bfloat16 models (TypeError; convert with ``model.float()``).
    A fitted detector is saved with :meth:`save` and restored with :meth:`load` (``weights_only`` loading,
    validated; malformed files raise :class:`DetectorFileError`).
    """

    def __init__(
        self,
        model: Optional[nn.Module] = None,
        *,
        hidden: Sequence[int] = (64, 64),
        method: str = "vat",
        eta: Optional[float] = None,
        xi: float = 1e-6,
        omega: Optional[float] = None,
        epochs: Optional[int] = None,
        batch_size: int = 64,
        lr: Optional[float] = None,
        seed: int = 0,
        progress: bool = True,
        device=None,
        num_threads: Optional[int] = 1,
        power: str = "fused",
        early_stopping: Optional[int] = None,
    ):
        if model is not None and not isinstance(model, nn.Module):
            raise ValueError(f"model must be None or an nn.Module, got {type(model).__name__}")
        hidden = tuple(hidden)
        if not all(isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in hidden):
            raise ValueError(f"hidden must be a sequence of positive ints, got {hidden!r}")
        if method not in _METHODS:
            raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
        if power not in _POWERS:
            raise ValueError(f"power must be one of {_POWERS}, got {power!r}")
        if eta is not None:
            eta = _checks.check_number(eta, "eta", positive=True)
        xi = _checks.check_number(xi, "xi", positive=True)
        if omega is not None:
            omega = _checks.check_number(omega, "omega", positive=False)
        if method == "vat" and omega == 0:
            raise ValueError("omega must be > 0 for method='vat' (the CE term carries the labels)")
        epochs = _checks.positive_int(epochs, "epochs", allow_none=True)
        batch_size = _checks.positive_int(batch_size, "batch_size", allow_none=False)
        if lr is not None:
            lr = _checks.check_number(lr, "lr", positive=True)
        num_threads = _checks.positive_int(num_threads, "num_threads", allow_none=True)
        early_stopping = _checks.positive_int(early_stopping, "early_stopping", allow_none=True)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self.model = model
        self.hidden = hidden
        self.method = method
        self.eta = None if eta is None else float(eta)
        self.xi = float(xi)
        self.omega = None if omega is None else float(omega)
        self.epochs = epochs
        self.batch_size = batch_size
        self.lr = None if lr is None else float(lr)
        self.seed = seed
        self.progress = bool(progress)
        self.device = device
        self.num_threads = num_threads
        self.power = power
        self.early_stopping = early_stopping
        self._user_model = model is not None
        self._fitted = False
        self.input_shape_: Optional[Tuple[int, ...]] = None   # (D,) or (C, H, W)
        self.dim_: Optional[int] = None             # D, or C*H*W for images
        self.mean_: Optional[torch.Tensor] = None   # (D,) pooled mean per coordinate, or (C, 1, 1) per channel;
        self.std_: Optional[torch.Tensor] = None    # same shape, pooled std (floored); both float64
        self.eta_: Optional[float] = None           # eta actually used (points: standardised units; images: data)
        self.lr_: Optional[float] = None            # learning rate actually used
        self.omega_: Optional[float] = None         # omega actually used
        self.history_: list = []                    # mean training loss per epoch
        self.n_epochs_: int = 0                     # epochs run by the last fit (early stopping)
        self.per_sample_: Optional[bool] = None     # fused step: rank-one shortcut used (logits per sample)
        self._run: Optional[dict] = None            # training state, only while fit runs
        self._on_epoch = None

    # ------------------------------------------------------------------ helpers
    @property
    def is_fitted(self) -> bool:
        """True once :meth:`fit` has run."""
        return self._fitted

    @property
    def is_image(self) -> bool:
        """Whether the detector was fitted on images (N, C, H, W)."""
        return self.input_shape_ is not None and len(self.input_shape_) == 3

    def _require_fitted(self):
        if not self._fitted:
            raise ValueError("OutlierDetector is not fitted; call fit(source, target) first")

    def _as_logits(self, out: torch.Tensor, batch: int) -> torch.Tensor:
        if out.dim() == 2 and out.shape[1] == 1:
            out = out[:, 0]
        if out.shape != (batch,):
            raise ValueError(f"model must map a batch of {batch} inputs to ({batch},) or ({batch}, 1) logits, got "
                             f"output shape {tuple(out.shape)}")
        return out

    def _logits(self, z: torch.Tensor) -> torch.Tensor:
        """(B,) logits of standardised inputs z (B, D) or (B, C, H, W)."""
        return self._as_logits(self.model(z), z.shape[0])

    def _param_dtype(self) -> torch.dtype:
        for prm in self.model.parameters():
            if prm.dtype.is_floating_point:
                return prm.dtype
        return torch.get_default_dtype()

    def _standardise(self, x: torch.Tensor, name: str = "points") -> torch.Tensor:
        return _standardised(x, self.mean_, self.std_, self._param_dtype(), name)

    def _perturbation_scale(self) -> torch.Tensor:
        """Size of one standardised unit in perturbation units (z = x / scale): 1 for points (perturbations in
        standardised units), the per-channel std (C, 1, 1) for images (perturbations in data units)."""
        if self.is_image:
            return self.std_.to(self._param_dtype())
        return torch.ones((), dtype=self._param_dtype(), device=self.std_.device)

    # ------------------------------------------------------------------ training
    def fit(self, source: torch.Tensor, target: torch.Tensor) -> "OutlierDetector":
        """Train on source (N, D) or (N, C, H, W) (label 0) and target (M, ...) (label 1) points. Returns self."""
        source = _checks.check_points_or_images(source, "source")
        target = _checks.check_points_or_images(target, "target")
        if source.shape[1:] != target.shape[1:]:
            raise ValueError(f"source and target must have the same dimension, got source dim "
                             f"{tuple(source.shape[1:])} and target dim {tuple(target.shape[1:])}")
        from tqdm.auto import tqdm

        old_threads = torch.get_num_threads()
        device = self._training_device(source)
        limit = self.num_threads is not None and device.type == "cpu" and self.num_threads != old_threads
        if limit:
            torch.set_num_threads(self.num_threads)
        try:
            with torch.enable_grad():
                self._setup(source, target, device)
                self._train(tqdm)
        finally:
            self._run = None
            if limit:
                torch.set_num_threads(old_threads)
        self.model.eval()
        self._fitted = True
        return self

    # ------------------------------------------------------------------ inference
    def predict_proba(self, points: torch.Tensor) -> torch.Tensor:
        """(K,) P(target | point) for points (K, D) or images (K, C, H, W) (also flattened, (K, C*H*W)),
        without grad, in the dtype/device of ``points``."""
        self._require_fitted()
        points = _checks.check_points_or_images(points, "points", self.input_shape_)
        dev = self.mean_.device
        chunk = max(1, _PREDICT_ELEMENTS // self.dim_)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                out = [torch.sigmoid(self._logits(self._standardise(part.detach().to(dev))))
                       for part in points.split(chunk)]
        finally:
            self.model.train(was_training)
        s = torch.cat(out)
        return s.to(device=points.device, dtype=points.dtype)

    def outlier_masks(self, source: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Boolean outlier masks (N,), (M,): source points with P(target) > 1/2, target points with < 1/2."""
        self._require_fitted()
        return _weights.outlier_masks(self.predict_proba(_checks.check_points_or_images(source, "source")),
                                      self.predict_proba(_checks.check_points_or_images(target, "target")))

    def hard_weights(
        self, source: torch.Tensor, target: torch.Tensor, a: Optional[torch.Tensor] = None,
        b: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hard SROT weights (a', b'), shapes (N,), (M,): flagged points get 0, the rest are rescaled to the
        original total mass. ``a``/``b`` default to uniform 1/N, 1/M (dtype/device of the points)."""
        self._require_fitted()
        source = _checks.check_points_or_images(source, "source")
        target = _checks.check_points_or_images(target, "target")
        if a is None:
            a = torch.full((len(source),), 1.0 / len(source), dtype=source.dtype, device=source.device)
        if b is None:
            b = torch.full((len(target),), 1.0 / len(target), dtype=target.dtype, device=target.device)
        return _weights.hard_weights(a, self.predict_proba(source), b, self.predict_proba(target))

    def soft_offsets(
        self, source: torch.Tensor, target: torch.Tensor, gamma: Optional[float] = None, p: int = 2,
        ce_floor: float = 1e-6,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Soft SROT cost offsets (u, v), shapes (N,), (M,), in cost units: u_i = gamma / CE(target label,
        f(x_i)), v_j = gamma / CE(source label, f(y_j)). ``gamma=None`` -> max_ij C(x_i, y_j) (detached) with
        C = |x - y| (p=1) or |x - y|^2 / 2 (p=2, the default, as in :class:`srot_fast.SROTLoss`), images
        flattened; computed by the backend that ``backend="auto"`` picks for these points, which streams over
        the N x M costs without storing them."""
        self._require_fitted()
        source = _checks.check_points_or_images(source, "source")
        target = _checks.check_points_or_images(target, "target")
        if isinstance(p, bool) or p not in (1, 2):
            raise ValueError(f"p must be 1 or 2, got {p!r}")
        if gamma is None:
            from .backends import get_ops, resolve_backend

            xs, ys = source.detach().flatten(1), target.detach().flatten(1)
            ops = get_ops(resolve_backend("auto", xs.shape[0], ys.shape[0], xs.device))
            gamma = float(ops.max_cost(xs, ys, p)) or 1.0
        return _weights.soft_offsets(self.predict_proba(source), self.predict_proba(target), gamma, ce_floor)

    # ------------------------------------------------------------------ persistence
    def save(self, path) -> None:
        """Save a fitted detector (config, classifier state_dict, standardisation) to ``path`` with
        ``torch.save``; only tensors and plain Python values, so :meth:`load` can use ``weights_only=True``."""
        self._require_fitted()
        config = dict(hidden=list(self.hidden), method=self.method, eta=self.eta, xi=self.xi, omega=self.omega,
                      epochs=self.epochs, batch_size=self.batch_size, lr=self.lr, seed=self.seed,
                      progress=self.progress, device=None if self.device is None else str(self.device),
                      num_threads=self.num_threads, power=self.power, early_stopping=self.early_stopping)
        state = {
            "format": _FORMAT, "version": _FORMAT_VERSION, "config": config, "arch": _arch_of(self.model),
            "user_model": self._user_model,
            "state_dict": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            "fitted": {"input_shape": list(self.input_shape_), "mean": self.mean_.detach().cpu(),
                       "std": self.std_.detach().cpu(), "eta": self.eta_, "lr": self.lr_, "omega": self.omega_,
                       "history": [float(h) for h in self.history_], "n_epochs": self.n_epochs_},
        }
        torch.save(state, path)

    @classmethod
    def load(cls, path, model: Optional[nn.Module] = None, *, map_location="cpu") -> "OutlierDetector":
        """Restore a detector saved by :meth:`save` (``torch.load(weights_only=True)``: no code is unpickled).
        Built-in classifiers are rebuilt; a user model must be passed as ``model`` (an instance of the same
        architecture; its weights are overwritten). Tensors go to ``map_location`` (default CPU).

        The file is validated before anything is built (types, sizes, the classifier's weights against its
        recorded architecture, the standardisation's shapes and values): a file that is unreadable, refused
        (pickled objects), or malformed raises :class:`DetectorFileError` naming what is wrong. A missing file
        raises ``FileNotFoundError``."""
        if model is not None and not isinstance(model, nn.Module):
            raise ValueError(f"model must be None or an nn.Module, got {type(model).__name__}")
        state = _read_detector_file(path, map_location)
        config, arch, state_dict, fitted = _validate_detector_file(state, path, model is not None)
        try:
            det = cls(None, **config)
        except (TypeError, ValueError) as exc:
            raise DetectorFileError(f"{path!s}: invalid 'config': {exc}") from None
        given = model is not None
        if model is None:
            model = _build_classifier(arch)
        try:
            model.load_state_dict(state_dict)
        except RuntimeError as exc:
            raise DetectorFileError(f"{path!s}: the saved weights do not fit the "
                                    f"{'model passed' if given else 'recorded architecture'}: {exc}") from None
        dev = fitted["mean"].device
        model.to(dev)
        model.eval()
        det.model = model
        det._user_model = given or bool(state.get("user_model", False))
        det.input_shape_ = tuple(fitted["input_shape"])
        det.dim_ = math.prod(det.input_shape_)
        sd = _stat_dtype(dev)
        det.mean_, det.std_ = fitted["mean"].to(sd), fitted["std"].to(sd)
        det.eta_, det.lr_ = fitted["eta"], fitted["lr"]
        det.omega_ = fitted["omega"] if fitted["omega"] is not None else det.omega
        det.history_ = list(fitted["history"])
        det.n_epochs_ = fitted["n_epochs"]
        det._fitted = True
        return det

    def __repr__(self) -> str:
        state = "fitted" if self._fitted else "not fitted"
        return (f"OutlierDetector(method={self.method!r}, power={self.power!r}, hidden={self.hidden}, "
                f"eta={self.eta}, omega={self.omega}, seed={self.seed}, {state})")
