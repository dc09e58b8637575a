r"""Bounded-memory CPU backend of the kernel primitives (docs/DESIGN.md, Kernel primitive): a compiled
streaming kernel with a blocked-torch fallback.

Same functions and signatures as :mod:`srot_fast.kernels.tensorized`:

- ``softmin(x, y, h, eps, p)``             -> (N,)    out_i = -eps * LSE_j[h_j - C(x_i, y_j) / eps]
- ``weighted_mean(x, y, h, eps, p, phi)``  -> (N, D)  sum_j softmax_j(h_j - C_ij / eps) * phi(x_i, y_j)
- ``plan_argmax(x, y, h, eps, p)``         -> (N,)    int64, argmax_j (h_j - C_ij / eps) (first on ties)
- ``max_cost(x, y, p)``                    -> ()      max_ij C(x_i, y_j)
- ``squared_distances(x, y)``              -> (N, M)  |x_i - y_j|^2, which ``softmin(..., sq=)`` reads instead of
  computing them (the solver keeps them for small problems: docs/DESIGN.md, Kernel primitive)
- ``softmin_sq(sq, h, eps, p)``            -> (B, N)  the soft-min pass over such stored distances, batched, without
  the operand checks of x and y (what the solver's geometry calls)

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

The same library holds the block-sparse entry points (``srot_bs_*``) of :mod:`srot_fast.kernels.blocksparse`
and the solver's compiled per-update steps: the Anderson step (:func:`anderson_step`), the marginal error
(:func:`marginal_error`), the dual objective (:func:`dual_value`), the KL translation (:func:`kl_translation`),
partial OT's augmented soft-min and rebalancing step (:func:`partial_augment`, :func:`partial_rebalance`), the
stall watch (:func:`track`) and the test of proposals (:func:`replaced`), each beside its torch reference in
``srot_fast/_anderson.py``, ``srot_fast/_loop.py`` or ``srot_fast/geometry.py``; and, composed of these, the
whole update loop at the target eps of a problem over stored squared distances, or a whole cold solve with its
eps-scaling (:func:`alternating_loop`, :func:`symmetric_loop` for self-transport), whose torch references are
``alternating`` and ``symmetric`` in ``srot_fast/_loop.py``. These have no fallback: the solver calls them only
when :func:`available`, and they raise a ValueError for operands of another dtype, shape or device.
How it is built, cached (a private, hash-checked cache) and loaded: :mod:`srot_fast.kernels._cpu_build`.

Fallback (no compiler, failed build, ``SROT_FAST_NO_COMPILE=1``, other dtypes or devices): the
``torch_*`` functions of :mod:`srot_fast.kernels._cpu_fallback` (row blocks of ~2**22 elements, exact
difference form, float16 / bfloat16 computed in float32, batched operands one problem after another).
When the compiled kernel cannot be used for float32 / float64 CPU tensors, a :class:`CompiledKernelWarning`
says why, once per process; the deliberate ``SROT_FAST_NO_COMPILE=1`` gives no warning (:func:`build_error`
still says why).

Caution:
    - Outputs carry no autograd graph (the primitives are used under the envelope theorem).
    - A row whose ``h`` is all ``-inf`` gives ``+inf`` (softmin), NaN (weighted_mean), 0 (plan_argmax).
    - ``csrc/cpu_ops.cpp`` must ship with the package (package data), else the fallback is used.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
import threading
from typing import Optional, Sequence

import torch

from ._common import UnsafeCacheWarning, check_operands, warn
from ._cpu_build import ABI_VERSION as _ABI_VERSION  # noqa: F401 - re-exported, as is the host tag
from ._cpu_build import Unavailable, _host_tag, open_or_build  # noqa: F401
from ._cpu_fallback import _row_blocks, torch_max_cost, torch_plan_argmax, torch_softmin, torch_weighted_mean

__all__ = [
    "CompiledKernelWarning",
    "UnsafeCacheWarning",
    "available",
    "build_error",
    "softmin",
    "weighted_mean",
    "plan_argmax",
    "max_cost",
    "squared_distances",
    "softmin_sq",
    "anderson_step",
    "marginal_error",
    "dual_value",
    "kl_translation",
    "partial_augment",
    "partial_dummies",
    "partial_rebalance",
    "track",
    "replaced",
    "alternating_loop",
    "symmetric_loop",
    "torch_softmin",
    "torch_weighted_mean",
    "torch_plan_argmax",
    "torch_max_cost",
]

_BUILD_TIMEOUT_S = 300
_SMALL_WORK = 1 << 20  # below B * N * M * max(D, 4) run on one thread (under a millisecond of work): starting
# an OpenMP team can cost more than that when the other cores are busy
_PAD_COLS = 16  # = W in csrc/cpu_ops.cpp: the y transpose is padded to a multiple of this
CPU_LIBRARY = True  # this backend builds the compiled library: the solver runs its Anderson step there on CPU

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_tried = False
_error: Optional[str] = None


class CompiledKernelWarning(UserWarning):
    """The compiled CPU kernel is not used (the message says why): the blocked-torch fallback runs instead,
    with the same results, slower. Given once per process; not given for ``SROT_FAST_NO_COMPILE=1``."""


# ------------------------------------------------------------------------------------------ loading
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
                _lib = open_or_build(_BUILD_TIMEOUT_S)
            except Unavailable as e:
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
    if dt not in (torch.float32, torch.float64):
        return None
    for t in ts:
        if t.dtype != dt or t.device.type != "cpu":
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


def softmin(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int,
            sq: Optional[torch.Tensor] = None) -> torch.Tensor:
    r"""(N,) | (B, N) soft-min ``out_i = -eps * log sum_j exp(h_j - C(x_i, y_j) / eps)``; ``+inf`` if all
    ``h = -inf``.

    ``sq``: the (N, M) | (B, N, M) squared distances of x and y from :func:`squared_distances` (float32 /
    float64, contiguous, on x's device), read instead of computed (a pass then costs N M reads whatever D; the
    solver keeps them for small problems, srot_fast.geometry.Geometry).

    Example:
        >>> x, y, h = torch.randn(1000, 2), torch.randn(800, 2), torch.zeros(800)
        >>> softmin(x, y, h, 0.01, 2).shape
        torch.Size([1000])
        >>> softmin(x.expand(3, -1, -1), y.expand(3, -1, -1), h.expand(3, -1), 0.01, 2).shape
        torch.Size([3, 1000])
    """
    B = _check(x, y, h, p)
    if sq is not None and (sq.shape != x.shape[:-1] + y.shape[-2:-1] or sq.dtype != x.dtype
                           or sq.dtype not in (torch.float32, torch.float64) or sq.device != x.device
                           or not sq.is_contiguous()):
        raise ValueError(f"sq: a contiguous float32 / float64 tensor of x's dtype ({x.dtype}), device ({x.device}) "
                         f"and shape {(*x.shape[:-1], y.shape[-2])} expected, got a "
                         f"{'' if sq.is_contiguous() else 'non-contiguous '}{sq.dtype} tensor of shape "
                         f"{tuple(sq.shape)} on {sq.device}")
    if sq is not None:
        return softmin_sq(sq, h, eps, p) if B is not None else softmin_sq(sq[None], h[None], eps, p)[0]
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


def softmin_sq(sq: torch.Tensor, h: torch.Tensor, eps: float, p: int) -> torch.Tensor:
    """(B, N) :func:`softmin` over stored squared distances: ``softmin(x, y, h, eps, p, sq=sq)`` for batched
    operands, without the checks of x and y (for the solver's geometry, which made ``sq`` (B, N, M) with
    :func:`squared_distances`); h (B, M). The compiled pass where sq and h are CPU tensors of one float32 / float64
    dtype, else torch ops."""
    if sq.dim() != 3 or not sq.is_contiguous() or sq.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"sq: a contiguous (B, N, M) float32 / float64 tensor expected, got a "
                         f"{'' if sq.is_contiguous() else 'non-contiguous '}{sq.dtype} tensor of shape "
                         f"{tuple(sq.shape)}")
    if p not in (1, 2):
        raise ValueError(f"p must be 1 or 2, got {p}")
    nb, n, m = sq.shape
    if h.shape != (nb, m):
        raise ValueError(f"h (B, M) = ({nb}, {m}) expected with sq {tuple(sq.shape)}, got {tuple(h.shape)}")
    lib = _native(sq, h)
    if lib is None or m == 0 or nb * n == 0:  # the stored distances, read by torch ops (LSE over no column: +inf)
        cost = sq.sqrt() if p == 1 else sq / 2
        return -eps * torch.logsumexp(h[..., None, :] - cost / eps, dim=-1)
    h = h.detach().contiguous()
    out = torch.empty((nb, n), dtype=sq.dtype)
    (lib.srot_softmin_sq_f32 if sq.dtype == torch.float32 else lib.srot_softmin_sq_f64)(
        _ptr(sq), _ptr(h), nb, n, m, n * m, m, p, float(eps), _ptr(out), n, _threads(nb * n, m, 1))
    return out


def squared_distances(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(N, M) | (B, N, M) contiguous |x_i - y_j|^2 in the dtype of x, for :func:`softmin`'s ``sq``: the values the
    compiled soft-min computes on the fly (same difference form, same order of the D terms), so a pass that reads
    them gives the same result; the blocked-torch difference form without the compiled library. float32 and
    float64 only (TypeError otherwise)."""
    B = _check(x, y)
    if x.dtype not in (torch.float32, torch.float64) or y.dtype != x.dtype:
        raise TypeError(f"squared_distances: float32 or float64 points of one dtype expected, got {x.dtype} and "
                        f"{y.dtype}")
    lib = _native(x, y)
    if lib is None:
        xb, yb = _batched(B, x.detach(), y.detach())
        if xb.shape[1] == 0 or yb.shape[1] == 0:
            out = xb.new_zeros((xb.shape[0], xb.shape[1], yb.shape[1]))
            return out if B is not None else out[0]
        out = torch.cat([((xb[:, blk, None, :] - yb[:, None, :, :]) ** 2).sum(-1)
                         for blk in _row_blocks(xb.shape[1], yb.shape[1] * max(xb.shape[2], 1))], 1)
        return out if B is not None else out[0]
    x, y = _batched(B, x, y)
    out = torch.empty((x.shape[0], x.shape[1], y.shape[1]), dtype=x.dtype)
    if out.numel() > 0:
        (x, yt, _), (nb, n, m, d, sx, syt, _) = _prep(x, y, None)
        getattr(lib, f"srot_sq_dist_{_suffix(x)}")(_ptr(x), _ptr(yt), nb, n, m, d, sx, syt, _ptr(out),
                                                   _threads(nb * n, m, d))
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


