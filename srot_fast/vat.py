r"""Power-iteration steps of virtual adversarial training (VAT; docs/DESIGN.md, Detector) for a binary classifier
f(x) = sigmoid(logit(x)).

The adversarial direction is the dominant eigenvector of H, the Hessian at r = 0 of

    r -> KL(Bernoulli(p) || Bernoulli(sigmoid(logit(z + r)))),      p = sigmoid(logit(z)) (detached).

Since the gradient of the KL in the logit vanishes at r = 0, H is exactly the Gauss-Newton / Fisher product
H = J^T F J with J = d logit / d z and F = sigma(l) (1 - sigma(l)), the Fisher information of a Bernoulli in
its logit. One power-iteration step from a random d0 is H d0:

- :func:`power_step` ``method="fused"``: H d0 = vjp(F * jvp(d0)), one forward-mode and one reverse-mode pass
  in one ``torch.func`` call (:func:`gauss_newton_product`), exact, no xi and no finite-difference
  cancellation. When every sample's logit depends on that sample only (``per_sample=True``, e.g. batch-norm
  statistics frozen, see :class:`FrozenBatchNorm`), J is block diagonal with rows g_i = grad logit_i, so
  H_i = F_i g_i g_i^T has rank one and H d0 = F (g . d0) g: the jvp is read off the vjp, J d0 = (J^T 1) . d0
  row by row (one reverse pass in all, the cost of the reference), and the step lands exactly on the
  dominant eigenvector +-g_i. (With the general jvp + vjp call a whole training step costs about 1.3 times
  the reference's on the paper's ConvNet and 2 times on a small MLP, on a CPU: forward-mode passes are slow;
  hence the shortcut, see docs/DETECTOR.md.)
- ``method="fd"``: the finite-difference reference of Miyato et al., grad_r KL(p || f(z + xi d0)) ~ xi H d0.
  In float32 with xi = 1e-6 the difference sigma(l + xi J d0) - p is at the rounding level of p: some rows
  come out exactly zero (the detector then uses the random d0) and others with a random sign.

Power iteration is refused in float16 / bfloat16 (the finite difference underflows and F loses its digits):
convert the model and inputs to float32 (``model.float()``). Autocast is disabled inside the steps.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import jvp, vjp

__all__ = ["power_step", "gauss_newton_product", "fd_product", "bernoulli_fisher", "FrozenBatchNorm",
           "is_per_sample", "check_power_dtype"]

LogitFn = Callable[[torch.Tensor], torch.Tensor]
_HALF = (torch.float16, torch.bfloat16)


def check_power_dtype(dtype: torch.dtype, what: str = "inputs") -> None:
    """Raise TypeError for float16 / bfloat16 (power iteration needs float32 or float64)."""
    if dtype in _HALF:
        raise TypeError(
            f"VAT power iteration needs float32 or float64, got {what} in {dtype}: in half precision the "
            "finite-difference probe underflows and the Fisher weight sigma(1 - sigma) loses its digits. "
            "Convert the model and data to float32 (model.float(), x.float()); mixed precision is not supported "
            "for the detector.")


def _no_autocast(device: torch.device):
    try:
        return torch.autocast(device_type=device.type, enabled=False)
    except (RuntimeError, ValueError):       # a device type without autocast support
        return contextlib.nullcontext()


def bernoulli_fisher(logit: torch.Tensor) -> torch.Tensor:
    """F = sigma(l) (1 - sigma(l)) computed as sigma(l) sigma(-l): no cancellation for confident logits."""
    return torch.sigmoid(logit) * torch.sigmoid(-logit)


def _check_logit(logit: torch.Tensor, z: torch.Tensor) -> None:
    if logit.shape != (z.shape[0],):
        raise ValueError(f"the logit function must map inputs {tuple(z.shape)} to ({z.shape[0]},) logits, got "
                         f"{tuple(logit.shape)}")


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).flatten(1).sum(1)


def _bcast(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.reshape((-1,) + (1,) * (like.dim() - 1))


def gauss_newton_product(fn: LogitFn, z: torch.Tensor, d: torch.Tensor, *, per_sample: bool = False):
    r"""Exact Gauss-Newton (= Hessian of the VAT KL at r = 0) product with one jvp and one vjp.

    Args:
        fn: logit function (B, *S) -> (B,); pure (no in-place update of captured buffers, e.g. batch-norm
            running statistics: wrap the model with :class:`FrozenBatchNorm`).
        z: (B, *S) inputs; d: (B, *S) directions.
        per_sample: True when logit_i depends on z_i only; then J d = rowwise (J^T 1) . d and a single vjp
            gives the product (exact under that assumption).

    Returns:
        (logit (B,), H d (B, *S)) with H = J^T diag(F) J, F = sigma(l) sigma(-l); no autograd graph.
    """
    check_power_dtype(z.dtype)
    if per_sample:
        logit, g = _input_grad(fn, z)
        jd = _rowdot(g, d.detach().to(g.dtype))
        return logit, _bcast(bernoulli_fisher(logit) * jd, g) * g
    with _no_autocast(z.device), torch.no_grad():   # torch.func ignores the outer no_grad for its own level
        z = z.detach()
        d = d.detach().to(z.dtype)
        # vjp of the jvp: the forward runs once with tangents; its primal output is differentiated in reverse,
        # the tangent J d comes back as auxiliary output (not differentiated)
        logit, vjp_fn, jd = vjp(lambda x: jvp(fn, (x,), (d,)), z, has_aux=True)
        _check_logit(logit, z)
        (hd,) = vjp_fn(bernoulli_fisher(logit) * jd)
        return logit, hd


def _input_grad(fn: LogitFn, z: torch.Tensor):
    """(logit (B,), J^T 1 (B, *S)) detached: one forward and one reverse pass w.r.t. the input only (plain
    autograd: on small networks torch.func's per-call overhead would cost more than the pass itself)."""
    with _no_autocast(z.device), torch.enable_grad():
        zr = z.detach().requires_grad_(True)
        logit = fn(zr)
        _check_logit(logit, z)
        (g,) = torch.autograd.grad(logit.sum(), zr)
    return logit.detach(), g


def fd_product(fn: LogitFn, z: torch.Tensor, d: torch.Tensor, p: Optional[torch.Tensor] = None,
               xi: float = 1e-6) -> torch.Tensor:
    r"""Finite-difference reference (Miyato et al.): grad_r sum_i KL(p_i || f(z_i + r_i)) at r = xi d, which is
    xi H d + O(xi^2). ``p`` (B,) defaults to sigmoid(fn(z)) (one more forward). Returns (B, *S), no graph."""
    check_power_dtype(z.dtype)
    with _no_autocast(z.device), torch.enable_grad():
        z = z.detach()
        if p is None:
            with torch.no_grad():
                p = torch.sigmoid(fn(z))
        r = (xi * d.detach().to(z.dtype)).requires_grad_(True)
        lq = fn(z + r)
        _check_logit(lq, z)
        p = p.detach().to(lq.dtype)
        kl = -(p * F.logsigmoid(lq) + (1 - p) * F.logsigmoid(-lq)).sum()   # KL up to a constant in r
        (g,) = torch.autograd.grad(kl, r)
    return g


def power_step(fn: LogitFn, z: torch.Tensor, d0: torch.Tensor, *, method: str = "fused",
               p: Optional[torch.Tensor] = None, xi: float = 1e-6, per_sample: bool = True) -> torch.Tensor:
    r"""One power-iteration step: a (B, *S) tensor equal per sample to a positive multiple of H d0.

    ``method="fused"``: with ``per_sample`` the exact rank-one step sign(g . d0) g (the positive factor
    F |g . d0| is dropped, so confident points with F ~ 1e-30 still get a direction); otherwise the
    jvp/vjp product H d0. ``method="fd"``: the finite-difference gradient at r = xi d0 (``p`` = the clean
    predictions, detached). Rows that come out exactly zero (g . d0 = 0, or an underflowed finite
    difference) are left to the caller (e.g. fall back to d0).
    """
    if method == "fd":
        return fd_product(fn, z, d0, p, xi)
    if method != "fused":
        raise ValueError(f"method must be 'fused' or 'fd', got {method!r}")
    if not per_sample:
        return gauss_newton_product(fn, z, d0, per_sample=False)[1]
    check_power_dtype(z.dtype)
    _, g = _input_grad(fn, z)
    return _bcast(torch.sign(_rowdot(g, d0.to(g.dtype))), g) * g


def is_per_sample(fn: LogitFn, z: torch.Tensor, rtol: float = 1e-4) -> bool:
    """Whether fn's logits on the batch z (B >= 2) equal those computed on two halves (no cross-sample
    coupling, e.g. through batch statistics). Random layers (dropout) make it return False. The global CPU
    RNG state is restored."""
    if z.shape[0] < 2:
        return True
    k = z.shape[0] // 2
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        full = fn(z)
        parts = torch.cat([fn(z[:k]), fn(z[k:])])
    scale = float(full.abs().max()) + 1.0
    return bool(((full - parts).abs() <= rtol * scale).all())


class FrozenBatchNorm:
    r"""Batch-norm statistics frozen for the perturbed passes of a VAT step.

    The clean forward pass runs inside :meth:`record` (training mode: batch statistics, running statistics
    updated once, as in any training step); the perturbed passes call :meth:`fn`, which evaluates the model
    with every training-mode ``_BatchNorm`` layer normalising by the clean batch's mean and (biased) variance
    instead of its own batch's. So perturbed passes never update the running statistics, the perturbed network
    is the clean one evaluated at z + r (KL = 0 at r = 0 exactly), and samples do not interact through batch
    statistics (per-sample logits). With ``attached=True`` the recorded statistics stay in the clean pass's
    graph, so a loss on the perturbed logits is differentiated through them: the gradient then respects the
    scale invariance of batch-norm (with constant statistics, shrinking the weights before a batch-norm would
    look like a way to flatten the perturbed outputs, and VAT training degenerates). Models without
    batch-norm pass through unchanged.
    """

    def __init__(self, model: nn.Module, logits: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        self.model = model
        self.logits = logits if logits is not None else (lambda out: out)
        self.bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        self.stats: Dict[nn.Module, tuple] = {}

    @contextlib.contextmanager
    def record(self):
        """Context for the clean pass: record each training-mode batch-norm layer's input statistics."""
        self.stats = {}
        handles = [m.register_forward_pre_hook(self._hook) for m in self.bns if m.training]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def _hook(self, module, inputs):
        x = inputs[0]
        dims = [0] + list(range(2, x.dim()))
        self.stats[module] = (x.mean(dims), x.var(dims, unbiased=False))

    @staticmethod
    def _normalise(module, mean, var, x):
        shape = (1, -1) + (1,) * (x.dim() - 2)
        y = (x - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + module.eps)
        if module.weight is not None:
            y = y * module.weight.reshape(shape)
        if module.bias is not None:
            y = y + module.bias.reshape(shape)
        return y

    def fn(self, x: torch.Tensor, attached: bool = False) -> torch.Tensor:
        """Logits of x with the recorded statistics: as constants (default; for the power step, which only
        differentiates in x) or ``attached`` to the clean graph (for the adversarial loss term)."""
        patched = []
        try:
            for m, (mean, var) in self.stats.items():
                if not attached:
                    mean, var = mean.detach(), var.detach()
                m.forward = functools.partial(self._normalise, m, mean, var)   # instance attribute shadows
                patched.append(m)
            return self.logits(self.model(x))
        finally:
            for m in patched:
                del m.forward
