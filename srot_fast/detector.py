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
"""
from __future__ import annotations

import contextlib
import math
import re
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from . import _checks
from . import nets as _nets
from . import vat as _vat
from . import weights as _weights

__all__ = ["OutlierDetector", "DetectorFileError"]

_METHODS = ("vat", "ce")
_POWERS = ("fused", "fd")
_DEFAULT_STEPS = 2000      # epochs=None -> enough epochs for about this many optimiser steps
_MIN_EPOCHS = 20
_POINT_ETA_FRACTION = 0.1  # points, eta=None -> this fraction of the median pairwise distance (standardised units)
_PAIRWISE_SAMPLE = 1000    # points used for that median (evenly spaced over the pooled training points)
_IMAGE_ETA_FRACTION = 0.15  # images, eta=None -> this fraction of sqrt(C H W) x the rms per-channel std
_POINT_LR = 3e-3
_IMAGE_LR = 2e-4           # paper (Adam)
_POINT_OMEGA = 3e-2        # omega=None on points (docs/DETECTOR.md, "Defaults on points")
_IMAGE_OMEGA = 3e-2        # omega=None on images: 30x the paper's value (docs/DETECTOR.md, "Choice of omega")
_EARLY_STOP_RTOL = 1e-3
_FORMAT = "srot_fast.OutlierDetector"
_FORMAT_VERSION = 2        # version 1 files (same layout, float32 statistics) load too
_PREDICT_ELEMENTS = 1 << 22   # predict_proba works in chunks of about this many input numbers
_MAX_LAYERS = 64           # detector files: at most this many hidden layers / convolutions
_MAX_WIDTH = 1 << 24       # detector files: at most this input dimension, width or channel count

def _stat_dtype(device: torch.device) -> torch.dtype:
    """float64 for statistics, except on devices without it (MPS)."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


def _group_dims(image: bool) -> tuple:
    return (0, 2, 3) if image else (0,)