def anderson_step(g, g_hat, err, done, value, mask, images, resid, inner, valid, best, top, since, w: int,
                  gap: int) -> torch.Tensor:
    """(B, M) next potential g from one step of the safeguarded Anderson acceleration, computed by the compiled
    library: the arithmetic of :meth:`srot_fast._anderson.Anderson.step` (its torch reference, which documents
    it) in one call, for CPU tensors. The state -- images, resid (B, K, M) float64, inner (B, K, K) float64,
    valid (B, K) bool, best, top (B,) float64, since (B,) int64, all contiguous -- is updated in place; w is the
    slot written now. g, g_hat (B, M) float32 or float64; err, value (B,) float64 (value None: no value test);
    done (B,) bool; mask (B, M) float64 contiguous. Call only when :func:`available`."""
    nb, k1, m = images.shape
    f64 = torch.float64
    for name, t, dtype, shape in (("anderson_step: mask", mask, f64, (nb, m)),
                                  ("anderson_step: images", images, f64, (nb, k1, m)),
                                  ("anderson_step: resid", resid, f64, (nb, k1, m)),
                                  ("anderson_step: inner", inner, f64, (nb, k1, k1)),
                                  ("anderson_step: valid", valid, torch.bool, (nb, k1)),
                                  ("anderson_step: best", best, f64, (nb,)), ("anderson_step: top", top, f64, (nb,)),
                                  ("anderson_step: since", since, torch.int64, (nb,))):
        _state(name, t, dtype, shape)  # written in place or read raw by the C code
    # contiguous copies where needed, bound to names so that they live through the call
    g = _state("anderson_step: g", g.contiguous(), g.dtype, (nb, m))
    g_hat = _state("anderson_step: g_hat", g_hat.to(g.dtype).contiguous(), g.dtype, (nb, m))
    err = _state("anderson_step: err", err.double().contiguous(), f64, (nb,))
    done = _state("anderson_step: done", done.bool().contiguous(), torch.bool, (nb,))
    value = None if value is None else _state("anderson_step: value", value.double().contiguous(), f64, (nb,))
    out = torch.empty_like(g)
    (_load().srot_anderson_f32 if g.dtype == torch.float32 else _load().srot_anderson_f64)(
        _ptr(g), _ptr(g_hat), _ptr(err), None if value is None else _ptr(value), _ptr(done), _ptr(mask),
        _ptr(images), _ptr(resid), _ptr(inner), _ptr(valid), _ptr(best), _ptr(top), _ptr(since), nb, k1, m, w, gap,
        _ptr(out))
    return out



