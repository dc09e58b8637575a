r"""Outlier detector of SROT (paper §3, SPEC §2): a source-vs-target classifier trained with virtual
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
the paper's :class:`srot_fast.nets.ConvNet`). Batch-norm statistics are frozen during the perturbed passes
(:class:`srot_fast.vat.FrozenBatchNorm`): they normalise by the clean batch's statistics and never update the
running ones.

A source point is an outlier when f(x_i) > 1/2, a target point when f(y_j) < 1/2; see
:mod:`srot_fast.weights` for the hard weights and soft cost offsets built from these scores.
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from . import nets as _nets
from . import vat as _vat
from . import weights as _weights

__all__ = ["OutlierDetector"]

_METHODS = ("vat", "ce")
_POWERS = ("fused", "fd")
_DEFAULT_STEPS = 2000      # epochs=None -> enough epochs for about this many optimiser steps
_MIN_EPOCHS = 20
_ETA_FRACTION = 0.25       # points, eta=None -> this fraction of the mean per-coordinate std of the pooled data
_IMAGE_ETA_FRACTION = 0.15  # images, eta=None -> this fraction of sqrt(C H W) x the rms per-channel std
_POINT_LR = 3e-3
_IMAGE_LR = 2e-4           # paper (Adam)
_POINT_OMEGA = 1e-3        # omega=None on points: the paper's value
_IMAGE_OMEGA = 3e-2        # omega=None on images: 30x the paper's value (docs/DETECTOR.md, "Choice of omega")
_EARLY_STOP_RTOL = 1e-3
_FORMAT = "srot_fast.OutlierDetector"
_FORMAT_VERSION = 1
_PREDICT_ELEMENTS = 1 << 22   # predict_proba works in chunks of about this many input numbers

_MLP = _nets.MLP           # the former private name


def _check_points(t, name: str, shape: Optional[Tuple[int, ...]] = None) -> torch.Tensor:
    """(N, D) points or (N, C, H, W) images, finite floats; with ``shape`` (the fitted per-point shape) also
    accept (N, prod(shape)) flattened images and return them reshaped."""
    if not torch.is_tensor(t):
        raise TypeError(f"{name} must be a torch.Tensor of shape (num_points, dim) or (num_images, C, H, W), "
                        f"got {type(t).__name__}")
    if t.dim() not in (2, 4):
        raise ValueError(f"{name} must be 2-D (num_points, dim) or 4-D (num_images, C, H, W), got shape "
                         f"{tuple(t.shape)}")
    if t.shape[0] == 0 or t[0].numel() == 0:
        raise ValueError(f"{name} must hold at least one point of dimension >= 1, got shape {tuple(t.shape)}")
    if not t.dtype.is_floating_point:
        raise ValueError(f"{name} must have a floating dtype, got {t.dtype}")
    if shape is not None and tuple(t.shape[1:]) != tuple(shape):
        if len(shape) == 3 and t.dim() == 2 and t.shape[1] == math.prod(shape):
            t = t.reshape((t.shape[0],) + tuple(shape))
        else:
            raise ValueError(f"{name} has dimension {tuple(t.shape[1:])} per point but the detector was fitted "
                             f"on dimension {tuple(shape)}" + (" (flattened images are accepted too)"
                                                               if len(shape) == 3 else ""))
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} contains NaN or inf values")
    return t


def _number(value, name: str, positive: bool) -> float:
    """float(value), finite and > 0 (positive=True) or >= 0, else ValueError naming ``name``."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(out) or out < 0 or (positive and out == 0):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
    return out


def _positive_int(value, name: str, allow_none: bool) -> Optional[int]:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be {'None or ' if allow_none else ''}a positive int, got {value!r}")
    return value


def _bernoulli_kl(p: torch.Tensor, logit_q: torch.Tensor) -> torch.Tensor:
    """(B,) KL(Bernoulli(p) || Bernoulli(sigmoid(logit_q))) minus the (constant in q) entropy of p,
    i.e. the cross-entropy -p log q - (1 - p) log(1 - q); same gradient in q as the KL."""
    return -(p * F.logsigmoid(logit_q) + (1 - p) * F.logsigmoid(-logit_q))


