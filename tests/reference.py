r"""Thin adapters from srot_fast's conventions to the reference solvers POT and GeomLoss (tests only).

Convention mapping (srot_fast -> reference):

* Cost: p = 1 -> C = |x - y|, p = 2 -> C = |x - y|^2 / 2. POT gets the dense matrix M = C.
  GeomLoss ``SamplesLoss(p=...)`` uses exactly this cost (|x - y|^p / p).
* eps (cost units) = POT ``reg`` = GeomLoss ``blur**p``.
* tau (cost units) = POT ``reg_m`` = GeomLoss ``reach**p``; tau = inf on one side is POT's
  ``reg_m=(tau_a, inf)`` (that marginal becomes a hard constraint).
* Potentials, with srot's plan pi_ij = a_i b_j exp((f_i + g_j - C_ij) / eps):
  - ``ot.sinkhorn`` (balanced): pi = diag(u) K diag(v), K = exp(-M / reg), so
    f = eps * log(u / a), g = eps * log(v / b) (unique up to f + c, g - c).
  - ``ot.unbalanced.sinkhorn_unbalanced(..., reg_type='kl')``: POT multiplies the kernel by the
    entropic reference c (default a (x) b): pi = diag(u) (exp(-M / reg) * c) diag(v), so with
    c = a (x) b the scalings *are* the potentials: f = eps * log(u), g = eps * log(v).
    (With reg_type='entropy', c = 1 and the ot.sinkhorn formula above applies.)
    The relation is asserted by ``test_reference_potential_convention`` in test_sinkhorn.py.
* GeomLoss potentials (``potentials=True``): F on x and G on y with the same meaning as srot's f, g;
  with debias=True they are f_ab - f_aa and g_ab - g_bb.
"""
from __future__ import annotations

import contextlib
import math
import types

import numpy as np
import torch

__all__ = ["cost_np", "pot_sinkhorn", "pot_unbalanced", "geomloss_loss", "kl_div", "primal_objective",
           "random_problem", "torch_threads"]


def cost_np(x: torch.Tensor, y: torch.Tensor, p: int) -> np.ndarray:
    """(N, M) float64 dense cost in srot's convention, computed independently of srot_fast."""
    x = x.detach().double().cpu().numpy()
    y = y.detach().double().cpu().numpy()
    d = np.sqrt(((x[:, None, :] - y[None, :, :]) ** 2).sum(-1))
    return d if p == 1 else 0.5 * d**2


def _np(t) -> np.ndarray:
    return t.detach().double().cpu().numpy() if torch.is_tensor(t) else np.asarray(t, dtype=np.float64)


def pot_sinkhorn(a, b, M, eps, *, n_iter=200_000, stop=1e-15):
    """Balanced entropic OT by ``ot.sinkhorn``: (plan, f, g) as float64 torch tensors."""
    import ot

    a, b, M = _np(a), _np(b), _np(M)
    plan, log = ot.sinkhorn(a, b, M, reg=eps, numItermax=n_iter, stopThr=stop, log=True, warn=False)
    f = eps * np.log(log["u"] / a)
    g = eps * np.log(log["v"] / b)
    return tuple(torch.from_numpy(np.asarray(t)) for t in (plan, f, g))


def pot_unbalanced(a, b, M, eps, tau, *, c=None, n_iter=200_000, stop=1e-15):
    """KL-unbalanced entropic OT by ``ot.unbalanced.sinkhorn_unbalanced`` (reg_type 'kl').

    ``tau`` is a number or a pair (tau_a, tau_b) (inf allowed); ``c`` the entropic reference
    (default a (x) b). Returns (plan, f, g); f, g are eps*log of POT's scalings, i.e. srot's
    potentials when c = a (x) b.
    """
    import ot

    a, b, M = _np(a), _np(b), _np(M)
    tau = tuple(tau) if isinstance(tau, (tuple, list)) else (tau, tau)
    kw = {} if c is None else {"c": _np(c)}
    plan, log = ot.unbalanced.sinkhorn_unbalanced(a, b, M, reg=eps, reg_m=tau, reg_type="kl",
                                                  numItermax=n_iter, stopThr=stop, log=True, **kw)
    f = eps * log["logu"]
    g = eps * log["logv"]
    return tuple(torch.from_numpy(np.asarray(t)) for t in (plan, f, g))


def _exact_distance(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B, N, M) |x_i - y_j| without GeomLoss's clamp of the squared distance at 1e-8."""
    return ((x[:, :, None, :] - y[:, None, :, :]) ** 2).sum(-1).sqrt()


def geomloss_loss(*, p, blur, reach=None, debias=False, scaling=0.5, diameter=None, potentials=False):
    """``geomloss.SamplesLoss('sinkhorn', ...)`` on the tensorized backend, same cost convention.

    For p = 1 the cost is passed explicitly: GeomLoss's built-in tensorized distance is
    sqrt(max(|x - y|^2, 1e-8)), i.e. 1e-4 instead of 0 on the diagonal of the x <-> x problem,
    which shifts debiased p = 1 values by ~1e-5 relative. Values only: do not differentiate this.
    """
    from geomloss import SamplesLoss

    cost = _exact_distance if p == 1 else None
    return SamplesLoss("sinkhorn", p=p, blur=blur, reach=reach, debias=debias, scaling=scaling,
                       diameter=diameter, potentials=potentials, backend="tensorized", cost=cost)