def _state(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """``t`` itself when it is a contiguous CPU tensor of ``dtype`` and ``shape`` (written in place or read raw by
    the C code), else a ValueError naming it."""
    if t.dtype != dtype or t.shape != shape or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous CPU {dtype} tensor of shape {tuple(shape)}, got {t.dtype} "
                         f"{tuple(t.shape)} on {t.device}")
    return t


def marginal_error(log_a: torch.Tensor, f: torch.Tensor, s: torch.Tensor, f_hat: Optional[torch.Tensor],
                   eps: float) -> torch.Tensor:
    r"""(B,) float64 sum_i a_i |exp((f_i - s_i)/eps) - exp((f_hat_i - s_i)/eps)| for (B, N) CPU tensors of one
    float32 / float64 dtype, computed by the compiled library: :func:`srot_fast._loop.marginal_error` (its
    torch reference, which documents it) in one call. ``f_hat`` None for balanced OT (f_hat = s). Call only when
    :func:`available`."""
    shape, dtype = f.shape, f.dtype
    if len(shape) != 2 or dtype not in (torch.float32, torch.float64):
        raise ValueError(f"marginal_error: f must be a (B, N) float32 / float64 tensor, got {dtype} {tuple(shape)}")
    log_a, f, s, f_hat = (None if t is None else _state(name, t.contiguous(), dtype, shape)
                          for name, t in (("log_a", log_a), ("f", f), ("s", s), ("f_hat", f_hat)))
    out = torch.empty(shape[0], dtype=torch.float64)
    (_load().srot_marginal_error_f32 if dtype == torch.float32 else _load().srot_marginal_error_f64)(
        _ptr(log_a), _ptr(f), _ptr(s), None if f_hat is None else _ptr(f_hat), shape[0], shape[1], float(eps),
        _ptr(out))
    return out


