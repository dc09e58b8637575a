"""SROTLoss (soft, KL, p = 1) loss + gradient against GeomLoss and POT at equal iterations.

Problem: x, y (n, 2) float32 Gaussian clouds (y shifted by 0.5), uniform weights, cost |x - y| (p = 1),
blur 0.05 (eps = 0.05), reach 1 (tau = 1, KL), eps-scaling 0.5 from the bounding-box diameter, debias off
(every SROTLoss here passes ``debias=False``: its default, as GeomLoss's, is the debiased divergence).
Fixed detector scores (P(target)) make the soft SROT offsets; gamma = max C (paper default) unless stated.

Equal iterations: GeomLoss runs ``len(eps_list)`` symmetric updates and one extrapolation, i.e.
``L + 1`` updates (plus its initialisation); srot_fast gets the same ``scaling``, ``max_iter = L + 1`` and a
tolerance no run reaches, and each benchmark asserts ``last_result.n_iter == L + 1``. POT's
``sinkhorn_unbalanced2`` (no eps-scaling, dense float64 kernel, autograd through the iterations) gets
``numItermax = L + 1`` as well, where its dense matrices fit in memory.

Cases (``extra_info`` holds n, backend, n_iter / updates, the value, seconds per loss + gradient):
- ``test_srot``: SROTLoss strategy 'soft' on backends cpu, keops, tensorized (+ triton on CUDA);
- ``test_geomloss``: ``geomloss.SamplesLoss('sinkhorn', p=1, blur=0.05, reach=1, scaling=0.5,
  debias=False)``, backend 'online' (KeOps) and 'tensorized';
- ``test_pot``: POT ``ot.unbalanced.sinkhorn_unbalanced2`` on the dense cost, loss + gradient;
- ``test_offsets_overhead``: backend 'cpu' with strategy None vs 'soft' (gamma fixed) vs 'soft' (gamma =
  max C, one more kernel pass), interleaved: what the soft offsets cost over no offsets.

Sizes n = m in {1k, 4k}; 16k with ``SROT_BENCH_LARGE=1``; ``SROT_BENCH_SIZES=...`` overrides.
Run: ``pytest benchmarks/bench_sinkhorn.py --benchmark-only --benchmark-json=sinkhorn.json``
"""

from __future__ import annotations

import os
import statistics
import time
import warnings

import pytest
import torch

from srot_fast.geometry import bbox_diameter
from srot_fast.loss import SROTLoss
from srot_fast.sinkhorn import epsilon_schedule

LARGE = os.environ.get("SROT_BENCH_LARGE", "") not in ("", "0")
SIZES = [1024, 4096] + ([16384] if LARGE else [])
if os.environ.get("SROT_BENCH_SIZES"):
    SIZES = [int(v) for v in os.environ["SROT_BENCH_SIZES"].split(",")]
CUDA = torch.cuda.is_available()
P, BLUR, REACH, SCALING = 1, 0.05, 1.0, 0.5
SROT_BACKENDS = ["cpu", "keops", "tensorized"] + (["triton"] if CUDA else [])
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # max_iter is reached on purpose


def _problem(n, device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 2, generator=g)
    y = torch.randn(n, 2, generator=g) + 0.5
    s_x = 0.05 + 0.6 * torch.rand(n, generator=g)  # P(target) of source points: some > 1/2 (outliers)
    s_y = 0.4 + 0.55 * torch.rand(n, generator=g)  # of target points: some < 1/2 (outliers)
    return x.to(device), y.to(device), s_x.to(device), s_y.to(device)


def _updates(x, y) -> int:
    """GeomLoss's number of updates for this problem: len(eps_list) + 1 (the last extrapolation)."""
    return len(epsilon_schedule(P, bbox_diameter(x, y), BLUR, SCALING)) + 1


def _record(benchmark, **info):
    benchmark.extra_info.update(info)


def _time(benchmark, run, warm_up, device):
    def step():
        out = run()
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    rounds = warm_up(step)
    benchmark.pedantic(step, rounds=rounds, iterations=1, warmup_rounds=0)
    if benchmark.stats is not None:  # None under --benchmark-disable (one untimed call)
        _record(benchmark, seconds_median=benchmark.stats.stats.median)


def _srot_run(loss, x0, y, scores):
    def run():
        x = x0.clone().requires_grad_()
        value = loss(x, y, scores=scores)
        (grad,) = torch.autograd.grad(value, x)
        return value.detach(), grad

    return run


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("backend", SROT_BACKENDS)
def test_srot(benchmark, backend, n, warm_up, dense_fits, load_backend):
    device = "cuda" if CUDA and backend != "cpu" else "cpu"
    _record(benchmark, solver="srot_fast", strategy="soft", backend=backend, n=n, device=device)
    if backend == "tensorized" and not dense_fits(n, n, torch.float32):
        _record(benchmark, seconds_median="out of memory")
        pytest.skip("out of memory: dense N x M buffers")
    if backend == "keops" and not CUDA and n > 16384:
        pytest.skip("keops on 2 CPU cores: minutes per call above 16k points")
    load_backend(backend)  # skips when not installed
    x, y, s_x, s_y = _problem(n, device)
    iters = _updates(x, y)
    loss = SROTLoss("sinkhorn", p=P, blur=BLUR, reach=REACH, scaling=SCALING, debias=False, backend=backend,
                    strategy="soft", tol=1e-30, max_iter=iters)
    _time(benchmark, _srot_run(loss, x, y, (s_x, s_y)), warm_up, device)
    assert loss.last_result.n_iter == iters, (loss.last_result.n_iter, iters)
    _record(benchmark, n_iter=loss.last_result.n_iter, value=float(loss(x, y, scores=(s_x, s_y))))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("gl_backend", ["online", "tensorized"])
