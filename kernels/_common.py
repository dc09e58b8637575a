"""Argument checks and the cache folder shared by the kernel backends (cpu_ops, keops_ops, triton_softmin).

The cache folder holds built libraries that get loaded into the process, so :func:`cache_dir` only
returns a folder that nobody but the current user (and root) can write to; anything else would let
another user plant code that runs in this process. A folder that fails the check is not used: a
warning (:class:`UnsafeCacheWarning`) names the reason and a private temporary folder, removed at
exit, serves this process instead.
"""
from __future__ import annotations

import atexit
import os
import shutil
import stat
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Optional

import torch

__all__ = ["UnsafeCacheWarning", "cache_dir", "check_operands", "unsafe_reason", "warn"]


class UnsafeCacheWarning(UserWarning):
    """The configured cache folder is not private to the current user (or cannot be created); a private
    temporary folder is used for this process instead."""


_lock = threading.Lock()
_private: Optional[Path] = None  # the per-process fallback folder, created on first need
_warned: set = set()


def warn(message: str, category: type) -> None:
    """``warnings.warn`` attributed to the first caller outside srot_fast, once per message and process."""
    if message in _warned:
        return
    _warned.add(message)
    prefixes = tuple(
        os.path.dirname(mod.__file__) + os.sep
        for mod in (sys.modules.get("srot_fast"), sys.modules.get(__package__ or ""))
        if mod is not None and getattr(mod, "__file__", None)
    )
    level, frame = 2, sys._getframe(1)
    while frame is not None and prefixes and frame.f_code.co_filename.startswith(prefixes):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def _expand(raw: str) -> Path:
    return Path(os.path.abspath(os.path.expanduser(os.path.expandvars(raw))))