_KINDS = {"balanced": 0, "kl": 1, "tv": 2}  # penalty kinds of srot_fast.penalties, as the C code numbers them


def dual_value(log_a: torch.Tensor, log_b: torch.Tensor, f_hat: torch.Tensor, g: torch.Tensor, s: torch.Tensor,
               kind_a: str, tau_a: float, kind_b: str, tau_b: float, eps: float) -> torch.Tensor:
    r"""(B,) float64 dual objective of :func:`srot_fast._loop.dual_value` (its torch reference, which documents it)
    in one call of the compiled library: log_a, f_hat, s (B, N) and log_b, g (B, M) CPU tensors of one float32 /
    float64 dtype; each side's penalty as its kind ('balanced', 'kl', 'tv') and tau. Call only when
    :func:`available`."""
    dtype, (nb, n), m = f_hat.dtype, f_hat.shape, g.shape[-1]
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dual_value: float32 / float64 potentials expected, got {dtype}")
    log_a, f_hat, s = (_state(name, t.contiguous(), dtype, (nb, n)) for name, t in (("log_a", log_a),
                                                                                    ("f_hat", f_hat), ("s", s)))
    log_b, g = (_state(name, t.contiguous(), dtype, (nb, m)) for name, t in (("log_b", log_b), ("g", g)))
    out = torch.empty(nb, dtype=torch.float64)
    (_load().srot_dual_value_f32 if dtype == torch.float32 else _load().srot_dual_value_f64)(
        _ptr(log_a), _ptr(log_b), _ptr(f_hat), _ptr(g), _ptr(s), nb, n, m, _KINDS[kind_a], float(tau_a),
        _KINDS[kind_b], float(tau_b), float(eps), _ptr(out))
    return out


def kl_translation(log_a: torch.Tensor, f: torch.Tensor, log_b: torch.Tensor, g: torch.Tensor, rate_a: float,
                   rate_b: float) -> torch.Tensor:
    r"""(B,) float64 step c along (f + c, g - c) of :func:`srot_fast._loop.kl_translation` (its torch reference,
    which documents it) in one call of the compiled library: log_a, f (B, N) and log_b, g (B, M) CPU tensors of
    one float32 / float64 dtype; rate = 1 / tau on each side (0 on a balanced side). Call only when
    :func:`available`."""
    dtype, (nb, n), m = f.dtype, f.shape, g.shape[-1]
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"kl_translation: float32 / float64 potentials expected, got {dtype}")
    log_a, f = (_state(name, t.contiguous(), dtype, (nb, n)) for name, t in (("log_a", log_a), ("f", f)))
    log_b, g = (_state(name, t.contiguous(), dtype, (nb, m)) for name, t in (("log_b", log_b), ("g", g)))
    out = torch.empty(nb, dtype=torch.float64)
    (_load().srot_kl_translation_f32 if dtype == torch.float32 else _load().srot_kl_translation_f64)(
        _ptr(log_a), _ptr(f), _ptr(log_b), _ptr(g), nb, n, m, float(rate_a), float(rate_b), _ptr(out))
    return out


