"""Launchers and primitives of the Triton backend. The ``*_fwd`` launchers check the arguments, pick the path
(small-d or large-d), the dot precision, the block sizes (fixed defaults, or autotuned: :mod:`.autotune`) and
the grid, allocate the outputs and launch the kernels of :mod:`.kernels` (keyword arguments); the four
primitives ``softmin``, ``weighted_mean``, ``plan_argmax`` and ``max_cost`` call them with the defaults.
float16 / bfloat16 points are passed to the kernels as they are (no float32 copy; the kernels upcast each
tile in registers); ``h`` and the outputs are float32 for them.
:mod:`srot_fast.kernels.triton_softmin` re-exports the public names."""

from __future__ import annotations

import math
import os

import torch
import triton

from .._common import check_operands
from .autotune import _TUNED, _size_key, _tune
from .kernels import (
    _max_sq_fwd_kernel,
    _plan_argmax_fwd_kernel,
    _softmin_fwd_kernel,
    _softmin_small_kernel,
    _weighted_mean_dot_kernel,
    _weighted_mean_fwd_kernel,
    _weighted_mean_soa_kernel,
    _weighted_sum_dot_kernel,
)
from .options import check_autotune, check_precision

__all__ = [
    "softmin",
    "weighted_mean",
    "plan_argmax",
    "max_cost",
    "softmin_fwd",
    "weighted_mean_fwd",
    "plan_argmax_fwd",
    "max_sq_fwd",
]

_MAX_D_WMEAN = 64  # largest D of the one-pass (small-d) weighted_mean
_MAX_D_WMEAN_DOT = 128  # largest D of the one-pass tl.dot weighted_mean (float32)
_DOT_MIN_D = 32  # D from which 'auto' forms distances with tl.dot (large-d path)

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


_HALF = (torch.float16, torch.bfloat16)  # loaded as such, computed in float32
_DTYPES = _HALF + (torch.float32, torch.float64)


def _cdt(dtype: torch.dtype) -> torch.dtype:
    """The compute dtype of points of ``dtype``: float32 for float16 / bfloat16, else ``dtype``."""
    return torch.float32 if dtype in _HALF else dtype


def _check(x, y, h=None, p=1):
    """Argument checks of every launcher; returns whether the operands are batched (see _common.check_operands).
    x and y: float16, bfloat16, float32 or float64, one dtype; h: x's dtype or its compute dtype (float32 for
    half points)."""
    batched = check_operands(x, y, h, p, allow_empty=True, allow_batch=True) is not None  # empty: refused below
    if x.dtype not in _DTYPES:
        raise TypeError(f"triton kernels take float16, bfloat16, float32 or float64 points, got {x.dtype}")
    if y.dtype != x.dtype or y.device != x.device:
        raise ValueError(f"y must have x's dtype and device ({x.dtype}, {x.device})")
    if h is not None and (h.dtype not in (x.dtype, _cdt(x.dtype)) or h.device != x.device):
        raise ValueError(f"h must have x's dtype ({x.dtype}) or {_cdt(x.dtype)}, and x's device ({x.device})")
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError("triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before importing triton)")
    if x.shape[-2] == 0 or y.shape[-2] == 0:
        raise ValueError("empty point cloud")
    return batched


def _lead(*ts):
    """Add the leading batch dimension of size 1 to each tensor (None passes)."""
    return tuple(None if t is None else t.unsqueeze(0) for t in ts)


def _rows(t):
    """``t`` detached, with its last dimension contiguous (other strides kept: a view is not copied)."""
    t = t.detach()
    return t if t.stride(-1) == 1 else t.contiguous()


def _prm(x, eps):
    """[log2(e) / eps, eps ln 2] in x's compute dtype, on x's device (a Python float would be specialised to
    float32); its dtype is the kernels' compute dtype.
    Filled on the device: ``torch.tensor(..., device='cuda')`` copies from pageable memory, which waits for
    the queued kernels (a host-device sync per launch)."""
    prm = torch.empty(2, dtype=_cdt(x.dtype), device=x.device)
    prm[0].fill_(_LOG2E / eps)
    prm[1].fill_(eps * _LN2)
    return prm


