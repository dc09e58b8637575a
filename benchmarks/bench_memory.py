"""Peak memory of SROTLoss (soft, KL, p = 1, debias off) loss + gradient at n = m = 64k on the CPU.

Each case runs in a fresh Python process (this file as a script) and reports ``ru_maxrss``: once after
imports, inputs and a small warm-up (C++ build), and once after one loss + gradient at full size. The
growth is what the solve itself needed; an N x M float32 buffer at 64k would be 16 GiB (the dense
'tensorized' backend needs about three: it is recorded as "out of memory", not run).

Cost estimate, 2 idle cores: one kernel pass at 64k, d = 2 is ~4.3e9 pairs, ~3 s for the compiled 'cpu'
backend; the run uses ``diameter = blur`` (a one-step eps schedule: memory does not depend on the
number of iterations) and ``max_iter = 2``, about 12 passes including gamma = max C and the two
gradient reductions: ~40 s (twice that under load). ``SROT_BENCH_MEM_N`` changes the size.

Run: ``pytest benchmarks/bench_memory.py --benchmark-only --benchmark-json=memory.json`` or
``python benchmarks/bench_memory.py cpu 65536`` (prints one JSON line).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

N_DEFAULT = int(os.environ.get("SROT_BENCH_MEM_N", "65536"))


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def measure(backend: str, n: int) -> dict:
    """Peak RSS before / after one SROTLoss loss + gradient on ``backend`` at n = m (run in a fresh process)."""
    import warnings

    import torch

    from srot_fast.loss import SROTLoss

    warnings.simplefilter("ignore")  # max_iter is reached on purpose

    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 2, generator=g)
    y = torch.randn(n, 2, generator=g) + 0.5
    s_x = 0.05 + 0.6 * torch.rand(n, generator=g)
    s_y = 0.4 + 0.55 * torch.rand(n, generator=g)
    loss = SROTLoss("sinkhorn", p=1, blur=0.05, reach=1.0, diameter=0.05, debias=False, backend=backend,
                    strategy="soft", tol=1e-30, max_iter=2)
    small = 512
    xs = x[:small].clone().requires_grad_()
    torch.autograd.grad(loss(xs, y[:small], scores=(s_x[:small], s_y[:small])), xs)  # build / warm-up
    before = _maxrss_bytes()
    t = time.perf_counter()
    xg = x.clone().requires_grad_()
    value = loss(xg, y, scores=(s_x, s_y))
    (grad,) = torch.autograd.grad(value, xg)
    seconds = time.perf_counter() - t
    after = _maxrss_bytes()
    return dict(backend=loss.last_result.backend, n=n, m=n, d=2, seconds=seconds, rss_before_bytes=before,
                rss_peak_bytes=after, growth_bytes=after - before, inputs_bytes=4 * (2 * n * 2 + 2 * n),
                dense_nm_float32_bytes=4 * n * n, value=float(value.detach()),
                grad_finite=bool(torch.isfinite(grad).all()))


def run_in_subprocess(backend: str, n: int, timeout: float = 1800) -> dict:
    proc = subprocess.run([sys.executable, __file__, backend, str(n)], capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_peak_rss(benchmark):
    """The 'cpu' backend at n = m = 64k: records the peak RSS growth; fails if it reaches one N x M buffer."""
    import pytest

    if not sys.platform.startswith("linux"):
        pytest.skip("ru_maxrss units are Linux-specific")
    n = N_DEFAULT
    benchmark.extra_info.update(backend="cpu", n=n, m=n, d=2, solver="SROTLoss soft KL p=1, loss + gradient")
    result = benchmark.pedantic(run_in_subprocess, args=("cpu", n), rounds=1, iterations=1, warmup_rounds=0)
    benchmark.extra_info.update(result)
    benchmark.extra_info["tensorized"] = "out of memory (~3 N x M float32 buffers)"
    assert result["grad_finite"]
    assert result["growth_bytes"] < result["dense_nm_float32_bytes"] / 16, result


if __name__ == "__main__":
    backend = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else N_DEFAULT
    print(json.dumps(measure(backend, n)))