def partial_augment(real: torch.Tensor, h: torch.Tensor, eps: float) -> torch.Tensor:
    """(B, N + 1) augmented soft-min of partial OT from the real one, real (B, N), and log-weights h (B, M + 1) of
    one float32 / float64 dtype on the CPU: :meth:`srot_fast.geometry.PartialGeometry._augment` (its torch
    reference, which documents it) in one call of the compiled library, in float64 arithmetic rounded to the
    dtype. Call only when :func:`available`."""
    dtype, (nb, n), m1 = real.dtype, real.shape, h.shape[-1]
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"partial_augment: float32 / float64 soft-mins expected, got {dtype}")
    if m1 < 1:
        raise ValueError(f"partial_augment: h (B, M + 1) with its dummy column expected, got {tuple(h.shape)}")
    real = _state("real", real.contiguous(), dtype, (nb, n))
    h = _state("h", h.contiguous(), dtype, (nb, m1))
    out = torch.empty((nb, n + 1), dtype=dtype)
    (_load().srot_partial_augment_f32 if dtype == torch.float32 else _load().srot_partial_augment_f64)(
        _ptr(real), _ptr(h), nb, n, m1 - 1, float(eps), _ptr(out))
    return out


def _partial_operands(fn: str, f, g, log_a, log_b):
    """(dtype, B, N + 1, M + 1, f, g, log_a, log_b) for a compiled step of partial OT: f, log_a (B, N + 1) and g,
    log_b (B, M + 1) with their dummy points, contiguous, one float32 / float64 dtype; else a ValueError."""
    dtype, (nb, n1), m1 = f.dtype, f.shape, g.shape[-1]
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{fn}: float32 / float64 potentials expected, got {dtype}")
    if n1 < 1 or m1 < 1:
        raise ValueError(f"{fn}: f (B, N + 1) and g (B, M + 1) with their dummy points expected, got "
                         f"{tuple(f.shape)} and {tuple(g.shape)}")
    f, log_a = (_state(name, t.contiguous(), dtype, (nb, n1)) for name, t in (("f", f), ("log_a", log_a)))
    g, log_b = (_state(name, t.contiguous(), dtype, (nb, m1)) for name, t in (("g", g), ("log_b", log_b)))
    return dtype, nb, n1, m1, f, g, log_a, log_b


def partial_dummies(f: torch.Tensor, g: torch.Tensor, log_a: torch.Tensor, log_b: torch.Tensor, eps: float):
    """(f, g) with the dummy points' exact updates of partial OT's rebalancing step (``dummies``,
    :meth:`srot_fast.geometry.PartialGeometry.rebalance`, its torch reference) in one call of the compiled library,
    the sums in float64 rounded to the dtype: f, log_a (B, N + 1) and g, log_b (B, M + 1) CPU tensors of one float32
    / float64 dtype; returns new tensors. Call only when :func:`available`."""
    dtype, nb, n1, m1, f, g, log_a, log_b = _partial_operands("partial_dummies", f, g, log_a, log_b)
    f_out, g_out = torch.empty_like(f), torch.empty_like(g)
    (_load().srot_partial_dummies_f32 if dtype == torch.float32 else _load().srot_partial_dummies_f64)(
        _ptr(f), _ptr(g), _ptr(log_a), _ptr(log_b), nb, n1 - 1, m1 - 1, float(eps), _ptr(f_out), _ptr(g_out))
    return f_out, g_out


def partial_rebalance(f: torch.Tensor, g: torch.Tensor, last: torch.Tensor, log_a: torch.Tensor,
                      log_b: torch.Tensor, eps: float, mass: float):
    """(f, g, last, s) after partial OT's rebalancing step: :meth:`srot_fast.geometry.PartialGeometry.rebalance`
    without ``dummies`` (its torch reference, which documents it) in one call of the compiled library, float64
    arithmetic rounded to the dtype. f, log_a (B, N + 1), g, log_b (B, M + 1), last (B, N) -- the real part of the
    last row soft-min -- CPU tensors of one float32 / float64 dtype; returns new f, g, last and the row soft-min s
    (B, N + 1) at the new g. Call only when :func:`available`."""
    dtype, nb, n1, m1, f, g, log_a, log_b = _partial_operands("partial_rebalance", f, g, log_a, log_b)
    last = _state("last", last.contiguous(), dtype, (nb, n1 - 1))
    f_out, g_out, last_out, s_out = (torch.empty_like(t) for t in (f, g, last, f))
    (_load().srot_partial_rebalance_f32 if dtype == torch.float32 else _load().srot_partial_rebalance_f64)(
        _ptr(f), _ptr(g), _ptr(last), _ptr(log_a), _ptr(log_b), nb, n1 - 1, m1 - 1, float(eps), math.log(mass),
        _ptr(f_out), _ptr(g_out), _ptr(last_out), _ptr(s_out))
    return f_out, g_out, last_out, s_out


