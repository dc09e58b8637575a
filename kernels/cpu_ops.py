r"""Bounded-memory CPU backend of the kernel primitives (SPEC §4): a compiled streaming kernel with a
blocked-torch fallback.

Same functions and signatures as :mod:`srot_fast.kernels.tensorized`:

- ``softmin(x, y, h, eps, p)``             -> (N,)    out_i = -eps * LSE_j[h_j - C(x_i, y_j) / eps]
- ``weighted_mean(x, y, h, eps, p, phi)``  -> (N, D)  sum_j softmax_j(h_j - C_ij / eps) * phi(x_i, y_j)
- ``plan_argmax(x, y, h, eps, p)``         -> (N,)    int64, argmax_j (h_j - C_ij / eps) (first on ties)
- ``max_cost(x, y, p)``                    -> ()      max_ij C(x_i, y_j)

with C = |x - y| (p = 1) or |x - y|^2 / 2 (p = 2); ``x`` (N, D), ``y`` (M, D), ``h`` (M,) may hold
``-inf`` (zero-weight columns), ``eps`` > 0 a Python float.

Compiled path (CPU float32 / float64 tensors): ``csrc/cpu_ops.cpp``, a plain C++/OpenMP kernel built on
first use with the system compiler (``$CXX`` or ``g++``, ``-O3 -march=native -fopenmp``) into a cache
folder (``$SROT_FAST_CACHE``, else ``$XDG_CACHE_HOME/srot_fast``, else ``~/.cache/srot_fast``) and loaded
with :mod:`ctypes` -- no torch headers, so the build takes about a second and does not depend on the torch
ABI. One pass per super-block of 64 rows: for each column tile (256 columns, reused from L2 by the
8 groups of 8 register-blocked rows), exact difference-form distances and an online log-sum-exp
(running max and rescaled sum); exp arguments below -80 are flushed to 0. Memory is O((N + M) * D)
plus a few tens of KB per thread. It uses ``torch.get_num_threads()`` threads (one below ~1e6 units of
work). Measured on one core of the 2-core Xeon (float32 softmin, n = m from 1k to 64k): 1.7-2.0e9
pairs/s at D = 2 and 4.3-4.6e8 at D = 64, 1.1-1.5x and 1.6-4.4x a plain fused C loop
(benchmarks/README.md).

Fallback (no compiler, failed build, ``SROT_FAST_NO_COMPILE=1``, other dtypes or devices): the
``torch_*`` functions, which process row blocks of at most ``2**22 / M`` rows with
``torch.cdist(..., compute_mode="donot_use_mm_for_euclid_dist")`` (exact difference form), so the
largest temporary is ~2**22 elements whatever N and M (float16 / bfloat16 are computed in float32).

Tested (tests/test_kernels.py) against the torch reference on a 2-core Xeon (AVX-512), gcc 12,
torch 2.13 CPU: odd sizes, D in {1, 2, 3, 64}, p in {1, 2}, float32 and float64, coincident points,
shifted log-weights up to 1e6, ``-inf`` columns; peak memory at N = M = 20000.

Caution:
    - Outputs carry no autograd graph (the primitives are used under the envelope theorem).
    - A row whose ``h`` is all ``-inf`` gives ``+inf`` (softmin), NaN (weighted_mean), 0 (plan_argmax).
    - The shared library is built with ``-march=native``; the cache key includes the CPU flags, so a
      cache folder shared between different machines rebuilds instead of crashing.
    - ``csrc/cpu_ops.cpp`` must ship with the package (package data), else the fallback is used.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

from ._common import cache_dir, check_operands

__all__ = [
    "available",
    "build_error",
    "softmin",
    "weighted_mean",
    "plan_argmax",
    "max_cost",
    "torch_softmin",
    "torch_weighted_mean",
    "torch_plan_argmax",
    "torch_max_cost",
]

_SRC = Path(__file__).with_name("csrc") / "cpu_ops.cpp"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-std=c++17", "-shared", "-fPIC"]
_BLOCK_ELEMS = 1 << 22  # fallback: rows per block * M <= this
_SMALL_WORK = 1 << 20  # below N * M * max(D, 4) run on one thread (~0.5 ms of work): a 2-thread region cost
# ~18 ms per call with the other core busy (load 4 on 2 cores, 256 x 256: 0.12 ms on one thread)
_PAD_COLS = 16  # = W in csrc/cpu_ops.cpp: the y transpose is padded to a multiple of this

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_tried = False
_error: Optional[str] = None


# --------------------------------------------------------------------------------------------- build
def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


def _build(cxx: str) -> Path:
    src = _SRC.read_bytes()
    key = hashlib.sha256(
        b"\0".join([src, " ".join(_FLAGS).encode(), cxx.encode(), _cpu_flags().encode(), platform.machine().encode()])
    ).hexdigest()[:16]
    out_dir = cache_dir()
    so = out_dir / f"srot_cpu_ops_{key}.so"
    if so.exists():
        return so
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)  # atomic publish: concurrent builds are safe
    os.close(fd)
    try:
        subprocess.run([cxx, *_FLAGS, str(_SRC), "-o", tmp], check=True, capture_output=True, timeout=300)
        os.replace(tmp, so)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return so


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, c_int, dbl = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
    for suf in ("f32", "f64"):
        getattr(lib, f"srot_softmin_{suf}").argtypes = [p, p, p, i64, i64, i64, c_int, dbl, p, c_int]
        getattr(lib, f"srot_wmean_{suf}").argtypes = [p, p, p, i64, i64, i64, c_int, dbl, c_int, p, c_int]
        getattr(lib, f"srot_argmax_{suf}").argtypes = [p, p, p, i64, i64, i64, c_int, dbl, p, c_int]
        fn = getattr(lib, f"srot_max_sq_{suf}")
        fn.argtypes = [p, p, i64, i64, i64, c_int]
        fn.restype = dbl
        for name in ("softmin", "wmean", "argmax"):
            getattr(lib, f"srot_{name}_{suf}").restype = None


def _load() -> Optional[ctypes.CDLL]:
    global _lib, _tried, _error
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        if os.environ.get("SROT_FAST_NO_COMPILE", "") not in ("", "0"):
            _error = "disabled by SROT_FAST_NO_COMPILE"
        elif not sys.platform.startswith("linux"):
            _error = f"compiled CPU kernel only built on Linux (platform {sys.platform})"
        else:
            cxx = os.environ.get("CXX", "g++")
            try:
                lib = ctypes.CDLL(str(_build(cxx)))
                _declare(lib)
                _lib = lib
            except FileNotFoundError as e:  # no compiler, or csrc/cpu_ops.cpp not shipped
                _error = f"{type(e).__name__}: {e}"
            except subprocess.CalledProcessError as e:
                _error = f"build failed ({' '.join(e.cmd[:2])} ...): {e.stderr.decode(errors='replace')[-2000:]}"
            except subprocess.TimeoutExpired as e:
                _error = f"build timed out after {e.timeout} s"
            except (OSError, AttributeError) as e:  # unwritable cache, bad .so, missing symbol
                _error = f"{type(e).__name__}: {e}"
        _tried = True
        return _lib


def available() -> bool:
    """True when the compiled kernel is built (or builds now) and loads; False means torch fallback."""
    return _load() is not None


def build_error() -> Optional[str]:
    """Why the compiled kernel is not available (None when it is or was not tried yet)."""
    _load()
    return _error


# ---------------------------------------------------------------------------------------- dispatch
def _check(x, y, h=None, p=1):
    check_operands(x, y, h, p, allow_empty=True)


def _native(*ts) -> Optional[ctypes.CDLL]:
    """The library when every tensor is a CPU float32/float64 tensor of one dtype, else None."""
    dt = ts[0].dtype
    if dt not in (torch.float32, torch.float64) or any(t.device.type != "cpu" or t.dtype != dt for t in ts):
        return None
    return _load()


def _threads(n, m, d) -> int:
    return 1 if n * m * max(d, 4) < _SMALL_WORK else max(1, torch.get_num_threads())


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def _suffix(t: torch.Tensor) -> str:
    return "f32" if t.dtype == torch.float32 else "f64"


def _prep(x, y, h):
    x = x.detach().contiguous()
    m, d = y.shape
    # (D, ld) transpose, ld = M rounded up to _PAD_COLS (zeros): columns contiguous for the SIMD tiles
    yt = y.new_zeros(d, -(-m // _PAD_COLS) * _PAD_COLS)
    yt[:, :m] = y.detach().t()
    h = h.detach().contiguous() if h is not None else None
    return x, yt, h


def softmin(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int) -> torch.Tensor:
    r"""(N,) soft-min ``out_i = -eps * log sum_j exp(h_j - C(x_i, y_j) / eps)``; ``+inf`` if all ``h = -inf``.

    Example:
        >>> x, y, h = torch.randn(1000, 2), torch.randn(800, 2), torch.zeros(800)
        >>> softmin(x, y, h, 0.01, 2).shape
        torch.Size([1000])
    """
    _check(x, y, h, p)
    lib = _native(x, y, h)
    if lib is None:
        return torch_softmin(x, y, h, eps, p)
    n, d = x.shape
    m = y.shape[0]
    out = torch.empty(n, dtype=x.dtype)
    if n == 0 or m == 0:
        return out.fill_(float("inf"))
    x, yt, h = _prep(x, y, h)
    getattr(lib, f"srot_softmin_{_suffix(x)}")(
        _ptr(x), _ptr(yt), _ptr(h), n, m, d, p, float(eps), _ptr(out), _threads(n, m, d)
    )
    return out


def weighted_mean(
    x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int, phi: str = "y"
) -> torch.Tensor:
    r"""(N, D) mean of phi(x_i, y_j) under w_ij = softmax_j(h_j - C_ij / eps).

    ``phi="y"``: y_j. ``phi="grad"``: nabla_x C = (x_i - y_j) / |x_i - y_j| (p = 1, 0 where x_i = y_j)
    or x_i - y_j (p = 2).
    """
    _check(x, y, h, p)
    if phi not in ("y", "grad"):
        raise ValueError(f"phi must be 'y' or 'grad', got {phi!r}")
    lib = _native(x, y, h)
    if lib is None:
        return torch_weighted_mean(x, y, h, eps, p, phi)
    n, d = x.shape
    m = y.shape[0]
    out = torch.empty(n, d, dtype=x.dtype)
    if n == 0 or m == 0:
        return out.fill_(float("nan"))
    xc, yt, hc = _prep(x, y, h)
    code = 1 if (phi == "grad" and p == 1) else 0
    getattr(lib, f"srot_wmean_{_suffix(xc)}")(
        _ptr(xc), _ptr(yt), _ptr(hc), n, m, d, p, float(eps), code, _ptr(out), _threads(n, m, d)
    )
    if phi == "grad" and p == 2:
        out = xc - out
    return out


def plan_argmax(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int) -> torch.Tensor:
    """(N,) int64 index of the largest plan entry per row, argmax_j (h_j - C_ij / eps), first on ties."""
    _check(x, y, h, p)
    if y.shape[0] == 0:
        raise ValueError("plan_argmax needs at least one column (M >= 1)")
    lib = _native(x, y, h)
    if lib is None:
        return torch_plan_argmax(x, y, h, eps, p)
    n, d = x.shape
    m = y.shape[0]
    out = torch.empty(n, dtype=torch.int64)
    if n == 0:
        return out
    x, yt, h = _prep(x, y, h)
    getattr(lib, f"srot_argmax_{_suffix(x)}")(
        _ptr(x), _ptr(yt), _ptr(h), n, m, d, p, float(eps), _ptr(out), _threads(n, m, d)
    )
    return out


def max_cost(x: torch.Tensor, y: torch.Tensor, p: int) -> torch.Tensor:
    """() largest ground cost max_ij C(x_i, y_j) (0-dim tensor of x's dtype)."""
    _check(x, y, None, p)
    if x.shape[0] == 0 or y.shape[0] == 0:
        raise ValueError("max_cost of an empty point cloud")
    lib = _native(x, y)
    if lib is None:
        return torch_max_cost(x, y, p)
    n, d = x.shape
    m = y.shape[0]
    x, yt, _ = _prep(x, y, None)
    s = getattr(lib, f"srot_max_sq_{_suffix(x)}")(_ptr(x), _ptr(yt), n, m, d, _threads(n, m, d))
    s = torch.tensor(s, dtype=x.dtype)  # exact: the kernel's float32 max is representable in float64
    return s.sqrt() if p == 1 else s / 2


# ------------------------------------------------------------------------------- blocked torch
def _row_blocks(n: int, m: int):
    step = max(1, _BLOCK_ELEMS // max(m, 1))
    for i0 in range(0, n, step):
        yield slice(i0, min(n, i0 + step))


def _cost_block(xb: torch.Tensor, y: torch.Tensor, p: int) -> torch.Tensor:
    dist = torch.cdist(xb, y, compute_mode="donot_use_mm_for_euclid_dist")  # (B, M), exact form
    return dist if p == 1 else dist.square_().mul_(0.5)


def _logits_block(xb, y, h, eps, p):
    return _cost_block(xb, y, p).div_(-eps).add_(h)


def _upcast(*ts):
    """float16 / bfloat16 -> float32 (torch.cdist has no CPU half kernels); other dtypes unchanged."""
    return tuple(t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in ts)


@torch.no_grad()
def torch_softmin(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int) -> torch.Tensor:
    """Blocked-torch :func:`softmin` (any device and float dtype; temporaries of ~2**22 elements)."""
    _check(x, y, h, p)
    out = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
    x, y, h = _upcast(x, y, h)
    for blk in _row_blocks(x.shape[0], y.shape[0]):
        out[blk] = torch.logsumexp(_logits_block(x[blk], y, h, eps, p), dim=1).mul_(-eps)
    return out


@torch.no_grad()
def torch_weighted_mean(
    x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int, phi: str = "y"
) -> torch.Tensor:
    """Blocked-torch :func:`weighted_mean`."""
    _check(x, y, h, p)
    if phi not in ("y", "grad"):
        raise ValueError(f"phi must be 'y' or 'grad', got {phi!r}")
    out = torch.empty_like(x)
    x, y, h = _upcast(x, y, h)
    for blk in _row_blocks(x.shape[0], y.shape[0]):
        xb = x[blk]
        if phi == "grad" and p == 1:
            dist = _cost_block(xb, y, 1)
            w = torch.softmax(dist / -eps + h, dim=1)
            w = torch.where(dist > 0, w / dist, torch.zeros_like(w))  # w_ij / |x_i - y_j|, 0 at x_i = y_j
            # sum_j w_ij (x_ik - y_jk), one coordinate at a time (exact, no (B, M, D) buffer)
            for k in range(x.shape[1]):
                out[blk, k] = (w * (xb[:, k, None] - y[None, :, k])).sum(1)
        else:
            wy = torch.softmax(_logits_block(xb, y, h, eps, p), dim=1) @ y
            out[blk] = xb - wy if phi == "grad" else wy
    return out


@torch.no_grad()
def torch_plan_argmax(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int) -> torch.Tensor:
    """Blocked-torch :func:`plan_argmax`."""
    _check(x, y, h, p)
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    x, y, h = _upcast(x, y, h)
    for blk in _row_blocks(x.shape[0], y.shape[0]):
        out[blk] = _logits_block(x[blk], y, h, eps, p).argmax(dim=1)
    return out


@torch.no_grad()
def torch_max_cost(x: torch.Tensor, y: torch.Tensor, p: int) -> torch.Tensor:
    """Blocked-torch :func:`max_cost`."""
    _check(x, y, None, p)
    dtype = x.dtype
    x, y = _upcast(x, y)
    best = torch.full((), -float("inf"), dtype=x.dtype, device=x.device)
    for blk in _row_blocks(x.shape[0], y.shape[0]):
        best = torch.maximum(best, _cost_block(x[blk], y, p).max())
    return best.to(dtype)
