"""``sinkhorn`` and ``SROTLoss`` on every backend against the dense ``tensorized`` reference
(docs/DESIGN.md, Solver and Kernel primitive).

Backends: ``cpu`` (compiled C++ kernel, else its torch fallback), ``keops`` (marker ``keops``) and ``triton``
(marker ``triton``; on CPU under ``TRITON_INTERPRET=1``, set by tests/conftest.py). Everything runs in
float64 at 37 x 53 points, D = 3 -- the KeOps formulas compiled by tests/test_kernels.py (D = 3, float64),
so this file adds no KeOps build. Each problem runs a fixed number of updates (``tol`` below any reachable
error), so every backend performs the same arithmetic up to summation order.

Tolerances (float64): values, potentials, masses and gradients within ``atol = rtol = 1e-9`` of the
reference (the kernels agree to ~1e-14 per pass; the updates are contractions, so errors do not grow).
float64 ``gradcheck`` of ``sinkhorn(...).value`` runs on cpu, keops and (w.r.t. x only) triton. The Triton
interpreter costs ~10 ms per kernel call, so Triton gets a subset of the cases. Whole file: ~45 s on 2
loaded cores with a warm KeOps cache.
"""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch
from reference import assert_argmax
from srot_fast.kernels import cpu_ops

from srot_fast import backends, sinkhorn
from srot_fast.loss import SROTLoss

N, M, D = 37, 53, 3
DT = torch.float64
ITERS = 16  # updates per solve: eps-scaling (9 steps here) + 7 at the final eps
TOL = dict(atol=1e-9, rtol=1e-9)
pytestmark = pytest.mark.filterwarnings("ignore:Sinkhorn stopped at max_iter")  # fixed iteration counts


def _need(backend: str) -> None:
    if backend == "keops":
        pytest.importorskip("pykeops")
    if backend == "triton":
        pytest.importorskip("triton")
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("no CUDA and TRITON_INTERPRET is not set")


KEOPS, TRITON = pytest.mark.keops, pytest.mark.triton


def _device(backend: str) -> str:
    """Triton needs CUDA tensors on a GPU machine (the interpreter takes CPU tensors); the reference it is
    compared with runs on the same device."""
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def _data(seed=0, n=N, m=M):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g, dtype=DT)
    y = torch.randn(m, D, generator=g, dtype=DT) + 0.5
    y[min(4, m - 1)] = x[2]  # a coincident pair: the p = 1 kink
    a = torch.rand(n, generator=g, dtype=DT) + 0.5
    b = torch.rand(m, generator=g, dtype=DT) + 0.5
    s_x = torch.rand(n, generator=g, dtype=DT) * 0.98 + 0.01  # P(target) scores for the soft strategy
    s_y = torch.rand(m, generator=g, dtype=DT) * 0.98 + 0.01
    return x, y, a / a.sum(), b / b.sum(), s_x, s_y


# (penalty, tau, mass, offsets): plain balanced / KL, soft offsets with KL, partial OT with offsets
CONFIGS = {
    "balanced": dict(penalty="balanced"),
    "kl": dict(penalty="kl", tau=1.0),
    "kl_soft": dict(penalty="kl", tau=(0.7, 1.3), offsets=True),
    "partial_soft": dict(penalty="balanced", mass=0.6, offsets=True),
}


def _solve(backend, cfg, p, leaf=True, device="cpu"):
    x, y, a, b, s_x, s_y = (t.to(device) for t in _data())
    x, y, a, b = (t.clone().requires_grad_(leaf) for t in (x, y, a, b))
    kw = dict(cfg)
    u = v = None
    if kw.pop("offsets", False):
        u, v = 0.3 * -torch.log(s_x), 0.3 * -torch.log1p(-s_y)
    res = sinkhorn(x, y, a, b, p=p, eps=0.1**p, u=u, v=v, tol=1e-300, max_iter=ITERS, backend=backend, **kw)
    grads = torch.autograd.grad(res.value, (x, y, a, b))
    return res, grads


def _cases(*axes, triton):
    """Full grid on cpu and keops; on the (slow) Triton interpreter only the listed cases."""
    import itertools

    grid = [("cpu", *c) for c in itertools.product(*axes)]
    grid += [pytest.param("keops", *c, marks=KEOPS) for c in itertools.product(*axes)]
    return grid + [pytest.param("triton", *c, marks=TRITON) for c in triton]