def track(err: torch.Tensor, done: torch.Tensor, low, flat, rest, stalls, watch: bool, quit: int, stall: int,
          plain_run: int) -> None:
    """The stall watch of :meth:`srot_fast._anderson.Anderson.track` (its torch reference, which documents it) in
    one call, for contiguous CPU tensors: err (B,) float64, done (B,) bool; the state low (B,) float64, flat, rest,
    stalls (B,) int64 is updated in place. Call only when :func:`available`."""
    shape = low.shape
    for name, t, dtype in (("err", err, torch.float64), ("done", done, torch.bool), ("low", low, torch.float64),
                           ("flat", flat, torch.int64), ("rest", rest, torch.int64), ("stalls", stalls, torch.int64)):
        _state(name, t, dtype, shape)
    _load().srot_track(_ptr(err), _ptr(done), _ptr(low), _ptr(flat), _ptr(rest), _ptr(stalls), shape[0],
                       int(watch), int(quit), stall, plain_run)


def replaced(col: torch.Tensor, done: torch.Tensor, best: torch.Tensor, valid: torch.Tensor, rest: torch.Tensor,
             stalls: torch.Tensor, newest: int, far_limit: float, by_value: bool, quit: int) -> torch.Tensor:
    """(B,) bool: the proposals that the loop replaces by T(g) (none where ``done``),
    :meth:`srot_fast._anderson.Anderson.replaced` (its
    torch reference, which documents it) in one call, for contiguous CPU tensors: col, best (B,) float64, done
    (B,) bool, rest, stalls (B,) int64; valid (B, K) bool keeps only slot ``newest`` where a proposal is too far
    (in place). Call only when :func:`available`."""
    shape = best.shape
    for name, t, dtype in (("col", col, torch.float64), ("done", done, torch.bool), ("best", best, torch.float64),
                           ("rest", rest, torch.int64), ("stalls", stalls, torch.int64)):
        _state(name, t, dtype, shape)
    _state("valid", valid, torch.bool, (shape[0], valid.shape[-1]))
    out = torch.empty(shape, dtype=torch.bool)
    _load().srot_replaced(_ptr(col), _ptr(done), _ptr(best), _ptr(valid), _ptr(rest), _ptr(stalls), shape[0],
                          valid.shape[1], newest, float(far_limit), int(by_value), quit, _ptr(out))
    return out


def _loop_fields():
    p, i, d = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
    return ([(name, p) for name in ("sq_x", "sq_y", "la", "lb", "u", "v", "mass_a", "mass_b", "mask", "f", "g", "s",
                                    "t", "col", "err", "done", "n_iter", "updates", "images", "resid", "inner",
                                    "valid", "best", "top", "low", "since", "flat", "rest", "stalls")]
            + [(name, i) for name in ("nb", "n", "m", "p", "kind_a", "kind_b")]
            + [(name, d) for name in ("tau_a", "tau_b", "eps", "tol", "enter_tol", "value_tol", "value_span")]
            + [(name, i) for name in ("window", "steps", "it0", "max_iter", "accelerate", "by_value", "watch",
                                      "translate", "k1", "slot", "gap", "stall", "plain_run")]
            + [("far_limit", d), ("nthreads", i), ("last", p), ("log_mass", d), ("quit", i), ("eps_list", p),
               ("n_eps", i)]
            + [(name, d) for name in ("scale_tol", "scale_enter", "scale_near")]
            + [("scale_cap", i), ("need_t", i), ("passes", p), ("span", d), ("wild", d)])


class _LoopArgs(ctypes.Structure):
    """The C struct ``LoopArgs`` of ``csrc/cpu_ops.cpp`` (same fields, same order)."""

    _fields_ = _loop_fields()