def _h2(h, dtype):
    """(B, M) column log-weights in base 2 (-inf stays -inf) in the compute ``dtype``, columns contiguous."""
    return _rows(h.detach().to(dtype) * _LOG2E)


def _use_dot(path: str, d: int, dtype: torch.dtype) -> bool:
    """tl.dot distances for float32 and half points at D >= 32 ('auto') or when asked; never for float64:
    float64 tl.dot
    failed to compile with Triton 3.6 on sm_90, so float64 always takes the exact difference form."""
    if path not in ("auto", "small", "dot"):
        raise ValueError(f"path must be 'auto', 'small' or 'dot', got {path!r}")
    if dtype == torch.float64:
        if path == "dot":
            raise ValueError("path='dot' is float32 only (float64 uses the exact difference form)")
        return False
    return path == "dot" or (path == "auto" and d >= _DOT_MIN_D)


# The float32 default when neither ``precision=`` nor SROT_TRITON_DOT_PRECISION is given: "tf32x3" has the
# accuracy of "ieee" and is faster on GPUs with TF32 tensor cores ("ieee" on GPUs without them).
_DEFAULT_PRECISION = "tf32x3"


def _has_tf32(device: torch.device) -> bool:
    """TF32 tensor cores (compute capability 8.0 and later); False off CUDA."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def _precision(precision, device=None) -> str:
    """tl.dot input precision of the large-d path for float32 points: ``precision`` if given, else the
    environment variable ``SROT_TRITON_DOT_PRECISION``, else ``_DEFAULT_PRECISION`` (replaced by "ieee"
    where that is "tf32x3" and ``device`` is a GPU without TF32 tensor cores). Checked at every launch,
    small-d ones included, so that a wrong value shows at once.

    - "ieee": fp32 FMA on the CUDA cores.
    - "tf32x3": each fp32 operand split into a TF32 high part and a TF32 low part, three tensor-core
      products (hi.hi + hi.lo + lo.hi) with fp32 accumulation: fp32-accurate.
    - "tf32" (opt-in, never a default): one tensor-core product of the operands rounded to TF32 (10 stored
      significand bits), FlashSinkhorn's default: see the package docstring for its error.

    float16 / bfloat16 points take "tf32" for the cross term x.y whatever this says (exact for them)."""
    name = "precision"
    if precision is None:
        precision, name = os.environ.get("SROT_TRITON_DOT_PRECISION"), "SROT_TRITON_DOT_PRECISION"
        if precision is None:
            precision = _DEFAULT_PRECISION
            if precision == "tf32x3" and device is not None and device.type == "cuda" and not _has_tf32(device):
                precision = "ieee"
    return check_precision(precision, name)


def _operands(x, y, dot: bool):
    """Detached (x, y, xx, yy, coinc, centre) of a batched (B, N, D), (B, M, D) launch. Large-d path: each
    problem's two clouds are centred on their common mean (distances are unchanged, the cancellation in
    |x|^2 + |y|^2 - 2 x.y shrinks) and the squared norms computed once ((B, N) and (B, M), contiguous);
    ``coinc`` = 2 sqrt(D) * machine epsilon of float32, above the relative rounding noise of that
    cancellation (~2 u at D = 300..12288 on CPU; sqrt(D / BLOCK_K) u for sequential chunks), so exactly
    coincident points get distance 0 (the p = 1 kink). float16 / bfloat16 points are not centred (a centred
    copy would be float32, or rounded again) and their norms are float32 sums (no float32 copy of the
    points): the cancellation error, ~u32 |x|^2, stays below the points' own rounding, ~u_half |x| |x - y|,
    unless |x| exceeds |x - y| by about 2^15 (bfloat16) or 2^12 (float16). Small-d path: the points as given
    when their coordinates are contiguous (no copy), ``xx``/``yy`` unused placeholders (x itself)."""
    x, y = _rows(x), _rows(y)
    if not dot:
        return x, y, x, x, 0.0, None
    coinc = 2.0 * math.sqrt(x.shape[-1]) * torch.finfo(torch.float32).eps
    if x.dtype in _HALF:
        def sq_norms(t):
            return torch.linalg.vector_norm(t, dim=-1, dtype=torch.float32).square()

        return x, y, sq_norms(x), sq_norms(y), coinc, None
    n, m = x.shape[-2], y.shape[-2]
    centre = (x.sum(-2, keepdim=True) + y.sum(-2, keepdim=True)) / (n + m)  # (B, 1, D)
    xc, yc = (x - centre).contiguous(), (y - centre).contiguous()
    return xc, yc, (xc * xc).sum(-1), (yc * yc).sum(-1), coinc, centre


def _grid(n, nb):
    """Launch grid: cdiv(N, BLOCK_N) row blocks for each of the ``nb`` problems (``meta``: the block sizes)."""
    return lambda meta: (triton.cdiv(n, meta["BLOCK_N"]) * nb,)


def softmin_fwd(x, y, h, eps, p, *, path="auto", block_n=None, block_m=None, block_k=None, num_warps=None,
                trans=None, precision=None, autotune=None):
    """Launcher of :func:`softmin`: x (N, D) or (B, N, D) -> (N,) or (B, N), one launch for the batch.
    ``path``: 'small' (coordinate loop), 'dot' (tl.dot, fp32-exact) or 'auto' ('dot' for D >= 32);
    ``precision``: the dot path's tl.dot precision (:func:`_precision`). Block sizes are powers of two
    (>= 16 on the dot path); ``trans`` picks the small-d tile orientation. On a GPU from ``_TUNE_MIN_PAIRS``
    pairs (B * N * M) with no block size given, the blocks are autotuned (``_CFG_DOT`` / ``_CFG_SMALL``)
    unless ``autotune`` is False (None: ``SROT_TRITON_AUTOTUNE``, on unless '0'); otherwise defaults 32 x 64
    (small), 64 x 64 x 32 (dot), 4 warps. Output in the compute dtype (float32 for half points)."""
    batched = _check(x, y, h, p)
    if not batched:
        return softmin_fwd(*_lead(x, y, h), eps, p, path=path, block_n=block_n, block_m=block_m,
                           block_k=block_k, num_warps=num_warps, trans=trans, precision=precision,
                           autotune=autotune)[0]
    nb, n, d = x.shape
    m = y.shape[1]
    dot = _use_dot(path, d, x.dtype)
    prec = _precision(precision, x.device)
    out = torch.empty(nb, n, dtype=_cdt(x.dtype), device=x.device)
    if nb == 0:
        return out
    h2 = _h2(h, out.dtype)
    tune = _tune(x, nb * n * m, (block_n, block_m, block_k, num_warps, trans), autotune)
    if not dot:  # coordinate-major views (B, D, N) with contiguous rows: contiguous loads along rows and columns
        xt, yt = _rows(x.detach().transpose(-1, -2)), _rows(y.detach().transpose(-1, -2))
        args = (xt, yt, h2, _prm(x, eps), out, n, m, xt.stride(0), xt.stride(1), yt.stride(0), yt.stride(1),
                h2.stride(0), _size_key(nb, n, m))
        if tune:
            _TUNED["softmin_small"][_grid(n, nb)](*args, D=d, P=p)
        else:
            block_n = block_n or 32
            _softmin_small_kernel[(triton.cdiv(n, block_n) * nb,)](
                *args, D=d, P=p, TRANS=bool(trans), BLOCK_N=block_n, BLOCK_M=block_m or 64, num_warps=num_warps or 4)
        return out
    x, y, xx, yy, coinc, _ = _operands(x, y, dot)
    args = (x, y, xx, yy, h2, _prm(x, eps), out, n, m, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
            h2.stride(0), coinc, _size_key(nb, n, m))
    if tune:
        _TUNED["softmin_dot"][_grid(n, nb)](*args, D=d, P=p, DOT=True, FOLD=p == 2, PREC=prec)
        return out
    block_n = block_n or 64
    _softmin_fwd_kernel[(triton.cdiv(n, block_n) * nb,)](
        *args, D=d, P=p, DOT=True, FOLD=p == 2, PREC=prec, BLOCK_N=block_n, BLOCK_M=block_m or 64,
        BLOCK_K=block_k or 32, num_warps=num_warps or 4,
    )
    return out


def weighted_mean_fwd(x, y, h, eps, p, phi="y", *, path="auto", block_n=None, block_m=None, block_k=None,
                      num_warps=None, trans=None, precision=None, autotune=None):
    """Launcher of :func:`weighted_mean`: x (N, D) or (B, N, D) -> (N, D) or (B, N, D). Paths: 'small'
    (D <= 64): one streaming pass, products summed by broadcasting; 'dot' (float32 only; 'auto' takes it
    for 32 <= D): for D <= 128 one streaming pass with both x.y^T and w @ y by tl.dot, for D > 128 a softmin
    pass for the row normalisers then a pass adding tl.dot(w, y) into the (B, N, D) output. float64 above
    D = 64: the two passes with exact differences and register sums. One launch per pass for the whole batch.
    ``precision`` as :func:`softmin_fwd`. Autotuned on a GPU as :func:`softmin_fwd` (one-pass kernels;
    ``autotune`` as there); defaults 16 x 32 (small), 64 x 64 (dot, one pass), 64 x 64 x 32 (two passes).
    ``trans=True`` (small path, D <= 3; never autotuned): the block-sparse kernel's tile step instead, on
    coordinate-major points, a thread per row and one accumulator per coordinate (default 64 x 64, 2 warps).
    Output in the compute dtype (float32 for half points)."""
    batched = _check(x, y, h, p)
    if phi not in ("y", "grad"):
        raise ValueError(f"phi must be 'y' or 'grad', got {phi!r}")
    if not batched:
        return weighted_mean_fwd(*_lead(x, y, h), eps, p, phi, path=path, block_n=block_n, block_m=block_m,
                                 block_k=block_k, num_warps=num_warps, trans=trans, precision=precision,
                                 autotune=autotune)[0]
    nb, n, d = x.shape
    m = y.shape[1]
    dot = _use_dot(path, d, x.dtype)  # also the argument check: path='dot' is float32 only
    prec = _precision(precision, x.device)
    cdt = _cdt(x.dtype)
    if path == "small" and d > _MAX_D_WMEAN:
        raise ValueError(f"the small-d weighted_mean path takes D <= {_MAX_D_WMEAN} (got {d}); use path='dot'")
    if trans and (dot or d > 3):
        raise ValueError(f"trans=True is a small-d weighted_mean tile for D <= 3 (got D = {d}"
                         f"{', the dot path' if dot else ''})")
    if nb == 0:
        return torch.empty(0, n, d, dtype=cdt, device=x.device)
    unit = phi == "grad" and p == 1
    fixed = (block_n, block_m, block_k, num_warps, trans)
    x0 = x
    h2 = _h2(h, cdt)
    if dot and d <= _MAX_D_WMEAN_DOT:  # float32, one pass, tl.dot
        x, y, xx, yy, coinc, centre = _operands(x, y, True)
        out = torch.empty(nb, n, d, dtype=cdt, device=x.device)
        args = (x, y, xx, yy, h2, _prm(x, eps), out, n, m, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
                h2.stride(0), coinc, _size_key(nb, n, m))
        const = dict(D=d, P=p, UNIT=unit, PREC=prec, BLOCK_D=max(16, triton.next_power_of_2(d)))
        if _tune(x, nb * n * m, fixed, autotune):
            _TUNED["wmean_dot"][_grid(n, nb)](*args, **const)
        else:
            block_n = block_n or 64
            _weighted_mean_dot_kernel[(triton.cdiv(n, block_n) * nb,)](
                *args, **const, BLOCK_N=block_n, BLOCK_M=block_m or 64, num_warps=num_warps or 4)
        if not unit and centre is not None:  # mean of the centred y_j: undo the centring
            out += centre
    elif dot or d > _MAX_D_WMEAN:  # two passes: float32 tl.dot, or float64 exact differences and broadcast sums
        block_n, block_m = block_n or (64 if dot else 16), block_m or (64 if dot else 16)
        block_k = block_k or (32 if dot else 16)
        lse2 = softmin_fwd(x, y, h, eps, p, path="dot" if dot else "small", block_n=block_n, block_m=block_m,
                           block_k=block_k, num_warps=num_warps, precision=prec) / -(eps * _LN2)
        x, y, xx, yy, coinc, centre = _operands(x, y, dot)
        acc = torch.zeros(nb, n, d, dtype=cdt, device=x.device)
        wsum = torch.empty(nb, n, dtype=cdt, device=x.device)
        _weighted_sum_dot_kernel[(triton.cdiv(n, block_n) * nb,)](
            x, y, xx, yy, h2, lse2.contiguous(), _prm(x, eps), acc, wsum, n, m, x.stride(0), x.stride(1),
            y.stride(0), y.stride(1), h2.stride(0), coinc, D=d, P=p, UNIT=unit, BLOCK_N=block_n, BLOCK_M=block_m,
            BLOCK_K=block_k, DOT=dot, PREC=prec, num_warps=num_warps or 4,
        )
        if unit:  # sum_j w'_ij (x_i - y_j) = x_i sum_j w'_ij - sum_j w'_ij y_j (centring cancels)
            out = x * wsum[..., None] - acc
        elif centre is not None:  # mean of y_j: undo the centring (the weights sum to wsum = 1 up to rounding)
            out = acc + centre * wsum[..., None]
        else:
            out = acc
    elif trans:  # small path, D <= 3, coordinate-major points, a thread per row
        xt, yt = _rows(x.detach().transpose(-1, -2)), _rows(y.detach().transpose(-1, -2))
        out = torch.empty(nb, n, d, dtype=cdt, device=x.device)
        block_n = block_n or 64
        _weighted_mean_soa_kernel[(triton.cdiv(n, block_n) * nb,)](
            xt, yt, h2, _prm(x, eps), out, n, m, xt.stride(0), xt.stride(1), yt.stride(0), yt.stride(1), h2.stride(0),
            D=d, P=p, UNIT=unit, BLOCK_N=block_n, BLOCK_M=block_m or 64, num_warps=num_warps or 2)
    else:  # small path, one pass
        x, y = _rows(x), _rows(y)
        out = torch.empty(nb, n, d, dtype=cdt, device=x.device)
        args = (x, y, h2, _prm(x, eps), out, n, m, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
                h2.stride(0), _size_key(nb, n, m))
        const = dict(D=d, P=p, UNIT=unit, BLOCK_D=max(2, triton.next_power_of_2(d)))
        if _tune(x, nb * n * m, fixed, autotune):
            _TUNED["wmean_small"][_grid(n, nb)](*args, **const)
        else:
            block_n = block_n or 16
            _weighted_mean_fwd_kernel[(triton.cdiv(n, block_n) * nb,)](
                *args, **const, BLOCK_N=block_n, BLOCK_M=block_m or 32, num_warps=num_warps or 4)
    if phi == "grad" and p == 2:
        out = x0.detach() - out
    return out


def plan_argmax_fwd(x, y, h, eps, p, *, path="auto", block_n=None, block_m=None, block_k=None, num_warps=None,
                    precision=None):
    """Launcher of :func:`plan_argmax`: x (N, D) or (B, N, D) -> int64 (N,) or (B, N) (paths and default
    block sizes as :func:`softmin_fwd`; not tuned)."""
    batched = _check(x, y, h, p)
    if not batched:
        return plan_argmax_fwd(*_lead(x, y, h), eps, p, path=path, block_n=block_n, block_m=block_m,
                               block_k=block_k, num_warps=num_warps, precision=precision)[0]
    nb, n, d = x.shape
    m = y.shape[1]
    dot = _use_dot(path, d, x.dtype)
    prec = _precision(precision, x.device)
    out = torch.empty(nb, n, dtype=torch.int64, device=x.device)
    if nb == 0:
        return out
    block_n = block_n or (64 if dot else 32)
    h2 = _h2(h, _cdt(x.dtype))
    x, y, xx, yy, coinc, _ = _operands(x, y, dot)
    _plan_argmax_fwd_kernel[(triton.cdiv(n, block_n) * nb,)](
        x, y, xx, yy, h2, _prm(x, eps), out, n, m, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
        h2.stride(0), coinc, D=d, P=p, DOT=dot, PREC=prec, BLOCK_N=block_n, BLOCK_M=block_m or 64,
        BLOCK_K=block_k or 32, num_warps=num_warps or 4,
    )
    return out


def max_sq_fwd(x, y, *, path="auto", block_n=None, block_m=None, block_k=None, num_warps=None, precision=None):
    """(N,) or (B, N) max_j |x_i - y_j|^2 (launcher behind :func:`max_cost`; paths as :func:`softmin_fwd`;
    not tuned), in the compute dtype."""
    batched = _check(x, y)
    if not batched:
        return max_sq_fwd(*_lead(x, y), path=path, block_n=block_n, block_m=block_m, block_k=block_k,
                          num_warps=num_warps, precision=precision)[0]
    nb, n, d = x.shape
    m = y.shape[1]
    dot = _use_dot(path, d, x.dtype)
    prec = _precision(precision, x.device)
    out = torch.empty(nb, n, dtype=_cdt(x.dtype), device=x.device)
    if nb == 0:
        return out
    block_n = block_n or (64 if dot else 32)
    x, y, xx, yy, coinc, _ = _operands(x, y, dot)
    _max_sq_fwd_kernel[(triton.cdiv(n, block_n) * nb,)](
        x, y, xx, yy, out, n, m, x.stride(0), x.stride(1), y.stride(0), y.stride(1), coinc,
        D=d, DOT=dot, PREC=prec, BLOCK_N=block_n, BLOCK_M=block_m or 64, BLOCK_K=block_k or 32,
        num_warps=num_warps or 4,
    )
    return out


# ---------------------------------------------------------------------------------------- primitives
# Each primitive also takes the keyword options of :mod:`.options` (``precision``, ``autotune``; None: the
# environment's default), which the solver's geometry passes on; plan_argmax and max_cost are never tuned.
def softmin(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int, *, precision=None,
            autotune=None) -> torch.Tensor:
    r"""(N,) or (B, N) soft-min ``out_i = -eps * log sum_j exp(h_j - C(x_i, y_j) / eps)``; ``+inf`` if all
    ``h = -inf``.

    Example:
        >>> x, y = torch.randn(1000, 2, device="cuda"), torch.randn(800, 2, device="cuda")
        >>> h = torch.zeros(800, device="cuda")
        >>> softmin(x, y, h, 0.01, 2).shape  # doctest: +SKIP
        torch.Size([1000])
    """
    return softmin_fwd(x, y, h, eps, p, precision=precision, autotune=autotune)


def weighted_mean(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int, phi: str = "y", *,
                  precision=None, autotune=None) -> torch.Tensor:
    r"""(N, D) or (B, N, D) mean of phi(x_i, y_j) under w_ij = softmax_j(h_j - C_ij / eps); any D (two
    passes for D > 64).

    ``phi="y"``: y_j. ``phi="grad"``: (x_i - y_j) / |x_i - y_j| for p = 1 (0 where x_i = y_j),
    x_i - y_j for p = 2 (computed as x_i - mean of y_j).
    """
    return weighted_mean_fwd(x, y, h, eps, p, phi, precision=precision, autotune=autotune)


def plan_argmax(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int, *, precision=None,
                autotune=None) -> torch.Tensor:
    """(N,) or (B, N) int64 index of the largest plan entry per row, argmax_j (h_j - C_ij / eps), first on
    ties."""
    check_autotune(autotune)
    return plan_argmax_fwd(x, y, h, eps, p, precision=precision)


def max_cost(x: torch.Tensor, y: torch.Tensor, p: int, *, precision=None, autotune=None) -> torch.Tensor:
    """() largest ground cost max_ij C(x_i, y_j) (0-dim tensor of x's dtype), or (B,) one per problem."""
    if p not in (1, 2):
        raise ValueError(f"p must be 1 or 2, got {p}")
    check_autotune(autotune)
    s = max_sq_fwd(x, y, precision=precision).amax(dim=-1)
    return s.sqrt() if p == 1 else s / 2