@pytest.mark.parametrize(
    "backend,cfg,p", _cases(list(CONFIGS), (1, 2), triton=[(c, 1) for c in CONFIGS] + [("kl_soft", 2)])
)
def test_sinkhorn_matches_tensorized(backend, cfg, p):
    """Value, potentials, masses, n_iter, gradients (x, y, a, b), barycentric projection and label
    propagation agree with the dense reference."""
    _need(backend)
    ref, ref_grads = _solve("tensorized", CONFIGS[cfg], p, device=_device(backend))
    res, grads = _solve(backend, CONFIGS[cfg], p, device=_device(backend))
    assert res.backend == backend and ref.backend == "tensorized"
    assert res.n_iter == ref.n_iter == ITERS
    for name in ("value", "f", "g", "row_mass", "col_mass"):
        torch.testing.assert_close(getattr(res, name).detach(), getattr(ref, name).detach(), **TOL, msg=name)
    for name, got, want in zip("xyab", grads, ref_grads):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, want, **TOL, msg=f"d value / d {name}")
    torch.testing.assert_close(res.barycentric_projection(), ref.barycentric_projection(), **TOL)
    # the arg-max may resolve a near-tie the other way: its plan entry is within rounding of the row's largest
    assert_argmax(res.plan_argmax().cpu(), ref.plan().detach().double().cpu().log(), 1e-9)


_LOSS = {"plain-balanced": (None, None), "plain-kl": (None, 1.0), "soft-kl": ("soft", 1.0),
         "soft-kl-pair": ("soft", (0.5, 2.0))}


@pytest.mark.parametrize("backend,case,p", _cases(list(_LOSS), (1, 2), triton=[("soft-kl", 1), ("soft-kl", 2)]))
def test_srotloss_matches_tensorized(backend, case, p):
    """SROTLoss (gamma = max C computed by the backend's own max_cost) on a backend vs 'tensorized'."""
    _need(backend)
    strategy, reach = _LOSS[case]
    x0, y0, a0, b0, s_x, s_y = (t.to(_device(backend)) for t in _data(seed=1))
    out = {}
    for be in ("tensorized", backend):
        x, y, a, b = (t.clone().requires_grad_() for t in (x0, y0, a0, b0))
        loss = SROTLoss(p=p, blur=0.1, reach=reach, strategy=strategy, backend=be, tol=1e-300, max_iter=ITERS,
                        debias=False)
        value = loss(a, x, b, y, scores=(s_x, s_y) if strategy else None)
        grads = torch.autograd.grad(value, (x, y, a, b))
        out[be] = (value.detach(), grads, loss.last_result)
    (v_ref, g_ref, r_ref), (v, g, r) = out["tensorized"], out[backend]
    assert r.backend == backend and r.n_iter == r_ref.n_iter
    torch.testing.assert_close(v, v_ref, **TOL)
    torch.testing.assert_close(r.f, r_ref.f, **TOL)
    torch.testing.assert_close(r.g, r_ref.g, **TOL)
    for name, got, want in zip("xyab", g, g_ref):
        torch.testing.assert_close(got, want, **TOL, msg=f"d loss / d {name}")


@pytest.mark.parametrize(
    "backend,p",
    [("cpu", 1), ("cpu", 2), pytest.param("keops", 1, marks=KEOPS), pytest.param("keops", 2, marks=KEOPS),
     pytest.param("triton", 1, marks=TRITON)],
)
def test_gradcheck_value(backend, p):
    """float64 gradcheck of sinkhorn(...).value w.r.t. points and weights (KL: weights are free), with
    offsets; converged to 1e-14 so the envelope-theorem gradient is the derivative of the value.
    Each finite difference is a full solve, so the slow backends get fewer inputs: KeOps (x, b) at 4 x 5
    points, the Triton interpreter x at 3 x 4 (y, a, b use the same reductions with the roles swapped, and
    every gradient is compared with 'tensorized' above)."""
    _need(backend)
    n, m = {"cpu": (6, 7), "keops": (4, 5), "triton": (3, 4)}[backend]
    x, y, a, b, s_x, s_y = (t.to(_device(backend)) for t in _data(seed=2, n=n, m=m))
    x, y, a, b = (t.clone().requires_grad_() for t in (x, y, a, b))
    u, v = 0.2 * -torch.log(s_x), 0.2 * -torch.log1p(-s_y)
    eps, tau = {"cpu": (0.5**p, 1.0), "keops": (1.0, 0.3), "triton": (2.0, 0.3)}[backend]  # fewer updates

    def value(x, y, a, b):
        return sinkhorn(x, y, a, b, p=p, eps=eps, penalty="kl", tau=tau, u=u, v=v,
                        tol=1e-14, max_iter=5000, backend=backend).value

    if backend != "cpu":
        y.requires_grad_(False), a.requires_grad_(False)
    if backend == "triton":
        b.requires_grad_(False)
    assert torch.autograd.gradcheck(value, (x, y, a, b), eps=1e-6, atol=1e-6, rtol=1e-5)