def alternating_loop(sq_x, sq_y, log_a, log_b, u, v, mass_a, mass_b, state: dict, anderson: Optional[dict],
                     p: int, kind_a: str, tau_a: float, kind_b: str, tau_b: float, eps: float, tol: float,
                     enter_tol: Optional[float], value_tol: Optional[float], value_span: float, window: int,
                     steps: int, it0: int, max_iter: int, translate: bool, last: Optional[torch.Tensor] = None,
                     mass: float = 1.0, scaling: Optional[tuple] = None) -> torch.Tensor:
    """The update loop at the target eps of :func:`srot_fast._loop.alternating` (its torch reference, which documents
    it) in one call of the compiled library, over stored squared distances: every problem of the batch looks and
    updates until it is done or the loop has run ``max_iter`` updates in all (it0 before this call). Operands:
    sq_x (B, N, M) and sq_y (B, M, N) squared distances, log_a (B, N), log_b (B, M), u (B, N) and v (B, M) cost
    offsets or None, all contiguous CPU tensors of one float32 / float64 dtype;
    mass_a, mass_b (B,) float64 total weights. ``state``: f, s (B, N), g, t (B, M) in that dtype, col, err (B,)
    float64, done (B,) bool, n_iter (B,) int64, updated in place. ``anderson``: the state of
    :class:`srot_fast._anderson.Anderson` (its fields ``mask``, ``images``, ``resid``, ``inner``, ``valid``,
    ``best``, ``top``, ``low``, ``since``, ``flat``, ``rest``, ``stalls`` (history allocated) and ``slot``,
    ``by_value``, ``watch``, ``quit``, ``restart_gap``, ``stall``, ``plain_run``, ``far``, and for partial OT
    ``span``, ``wild``: :meth:`~srot_fast._anderson.Anderson.wild`), updated in place; None:
    plain updates. Partial OT of transported ``mass`` (:class:`srot_fast.geometry.PartialGeometry`, balanced
    penalties) where ``last`` (B, N) is given, the real part of the row soft-min, updated in place: then log_a, f,
    s (B, N + 1) and log_b, g, t (B, M + 1) hold the dummy points too. Returns the (B,) int64 updates each problem
    ran. ``scaling``: a cold solve instead, eps-scaling first -- the whole of
    :func:`srot_fast._loop.alternating` without ``init`` -- as (eps_list, scale_tol, scale_cap, scale_enter,
    scale_near, need_t, passes): the fitted schedule ending at ``eps``, the loose solves' settings, whether the
    first look at the target reads the columns, and a (1,) int64 tensor that receives the passes run; the state's
    f, g, s, t, col, err, done are then outputs, n_iter gets every update added (eps-scaling's included), the
    returned updates are those of the loop at ``eps``, the Anderson state is reset before each loop and ``it0``,
    ``steps`` are not read. Call only when :func:`available`."""
    dtype, (nb, n, m) = sq_x.dtype, sq_x.shape
    nr, mr = n, m  # the real points
    if last is not None:
        n, m = n + 1, m + 1
    f64, i64 = torch.float64, torch.int64
    ops = [("sq_x", sq_x, dtype, (nb, nr, mr)), ("sq_y", sq_y, dtype, (nb, mr, nr)), ("log_a", log_a, dtype, (nb, n)),
           ("log_b", log_b, dtype, (nb, m)), ("mass_a", mass_a, f64, (nb,)), ("mass_b", mass_b, f64, (nb,)),
           ("f", state["f"], dtype, (nb, n)), ("s", state["s"], dtype, (nb, n)), ("g", state["g"], dtype, (nb, m)),
           ("t", state["t"], dtype, (nb, m)), ("col", state["col"], f64, (nb,)), ("err", state["err"], f64, (nb,)),
           ("done", state["done"], torch.bool, (nb,)), ("n_iter", state["n_iter"], i64, (nb,))]
    ops += [(name, t, dtype, shape) for name, t, shape in (("u", u, (nb, nr)), ("v", v, (nb, mr)),
                                                            ("last", last, (nb, nr))) if t is not None]
    if dtype not in (f64, torch.float32):
        raise ValueError(f"alternating_loop: float32 / float64 operands expected, got {dtype}")
    if anderson is not None:
        k1 = anderson["images"].shape[1]
        ops += [("mask", anderson["mask"], f64, (nb, m)), ("images", anderson["images"], f64, (nb, k1, m)),
                ("resid", anderson["resid"], f64, (nb, k1, m)), ("inner", anderson["inner"], f64, (nb, k1, k1)),
                ("valid", anderson["valid"], torch.bool, (nb, k1))]
        ops += [(name, anderson[name], f64, (nb,)) for name in ("best", "top", "low")]
        ops += [(name, anderson[name], i64, (nb,)) for name in ("since", "flat", "rest", "stalls")]
    args, updates = _loop_args("alternating_loop", ops, nb, n, m, p, kind_a, tau_a, eps, tol, value_tol, value_span,
                               window, steps, it0, max_iter)
    args.kind_b, args.tau_b = _KINDS[kind_b], float(tau_b)
    args.enter_tol = -1.0 if enter_tol is None else float(enter_tol)
    args.translate, args.accelerate = int(translate), int(anderson is not None)
    args.log_mass = math.log(mass)
    args.span, args.wild = -1.0, 0.0  # no wild-proposal test unless partial OT's Anderson state sets one
    if anderson is not None:
        args.by_value, args.watch, args.k1 = int(anderson["by_value"]), int(anderson["watch"]), k1
        args.slot, args.gap = int(anderson["slot"]), int(anderson["restart_gap"])
        args.stall, args.plain_run, args.far_limit = int(anderson["stall"]), int(anderson["plain_run"]), \
            float(anderson["far"])
        args.quit = int(anderson["quit"])
        if anderson.get("span") is not None:
            args.span, args.wild = float(anderson["span"]), float(anderson["wild"])
    if scaling is not None:
        eps_list, args.scale_tol, args.scale_cap, args.scale_enter, args.scale_near, need_t, passes = scaling
        _state("alternating_loop: passes", passes, torch.int64, (1,))
        eps_list = torch.tensor(eps_list, dtype=f64)
        if eps_list.numel() == 0:
            raise ValueError("alternating_loop: an empty eps_list")
        args.eps_list, args.n_eps, args.need_t, args.passes = eps_list.data_ptr(), eps_list.numel(), int(need_t), \
            passes.data_ptr()
    (_load().srot_loop_f32 if dtype == torch.float32 else _load().srot_loop_f64)(ctypes.byref(args))
    return updates