def _bernoulli_entropy(p: torch.Tensor) -> torch.Tensor:
    return -(torch.xlogy(p, p) + torch.xlogy(1 - p, 1 - p))


def _rownorm(t: torch.Tensor) -> torch.Tensor:
    """(B, 1, ...) per-sample Euclidean norms, broadcastable against t."""
    return t.flatten(1).norm(dim=1).reshape((-1,) + (1,) * (t.dim() - 1))


def _has_batch_norm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


class OutlierDetector:
    r"""Source-vs-target classifier f(x) = P(target | x) used to flag type-II outliers (SROT, paper §3).

    Args:
        model: ``None`` -> built at :meth:`fit` with weights from ``seed``: a ReLU MLP with widths ``hidden``
            for points (N, D), the paper's :class:`~srot_fast.nets.ConvNet` (6 conv layers 32, 32, 64, 64, 128,
            128 + batch-norm + ReLU, one linear layer) for images (N, C, H, W). Otherwise an ``nn.Module``
            mapping standardised inputs (B, D) or (B, C, H, W) to (B,) or (B, 1) logits; it is trained in place
            (its initial weights are yours, so re-fitting continues from the trained weights).
        hidden: hidden widths of the default MLP (points only).
        method: ``"vat"`` (CE + virtual adversarial KL, the paper's AR classifier) or ``"ce"`` (CE only).
        eta: radius of the adversarial perturbation, in data units (Euclidean norm of the whole perturbation of
            one point / image). ``None`` -> points: 0.25 x the mean per-coordinate standard deviation of the
            pooled (source + target) training points; images: 0.15 x sqrt(C H W) x the rms per-channel standard
            deviation (28x28 MNIST in [0, 1]: about 1.4); stored in ``eta_``. It must exceed the size of an
            outlier cluster for VAT to override its labels and stay below the gap between the measures: on
            :func:`srot_fast.datasets.make_toy_2d` (default eta_ ~ 0.27) the default detects all type-II
            outliers for seeds 0-19 and eta = 0.1 for seeds 5-19, while eta = 0.6 collapses one class on 3 of
            seeds 5-19. On images the paper uses eta = 10 (images in [-1, 1], 50 epochs of 50k images), about
            0.55 sqrt(C H W) x std; on the small real-image settings of docs/DETECTOR.md (1000 images, 50
            epochs) 0.25 left whole Fashion-MNIST classes unseparated while 0.1 and 0.15 detected everything.
        xi: finite-difference step of ``power="fd"``, in standardised input units (inputs are standardised with
            the pooled mean/std from :meth:`fit`: per coordinate for points, per channel for images). Where the
            finite difference underflows to an exactly zero gradient, the random direction is used instead.
        omega: weight of the CE term in the VAT loss; ``None`` -> the paper's 1e-3 for points, 3e-2 for images
            (stored in ``omega_``; ``omega=1e-3`` gives the paper's value on images). With 1e-3 and our short
            trainings (~2000 steps; the paper's ~40 000) the VAT term won on Fashion-MNIST 28x28 and 44-49 % of
            clean points were flagged; 3e-2 passed every measured setting (docs/DETECTOR.md, "Choice of omega").
            Ignored for ``method="ce"``.
        epochs: passes over the data. ``None`` -> enough epochs for about 2000 optimiser steps (at least 20),
            points and images alike (1000 images in batches of 64: 125 epochs; the paper uses 20 to 50 epochs of
            50k images).
        batch_size: points per mini-batch (drawn from the shuffled union of source and target; paper: 64).
        lr: Adam learning rate. ``None`` -> 3e-3 for points, 2e-4 for images (paper).
        seed: seeds a private generator for the built-in nets' init, the shuffling and the random directions.
        progress: show a tqdm bar over epochs.
        device: training device; ``None`` -> the device of the source points, except that images on the CPU
            train on CUDA when it is available.
        num_threads: torch intra-op CPU threads while :meth:`fit` runs (``torch.set_num_threads``, set for
            the duration of the call and restored afterwards; process-wide). The training step on points works
            on tiny tensors, where OpenMP threads cost far more than they gain: measured on a shared 2-core
            machine, 300 steps took 0.3 s with 1 thread and 17 s with 2. ``None`` leaves torch's setting.
        power: power-iteration step of VAT: ``"fused"`` (exact, no xi; default) or ``"fd"`` (reference).
            See :mod:`srot_fast.vat` and docs/DETECTOR.md for the comparison.
        early_stopping: ``None`` or a patience in epochs: stop when the mean training loss of an epoch has not
            improved on the best one by more than 0.1 % for that many epochs (``n_epochs_`` records the count).

    Classes are balanced in the loss: each point's loss is weighted by (N + M) / (2 * its class size).
    For a user model, the first VAT batch checks whether its logits are per sample (with batch-norm frozen);
    if so (``per_sample_``) the fused step takes the one-vjp rank-one shortcut, else the jvp + vjp product.
    Power iteration refuses float16 / bfloat16 models (TypeError; convert with ``model.float()``).
    A fitted detector is saved with :meth:`save` and restored with :meth:`load` (``weights_only`` loading).
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
            eta = _number(eta, "eta", positive=True)
        xi = _number(xi, "xi", positive=True)
        if omega is not None:
            omega = _number(omega, "omega", positive=False)
        if method == "vat" and omega == 0:
            raise ValueError("omega must be > 0 for method='vat' (the CE term carries the labels)")
        epochs = _positive_int(epochs, "epochs", allow_none=True)
        batch_size = _positive_int(batch_size, "batch_size", allow_none=False)
        if lr is not None:
            lr = _number(lr, "lr", positive=True)
        num_threads = _positive_int(num_threads, "num_threads", allow_none=True)
        early_stopping = _positive_int(early_stopping, "early_stopping", allow_none=True)
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
        self.mean_: Optional[torch.Tensor] = None   # (D,) pooled mean per coordinate, or (C, 1, 1) per channel
        self.std_: Optional[torch.Tensor] = None    # same shape, pooled std (floored)
        self.eta_: Optional[float] = None           # eta actually used, data units
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

    def _standardise(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean_) / self.std_

    # ------------------------------------------------------------------ training
    def fit(self, source: torch.Tensor, target: torch.Tensor) -> "OutlierDetector":
        """Train on source (N, D) or (N, C, H, W) (label 0) and target (M, ...) (label 1) points. Returns self."""
        source = _check_points(source, "source")
        target = _check_points(target, "target")
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

    def _training_device(self, source: torch.Tensor) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        if source.dim() == 4 and source.device.type == "cpu" and torch.cuda.is_available():
            return torch.device("cuda")
        return source.device

    def _setup(self, source: torch.Tensor, target: torch.Tensor, device: torch.device) -> None:
        """Model, standardisation, labels, optimiser and generator of a fit (stored in ``self._run``)."""
        image = source.dim() == 4
        shape = tuple(source.shape[1:])
        gen = torch.Generator()                 # CPU generator: init, shuffling, random directions
        gen.manual_seed(self.seed)
        if not self._user_model:
            self.model = (_nets.ConvNet(shape[0], generator=gen) if image
                          else _nets.MLP(shape[0], self.hidden, generator=gen))
        self.model.to(device)
        dtype = self._param_dtype()
        if self.method == "vat":
            _vat.check_power_dtype(dtype, "the model parameters")

        x = torch.cat([source.detach(), target.detach()]).to(device=device, dtype=dtype)
        n_s, n_t = source.shape[0], target.shape[0]
        labels = torch.cat([torch.zeros(n_s), torch.ones(n_t)]).to(device=device, dtype=dtype)
        n_all = n_s + n_t
        cls_w = torch.cat([torch.full((n_s,), n_all / (2.0 * n_s)), torch.full((n_t,), n_all / (2.0 * n_t))])
        cls_w = cls_w.to(device=device, dtype=dtype)

        if image:       # per-channel statistics
            mean = x.mean(dim=(0, 2, 3), keepdim=True)[0]
            std = (x.std(dim=(0, 2, 3), unbiased=False, keepdim=True)[0] if n_all > 1
                   else torch.ones_like(mean))
        else:           # per-coordinate statistics
            mean = x.mean(0)
            std = x.std(0, unbiased=False) if n_all > 1 else torch.ones_like(mean)
        floor = 1e-6 * max(float(std.max()), float(mean.abs().max()), 1.0)
        std = std.clamp_min(floor)
        self.mean_, self.std_, self.input_shape_, self.dim_ = mean, std, shape, math.prod(shape)
        if self.eta is not None:
            self.eta_ = self.eta
        elif image:
            self.eta_ = _IMAGE_ETA_FRACTION * math.sqrt(self.dim_ * float(std.pow(2).mean()))
        else:
            self.eta_ = _ETA_FRACTION * float(std.mean())
        self.lr_ = self.lr if self.lr is not None else (_IMAGE_LR if image else _POINT_LR)
        self.omega_ = self.omega if self.omega is not None else (_IMAGE_OMEGA if image else _POINT_OMEGA)
        z = (x - mean) / std

        bs = self.batch_size
        n_batches = math.ceil(n_all / bs)
        bn = _has_batch_norm(self.model)
        # batch-norm cannot train on a last batch of one point: merge it into the previous batch
        if bn and n_batches > 1 and n_all % bs == 1:
            n_batches -= 1
        epochs = self.epochs
        if epochs is None:
            epochs = max(_MIN_EPOCHS, math.ceil(_DEFAULT_STEPS / n_batches))
        self.history_ = []
        self.n_epochs_ = 0
        self._fitted = False
        builtin = isinstance(self.model, (_nets.MLP, _nets.ConvNet))
        self.per_sample_ = True if builtin else None
        self._run = dict(
            z=z, labels=labels, cls_w=cls_w, gen=gen, device=device, epochs=epochs, n_batches=n_batches,
            opt=torch.optim.Adam(self.model.parameters(), lr=self.lr_),
            frozen=_vat.FrozenBatchNorm(self.model, logits=lambda out: self._as_logits(out, out.shape[0])),
            per_sample=True if builtin else None,     # user models: checked on the first batch
        )

    def _batch_indices(self, perm: torch.Tensor, k: int) -> torch.Tensor:
        bs, nb = self.batch_size, self._run["n_batches"]
        return perm[k * bs:] if k == nb - 1 else perm[k * bs:(k + 1) * bs]

    def _train(self, tqdm):
        run = self._run
        z, labels, cls_w, gen, opt = run["z"], run["labels"], run["cls_w"], run["gen"], run["opt"]
        n_all = z.shape[0]
        self.model.train()
        bar = tqdm(range(run["epochs"]), desc=f"OutlierDetector.fit ({self.method})", disable=not self.progress,
                   leave=False)
        best, stale = math.inf, 0
        for _ in bar:
            perm = torch.randperm(n_all, generator=gen).to(run["device"])
            total = 0.0
            for k in range(run["n_batches"]):
                idx = self._batch_indices(perm, k)
                loss = self._batch_loss(z[idx], labels[idx], cls_w[idx], gen)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total += float(loss.detach()) * idx.numel()
            self.history_.append(total / n_all)
            self.n_epochs_ += 1
            bar.set_postfix(loss=f"{self.history_[-1]:.4g}")
            if self._on_epoch is not None:     # private hook (diagnostics, benchmarks): f(detector)
                self._on_epoch(self)
            if self.early_stopping is not None:
                if self.history_[-1] < best - _EARLY_STOP_RTOL * abs(best):
                    best, stale = self.history_[-1], 0
                else:
                    stale += 1
                    if stale >= self.early_stopping:
                        break
        bar.close()

    def _direction(self, zb: torch.Tensor, p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """(B, ...) unit adversarial directions in data units (one power-iteration step)."""
        run = self._run
        frozen = run["frozen"]
        std = self.std_
        d0 = torch.randn(zb.shape, generator=gen).to(device=zb.device, dtype=zb.dtype)
        d0 = d0 / _rownorm(d0).clamp_min(1e-30)
        fn = frozen.fn
        if run["per_sample"] is None and self.power == "fused":
            run["per_sample"] = _vat.is_per_sample(fn, zb)
            self.per_sample_ = run["per_sample"]
        g_z = _vat.power_step(fn, zb, d0, method=self.power, p=p, xi=self.xi,
                              per_sample=bool(run["per_sample"]))
        g = g_z / std                           # gradient w.r.t. a perturbation in data units
        g_norm = _rownorm(g)
        d0_data = d0 * std
        d0_data = d0_data / _rownorm(d0_data).clamp_min(1e-30)
        # where the step comes out exactly 0 (underflowed finite difference), fall back to the random direction
        return torch.where(g_norm > 0, g / g_norm.clamp_min(1e-30), d0_data)

    def _batch_loss(self, zb, yb, wb, gen) -> torch.Tensor:
        """Class-weighted mean over the batch of the per-sample loss (CE, or omega*CE + VAT KL)."""
        frozen = self._run["frozen"]
        with frozen.record() if self.method == "vat" else contextlib.nullcontext():
            logit = self._logits(zb)
        ce = F.binary_cross_entropy_with_logits(logit, yb, reduction="none")
        if self.method == "ce":
            return (wb * ce).sum() / wb.sum()
        p = torch.sigmoid(logit.detach())
        d = self._direction(zb, p, gen)
        r_adv_z = (self.eta_ * d) / self.std_   # r_adv = eta * d / |d| in data units, mapped to z
        logit_adv = self._as_logits(frozen.fn(zb + r_adv_z, attached=True), zb.shape[0])
        kl = _bernoulli_kl(p, logit_adv) - _bernoulli_entropy(p)
        per_sample = self.omega_ * ce + kl
        return (wb * per_sample).sum() / wb.sum()

    # ------------------------------------------------------------------ inference
    def predict_proba(self, points: torch.Tensor) -> torch.Tensor:
        """(K,) P(target | point) for points (K, D) or images (K, C, H, W) (also flattened, (K, C*H*W)),
        without grad, in the dtype/device of ``points``."""
        self._require_fitted()
        points = _check_points(points, "points", self.input_shape_)
        dev = self.mean_.device
        dtype = self._param_dtype()
        chunk = max(1, _PREDICT_ELEMENTS // self.dim_)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                out = [torch.sigmoid(self._logits(self._standardise(part.detach().to(device=dev, dtype=dtype))))
                       for part in points.split(chunk)]
        finally:
            self.model.train(was_training)
        s = torch.cat(out)
        return s.to(device=points.device, dtype=points.dtype)

    def outlier_masks(self, source: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Boolean outlier masks (N,), (M,): source points with P(target) > 1/2, target points with < 1/2."""
        self._require_fitted()
        return _weights.outlier_masks(self.predict_proba(_check_points(source, "source")),
                                      self.predict_proba(_check_points(target, "target")))

    def hard_weights(
        self, source: torch.Tensor, target: torch.Tensor, a: Optional[torch.Tensor] = None,
        b: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hard SROT weights (a', b'), shapes (N,), (M,): flagged points get 0, the rest are rescaled to the
        original total mass. ``a``/``b`` default to uniform 1/N, 1/M (dtype/device of the points)."""
        self._require_fitted()
        source = _check_points(source, "source")
        target = _check_points(target, "target")
        if a is None:
            a = torch.full((len(source),), 1.0 / len(source), dtype=source.dtype, device=source.device)
        if b is None:
            b = torch.full((len(target),), 1.0 / len(target), dtype=target.dtype, device=target.device)
        return _weights.hard_weights(a, self.predict_proba(source), b, self.predict_proba(target))

    def soft_offsets(
        self, source: torch.Tensor, target: torch.Tensor, gamma: Optional[float] = None, p: int = 1,
        ce_floor: float = 1e-6,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Soft SROT cost offsets (u, v), shapes (N,), (M,), in cost units: u_i = gamma / CE(target label,
        f(x_i)), v_j = gamma / CE(source label, f(y_j)). ``gamma=None`` -> max_ij C(x_i, y_j) (detached) with
        C = |x - y| (p=1) or |x - y|^2 / 2 (p=2), images flattened."""
        self._require_fitted()
        source = _check_points(source, "source")
        target = _check_points(target, "target")
        if p not in (1, 2):
            raise ValueError(f"p must be 1 or 2, got {p!r}")
        if gamma is None:
            from .kernels.tensorized import max_cost

            gamma = float(max_cost(source.detach().flatten(1), target.detach().flatten(1), p))
        return _weights.soft_offsets(self.predict_proba(source), self.predict_proba(target), gamma, ce_floor)

    # ------------------------------------------------------------------ persistence
    def _arch(self) -> dict:
        m = self.model
        if isinstance(m, _nets.ConvNet):
            return {"kind": "convnet", "in_channels": m.in_channels, "widths": list(m.widths),
                    "batch_norm": m.batch_norm}
        if isinstance(m, _nets.MLP):
            lins = [layer for layer in m.net if isinstance(layer, nn.Linear)]
            return {"kind": "mlp", "dim": lins[0].in_features, "hidden": [lin.out_features for lin in lins[:-1]]}
        return {"kind": "user", "class": f"{type(m).__module__}.{type(m).__qualname__}"}

    def save(self, path) -> None:
        """Save a fitted detector (config, classifier state_dict, standardisation) to ``path`` with
        ``torch.save``; only tensors and plain Python values, so :meth:`load` can use ``weights_only=True``."""
        self._require_fitted()
        config = dict(hidden=list(self.hidden), method=self.method, eta=self.eta, xi=self.xi, omega=self.omega,
                      epochs=self.epochs, batch_size=self.batch_size, lr=self.lr, seed=self.seed,
                      progress=self.progress, device=None if self.device is None else str(self.device),
                      num_threads=self.num_threads, power=self.power, early_stopping=self.early_stopping)
        state = {
            "format": _FORMAT, "version": _FORMAT_VERSION, "config": config, "arch": self._arch(),
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
        architecture; its weights are overwritten). Tensors go to ``map_location`` (default CPU)."""
        state = torch.load(path, map_location=map_location, weights_only=True)
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ValueError(f"{path!s} is not a saved OutlierDetector")
        if state.get("version") != _FORMAT_VERSION:
            raise ValueError(f"{path!s}: unsupported OutlierDetector format version {state.get('version')!r}")
        config = dict(state["config"])
        config["hidden"] = tuple(config["hidden"])
        arch = state["arch"]
        given = model is not None
        if model is None:
            gen = torch.Generator()             # throwaway init (overwritten by the state_dict)
            if arch["kind"] == "mlp":
                model = _nets.MLP(arch["dim"], arch["hidden"], generator=gen)
            elif arch["kind"] == "convnet":
                model = _nets.ConvNet(arch["in_channels"], arch["widths"], arch["batch_norm"], generator=gen)
            else:
                raise ValueError(f"{path!s} holds a user model of class {arch['class']}: pass an instance of it, "
                                 "OutlierDetector.load(path, model=...)")
        det = cls(model, **config)
        det._user_model = given or bool(state.get("user_model", False))
        model.load_state_dict(state["state_dict"])
        fitted = state["fitted"]
        dev = fitted["mean"].device
        model.to(dev)
        model.eval()
        det.input_shape_ = tuple(int(s) for s in fitted["input_shape"])
        det.dim_ = math.prod(det.input_shape_)
        det.mean_, det.std_ = fitted["mean"], fitted["std"]
        det.eta_, det.lr_ = fitted["eta"], fitted["lr"]
        det.omega_ = fitted.get("omega", det.omega)
        det.history_ = list(fitted["history"])
        det.n_epochs_ = int(fitted["n_epochs"])
        det._fitted = True
        return det

    def __repr__(self) -> str:
        state = "fitted" if self._fitted else "not fitted"
        return (f"OutlierDetector(method={self.method!r}, power={self.power!r}, hidden={self.hidden}, "
                f"eta={self.eta}, omega={self.omega}, seed={self.seed}, {state})")