def kl_div(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Generalised KL(p | q) = sum p log(p / q) - p + q (0 log 0 = 0)."""
    p, q = p.double(), q.double()
    plogp = torch.where(p > 0, p * torch.log(p / q), torch.zeros_like(p))
    return (plogp - p + q).sum()


def primal_objective(plan, C, a, b, eps, penalty, tau) -> torch.Tensor:
    """<C, pi> + eps KL(pi | a (x) b) + tau_a D(pi 1 | a) + tau_b D(pi^T 1 | b), D in {KL, TV}
    (a side with tau = inf contributes nothing: its marginal is assumed exact)."""
    tau_a, tau_b = tuple(tau) if isinstance(tau, (tuple, list)) else (tau, tau)
    plan, C, a, b = (torch.as_tensor(t).double() for t in (plan, C, a, b))
    out = (C * plan).sum() + eps * kl_div(plan, a[:, None] * b[None, :])
    for t, marg, w in ((tau_a, plan.sum(1), a), (tau_b, plan.sum(0), b)):
        if math.isinf(t):
            continue
        out = out + t * (kl_div(marg, w) if penalty == "kl" else (marg - w).abs().sum())
    return out


def random_problem(n, m, d=2, *, seed=0, mass_b=1.0, shift=0.3, dtype=torch.float64):
    """Points x (n, d) in [0, 1]^d, y (m, d) shifted by ``shift``; non-uniform weights a (sum 1) and
    b (sum ``mass_b``). Seeded, so every test sees the same data."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(n, d, generator=gen, dtype=dtype)
    y = torch.rand(m, d, generator=gen, dtype=dtype) + shift
    a = torch.rand(n, generator=gen, dtype=dtype) + 0.5
    b = torch.rand(m, generator=gen, dtype=dtype) + 0.5
    return x, y, a / a.sum(), mass_b * b / b.sum()


@contextlib.contextmanager
def torch_threads(n: int):
    """Temporarily run torch with ``n`` intra-op threads. The tests' problems are tiny: one thread is as
    fast, and it avoids OpenMP spin-waits when the 2 shared cores are busy with other work."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


class OnCuda:
    """On a GPU machine the Triton kernels need CUDA tensors: the module's functions called with tensor
    arguments moved to CUDA and tensor results moved back (other attributes pass through)."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        obj = getattr(self._module, name)
        if not isinstance(obj, types.FunctionType):
            return obj

        def call(*args, **kwargs):
            def to(t):
                return t.cuda() if isinstance(t, torch.Tensor) else t

            out = obj(*map(to, args), **{k: to(v) for k, v in kwargs.items()})
            return out.cpu() if isinstance(out, torch.Tensor) else out

        return call


def assert_argmax(idx, logits, rtol):
    """``idx`` (N,) int64 names, in each row of the float64 reference ``logits`` (N, M), a column in range
    whose logit is within ``rtol`` times the logits' scale (1 + the largest finite |logit|) of the row maximum:
    a near-tie may resolve either way when the kernel sums in another order or precision. A row with no
    finite logit gives 0 (torch.argmax's choice)."""
    n, m = logits.shape
    assert idx.shape == (n,) and idx.dtype == torch.int64
    assert ((idx >= 0) & (idx < m)).all(), idx
    finite = logits[logits.isfinite()]
    tol = rtol * (1.0 + (finite.abs().max().item() if finite.numel() else 0.0))
    best = logits.max(1).values
    chosen = logits.gather(1, idx[:, None])[:, 0]
    live = best > -math.inf
    short = (best - chosen)[live]
    assert (short <= tol).all(), f"chosen logit {short.max().item():.3g} below the row maximum (tolerance {tol:.3g})"
    assert (idx[~live] == 0).all(), idx[~live]


def optional_backend(name: str):
    """The primitives module of 'keops', 'triton' or 'blocksparse' for kernel tests: skips when the package is
    missing or, for Triton, when there is neither CUDA nor TRITON_INTERPRET=1; on CUDA the Triton module is wrapped in
    :class:`OnCuda` so the tests compare GPU results with CPU float64 references."""
    import os

    import pytest

    if name == "keops":
        pytest.importorskip("pykeops")
        from srot_fast.kernels import keops_ops

        return keops_ops
    if name == "triton":
        pytest.importorskip("triton")
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("no CUDA and TRITON_INTERPRET is not set")
        from srot_fast.kernels import triton_softmin

        return OnCuda(triton_softmin) if torch.cuda.is_available() else triton_softmin
    if name == "blocksparse":
        from srot_fast.kernels import blocksparse

        return blocksparse
    raise ValueError(f"not an optional backend: {name!r}")
