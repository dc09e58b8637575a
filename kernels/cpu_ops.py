r"""Bounded-memory CPU backend of the kernel primitives (docs/DESIGN.md, Kernel primitive): a compiled
streaming kernel with a blocked-torch fallback.

Same functions and signatures as :mod:`srot_fast.kernels.tensorized`:

- ``softmin(x, y, h, eps, p)``             -> (N,)    out_i = -eps * LSE_j[h_j - C(x_i, y_j) / eps]
- ``weighted_mean(x, y, h, eps, p, phi)``  -> (N, D)  sum_j softmax_j(h_j - C_ij / eps) * phi(x_i, y_j)
- ``plan_argmax(x, y, h, eps, p)``         -> (N,)    int64, argmax_j (h_j - C_ij / eps) (first on ties)
- ``max_cost(x, y, p)``                    -> ()      max_ij C(x_i, y_j)

with C = |x - y| (p = 1) or |x - y|^2 / 2 (p = 2); ``x`` (N, D), ``y`` (M, D), ``h`` (M,) may hold
``-inf`` (zero-weight columns), ``eps`` > 0 a Python float. Batched operands x (B, N, D), y (B, M, D),
h (B, M) give (B, N), (B, N, D), (B, N) and (B,): B independent problems with one ``eps``, each equal to
the unbatched call on that problem, in one call of the compiled kernel (B = 0 gives empty outputs).

Compiled path (CPU float32 / float64 tensors): ``csrc/cpu_ops.cpp``, a plain C++/OpenMP kernel built on
first use with the system compiler (``$CXX``, split like a shell command line, default ``g++``;
``-O3 -march=native -fopenmp``) into the cache folder of :func:`srot_fast.kernels._common.cache_dir`
and loaded with :mod:`ctypes` -- no torch headers, so the build is quick and does not depend on the torch
ABI. Per (problem, super-block of 64 rows) task: for each column tile (256 columns, reused from L2 by the
8 groups of 8 register-blocked rows), exact difference-form distances and an online log-sum-exp
(running max and rescaled sum); exp arguments below -80 are flushed to 0. OpenMP hands out the tasks of
the whole batch. Memory is O(B (N + M) D) plus a few tens of KB per thread. It uses
``torch.get_num_threads()`` threads (one below ~1e6 units of work, B N M max(D, 4)).

The same library holds the block-sparse entry points (``srot_bs_*``) of :mod:`srot_fast.kernels.blocksparse`.

Cache: a library is loaded only if it passes these checks, else it is rebuilt.

- The folder is private (owned by the current user, not writable by group or others, parents safe;
  see ``cache_dir``), otherwise a private temporary folder is used for this process, with an
  ``UnsafeCacheWarning``. This is what keeps other users' code out: the cache file name is computable
  from public facts, and a sha256 written beside a library by whoever can write the folder proves
  nothing.
- The library and its sidecar (``<name>.so.sha256``) are regular files (not symbolic links) owned by
  the user, not group/other-writable, and the library's sha256 equals the recorded one -- checked
  before ``dlopen``, so a truncated or corrupt file (which ``dlopen`` would map and crash on with
  SIGBUS) is never loaded. After loading, ``srot_abi_version()`` must equal ``_ABI_VERSION``.
- A build goes to temporary files named ``.srot_build_<pid>_<host>_*`` in the folder (the compiler runs
  in its own process group, killed on timeout or KeyboardInterrupt; the files are removed on any
  error), is fsynced and hashed, loaded from its temporary name, then published by atomic renames:
  library first, sidecar second. Temporary files whose process is gone (same host) or older than an
  hour are removed on the next load. Concurrent builds are safe; a reader that meets a library and a
  sidecar from two different builds rebuilds.

Fallback (no compiler, failed build, ``SROT_FAST_NO_COMPILE=1``, other dtypes or devices): the
``torch_*`` functions, which process row blocks of at most ``2**22 / M`` rows with
``torch.cdist(..., compute_mode="donot_use_mm_for_euclid_dist")`` (exact difference form), so the
largest temporary is ~2**22 elements whatever N and M (float16 / bfloat16 are computed in float32);
batched operands are solved one problem after another. When the compiled kernel cannot be used for
float32 / float64 CPU tensors, a :class:`CompiledKernelWarning` says why, once per process; the
deliberate ``SROT_FAST_NO_COMPILE=1`` gives no warning (:func:`build_error` still says why).

Caution:
    - Outputs carry no autograd graph (the primitives are used under the envelope theorem).
    - A row whose ``h`` is all ``-inf`` gives ``+inf`` (softmin), NaN (weighted_mean), 0 (plan_argmax).
    - The shared library is built with ``-march=native``; the cache key includes the CPU flags, so a
      cache folder shared between different machines rebuilds instead of crashing.
    - ``csrc/cpu_ops.cpp`` must ship with the package (package data), else the fallback is used.
    - Checking and loading are two steps: the library could be swapped in between only by someone who
      can write the private folder, that is the user or root.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import List, Optional

import torch

from ._common import UnsafeCacheWarning, cache_dir, check_operands, unsafe_reason, warn

__all__ = [
    "CompiledKernelWarning",
    "UnsafeCacheWarning",
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
_ABI_VERSION = 3  # = srot_abi_version() in csrc/cpu_ops.cpp; bump both when an entry point changes
_BUILD_TIMEOUT_S = 300
_TMP_PREFIX = ".srot_build_"  # temporary files of a build: .srot_build_<pid>_<host>_<random><suffix>
_STALE_S = 3600  # a temporary file this old is removed whatever its pid says
_BLOCK_ELEMS = 1 << 22  # fallback: rows per block * M <= this
_SMALL_WORK = 1 << 20  # below B * N * M * max(D, 4) run on one thread (under a millisecond of work): starting
# an OpenMP team can cost more than that when the other cores are busy
_PAD_COLS = 16  # = W in csrc/cpu_ops.cpp: the y transpose is padded to a multiple of this

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_tried = False
_error: Optional[str] = None


class CompiledKernelWarning(UserWarning):
    """The compiled CPU kernel is not used (the message says why): the blocked-torch fallback runs instead,
    with the same results, slower. Given once per process; not given for ``SROT_FAST_NO_COMPILE=1``."""


class _Unavailable(Exception):
    """Why the compiled kernel cannot be used (the message is :func:`build_error`)."""


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


def _compiler() -> List[str]:
    """``$CXX`` (default ``g++``) split like a shell would, so ``CXX="ccache g++"`` works."""
    raw = os.environ.get("CXX") or "g++"
    try:
        argv = shlex.split(raw)
    except ValueError as e:
        raise _Unavailable(f"CXX={raw!r} cannot be parsed: {e}") from None
    if not argv:
        raise _Unavailable(f"CXX={raw!r} names no compiler")
    return argv


def _lib_name(argv: List[str]) -> str:
    """Cache file name: a hash of the source, flags, compiler command, CPU flags, machine and ABI version."""
    key = hashlib.sha256(b"\0".join([
        _SRC.read_bytes(), " ".join(_FLAGS).encode(), "\0".join(argv).encode(), _cpu_flags().encode(),
        platform.machine().encode(), str(_ABI_VERSION).encode(),
    ])).hexdigest()[:16]
    return f"srot_cpu_ops_{key}.so"


def _read_nofollow(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _sidecar(so: Path) -> Path:
    return so.with_name(so.name + ".sha256")


def _verify(so: Path) -> Optional[str]:
    """None when ``so`` and its sidecar are private regular files of the current user and the sha256 of
    ``so`` equals the one recorded in the sidecar; else why not. Nothing is loaded."""
    side = _sidecar(so)
    for f in (so, side):
        try:
            reason = unsafe_reason(f)
        except FileNotFoundError:
            return f"{f.name} is missing"
        if reason:
            return reason
    try:
        recorded = _read_nofollow(side).decode("ascii", "replace").split()
        actual = hashlib.sha256(_read_nofollow(so)).hexdigest()
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    if not recorded or recorded[0] != actual:
        return f"{so.name} does not match its recorded sha256 (truncated or corrupt)"
    return None


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _tmp_prefix() -> str:
    return f"{_TMP_PREFIX}{os.getpid()}_{_host_tag()}_"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: exists, another user's
        return True
    return True


def _clean_stale(folder: Path) -> None:
    """Remove temporary files of builds that were killed: their pid (on this host) is gone, or they are
    older than ``_STALE_S``."""
    host = _host_tag()
    now = time.time()
    pattern = re.compile(re.escape(_TMP_PREFIX) + r"(\d+)_([0-9a-f]{8})_")
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        m = pattern.match(entry.name)
        if m is None:
            continue
        try:
            old = now - entry.stat(follow_symlinks=False).st_mtime > _STALE_S
            if old or (m.group(2) == host and not _pid_alive(int(m.group(1)))):
                os.unlink(entry.path)
        except OSError:
            pass


def _compile(argv: List[str], out: str) -> None:
    """Run the compiler in its own process group; on any exception (timeout, KeyboardInterrupt) kill the
    whole group so that no linker outlives us and writes ``out`` later."""
    cmd = [*argv, *_FLAGS, str(_SRC), "-o", out]
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
    except OSError as e:  # FileNotFoundError / PermissionError: no such compiler
        raise _Unavailable(f"cannot run the compiler {shlex.join(argv)} "
                           f"({type(e).__name__}: {e}); set CXX to a C++ compiler") from None
    try:
        _, err = proc.communicate(timeout=_BUILD_TIMEOUT_S)
    except BaseException as e:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()
        if isinstance(e, subprocess.TimeoutExpired):
            raise _Unavailable(f"build timed out after {_BUILD_TIMEOUT_S} s") from None
        raise
    if proc.returncode != 0:
        raise _Unavailable(f"build failed ({shlex.join(argv)} exited with {proc.returncode}): "
                           f"{err.decode(errors='replace')[-2000:]}")


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    try:
        fn = lib.srot_abi_version
    except AttributeError:
        raise _Unavailable(f"{path.name} exports no srot_abi_version") from None
    fn.argtypes, fn.restype = [], ctypes.c_int
    if fn() != _ABI_VERSION:
        raise _Unavailable(f"{path.name} has ABI version {fn()}, {_ABI_VERSION} expected")
    try:
        _declare(lib)
    except AttributeError as e:  # an entry point is missing
        raise _Unavailable(f"{path.name}: {e}") from None
    return lib


def _build(argv: List[str], so: Path) -> ctypes.CDLL:
    """Compile into private temporary files, fsync, record the sha256 in the sidecar, load and check the
    temporary library, then publish the library and after it the sidecar (atomic renames)."""
    folder = so.parent
    fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(), suffix=".so", dir=folder)
    os.close(fd)
    side_tmp = None
    try:
        _compile(argv, tmp)
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        try:
            os.fchmod(fd, 0o700)  # the linker creates it 0777 & ~umask
            os.fsync(fd)
            with os.fdopen(os.dup(fd), "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
        finally:
            os.close(fd)
        fd, side_tmp = tempfile.mkstemp(prefix=_tmp_prefix(), suffix=".sha256", dir=folder)
        with os.fdopen(fd, "w") as f:
            f.write(f"{digest}  {so.name}\n")
            f.flush()
            os.fsync(f.fileno())
        lib = _open(Path(tmp))  # our own fresh build: safe to load before it is published
        os.replace(tmp, so)
        os.replace(side_tmp, _sidecar(so))  # after the library: a reader never pairs a new sidecar with an old .so
        try:
            dfd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass
        return lib
    finally:
        for t in (tmp, side_tmp):
            if t is not None and os.path.lexists(t):
                try:
                    os.unlink(t)
                except OSError:
                    pass


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, c_int, dbl = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
    batch = [p, p, p, i64, i64, i64, i64, i64, i64, i64]  # x, yt, h, nbatch, n, m, d, sx, syt, sh
    for suf in ("f32", "f64"):
        getattr(lib, f"srot_softmin_{suf}").argtypes = [*batch, c_int, dbl, p, i64, c_int]
        getattr(lib, f"srot_wmean_{suf}").argtypes = [*batch, c_int, dbl, c_int, p, i64, c_int]
        getattr(lib, f"srot_argmax_{suf}").argtypes = [*batch, c_int, dbl, p, i64, c_int]
        getattr(lib, f"srot_max_sq_{suf}").argtypes = [p, p, i64, i64, i64, i64, i64, i64, p, c_int]
        for name in ("softmin", "wmean", "argmax", "max_sq"):
            getattr(lib, f"srot_{name}_{suf}").restype = None
        # block-sparse passes (kernels/blocksparse.py): + ld, offs, rng after the strides
        sparse = [*batch, i64, p, p]
        getattr(lib, f"srot_bs_softmin_{suf}").argtypes = [*sparse, c_int, dbl, p, i64, c_int]
        getattr(lib, f"srot_bs_wmean_{suf}").argtypes = [*sparse, c_int, dbl, c_int, p, i64, c_int]
        getattr(lib, f"srot_bs_argmax_{suf}").argtypes = [*sparse, c_int, dbl, p, i64, c_int]
        getattr(lib, f"srot_bs_max_sq_{suf}").argtypes = [p, p, i64, i64, i64, i64, i64, i64, i64, p, p, p, c_int]
        for name in ("softmin", "wmean", "argmax", "max_sq"):
            getattr(lib, f"srot_bs_{name}_{suf}").restype = None
    # rlo, rhi, rslo, rshi, nrb, clo, chi, cslo, cshi, ncb, lse, top, beta, slse, stop, sbeta, nbatch, n, m, d,
    # p, eps, log_thr, offs, rng, cap, kept, nthreads
    lib.srot_bs_prune.argtypes = [p, p, p, p, i64, p, p, p, p, i64, p, p, p, p, p, p, i64, i64, i64, i64, c_int, dbl,
                                  dbl, p, p, i64, p, c_int]
    lib.srot_bs_prune.restype = i64
    # h, y, lo, hi, nbatch, m, d, size, lse, top, beta, nthreads
    lib.srot_bs_col_stats.argtypes = [p, p, p, p, i64, i64, i64, i64, p, p, p, c_int]
    lib.srot_bs_col_stats.restype = None


def _open_or_build() -> ctypes.CDLL:
    """The verified cached library, else a fresh build (which replaces a missing, truncated, corrupt,
    foreign or group/other-writable file)."""
    argv = _compiler()
    try:
        name = _lib_name(argv)
    except OSError as e:  # csrc/cpu_ops.cpp not shipped
        raise _Unavailable(f"source not found ({type(e).__name__}: {e})") from None
    folder = cache_dir()
    _clean_stale(folder)
    so = folder / name
    if _verify(so) is None:  # checked before dlopen: a bad file is never mapped
        try:
            return _open(so)
        except (_Unavailable, OSError):  # wrong ABI version / symbols: rebuilt (loaded under another name)
            for f in (so, _sidecar(so)):
                try:
                    os.unlink(f)
                except OSError:
                    pass
    return _build(argv, so)


def _load() -> Optional[ctypes.CDLL]:
    global _lib, _tried, _error
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        deliberate = False
        if os.environ.get("SROT_FAST_NO_COMPILE", "") not in ("", "0"):
            _error, deliberate = "disabled by SROT_FAST_NO_COMPILE", True
        elif not sys.platform.startswith("linux"):
            _error = f"compiled CPU kernel only built on Linux (platform {sys.platform})"
        else:
            try:
                _lib = _open_or_build()
            except _Unavailable as e:
                _error = str(e)
            except OSError as e:  # unwritable folder, failed dlopen, ...
                _error = f"{type(e).__name__}: {e}"
        _tried = True
        if _lib is None and not deliberate:
            warn(f"srot_fast: compiled CPU kernel not used, the slower torch fallback runs instead: {_error}",
                 CompiledKernelWarning)
        return _lib


def available() -> bool:
    """True when the compiled kernel is built (or builds now) and loads; False means torch fallback."""
    return _load() is not None


def build_error() -> Optional[str]:
    """Why the compiled kernel is not available (None when it is or was not tried yet)."""
    _load()
    return _error


# ---------------------------------------------------------------------------------------- dispatch
def _check(x, y, h=None, p=1) -> Optional[int]:
    """Batch size B of batched operands, None for unbatched ones; ValueError for bad shapes or p."""
    return check_operands(x, y, h, p, allow_empty=True, allow_batch=True)


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


def _batched(B: Optional[int], *ts):
    """The operands with a leading batch dimension (one problem when unbatched)."""
    return tuple(t if B is not None or t is None else t[None] for t in ts)


def _prep(x, y, h):
    """Contiguous batched operands and the size / stride arguments of the C entry points: (x, yt, h) and
    (nbatch, n, m, d, sx, syt, sh) for x (B, N, D), y (B, M, D), h (B, M) or None."""
    x = x.detach().contiguous()
    nb, m, d = y.shape
    # (B, D, ld) transposes, ld = M rounded up to _PAD_COLS (zeros): columns contiguous for the SIMD tiles
    yt = y.new_zeros(nb, d, -(-m // _PAD_COLS) * _PAD_COLS)
    yt[:, :, :m] = y.detach().transpose(1, 2)
    h = h.detach().contiguous() if h is not None else None
    n = x.shape[1]
    return (x, yt, h), (nb, n, m, d, n * d, yt.shape[1] * yt.shape[2], m)


def softmin(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int) -> torch.Tensor:
    r"""(N,) | (B, N) soft-min ``out_i = -eps * log sum_j exp(h_j - C(x_i, y_j) / eps)``; ``+inf`` if all
    ``h = -inf``.

    Example:
        >>> x, y, h = torch.randn(1000, 2), torch.randn(800, 2), torch.zeros(800)
        >>> softmin(x, y, h, 0.01, 2).shape
        torch.Size([1000])
        >>> softmin(x.expand(3, -1, -1), y.expand(3, -1, -1), h.expand(3, -1), 0.01, 2).shape
        torch.Size([3, 1000])
    """
    B = _check(x, y, h, p)
    lib = _native(x, y, h)
    if lib is None:
        return torch_softmin(x, y, h, eps, p)
    x, y, h = _batched(B, x, y, h)
    out = torch.empty(x.shape[:2], dtype=x.dtype)
    if x.shape[1] == 0 or y.shape[1] == 0:
        out.fill_(float("inf"))
    elif x.shape[0] > 0:
        (x, yt, h), (nb, n, m, d, *strides) = _prep(x, y, h)
        getattr(lib, f"srot_softmin_{_suffix(x)}")(
            _ptr(x), _ptr(yt), _ptr(h), nb, n, m, d, *strides, p, float(eps), _ptr(out), n, _threads(nb * n, m, d)
        )
    return out if B is not None else out[0]


def weighted_mean(
    x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int, phi: str = "y"
) -> torch.Tensor:
    r"""(N, D) | (B, N, D) mean of phi(x_i, y_j) under w_ij = softmax_j(h_j - C_ij / eps).

    ``phi="y"``: y_j. ``phi="grad"``: nabla_x C = (x_i - y_j) / |x_i - y_j| (p = 1, 0 where x_i = y_j)
    or x_i - y_j (p = 2).
    """
    B = _check(x, y, h, p)
    if phi not in ("y", "grad"):
        raise ValueError(f"phi must be 'y' or 'grad', got {phi!r}")
    lib = _native(x, y, h)
    if lib is None:
        return torch_weighted_mean(x, y, h, eps, p, phi)
    x, y, h = _batched(B, x, y, h)
    out = torch.empty(x.shape, dtype=x.dtype)
    if x.shape[1] == 0 or y.shape[1] == 0:
        out.fill_(float("nan"))
    elif x.shape[0] > 0:
        (xc, yt, hc), (nb, n, m, d, *strides) = _prep(x, y, h)
        code = 1 if (phi == "grad" and p == 1) else 0
        getattr(lib, f"srot_wmean_{_suffix(xc)}")(
            _ptr(xc), _ptr(yt), _ptr(hc), nb, n, m, d, *strides, p, float(eps), code, _ptr(out), n * d,
            _threads(nb * n, m, d),
        )
        if phi == "grad" and p == 2:
            out = xc - out
    return out if B is not None else out[0]


def plan_argmax(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int) -> torch.Tensor:
    """(N,) | (B, N) int64 index of the largest plan entry per row, argmax_j (h_j - C_ij / eps), first on
    ties."""
    B = _check(x, y, h, p)
    if y.shape[-2] == 0:
        raise ValueError("plan_argmax needs at least one column (M >= 1)")
    lib = _native(x, y, h)
    if lib is None:
        return torch_plan_argmax(x, y, h, eps, p)
    x, y, h = _batched(B, x, y, h)
    out = torch.empty(x.shape[:2], dtype=torch.int64)
    if x.shape[0] > 0 and x.shape[1] > 0:
        (x, yt, h), (nb, n, m, d, *strides) = _prep(x, y, h)
        getattr(lib, f"srot_argmax_{_suffix(x)}")(
            _ptr(x), _ptr(yt), _ptr(h), nb, n, m, d, *strides, p, float(eps), _ptr(out), n, _threads(nb * n, m, d)
        )
    return out if B is not None else out[0]


def max_cost(x: torch.Tensor, y: torch.Tensor, p: int) -> torch.Tensor:
    """() | (B,) largest ground cost max_ij C(x_i, y_j) per problem, of x's dtype."""
    B = _check(x, y, None, p)
    if x.shape[-2] == 0 or y.shape[-2] == 0:
        raise ValueError("max_cost of an empty point cloud")
    lib = _native(x, y)
    if lib is None:
        return torch_max_cost(x, y, p)
    x, y = _batched(B, x, y)
    s = torch.zeros(x.shape[0], dtype=torch.float64)
    if x.shape[0] > 0:
        (x, yt, _), (nb, n, m, d, sx, syt, _) = _prep(x, y, None)
        getattr(lib, f"srot_max_sq_{_suffix(x)}")(_ptr(x), _ptr(yt), nb, n, m, d, sx, syt, _ptr(s),
                                                  _threads(nb * n, m, d))
    s = s.to(x.dtype)  # exact: the kernel's float32 maxima are representable in float64
    out = s.sqrt() if p == 1 else s / 2
    return out if B is not None else out[0]


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