def _loop_args(fn, ops, nb, n, m, p, kind_a, tau_a, eps, tol, value_tol, value_span, window, steps, it0, max_iter):
    """The LoopArgs of the operands ``ops`` -- (name, tensor, dtype, shape), checked by :func:`_state` -- and of the
    common settings (the rest zero), and the (nb,) int64 tensor its ``updates`` points to."""
    for name, t, dt, shape in ops:
        _state(f"{fn}: {name}", t, dt, shape)
    updates = torch.zeros(nb, dtype=torch.int64)
    args = _LoopArgs()
    for name, t, *_ in ops:
        setattr(args, {"log_a": "la", "log_b": "lb"}.get(name, name), t.data_ptr())
    args.updates = updates.data_ptr()
    args.nb, args.n, args.m, args.p = nb, n, m, int(p)
    args.kind_a, args.tau_a, args.eps, args.tol = _KINDS[kind_a], float(tau_a), float(eps), float(tol)
    args.enter_tol = -1.0
    args.value_tol = -1.0 if value_tol is None else float(value_tol)
    args.value_span, args.window, args.steps = float(value_span), int(window), int(steps)
    args.it0, args.max_iter = int(it0), int(max_iter)
    args.nthreads = _threads(nb * n, m, 1)
    return args, updates


def symmetric_loop(sq, log_a, u, v, mass_a, state: dict, p: int, kind: str, tau: float, eps: float, tol: float,
                   value_tol: Optional[float], value_span: float, window: int, it0: int,
                   max_iter: int, eps_list: Optional[Sequence[float]] = None) -> torch.Tensor:
    """The update loop at the target eps of :func:`srot_fast._loop.symmetric` (self-transport; its torch reference,
    which documents it) in one call of the compiled library, over the stored squared distances sq (B, N, N) of x
    with itself: every problem of the batch looks and updates until it is done or the loop has run ``max_iter``
    updates in all (it0 before this call). log_a (B, N), offsets u, v (B, N) or None (u = v), contiguous CPU tensors
    of sq's float32 / float64 dtype; mass_a (B,) float64. ``state``: f, s (B, N), err (B,) float64, done (B,)
    bool, n_iter (B,) int64, updated in place (s: the soft-min at the final f). Returns the (B,) int64 updates
    each problem ran. ``eps_list``: a cold solve, eps-scaling first (the fitted schedule ending at ``eps``; f is
    then an output; its len(eps_list) - 1 averaged steps count as updates only through ``it0`` and the given
    ``n_iter``, which the caller sets to that number). Call only when :func:`available`."""
    dtype, (nb, n, _) = sq.dtype, sq.shape
    if dtype not in (torch.float64, torch.float32):
        raise ValueError(f"symmetric_loop: float32 / float64 operands expected, got {dtype}")
    ops = [("sq_x", sq, dtype, (nb, n, n)), ("log_a", log_a, dtype, (nb, n)), ("mass_a", mass_a, torch.float64, (nb,)),
           ("f", state["f"], dtype, (nb, n)), ("s", state["s"], dtype, (nb, n)),
           ("err", state["err"], torch.float64, (nb,)), ("done", state["done"], torch.bool, (nb,)),
           ("n_iter", state["n_iter"], torch.int64, (nb,))]
    ops += [(name, t, dtype, (nb, n)) for name, t in (("u", u), ("v", v)) if t is not None]
    args, updates = _loop_args("symmetric_loop", ops, nb, n, n, p, kind, tau, eps, tol, value_tol, value_span,
                               window, 0, it0, max_iter)
    if eps_list is not None:
        eps_list = torch.tensor(list(eps_list), dtype=torch.float64)
        if eps_list.numel() == 0:
            raise ValueError("symmetric_loop: an empty eps_list")
        args.eps_list, args.n_eps = eps_list.data_ptr(), eps_list.numel()
    (_load().srot_symmetric_loop_f32 if dtype == torch.float32 else _load().srot_symmetric_loop_f64)(
        ctypes.byref(args))
    return updates