def test_gradcheck_balanced_points():
    """Balanced OT (weights fixed: their total mass must stay equal), gradients w.r.t. the points."""
    backend = "cpu"
    x, y, a, b, _, _ = _data(seed=3, n=6, m=7)
    x, y = x.clone().requires_grad_(), y.clone().requires_grad_()

    def value(x, y):
        return sinkhorn(x, y, a, b, p=2, eps=0.3, tol=1e-14, max_iter=5000, backend=backend).value

    assert torch.autograd.gradcheck(value, (x, y), eps=1e-6, atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------- selection
def test_auto_reports_its_choice():
    x, y, *_ = _data()
    small = sinkhorn(x[:10], y[:10], p=1, backend="auto", max_iter=3)
    # N * M < 4096: the compiled kernel, else the dense reference
    assert small.backend == ("cpu" if cpu_ops.available() else "tensorized")
    big = sinkhorn(torch.randn(80, 2, dtype=DT), torch.randn(70, 2, dtype=DT), p=1, backend="auto", max_iter=3)
    assert big.backend == "cpu"
    loss = SROTLoss(p=1, reach=1.0, debias=False)  # backend='auto' by default
    loss(torch.randn(80, 2, dtype=DT), torch.randn(70, 2, dtype=DT))
    assert loss.last_result.backend == "cpu"


def test_auto_on_cuda_prefers_triton_then_keops(monkeypatch):
    """Resolution only (no GPU needed): on a CUDA device 'auto' takes triton, else keops, else tensorized."""
    monkeypatch.setattr(backends, "_is_cuda", lambda device: True)
    installed = {"triton": True, "pykeops": True}
    monkeypatch.setattr(backends, "_installed", lambda pkg: pkg is None or installed[pkg])
    assert backends.resolve_backend("auto", 10_000, 10_000, "cuda") == "triton"
    installed["triton"] = False
    assert backends.resolve_backend("auto", 10_000, 10_000, "cuda") == "keops"
    installed["pykeops"] = False
    assert backends.resolve_backend("auto", 10_000, 10_000, "cuda") == "tensorized"


@pytest.mark.parametrize("backend,package,extra", [("keops", "pykeops", "keops"), ("triton", "triton", "triton")])
def test_missing_backend_names_the_extra(monkeypatch, backend, package, extra):
    """An explicitly requested backend whose package is absent raises ImportError naming the pip extra,
    from sinkhorn and from SROTLoss; 'auto' quietly avoids it."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    assert backend not in backends.available_backends()
    x, y, *_ = _data()
    with pytest.raises(ImportError, match=rf"srot_fast\[{extra}\]"):
        sinkhorn(x, y, p=1, backend=backend)
    with pytest.raises(ImportError, match=rf"pip install 'srot_fast\[{extra}\]'"):
        SROTLoss(p=1, backend=backend, debias=False)(x, y)
    assert sinkhorn(x, y, p=1, backend="auto", max_iter=3).backend in ("tensorized", "cpu")


def test_unknown_backend_is_rejected():
    x, y, *_ = _data()
    with pytest.raises(ValueError, match="backend must be"):
        sinkhorn(x, y, backend="numba")


def test_cpu_backend_without_compiler_matches(monkeypatch):
    """The 'cpu' backend's torch fallback (no compiler) gives the same Sinkhorn as the compiled kernel."""
    from srot_fast.kernels import cpu_ops

    ref, ref_grads = _solve("cpu", CONFIGS["kl_soft"], 1)
    monkeypatch.setattr(cpu_ops, "_load", lambda: None)
    res, grads = _solve("cpu", CONFIGS["kl_soft"], 1)
    torch.testing.assert_close(res.value, ref.value, **TOL)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, **TOL)
    assert math.isfinite(res.marginal_error)