def _per_problem(fn, B: int, x: torch.Tensor, *args, shape, dtype=None) -> torch.Tensor:
    """Stack ``fn(x[b], *(a[b] for tensor args), *other args)`` over the B problems; ``shape`` is the empty
    result's shape for B = 0."""
    if B == 0:
        return torch.empty(shape, dtype=dtype or x.dtype, device=x.device)
    return torch.stack([fn(x[b], *(a[b] if isinstance(a, torch.Tensor) else a for a in args)) for b in range(B)])


@torch.no_grad()
def torch_softmin(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int) -> torch.Tensor:
    """Blocked-torch :func:`softmin` (any device and float dtype; temporaries of ~2**22 elements; batched
    operands are solved one problem after another)."""
    B = _check(x, y, h, p)
    if B is not None:
        return _per_problem(torch_softmin, B, x, y, h, eps, p, shape=(0, x.shape[1]))
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
    B = _check(x, y, h, p)
    if phi not in ("y", "grad"):
        raise ValueError(f"phi must be 'y' or 'grad', got {phi!r}")
    if B is not None:
        return _per_problem(torch_weighted_mean, B, x, y, h, eps, p, phi, shape=x.shape)
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
    B = _check(x, y, h, p)
    if B is not None:
        return _per_problem(torch_plan_argmax, B, x, y, h, eps, p, shape=(0, x.shape[1]), dtype=torch.int64)
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    x, y, h = _upcast(x, y, h)
    for blk in _row_blocks(x.shape[0], y.shape[0]):
        out[blk] = _logits_block(x[blk], y, h, eps, p).argmax(dim=1)
    return out


@torch.no_grad()
def torch_max_cost(x: torch.Tensor, y: torch.Tensor, p: int) -> torch.Tensor:
    """Blocked-torch :func:`max_cost`."""
    B = _check(x, y, None, p)
    if B is not None:
        return _per_problem(torch_max_cost, B, x, y, p, shape=(0,))
    dtype = x.dtype
    x, y = _upcast(x, y)
    best = torch.full((), -float("inf"), dtype=x.dtype, device=x.device)
    for blk in _row_blocks(x.shape[0], y.shape[0]):
        best = torch.maximum(best, _cost_block(x[blk], y, p).max())
    return best.to(dtype)