def _row_chunks(x: torch.Tensor):
    return x.split(max(1, _PREDICT_ELEMENTS // max(1, x[0].numel())))


def _moments(x: torch.Tensor, image: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale, mean, std) of the pooled points x (N, D) per coordinate or images (N, C, H, W) per channel, in
    float64, shapes (D,) or (C, 1, 1): scale = max |x|, mean and (biased) std computed on x / scale, so no
    square overflows whatever the magnitude of the data. std is floored at 1e-6 x the largest |mean| or std
    (constant coordinates standardise to 0)."""
    sd = _stat_dtype(x.device)
    dims = _group_dims(image)
    scale = torch.stack([c.detach().to(sd).abs().amax(dims) for c in _row_chunks(x)]).amax(0)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    count = x.numel() // scale.numel()
    shape = (-1, 1, 1) if image else (-1,)
    b = scale.reshape(shape)
    mean_s = sum((c.detach().to(sd) / b).sum(dims) for c in _row_chunks(x)) / count
    m = mean_s.reshape(shape)
    var_s = sum(((c.detach().to(sd) / b - m) ** 2).sum(dims) for c in _row_chunks(x)) / count
    mean, std = (mean_s * scale).reshape(shape), (var_s.sqrt() * scale).reshape(shape)
    floor = 1e-6 * max(float(std.max()), float(mean.abs().max()))
    return b, mean, std.clamp_min(floor if floor > 0 else 1.0)


def _standardised(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, dtype: torch.dtype,
                  name: str) -> torch.Tensor:
    """(x - mean) / std computed in the statistics' dtype (float64) and cast to ``dtype``; ValueError naming
    ``name`` when a value overflows ``dtype``."""
    out = torch.cat([((c.detach().to(mean.dtype) - mean) / std).to(dtype) for c in _row_chunks(x)])
    if not torch.isfinite(out).all():
        big = float(((x.detach().to(mean.dtype) - mean) / std).abs().max())
        raise ValueError(f"{name}: the standardised values (x - mean) / std overflow {dtype} (largest magnitude "
                         f"{big:.3g}): the points lie far outside the range of the training data; rescale them")
    return out


def _median_pairwise_distance(z: torch.Tensor) -> float:
    """Median Euclidean distance between distinct points among at most _PAIRWISE_SAMPLE of the rows of z (evenly
    spaced, so no random draw); 1.0 when it is 0 (all points equal)."""
    idx = torch.linspace(0, z.shape[0] - 1, min(z.shape[0], _PAIRWISE_SAMPLE), device=z.device).round().long()
    sub = z[idx].flatten(1).to(_stat_dtype(z.device))
    if sub.shape[0] < 2:
        return 1.0
    dist = torch.cdist(sub, sub)
    iu = torch.triu_indices(sub.shape[0], sub.shape[0], offset=1, device=z.device)
    med = float(dist[iu[0], iu[1]].median())
    return med if med > 0 else 1.0


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


class DetectorFileError(ValueError):
    """A file given to :meth:`OutlierDetector.load` is not a valid saved detector; the message says what is
    wrong (unreadable file, refused content, missing or malformed field, shapes that do not match)."""


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

        pooled = torch.cat([source.detach(), target.detach()]).to(device)
        n_s, n_t = source.shape[0], target.shape[0]
        labels = torch.cat([torch.zeros(n_s), torch.ones(n_t)]).to(device=device, dtype=dtype)
        n_all = n_s + n_t
        cls_w = torch.cat([torch.full((n_s,), n_all / (2.0 * n_s)), torch.full((n_t,), n_all / (2.0 * n_t))])
        cls_w = cls_w.to(device=device, dtype=dtype)

        _, mean, std = _moments(pooled, image)
        self.mean_, self.std_, self.input_shape_, self.dim_ = mean, std, shape, math.prod(shape)
        z = _standardised(pooled, mean, std, dtype, "source and target")
        del pooled
        if self.eta is not None:
            self.eta_ = self.eta
        elif image:
            self.eta_ = _IMAGE_ETA_FRACTION * math.sqrt(self.dim_ * float(std.pow(2).mean()))
        else:
            self.eta_ = _POINT_ETA_FRACTION * _median_pairwise_distance(z)
        self.lr_ = self.lr if self.lr is not None else (_IMAGE_LR if image else _POINT_LR)
        self.omega_ = self.omega if self.omega is not None else (_IMAGE_OMEGA if image else _POINT_OMEGA)

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
            scale=self._perturbation_scale(),
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
        """(B, ...) unit adversarial directions in perturbation units (one power-iteration step)."""
        run = self._run
        frozen = run["frozen"]
        std = run["scale"]
        d0 = torch.randn(zb.shape, generator=gen).to(device=zb.device, dtype=zb.dtype)
        d0 = d0 / _rownorm(d0).clamp_min(1e-30)
        fn = frozen.fn
        if run["per_sample"] is None and self.power == "fused":
            run["per_sample"] = _vat.is_per_sample(fn, zb)
            self.per_sample_ = run["per_sample"]
        g_z = _vat.power_step(fn, zb, d0, method=self.power, p=p, xi=self.xi,
                              per_sample=bool(run["per_sample"]))
        g = g_z / std                           # gradient w.r.t. a perturbation in perturbation units
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
        r_adv_z = (self.eta_ * d) / self._run["scale"]   # r_adv = eta d / |d| in perturbation units, in z
        logit_adv = self._as_logits(frozen.fn(zb + r_adv_z, attached=True), zb.shape[0])
        kl = _bernoulli_kl(p, logit_adv) - _bernoulli_entropy(p)
        per_sample = self.omega_ * ce + kl
        return (wb * per_sample).sum() / wb.sum()

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


# ---------------------------------------------------------------------- detector files
_CONFIG_KEYS = ("hidden", "method", "eta", "xi", "omega", "epochs", "batch_size", "lr", "seed", "progress", "device",
                "num_threads", "power", "early_stopping")
_FITTED_KEYS = ("input_shape", "mean", "std", "eta", "lr", "history", "n_epochs")


def _read_detector_file(path, map_location):
    """torch.load(weights_only=True) with every failure but a missing / unreadable path as DetectorFileError."""
    import pickle

    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except pickle.UnpicklingError as exc:
        text = str(exc)
        found = re.search(r"(Unsupported global: [^\n]*?)(?:\. |\n|$)", text)
        if found:
            raise DetectorFileError(f"{path!s}: refused: it holds Python objects other than tensors and plain data, "
                                    f"which a detector file never does ({found.group(1)[:200]})") from None
        detail = " ".join(text.split("WeightsUnpickler error:")[-1].split())[:200]
        raise DetectorFileError(f"{path!s}: not a readable torch.save file (UnpicklingError: {detail})") from None
    except Exception as exc:     # truncated or foreign files surface as KeyError, EOFError, OSError, RuntimeError...
        detail = (str(exc).strip().splitlines() or [""])[0][:200]
        raise DetectorFileError(f"{path!s}: not a readable torch.save file ({type(exc).__name__}: {detail})") from None


def _int_in(value, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def _finite_number(value, minimum: float, allow_equal: bool) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return value >= minimum if allow_equal else value > minimum


def _int_list(value, name: str, path, max_len: int) -> list:
    if not isinstance(value, (list, tuple)) or len(value) > max_len or not all(
            _int_in(v, 1, _MAX_WIDTH) for v in value):
        raise DetectorFileError(f"{path!s}: {name} must be a list of at most {max_len} ints in [1, {_MAX_WIDTH}], "
                                f"got {value!r:.200}")
    return list(value)


def _arch_from_file(arch, path) -> dict:
    if not isinstance(arch, dict) or arch.get("kind") not in ("mlp", "convnet", "user"):
        raise DetectorFileError(f"{path!s}: 'arch' must be a dict with kind 'mlp', 'convnet' or 'user', got "
                                f"{arch!r:.200}")
    if arch["kind"] == "mlp":
        if not _int_in(arch.get("dim"), 1, _MAX_WIDTH):
            raise DetectorFileError(f"{path!s}: arch 'dim' must be an int in [1, {_MAX_WIDTH}], got "
                                    f"{arch.get('dim')!r:.200}")
        return {"kind": "mlp", "dim": arch["dim"], "hidden": _int_list(arch.get("hidden"), "arch 'hidden'", path,
                                                                       _MAX_LAYERS)}
    if arch["kind"] == "convnet":
        if not _int_in(arch.get("in_channels"), 1, _MAX_WIDTH) or not isinstance(arch.get("batch_norm"), bool):
            raise DetectorFileError(f"{path!s}: arch 'in_channels' must be an int in [1, {_MAX_WIDTH}] and "
                                    f"'batch_norm' a bool, got {arch.get('in_channels')!r:.100}, "
                                    f"{arch.get('batch_norm')!r:.100}")
        widths = _int_list(arch.get("widths"), "arch 'widths'", path, _MAX_LAYERS)
        if not widths:
            raise DetectorFileError(f"{path!s}: arch 'widths' is empty")
        return {"kind": "convnet", "in_channels": arch["in_channels"], "widths": widths,
                "batch_norm": arch["batch_norm"]}
    return {"kind": "user", "class": str(arch.get("class"))[:200]}


def _build_classifier(arch: dict) -> nn.Module:
    """The built-in classifier of a validated ``arch``, on the CPU (throwaway init, overwritten on load)."""
    gen = torch.Generator()
    if arch["kind"] == "mlp":
        return _nets.MLP(arch["dim"], arch["hidden"], generator=gen)
    return _nets.ConvNet(arch["in_channels"], arch["widths"], arch["batch_norm"], generator=gen)


def _expected_state(arch: dict) -> dict:
    """{name: (shape, floating)} of the state_dict of the built-in classifier ``arch``, computed without building
    it (the layer layout of :class:`srot_fast.nets.MLP` and :class:`srot_fast.nets.ConvNet`)."""
    out = {}
    if arch["kind"] == "mlp":
        sizes = [arch["dim"], *arch["hidden"], 1]
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            out[f"net.{2 * i}.weight"] = ((fan_out, fan_in), True)
            out[f"net.{2 * i}.bias"] = ((fan_out,), True)
        return out
    c_in, j, bn = arch["in_channels"], 0, arch["batch_norm"]
    for c_out in arch["widths"]:
        out[f"features.{j}.weight"] = ((c_out, c_in, 3, 3), True)
        if not bn:
            out[f"features.{j}.bias"] = ((c_out,), True)
        else:
            for k in ("weight", "bias", "running_mean", "running_var"):
                out[f"features.{j + 1}.{k}"] = ((c_out,), True)
            out[f"features.{j + 1}.num_batches_tracked"] = ((), False)
        j += 3 if bn else 2
        c_in = c_out
    out["head.weight"] = ((1, c_in), True)
    out["head.bias"] = ((1,), True)
    return out


def _validate_detector_file(state, path, model_given: bool):
    """(config, arch, state_dict, fitted) of a loaded detector file, checked before anything is built."""
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise DetectorFileError(f"{path!s} is not a saved OutlierDetector (no 'format': {_FORMAT!r} entry)")
    if state.get("version") not in (1, _FORMAT_VERSION) or isinstance(state.get("version"), bool):
        raise DetectorFileError(f"{path!s}: unsupported OutlierDetector format version {state.get('version')!r:.100}"
                                f" (this version reads 1 and {_FORMAT_VERSION})")
    for key in ("config", "arch", "state_dict", "fitted"):
        if not isinstance(state.get(key), dict):
            raise DetectorFileError(f"{path!s}: missing or malformed {key!r} (a dict), got "
                                    f"{type(state.get(key)).__name__}")
    config = dict(state["config"])
    missing = [k for k in _CONFIG_KEYS if k not in config]
    extra = [k for k in config if k not in _CONFIG_KEYS]
    if missing or extra:
        raise DetectorFileError(f"{path!s}: 'config' has missing keys {missing} / unknown keys {extra!r:.200}")
    if not isinstance(config["hidden"], (list, tuple)):
        raise DetectorFileError(f"{path!s}: config 'hidden' must be a list of ints, got {config['hidden']!r:.200}")
    config["hidden"] = tuple(config["hidden"])
    if config["device"] is not None and not isinstance(config["device"], str):
        raise DetectorFileError(f"{path!s}: config 'device' must be None or a string, got {config['device']!r:.100}")
    if not isinstance(config["progress"], bool):
        raise DetectorFileError(f"{path!s}: config 'progress' must be a bool, got {config['progress']!r:.100}")

    arch = _arch_from_file(state["arch"], path)
    if arch["kind"] == "user" and not model_given:
        raise DetectorFileError(f"{path!s} holds a user model of class {arch['class']}: pass an instance of it, "
                                "OutlierDetector.load(path, model=...)")
    state_dict = state["state_dict"]
    for k, v in state_dict.items():
        if not isinstance(k, str) or not torch.is_tensor(v):
            raise DetectorFileError(f"{path!s}: 'state_dict' must map names to tensors, got {k!r:.100}: "
                                    f"{type(v).__name__}")
    if arch["kind"] != "user":
        expected = _expected_state(arch)
        if set(expected) != set(state_dict):
            raise DetectorFileError(
                f"{path!s}: 'state_dict' does not match arch {arch}: missing {sorted(set(expected) - set(state_dict))}"
                f", unexpected {sorted(set(state_dict) - set(expected))!r:.200}")
        for k, (shape, floating) in expected.items():
            got = state_dict[k]
            if tuple(got.shape) != shape or got.dtype.is_floating_point != floating:
                raise DetectorFileError(f"{path!s}: state_dict[{k!r}] has shape {tuple(got.shape)} and dtype "
                                        f"{got.dtype}, arch {arch} needs shape {shape} "
                                        f"({'floating' if floating else 'integer'})")

    fitted = dict(state["fitted"])
    missing = [k for k in _FITTED_KEYS if k not in fitted]
    if missing:
        raise DetectorFileError(f"{path!s}: 'fitted' has missing keys {missing}")
    shape = fitted["input_shape"]
    if not isinstance(shape, (list, tuple)) or len(shape) not in (1, 3) or not all(
            _int_in(v, 1, _MAX_WIDTH) for v in shape):
        raise DetectorFileError(f"{path!s}: fitted 'input_shape' must be [D] or [C, H, W] (ints in [1, "
                                f"{_MAX_WIDTH}]), got {shape!r:.200}")
    shape = [int(v) for v in shape]
    if arch["kind"] == "mlp" and shape != [arch["dim"]]:
        raise DetectorFileError(f"{path!s}: fitted 'input_shape' {shape} does not match the MLP's input dimension "
                                f"{arch['dim']}")
    if arch["kind"] == "convnet" and (len(shape) != 3 or shape[0] != arch["in_channels"]):
        raise DetectorFileError(f"{path!s}: fitted 'input_shape' {shape} does not match a ConvNet with "
                                f"{arch['in_channels']} input channels")
    stat_shape = (shape[0], 1, 1) if len(shape) == 3 else (shape[0],)
    for key in ("mean", "std"):
        t = fitted[key]
        if not torch.is_tensor(t) or not t.dtype.is_floating_point or tuple(t.shape) != stat_shape:
            raise DetectorFileError(
                f"{path!s}: fitted {key!r} must be a floating tensor of shape {stat_shape} (input shape {shape}), "
                f"got " + (f"shape {tuple(t.shape)}, {t.dtype}" if torch.is_tensor(t) else type(t).__name__))
        if not torch.isfinite(t).all() or (key == "std" and not (t > 0).all()):
            raise DetectorFileError(f"{path!s}: fitted {key!r} must be finite" + (" and > 0" if key == "std" else ""))
    if fitted["mean"].device != fitted["std"].device:
        raise DetectorFileError(f"{path!s}: fitted 'mean' and 'std' are on different devices")
    for key in ("eta", "lr"):
        if not _finite_number(fitted[key], 0.0, allow_equal=False):
            raise DetectorFileError(f"{path!s}: fitted {key!r} must be a finite number > 0, got {fitted[key]!r:.100}")
    omega = fitted.get("omega")
    if omega is not None and not _finite_number(omega, 0.0, allow_equal=True):
        raise DetectorFileError(f"{path!s}: fitted 'omega' must be None or a finite number >= 0, got {omega!r:.100}")
    history = fitted["history"]
    if not isinstance(history, (list, tuple)) or not all(
            isinstance(h, (int, float)) and not isinstance(h, bool) for h in history):
        raise DetectorFileError(f"{path!s}: fitted 'history' must be a list of numbers")
    if not _int_in(fitted["n_epochs"], 0, 1 << 40):
        raise DetectorFileError(f"{path!s}: fitted 'n_epochs' must be an int >= 0, got {fitted['n_epochs']!r:.100}")
    fitted = {"input_shape": shape, "mean": fitted["mean"], "std": fitted["std"], "eta": float(fitted["eta"]),
              "lr": float(fitted["lr"]), "omega": None if omega is None else float(omega),
              "history": [float(h) for h in history], "n_epochs": int(fitted["n_epochs"])}
    return config, arch, state_dict, fitted