# ------------------------------------------------------------------------- KeOps CUDA crash guard
def _keops_probe_env(monkeypatch, tmp_path, script):
    """keops_ops with a fresh probe state, the cache in tmp_path, a fixed key and ``script`` as the probe."""
    from srot_fast.kernels import keops_ops

    monkeypatch.setenv("SROT_FAST_CACHE", str(tmp_path))
    monkeypatch.delenv("SROT_KEOPS_CUDA_PROBE", raising=False)
    monkeypatch.setattr(keops_ops, "_cuda_checked", set())
    monkeypatch.setattr(keops_ops, "_cuda_failed", {})
    monkeypatch.setattr(keops_ops, "_probe_key", lambda index: f"key{index}")
    monkeypatch.setattr(keops_ops, "_CUDA_PROBE", script)
    return keops_ops


def _no_subprocess(*a, **k):
    raise AssertionError("the probe ran again")


def test_keops_cuda_probe_turns_a_crash_into_an_error(monkeypatch, tmp_path):
    """A KeOps CUDA compile that segfaults (pykeops 2.3 on CUDA 13) must not kill the caller: the child
    process's crash becomes a RuntimeError naming it and the backends to use instead; nothing is cached
    on disk, and later calls raise the same error without probing again."""
    mod = _keops_probe_env(monkeypatch, tmp_path, "import sys; assert sys.argv[1] == '1'; raise SystemExit(3)")
    with pytest.raises(RuntimeError, match="cuda:1.*exit status 3"):
        mod.check_cuda("cuda:1")  # the probe runs on the caller's device (argv[1])
    mod = _keops_probe_env(monkeypatch, tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    with pytest.raises(RuntimeError, match=r"cuda:0.*segmentation fault.*backend='triton'"):
        mod.check_cuda("cuda:0")
    assert not list(tmp_path.iterdir())
    monkeypatch.setattr(mod.subprocess, "run", _no_subprocess)
    with pytest.raises(RuntimeError, match="segmentation fault"):
        mod.check_cuda("cuda:0")


def test_keops_cuda_probe_timeout_is_an_error(monkeypatch, tmp_path):
    mod = _keops_probe_env(monkeypatch, tmp_path, "import time; time.sleep(30)")
    with pytest.raises(RuntimeError, match="no result within 1 s"):
        mod.check_cuda("cuda:0", timeout=1)


def test_keops_cuda_probe_success_is_remembered(monkeypatch, tmp_path):
    mod = _keops_probe_env(monkeypatch, tmp_path, "import sys; assert sys.argv[1] == '0'")
    mod.check_cuda("cuda:0")
    assert (tmp_path / "keops_cuda_ok_key0").exists()
    monkeypatch.setattr(mod.subprocess, "run", _no_subprocess)
    mod.check_cuda("cuda:0")  # same process: remembered
    monkeypatch.setattr(mod, "_cuda_checked", set())
    mod.check_cuda("cuda:0")  # new process, same (pykeops, CUDA, driver, GPU, nvrtc): the marker file
    with pytest.raises(AssertionError, match="ran again"):
        mod.check_cuda("cuda:1")  # another device (another key) is probed
    monkeypatch.setenv("SROT_KEOPS_CUDA_PROBE", "0")
    mod.check_cuda("cuda:1")  # skipped on request


def test_keops_cuda_probe_survives_a_read_only_cache(monkeypatch, tmp_path):
    ro = tmp_path / "ro"
    ro.write_text("a file where the cache folder should be")  # mkdir fails
    mod = _keops_probe_env(monkeypatch, tmp_path, "pass")
    monkeypatch.setenv("SROT_FAST_CACHE", str(ro / "cache"))
    mod.check_cuda("cuda:0")
    assert 0 in mod._cuda_checked


def test_keops_cpu_tensors_never_probe_cuda(monkeypatch):
    from srot_fast.kernels import keops_ops

    def boom(*a, **k):
        raise AssertionError("CUDA probe on CPU tensors")

    monkeypatch.setattr(keops_ops, "check_cuda", boom)
    x, y, h = torch.randn(5, 2), torch.randn(4, 2), torch.zeros(4)
    keops_ops._check(x, y, h, 1)