def _configured() -> Path:
    """``$SROT_FAST_CACHE``, else ``$XDG_CACHE_HOME/srot_fast``, else ``~/.cache/srot_fast`` (``~`` and
    ``$VARS`` expanded, made absolute)."""
    root = os.environ.get("SROT_FAST_CACHE")
    if root:
        return _expand(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return _expand(os.path.join(xdg, "srot_fast") if xdg else os.path.join("~", ".cache", "srot_fast"))


def unsafe_reason(path: Path, kind: str = "file") -> Optional[str]:
    """Why ``path`` must not be trusted, None when it may be: it must be a real (not symbolic link)
    ``kind`` in {'file', 'folder'}, owned by the current user and not writable by group or others.
    ``FileNotFoundError`` when it does not exist."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    if not (stat.S_ISDIR(st.st_mode) if kind == "folder" else stat.S_ISREG(st.st_mode)):
        return f"{path} is not a {'folder' if kind == 'folder' else 'regular file'}"
    uid = os.getuid()
    if st.st_uid != uid:
        return f"{path} is owned by uid {st.st_uid}, not by the current user (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _ancestor_reason(path: Path) -> Optional[str]:
    """Why a parent of the (symlink-free) ``path`` lets another user replace it: a parent owned by someone
    other than root or the current user, or writable by group / others without the sticky bit."""
    uid = os.getuid()
    for parent in path.parents:
        st = os.stat(parent)
        if st.st_uid not in (0, uid):
            return f"its parent {parent} is owned by uid {st.st_uid}"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            return f"its parent {parent} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _make_private(path: Path) -> None:
    """Create ``path`` and its missing parents with mode 0700 (``mkdir -p`` would give the parents 0777 &
    ~umask)."""
    missing = []
    while not os.path.lexists(path):
        missing.append(path)
        path = path.parent
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:  # created concurrently: checked like any existing folder
            pass


def _private_dir() -> Path:
    global _private
    with _lock:
        if _private is None or not _private.is_dir():
            _private = Path(os.path.realpath(tempfile.mkdtemp(prefix="srot_fast_cache_")))  # mode 0700, new
            atexit.register(shutil.rmtree, str(_private), True)
        return _private


def cache_dir() -> Path:
    """A folder that is safe to use for built kernels and probe results, as an absolute path without
    symbolic links: the configured one (``$SROT_FAST_CACHE``, else ``$XDG_CACHE_HOME/srot_fast``, else
    ``~/.cache/srot_fast``; ``~`` and ``$VARS`` expanded), created with mode 0700 if missing.

    The configured folder is used only if it is owned by the current user, not writable by group or
    others, writable by us, and each parent is owned by root or the user and not writable by others
    (unless sticky, as /tmp). Otherwise an :class:`UnsafeCacheWarning` (once per reason and process)
    names the reason and a private temporary folder (``tempfile.mkdtemp``, removed at exit) is returned.
    """
    try:
        path = _configured()
        _make_private(path)
        real = Path(os.path.realpath(path))  # later use goes by this path: a symlink swapped afterwards is moot
        if os.name != "posix":  # no POSIX owners / modes to check
            return real
        reason = unsafe_reason(real, "folder") or _ancestor_reason(real)
        if reason is None and not os.access(real, os.W_OK | os.X_OK):
            reason = f"{real} is not writable"
        if reason is None:
            return real
        reason = f"cache folder {path} not used: {reason}"
    except (OSError, RuntimeError, KeyError) as e:  # unwritable parent, no home folder, ...
        reason = f"cache folder not usable: {type(e).__name__}: {e}"
    private = _private_dir()
    warn(f"srot_fast: {reason}; using the private temporary folder {private} for this process",
         UnsafeCacheWarning)
    return private


def check_operands(
    x: torch.Tensor, y: torch.Tensor, h=None, p: int = 1, *, allow_empty: bool = False, allow_batch: bool = False
) -> Optional[int]:
    """Shape checks of every kernel primitive; returns B for batched operands, None for unbatched ones.

    Unbatched: x (N, D), y (M, D), optional log-weights h (M,). With ``allow_batch``, also batched: x (B, N, D),
    y (B, M, D), h (B, M) with one B >= 0; one batched operand makes all of them batched, and mixing the two is
    an error. The cost exponent p must be 1 or 2; N = 0 or M = 0 only with ``allow_empty``. Anything else is a
    ValueError naming the arguments and their shapes; points that are not real floating tensors of one dtype, or
    log-weights that are not real floating, a TypeError. Values are not checked here (NaN, eps): the solver
    checks its inputs once, and the passes run every update.
    """
    for name, t in (("x", x), ("y", y), ("h", h)):
        if t is not None and (not t.is_floating_point()):
            raise TypeError(f"{name} must be a real floating tensor, got {t.dtype}")
    if x.dtype != y.dtype:
        raise TypeError(f"x and y must have one dtype, got {x.dtype} and {y.dtype}")
    batched = allow_batch and (x.dim() == 3 or y.dim() == 3 or (h is not None and h.dim() == 2))
    if batched:
        if x.dim() != 3 or y.dim() != 3 or (h is not None and h.dim() != 2):
            hs = "" if h is None else f", h {tuple(h.shape)}"
            raise ValueError("x, y and h must be all unbatched or all batched: x (N, D) | (B, N, D), y (M, D) | "
                             f"(B, M, D), h (M,) | (B, M) expected, got x {tuple(x.shape)}, y {tuple(y.shape)}{hs}")
        if x.shape[0] != y.shape[0] or x.shape[2] != y.shape[2]:
            raise ValueError(f"x (B, N, D) and y (B, M, D) expected, got {tuple(x.shape)} and {tuple(y.shape)}")
        if h is not None and tuple(h.shape) != (y.shape[0], y.shape[1]):
            raise ValueError(f"h (B, M) = ({y.shape[0]}, {y.shape[1]}) expected, got {tuple(h.shape)}")
    else:
        if x.dim() != 2 or y.dim() != 2 or x.shape[1] != y.shape[1]:
            want = "x (N, D) | (B, N, D) and y (M, D) | (B, M, D)" if allow_batch else "x (N, D) and y (M, D)"
            raise ValueError(f"{want} expected, got {tuple(x.shape)} and {tuple(y.shape)}")
        if h is not None and (h.dim() != 1 or h.shape[0] != y.shape[0]):
            raise ValueError(f"h (M,) = ({y.shape[0]},) expected, got {tuple(h.shape)}")
    if p not in (1, 2):
        raise ValueError(f"p must be 1 or 2, got {p}")
    if not allow_empty and (x.shape[-2] == 0 or y.shape[-2] == 0):
        raise ValueError("empty point cloud")
    return int(x.shape[0]) if batched else None