def test_geomloss(benchmark, gl_backend, n, warm_up, dense_fits):
    geomloss = pytest.importorskip("geomloss")
    device = "cuda" if CUDA else "cpu"
    _record(benchmark, solver="geomloss", backend=gl_backend, n=n, device=device, geomloss=geomloss.__version__)
    if gl_backend == "tensorized" and not dense_fits(2 * n, 2 * n, torch.float32):
        _record(benchmark, seconds_median="out of memory")
        pytest.skip("out of memory: GeomLoss tensorized keeps several N x M matrices")
    if gl_backend == "online":
        pytest.importorskip("pykeops")
    x0, y, _, _ = _problem(n, device)
    loss = geomloss.SamplesLoss("sinkhorn", p=P, blur=BLUR, reach=REACH, scaling=SCALING, debias=False,
                                backend=gl_backend)

    def run():
        x = x0.clone().requires_grad_()
        value = loss(x, y)
        (grad,) = torch.autograd.grad(value, x)
        return value.detach(), grad

    _time(benchmark, run, warm_up, device)
    _record(benchmark, updates=_updates(x0, y), value=float(run()[0]))


@pytest.mark.parametrize("n", SIZES)
def test_pot(benchmark, n, warm_up, dense_fits):
    ot = pytest.importorskip("ot")
    _record(benchmark, solver="pot", backend="sinkhorn_unbalanced2 (dense, float64)", n=n, device="cpu",
            pot=ot.__version__)
    if not dense_fits(2 * n, 2 * n, torch.float64, "cpu"):  # cost, kernel, plan + autograd copies
        _record(benchmark, seconds_median="out of memory")
        pytest.skip("out of memory: POT needs dense float64 N x M matrices")
    x0, y, _, _ = _problem(n, "cpu")
    x0, y = x0.double(), y.double()
    iters = _updates(x0, y)
    a = torch.full((n,), 1.0 / n, dtype=torch.float64)

    def run():
        x = x0.clone().requires_grad_()
        cost = torch.cdist(x, y)  # p = 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            value = ot.unbalanced.sinkhorn_unbalanced2(a, a, cost, reg=BLUR**P, reg_m=REACH**P, reg_type="kl",
                                                       numItermax=iters, stopThr=1e-300)
        (grad,) = torch.autograd.grad(value, x)
        return value.detach(), grad

    _time(benchmark, run, warm_up, "cpu")
    _record(benchmark, updates=iters, value=float(run()[0]))


VARIANTS = {"none": (None, None), "soft_fixed_gamma": ("soft", 10.0), "soft_gamma_max_cost": ("soft", None)}


@pytest.mark.parametrize("n", SIZES)
def test_offsets_overhead(benchmark, n, warm_up):
    """Same backend ('cpu'), same iterations; only the cost offsets (and gamma's extra max C pass) differ.
    The three variants run interleaved in every round, so load drift hits them alike; ``extra_info`` holds
    each variant's median seconds and its ratio to no offsets (the benchmark's own time is one round)."""
    x, y, s_x, s_y = _problem(n, "cpu")
    iters = _updates(x, y)
    runs, losses = {}, {}
    for variant, (strategy, gamma) in VARIANTS.items():
        losses[variant] = SROTLoss("sinkhorn", p=P, blur=BLUR, reach=REACH, scaling=SCALING, debias=False,
                                   backend="cpu", strategy=strategy, gamma=gamma, tol=1e-30, max_iter=iters)
        runs[variant] = _srot_run(losses[variant], x, y, (s_x, s_y) if strategy else None)
    times = {v: [] for v in runs}

    def one_round():
        for v, run in runs.items():
            t = time.perf_counter()
            run()
            times[v].append(time.perf_counter() - t)

    rounds = warm_up(one_round)
    for t in times.values():
        t.clear()
    benchmark.pedantic(one_round, rounds=rounds, iterations=1, warmup_rounds=0)
    med = {v: statistics.median(t) for v, t in times.items()}
    _record(benchmark, solver="srot_fast", backend="cpu", n=n, device="cpu", n_iter=iters, overhead=True,
            **{f"seconds_{v}": med[v] for v in med}, **{f"ratio_{v}": med[v] / med["none"] for v in med})
    assert all(loss.last_result.n_iter == iters for loss in losses.values())
