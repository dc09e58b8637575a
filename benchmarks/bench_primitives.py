"""Throughput of the softmin primitive (docs/DESIGN.md, "Kernel primitive") per backend: pairs (i, j) per second.

Grid: backends (tensorized, cpu = compiled C++, cpu_torch = blocked-torch fallback = "chunked torch",
keops, and triton when CUDA is present) and peers (keops_raw = a plain pykeops LazyTensor formula,
fused_c = the plain fused C loop of benchmarks/fused_reference.c, CPU only) x n = m in {1k, 4k}
(+ {16k, 64k} with ``SROT_BENCH_LARGE=1``; ``SROT_BENCH_SIZES=256,1024`` overrides) x d in {2, 64} x
p in {1, 2}, float32. A case whose call would take more than ~30 s at a generous throughput for its
backend is skipped and recorded as ``"not run (too slow)"``. Warm-up (KeOps compile, C++ build) happens
before the timed rounds. Each result carries ``extra_info``: backend, n, m, d, p, dtype, device, threads,
``pairs_per_s`` (median) and ``pairs_per_s_p20_p80``; the dense reference is recorded as ``"out of memory"``
(and skipped) when its N x M buffers would not fit.

Run: ``pytest benchmarks/bench_primitives.py --benchmark-only --benchmark-json=bench.json``
"""

from __future__ import annotations

import os

import pytest
import torch

LARGE = os.environ.get("SROT_BENCH_LARGE", "") not in ("", "0")
SIZES = [1024, 4096] + ([16384, 65536] if LARGE else [])
if os.environ.get("SROT_BENCH_SIZES"):
    SIZES = [int(v) for v in os.environ["SROT_BENCH_SIZES"].split(",")]
DIMS = [2, 64]
PS = [1, 2]
CUDA = torch.cuda.is_available()
BACKENDS = ["tensorized", "keops", "keops_raw"] + (["triton"] if CUDA else ["cpu", "cpu_torch", "fused_c"])
# generous CPU pairs/s (2 cores) per (backend, d) for the "too slow" rule; GPU backends are not limited
_FAST_CPU = {"keops": 3e8, "keops_raw": 3e8, "cpu_torch": 5e8, "tensorized": 1e9}
_MAX_CALL_S = 30.0


def _record(benchmark, **info):
    benchmark.extra_info.update({k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in info.items()})


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_softmin_throughput(benchmark, backend, n, d, p, device, load_backend, dense_fits, warm_up):
    m, dtype, eps = n, torch.float32, 0.05
    if backend in ("cpu", "cpu_torch", "fused_c"):
        device = "cpu"
    _record(
        benchmark,
        primitive="softmin",
        backend=backend,
        n=n,
        m=m,
        d=d,
        p=p,
        dtype=dtype,
        device=device,
        threads=torch.get_num_threads(),
    )
    if backend == "tensorized" and not dense_fits(n, m, dtype):
        _record(benchmark, pairs_per_s="out of memory")
        pytest.skip(f"out of memory: the dense reference needs ~3 x {n} x {m} floats")
    if device == "cpu" and n * m * max(1.0, d / 8) / _FAST_CPU.get(backend, 4e9) > _MAX_CALL_S:
        _record(benchmark, pairs_per_s="not run (too slow)")
        pytest.skip(f"{backend} at n = m = {n}, d = {d} would take > {_MAX_CALL_S:.0f} s per call on this CPU")
    mod = load_backend(backend)
    if backend == "triton" and device != "cuda":
        pytest.skip("triton benchmarks need a GPU")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g, dtype=dtype).to(device)
    y = torch.randn(m, d, generator=g, dtype=dtype).to(device)
    h = torch.full((m,), -float(torch.log(torch.tensor(float(m)))), dtype=dtype, device=device)

    def run():
        out = mod.softmin(x, y, h, eps, p)
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    rounds = warm_up(run)
    benchmark.pedantic(run, rounds=rounds, iterations=1, warmup_rounds=0)
    if benchmark.stats is None:  # --benchmark-disable: one untimed call
        return
    st = benchmark.stats.stats
    pairs = n * m
    q = sorted(st.data)
    p20, p80 = q[int(0.2 * (len(q) - 1))], q[int(0.8 * (len(q) - 1))]
    _record(benchmark, pairs_per_s=pairs / st.median, pairs_per_s_p20_p80=[pairs / p80, pairs / p20])
