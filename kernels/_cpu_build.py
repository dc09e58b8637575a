"""Build, cache and load the compiled CPU kernel of :mod:`srot_fast.kernels.cpu_ops` (``csrc/cpu_ops.cpp``):
the compiler call, the cache file name, the checks before ``dlopen`` and the ctypes declarations of the
entry points. :func:`open_or_build` is the one entry; ``cpu_ops`` keeps the per-process state.

Cache: a library is loaded only if it passes these checks, else it is rebuilt.

- The folder is private (owned by the current user, not writable by group or others, parents safe;
  see ``cache_dir``), otherwise a private temporary folder is used for this process, with an
  ``UnsafeCacheWarning``. This is what keeps other users' code out: the cache file name is computable
  from public facts, and a sha256 written beside a library by whoever can write the folder proves
  nothing.
- The library and its sidecar (``<name>.so.sha256``) are regular files (not symbolic links) owned by
  the user, not group/other-writable, and the library's sha256 equals the recorded one -- checked
  before ``dlopen``, so a truncated or corrupt file (which ``dlopen`` would map and crash on with
  SIGBUS) is never loaded. After loading, ``srot_abi_version()`` must equal ``ABI_VERSION``.
- A build goes to temporary files named ``.srot_build_<pid>_<host>_*`` in the folder (the compiler runs
  in its own process group, killed on timeout or KeyboardInterrupt; the files are removed on any
  error), is fsynced and hashed, loaded from its temporary name, then published by atomic renames:
  library first, sidecar second. Temporary files whose process is gone (same host) or older than an
  hour are removed on the next load. Concurrent builds are safe; a reader that meets a library and a
  sidecar from two different builds rebuilds.

Caution:
    - The shared library is built with ``-march=native``; the cache key includes the CPU flags, so a
      cache folder shared between different machines rebuilds instead of crashing.
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
import tempfile
import time
from pathlib import Path
from typing import List, Optional

from ._common import cache_dir, unsafe_reason

__all__ = ["Unavailable", "open_or_build", "ABI_VERSION"]

_SRC = Path(__file__).with_name("csrc") / "cpu_ops.cpp"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-std=c++17", "-shared", "-fPIC"]
ABI_VERSION = 11  # = srot_abi_version() in csrc/cpu_ops.cpp; bump both when an entry point changes
_TMP_PREFIX = ".srot_build_"  # temporary files of a build: .srot_build_<pid>_<host>_<random><suffix>
_STALE_S = 3600  # a temporary file this old is removed whatever its pid says


class Unavailable(Exception):
    """Why the compiled kernel cannot be used (the message is ``cpu_ops.build_error()``)."""


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
        raise Unavailable(f"CXX={raw!r} cannot be parsed: {e}") from None
    if not argv:
        raise Unavailable(f"CXX={raw!r} names no compiler")
    return argv


def _lib_name(argv: List[str]) -> str:
    """Cache file name: a hash of the source, flags, compiler command, CPU flags, machine and ABI version."""
    key = hashlib.sha256(b"\0".join([
        _SRC.read_bytes(), " ".join(_FLAGS).encode(), "\0".join(argv).encode(), _cpu_flags().encode(),
        platform.machine().encode(), str(ABI_VERSION).encode(),
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


def _compile(argv: List[str], out: str, timeout_s: float) -> None:
    """Run the compiler in its own process group, for at most ``timeout_s`` seconds; on any exception
    (timeout, KeyboardInterrupt) kill the whole group so that no linker outlives us and writes ``out``
    later."""
    cmd = [*argv, *_FLAGS, str(_SRC), "-o", out]
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
    except OSError as e:  # FileNotFoundError / PermissionError: no such compiler
        raise Unavailable(f"cannot run the compiler {shlex.join(argv)} "
                           f"({type(e).__name__}: {e}); set CXX to a C++ compiler") from None
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except BaseException as e:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()
        if isinstance(e, subprocess.TimeoutExpired):
            raise Unavailable(f"build timed out after {timeout_s} s") from None
        raise
    if proc.returncode != 0:
        raise Unavailable(f"build failed ({shlex.join(argv)} exited with {proc.returncode}): "
                           f"{err.decode(errors='replace')[-2000:]}")


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    try:
        fn = lib.srot_abi_version
    except AttributeError:
        raise Unavailable(f"{path.name} exports no srot_abi_version") from None
    fn.argtypes, fn.restype = [], ctypes.c_int
    if fn() != ABI_VERSION:
        raise Unavailable(f"{path.name} has ABI version {fn()}, {ABI_VERSION} expected")
    try:
        _declare(lib)
    except AttributeError as e:  # an entry point is missing
        raise Unavailable(f"{path.name}: {e}") from None
    return lib


def _build(argv: List[str], so: Path, timeout_s: float) -> ctypes.CDLL:
    """Compile into private temporary files, fsync, record the sha256 in the sidecar, load and check the
    temporary library, then publish the library and after it the sidecar (atomic renames)."""
    folder = so.parent
    fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(), suffix=".so", dir=folder)
    os.close(fd)
    side_tmp = None
    try:
        _compile(argv, tmp, timeout_s)
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
    # rlo, rhi, rslo, rshi, nrb, clo, chi, cslo, cshi, ncb, lse, top, beta, slse, stop, sbeta, lrow, lrow0, alpha,
    # best, nbatch, n, m, d, p, eps, log_thr, offs, rng, cap, kept, nthreads
    lib.srot_bs_prune.argtypes = [p, p, p, p, i64, p, p, p, p, i64, p, p, p, p, p, p, p, p, p, p, i64, i64, i64, i64,
                                  c_int, dbl, dbl, p, p, i64, p, c_int]
    lib.srot_bs_prune.restype = i64
    # h, y, lo, hi, nbatch, m, d, size, lse, top, beta, nthreads
    lib.srot_bs_col_stats.argtypes = [p, p, p, p, i64, i64, i64, i64, p, p, p, c_int]
    lib.srot_bs_col_stats.restype = None
    # soft-min over stored squared distances: s, h, nbatch, n, m, ss, sh, p, eps, out, sout, nthreads
    for suf in ("f32", "f64"):
        getattr(lib, f"srot_softmin_sq_{suf}").argtypes = [p, p, i64, i64, i64, i64, i64, c_int, dbl, p, i64, c_int]
        getattr(lib, f"srot_softmin_sq_{suf}").restype = None
        # x, yt, nbatch, n, m, d, sx, syt, out, nthreads
        getattr(lib, f"srot_sq_dist_{suf}").argtypes = [p, p, i64, i64, i64, i64, i64, i64, p, c_int]
        getattr(lib, f"srot_sq_dist_{suf}").restype = None
    # Anderson step (srot_fast/_anderson.py): g, ghat, err, value, done, mask, images, resid, inner, valid, best,
    # top, since, nb, k1, m, w, gap, out
    for suf in ("f32", "f64"):
        getattr(lib, f"srot_anderson_{suf}").argtypes = [*([p] * 13), i64, i64, i64, i64, i64, p]
        getattr(lib, f"srot_anderson_{suf}").restype = None
    # the loop's bookkeeping: marginal error (la, f, s, fhat, nb, n, eps, out), stall watch (err, done, low, flat,
    # rest, stalls, nb, watch, quit, stall, plain_run), replaced proposals (col, done, best, valid, rest, stalls, nb,
    # k1, newest, far_limit, by_value, quit, out)
    for suf in ("f32", "f64"):
        getattr(lib, f"srot_marginal_error_{suf}").argtypes = [p, p, p, p, i64, i64, dbl, p]
        getattr(lib, f"srot_marginal_error_{suf}").restype = None
        # dual objective: la, lb, fhat, g, s, nb, n, m, kind_a, tau_a, kind_b, tau_b, eps, out
        getattr(lib, f"srot_dual_value_{suf}").argtypes = [p, p, p, p, p, i64, i64, i64, c_int, dbl, c_int, dbl, dbl,
                                                           p]
        getattr(lib, f"srot_dual_value_{suf}").restype = None
        # KL translation: la, f, lb, g, nb, n, m, rate_a, rate_b, out
        getattr(lib, f"srot_kl_translation_{suf}").argtypes = [p, p, p, p, i64, i64, i64, dbl, dbl, p]
        getattr(lib, f"srot_kl_translation_{suf}").restype = None
    # partial OT's augmented soft-min: real, h, nb, n, m, eps, out
    for suf in ("f32", "f64"):
        getattr(lib, f"srot_partial_augment_{suf}").argtypes = [p, p, i64, i64, i64, dbl, p]
        getattr(lib, f"srot_partial_augment_{suf}").restype = None
        # its rebalancing step: f, g, last, la, lb, nb, n, m, eps, log_mass, f_out, g_out, last_out, s_out
        getattr(lib, f"srot_partial_rebalance_{suf}").argtypes = [p, p, p, p, p, i64, i64, i64, dbl, dbl, p, p, p, p]
        getattr(lib, f"srot_partial_rebalance_{suf}").restype = None
        getattr(lib, f"srot_partial_dummies_{suf}").argtypes = [p, p, p, p, i64, i64, i64, dbl, p, p]
        getattr(lib, f"srot_partial_dummies_{suf}").restype = None
    lib.srot_track.argtypes = [p, p, p, p, p, p, i64, c_int, c_int, i64, i64]
    lib.srot_track.restype = None
    lib.srot_replaced.argtypes = [p, p, p, p, p, p, i64, i64, i64, dbl, c_int, i64, p]
    lib.srot_replaced.restype = None
    # the update loops (srot_fast/_loop.py, alternating and symmetric): a pointer to their LoopArgs
    for suf in ("f32", "f64"):
        for name in ("loop", "symmetric_loop"):
            getattr(lib, f"srot_{name}_{suf}").argtypes = [p]
            getattr(lib, f"srot_{name}_{suf}").restype = None


def open_or_build(timeout_s: float) -> ctypes.CDLL:
    """The verified cached library, else a fresh build of at most ``timeout_s`` seconds (which replaces a
    missing, truncated, corrupt, foreign or group/other-writable file). Raises :class:`Unavailable` (or
    OSError) when neither works."""
    argv = _compiler()
    try:
        name = _lib_name(argv)
    except OSError as e:  # csrc/cpu_ops.cpp not shipped
        raise Unavailable(f"source not found ({type(e).__name__}: {e})") from None
    folder = cache_dir()
    _clean_stale(folder)
    so = folder / name
    if _verify(so) is None:  # checked before dlopen: a bad file is never mapped
        try:
            return _open(so)
        except (Unavailable, OSError):  # wrong ABI version / symbols: rebuilt (loaded under another name)
            for f in (so, _sidecar(so)):
                try:
                    os.unlink(f)
                except OSError:
                    pass
    return _build(argv, so, timeout_s)
