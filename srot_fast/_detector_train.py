"""Training of :class:`srot_fast.OutlierDetector` (docs/DESIGN.md, Detector): the pooled standardisation, the
default hyper-parameters, and the mini-batch loop with the CE or CE + VAT loss (:mod:`srot_fast.vat`).

:class:`_Training` holds the training methods of the detector (``_setup``, ``_train``, ``_batch_loss``,
``_direction``); :class:`srot_fast.detector.OutlierDetector` inherits them. The state of one fit lives in
``detector._run`` while :meth:`~srot_fast.detector.OutlierDetector.fit` runs.
"""
from __future__ import annotations

import contextlib
import math
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from . import nets as _nets
from . import vat as _vat

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
_PREDICT_ELEMENTS = 1 << 22   # predict_proba works in chunks of about this many input numbers


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
    square overflows whatever the magnitude of the data. A std below 1e-6 x the largest |mean| or std (a
    constant coordinate or channel) is replaced by the largest std: such a coordinate standardises to 0 on the
    training points, and a new point off that value moves as far in standardised units as in the other
    coordinates (with the floor itself, 1e-3 off a constant coordinate flipped a point's score from 0.1 to 1).
    All constant: std 1."""
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
    top = float(std.max())
    floor = 1e-6 * max(top, float(mean.abs().max()))
    if not top > floor:  # every coordinate constant
        return b, mean, torch.ones_like(std)
    return b, mean, torch.where(std > floor, std, torch.full_like(std, top))


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


class _Training:
    """The training methods of :class:`srot_fast.detector.OutlierDetector` (a mixin: it uses the detector's
    hyper-parameters and its ``_logits`` / ``_as_logits`` / ``_param_dtype`` / ``_perturbation_scale``)."""

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
                if best == math.inf or self.history_[-1] < best - _EARLY_STOP_RTOL * abs(best):  # (inf - inf: NaN)
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
