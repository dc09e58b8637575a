"""Benchmark fixtures: backend loading, warm-up outside the timed region, the dense-reference memory
check, and the machine/version record attached to every result (pytest-benchmark hook). The size
grids live in the benchmark files (``SROT_BENCH_LARGE=1`` adds the large sizes). Helpers are fixtures,
not imports, so that this conftest never shadows ``tests/conftest.py``.

Run: ``pytest benchmarks/ --benchmark-only`` (add ``--benchmark-json=out.json`` to keep a record); see
benchmarks/README.md.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import time
import types
from pathlib import Path

import pytest
import torch

_FUSED_SRC = Path(__file__).with_name("fused_reference.c")
_FUSED_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]


def _mem_available() -> int:
    """Bytes of memory available (``MemAvailable``), or a large number when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 50


def _fused_reference():
    """ctypes handle of benchmarks/fused_reference.c, built with gcc on first use (cached by source hash)."""
    src = _FUSED_SRC.read_bytes()
    key = hashlib.sha256(src + " ".join(_FUSED_FLAGS).encode()).hexdigest()[:12]
    so = Path(tempfile.gettempdir()) / f"srot_fused_reference_{key}.so"
    if not so.exists():
        tmp = so.with_suffix(f".{os.getpid()}.so")
        subprocess.run([os.environ.get("CC", "gcc"), *_FUSED_FLAGS, str(_FUSED_SRC), "-o", str(tmp), "-lm"],
                       check=True, capture_output=True, timeout=120)
        os.replace(tmp, so)
    lib = ctypes.CDLL(str(so))
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.fused_softmin_f32.argtypes = [vp, vp, vp, i64, i64, i64, ctypes.c_int, ctypes.c_float, vp]
    lib.fused_softmin_f32.restype = None
    return lib


def fused_softmin(x, y, h, eps, p):
    """Softmin by the plain fused C loop (float32 CPU only; the transpose of y is part of the call)."""
    lib = _fused_reference()
    x, yt, h = x.float().contiguous(), y.float().t().contiguous(), h.float().contiguous()
    out = torch.empty(x.shape[0], dtype=torch.float32)
    lib.fused_softmin_f32(x.data_ptr(), yt.data_ptr(), h.data_ptr(), x.shape[0], y.shape[0], x.shape[1], p,
                          float(eps), out.data_ptr())
    return out


def keops_raw_softmin(x, y, h, eps, p):
    """Softmin written directly with pykeops LazyTensors, eps a formula constant (what a KeOps user writes)."""
    from pykeops.torch import LazyTensor

    x_i, y_j = LazyTensor(x[:, None, :]), LazyTensor(y[None, :, :])
    h_j = LazyTensor(h[None, :, None])
    sq = ((x_i - y_j) ** 2).sum(-1)
    cost = sq.sqrt() if p == 1 else sq * 0.5
    return -eps * (h_j - cost * (1.0 / eps)).logsumexp(dim=1).view(-1)


def _load_backend(name: str):
    """Module-like object with ``softmin`` for ``name``; skips (with the reason) when unavailable.

    Backends of srot_fast: tensorized, cpu, cpu_torch (its blocked-torch fallback), keops, triton.
    Peers: keops_raw (plain LazyTensor formula), fused_c (benchmarks/fused_reference.c)."""
    if name == "fused_c":
        try:
            _fused_reference()
        except (OSError, subprocess.SubprocessError) as e:
            pytest.skip(f"fused C reference not built: {e}")
        return types.SimpleNamespace(softmin=fused_softmin)
    if name == "keops_raw":
        pytest.importorskip("pykeops")
        return types.SimpleNamespace(softmin=keops_raw_softmin)
    if name == "tensorized":
        from srot_fast.kernels import tensorized

        return tensorized
    if name in ("cpu", "cpu_torch"):
        from srot_fast.kernels import cpu_ops

        if name == "cpu_torch":
            return types.SimpleNamespace(softmin=cpu_ops.torch_softmin)
        if not cpu_ops.available():
            pytest.skip(f"compiled CPU kernel unavailable: {cpu_ops.build_error()}")
        return cpu_ops
    if name == "keops":
        pytest.importorskip("pykeops")
        from srot_fast.kernels import keops_ops

        return keops_ops
    if name == "triton":
        pytest.importorskip("triton")
        from srot_fast.kernels import triton_softmin

        return triton_softmin
    raise ValueError(name)


def _dense_fits(n: int, m: int, dtype: torch.dtype, device: str | None = None) -> bool:
    """Whether the materialised reference (about 3 N x M buffers) fits in half the available memory of
    ``device`` (default: CUDA when present, else the host)."""
    need = 3 * n * m * torch.finfo(dtype).bits // 8
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        return need < free // 2
    return need < _mem_available() // 2


def _warm_up(fn, *args) -> int:
    """Run ``fn`` once (KeOps compile, Triton JIT, C++ build, allocator warm-up) and return a number of
    timed rounds that keeps one benchmark near a second (3 to 20)."""
    t = time.perf_counter()
    fn(*args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    return int(min(20, max(3, 1.0 / max(dt, 1e-6))))


@pytest.fixture
def load_backend():
    return _load_backend


@pytest.fixture
def dense_fits():
    return _dense_fits


@pytest.fixture
def warm_up():
    return _warm_up


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def pytest_collect_file(file_path, parent):
    """Collect ``bench_*.py`` when the folder is given (``pytest benchmarks/``); files named on the command
    line are collected by pytest itself."""
    if file_path.suffix == ".py" and file_path.name.startswith("bench_") and not parent.session.isinitpath(file_path):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["torch"] = torch.__version__
    machine_info["torch_threads"] = torch.get_num_threads()
    machine_info["cuda_device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    machine_info["cpu_model"] = platform.processor() or platform.machine()
    for mod in ("pykeops", "triton"):
        try:
            machine_info[mod] = __import__(mod).__version__
        except ImportError:
            machine_info[mod] = None


@pytest.fixture(autouse=True)
def _jsonl_record(request):
    """With ``SROT_BENCH_JSONL=path``: append each finished benchmark (name, median, extra_info) to that file
    as it completes, so a run killed at its time budget (benchmarks/gpu_suite.py) keeps what it measured
    (pytest-benchmark writes its own JSON only at the end)."""
    yield
    path = os.environ.get("SROT_BENCH_JSONL")
    bench = request.node.funcargs.get("benchmark") if hasattr(request.node, "funcargs") else None
    if not path or bench is None:
        return
    import json

    stats = getattr(getattr(bench, "stats", None), "stats", None)
    row = dict(name=request.node.name, median_s=getattr(stats, "median", None),
               rounds=getattr(stats, "rounds", None))
    row.update({k: v for k, v in bench.extra_info.items() if not isinstance(v, (list, dict))})
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
