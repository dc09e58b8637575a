"""Argument validation shared by the public functions: every error names the argument."""
from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple

import torch

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _not_transformed(t: torch.Tensor, name: str) -> None:
    """Refuse a tensor wrapped by a torch.func transform (vmap, grad, jacrev, jvp): the solver's compiled kernels
    and data-dependent stopping test cannot run under them, and torch's own error would not say so."""
    if _is_functorch_wrapped(t):
        raise NotImplementedError(
            f"{name} is a tensor inside a torch.func transform (vmap, grad, jacrev, jvp, ...), which srot_fast does "
            f"not support: pass a (B, N, D) batch instead of vmap (it is solved as one problem), and use reverse "
            f"mode (backward() or torch.autograd.grad) for gradients")


_is_functorch_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor",
                                lambda t: False)


def check_points(t, name: str, batched: bool = False) -> torch.Tensor:
    """A (N, D) — or (B, N, D) when ``batched`` — finite floating-point tensor (float16 / bfloat16 are
    accepted here and computed in float32, see :func:`compute_dtype`)."""
    if not torch.is_tensor(t):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _not_transformed(t, name)
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating-point tensor (float16, bfloat16, float32 or float64), "
                        f"got {t.dtype}")
    want = (2, 3) if batched else (2,)
    if t.dim() not in want:
        shape = "(N, D) or (B, N, D)" if batched else "(N, D)"
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.dim() == 3 and t.shape[0] == 0 and t.shape[-1] > 0:
        return t  # an empty batch
    if t.shape[-2] == 0 or t.shape[-1] == 0:
        raise ValueError(f"{name} must hold at least one point of dimension >= 1, got {tuple(t.shape)}")
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} contains NaN or inf")
    return t


def check_pair(x: torch.Tensor, y: torch.Tensor, xname: str = "x", yname: str = "y") -> None:
    """Same feature dimension, dtype and device for two point clouds (batch sizes too if batched)."""
    if x.shape[-1] != y.shape[-1]:
        raise ValueError(
            f"{xname} and {yname} must have the same feature dimension D, got {x.shape[-1]} and {y.shape[-1]}"
        )
    if x.dim() != y.dim():
        raise ValueError(f"{xname} and {yname} must both be batched or both not, got shapes "
                         f"{tuple(x.shape)} and {tuple(y.shape)}")
    if x.dim() == 3 and x.shape[0] != y.shape[0]:
        raise ValueError(f"{xname} and {yname} have different batch sizes {x.shape[0]} and {y.shape[0]}")
    if x.dtype != y.dtype:
        raise TypeError(f"{xname} and {yname} must have the same dtype, got {x.dtype} and {y.dtype}")
    if x.device != y.device:
        raise ValueError(f"{xname} and {yname} must be on the same device, got {x.device} and {y.device}")


def check_weights(w: Optional[torch.Tensor], like: torch.Tensor, name: str) -> torch.Tensor:
    """Non-negative finite weights of shape like.shape[:-1] with a positive total; None -> uniform 1/N."""
    shape = like.shape[:-1]
    if w is None:  # uniform, in the dtype the solver computes in (float32 for half inputs)
        dtype = torch.float32 if like.dtype in _HALF_DTYPES else like.dtype
        return torch.full(shape, 1.0 / max(shape[-1], 1), dtype=dtype, device=like.device)
    if not torch.is_tensor(w):
        raise TypeError(f"{name} must be a torch.Tensor of weights, got {type(w).__name__}")
    _not_transformed(w, name)
    _same_device(w, like, name)
    if w.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)} (one weight per point), got {tuple(w.shape)}")
    if w.dtype != like.dtype and not (like.dtype in _HALF_DTYPES and w.dtype == torch.float32):
        raise TypeError(f"{name} must have dtype {like.dtype} like the points, got {w.dtype}")
    # one host sync when the weights are fine (NaN fails every comparison); else the checks below name the fault
    total = w.detach().double().sum(-1)
    if w.numel():
        least, low, high = torch.stack([w.detach().min().double(), total.min(), total.max()]).tolist()
        if least >= 0 and low > 0 and high <= _MAX_MASS:
            return w
    if not torch.isfinite(w).all():
        raise ValueError(f"{name} contains NaN or inf")
    if (w < 0).any():
        raise ValueError(f"{name} has negative weights")
    if not (total > 0).all():
        raise ValueError(f"{name} has zero total mass (all weights are zero)")
    if total.numel() and (not torch.isfinite(total).all() or float(total.max()) > _MAX_MASS):
        raise ValueError(f"{name} has a total mass of {float(total.max()):.3g}: too large to compute with "
                         f"(products of masses overflow); rescale the weights (e.g. to probabilities)")
    return w


def check_offsets(o: Optional[torch.Tensor], like: torch.Tensor, name: str) -> Optional[torch.Tensor]:
    """Optional finite per-point cost offsets of shape like.shape[:-1]."""
    if o is None:
        return None
    if not torch.is_tensor(o):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(o).__name__}")
    _not_transformed(o, name)
    _same_device(o, like, name)
    if o.shape != like.shape[:-1]:
        raise ValueError(f"{name} must have shape {tuple(like.shape[:-1])}, got {tuple(o.shape)}")
    if not torch.isfinite(o).all():
        raise ValueError(f"{name} contains NaN or inf")
    return o.to(torch.float32 if like.dtype in _HALF_DTYPES else like.dtype)


_MAX_MASS = 1e100  # total weight above which |a| |b| and the dual value overflow or lose all precision


def _same_device(t: torch.Tensor, like: torch.Tensor, name: str) -> None:
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but the points are on {like.device}; move it to {like.device}")


def compute_dtype(*ts, keep_half: bool = False):
    """Cast float16 / bfloat16 tensors (None passes through) to float32, the dtype the solver runs in.
    ``keep_half=True`` returns them unchanged: for the points on the Triton backend, whose kernels load half
    tiles and compute in float32 (no float32 copy, half the memory traffic). The cpu, keops and tensorized
    backends get float32 copies (their primitives would otherwise upcast at every call)."""
    if keep_half:
        return ts
    return tuple(t.float() if t is not None and t.dtype in _HALF_DTYPES else t for t in ts)


def power(base: float, p: int, name: str) -> float:
    """base**p as a float, with a ValueError naming ``name`` instead of a bare OverflowError (an infinite
    base stays infinite)."""
    if math.isinf(base):
        return math.inf
    try:
        out = float(base) ** p
    except OverflowError:
        out = math.inf
    if not math.isfinite(out):
        raise ValueError(f"{name}**p overflows ({name}={base}, p={p}); use a smaller {name}")
    return out


def check_scale(diameter: float, p: int, eps: float, dtype: torch.dtype) -> None:
    """Refuse data whose squared distances overflow the dtype (the kernels compute |x - y|^2)."""
    big = torch.finfo(dtype).max
    if not math.isfinite(diameter) or diameter * diameter >= big / 4:
        raise ValueError(f"x and y span a diameter of {diameter:.3g}: their squared distances overflow {dtype}; "
                         "rescale the points (or use float64)")
    if eps >= big / 4:
        raise ValueError(f"eps = {eps:.3g} overflows {dtype}; use a smaller blur / eps")
    resolution = torch.finfo(dtype).eps * max(diameter, 1e-300) ** p  # the rounding error of the largest costs
    if eps < resolution:
        raise ValueError(f"eps = {eps:.3g} is below what {dtype} resolves for costs up to diameter**p = "
                         f"{diameter ** p:.3g} (potentials would stall at a false fixed point); use float64 or a "
                         "larger blur / eps")


def check_masses(mass_a: torch.Tensor, mass_b: torch.Tensor, dtype: torch.dtype) -> None:
    """The product of the total masses must be representable in the dtype."""
    prod = float((mass_a.double() * mass_b.double()).max()) if mass_a.numel() else 0.0
    if not prod < torch.finfo(dtype).max / 16:
        raise ValueError(f"the total masses of a and b multiply to {prod:.3g}, which overflows {dtype}; "
                         "rescale the weights (e.g. to probabilities)")


def mass_rtol(dtype: torch.dtype) -> float:
    """Relative tolerance of total masses compared with each other or with ``mass``: the rounding of a sum of
    float32 weights (float64 is held to the same), or of half weights (~5e-4)."""
    return 1e-6 if dtype in (torch.float32, torch.float64) else 1e-3


def check_partial_mass(mass: float, least: float, dtype: torch.dtype, where: str = "") -> None:
    """Partial OT: ``mass`` <= ``least`` = min(|a|, |b|), up to :func:`mass_rtol` (so that a float sum of weights
    that rounds just below ``mass`` is accepted)."""
    if mass > least * (1 + mass_rtol(dtype)):
        raise ValueError(f"mass must be <= min(a.sum(), b.sum()) = {least:.9g}{where}, got {mass:.9g}")


def masses(w: torch.Tensor, f: torch.Tensor, s: torch.Tensor, eps: float) -> torch.Tensor:
    """w_i exp((f_i - s_i) / eps), computed as exp(log w_i + (f_i - s_i) / eps) in float64 (no overflow of
    the factor alone where the product is finite), returned in w's dtype."""
    out = torch.exp(w.double().log() + (f - s).double() / eps)
    return out.to(w.dtype)


def unconverged(max_iter: int, err: float, tol: float, dtype: torch.dtype, eps: float, size: float,
                also: str = "") -> str:
    """The ConvergenceWarning's message for a solve stopped at ``max_iter`` with relative marginal error ``err``.
    ``size``: the mean absolute potential, (<a, |f|> / |a| + <b, |g|> / |b|) / 2 of that problem. Rounding the
    potentials to ``dtype`` alone moves the measured error by about finfo(dtype).eps * size / eps (measured within
    1.5x on Gaussians: 3.3e-4 estimated against 2.7e-4 at the float32-rounded float64 solution); where that
    is above tol / 4 and ``err`` within 10x of it the message says the dtype is the limit (farther from it, the
    budget is, and the message also says the dtype's floor)."""
    msg = f"Sinkhorn stopped at max_iter={max_iter} with relative marginal error {err:.2e} > tol={tol:g}{also}"
    floor = torch.finfo(dtype).eps * size / eps
    name = str(dtype).replace('torch.', '')
    if dtype != torch.float64 and floor > tol / 4 and err > 10 * floor:
        return (f"{msg}; raise max_iter, eps (blur) or tol (and {name} resolves the marginals here only to about "
                f"{floor:.1e}, so a tol below that also needs float64)")
    if dtype != torch.float64 and floor > tol / 4:
        return (f"{msg}; {name} resolves the marginals here only to about {floor:.1e} "
                f"(potentials of mean size {size:.3g} against eps={eps:g}), so tol may be out of its reach: solve in "
                f"float64 (and raise max_iter), or raise tol or eps")
    return f"{msg}; raise max_iter, eps (blur) or tol"


def check_positive(value, name: str, allow_inf: bool = False) -> float:
    """A positive number (``inf`` allowed only when ``allow_inf``); a string is refused, not parsed."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}") from None
    if math.isnan(value) or value <= 0 or (math.isinf(value) and not allow_inf):
        kind = "a positive number or inf" if allow_inf else "a finite positive number"
        raise ValueError(f"{name} must be {kind}, got {value}")
    return value


def check_scaling(scaling) -> float:
    """The eps-scaling factor, a number in (0, 1) (a non-number is a TypeError, as in :func:`check_positive`)."""
    try:
        s = check_positive(scaling, "scaling")
    except ValueError:
        s = math.nan
    if not 0 < s < 1:
        raise ValueError(f"scaling must be in (0, 1), got {scaling}")
    return s


def check_flag(value, name: str) -> bool:
    """True or False; anything else (a string such as 'no', 0, None) is a TypeError naming ``name``: Python
    would read most of them as True."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def check_p(p) -> int:
    """The exponent of the ground cost: 1 or 2 (a bool is refused, though True == 1)."""
    if isinstance(p, bool) or p not in (1, 2):
        raise ValueError(f"p must be 1 (cost |x-y|) or 2 (cost |x-y|^2/2), got {p!r}")
    return int(p)


def pair_of(value, name: str, allow_inf: bool = True) -> tuple[float, float]:
    """A positive number or a pair (value_a, value_b); with ``allow_inf``, None in a pair is inf (a reach or tau
    of None: balanced OT on that side, as None for the whole argument means balanced OT)."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{name} must be a number or a pair (for_a, for_b), got {value!r}")
        side = [math.inf if allow_inf and w is None else w for w in value]
        return (check_positive(side[0], f"{name}[0]", allow_inf), check_positive(side[1], f"{name}[1]", allow_inf))
    v = check_positive(value, name, allow_inf)
    return v, v


def check_number(value, name: str, positive: bool) -> float:
    """float(value), finite and > 0 (positive=True) or >= 0, else ValueError naming ``name``."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(out) or out < 0 or (positive and out == 0):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
    return out


def positive_int(value, name: str, allow_none: bool) -> Optional[int]:
    """An int >= 1 (or None when ``allow_none``), else ValueError naming ``name``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be {'None or ' if allow_none else ''}a positive int, got {value!r}")
    return value


def non_negative_int(value, name: str) -> int:
    """An int >= 0 (bool refused), else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def check_int(value, name: str, minimum: int) -> int:
    """An int >= minimum: TypeError for anything that is not an int (bool and float too), ValueError below."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_fraction(value, name: str, closed: bool = False) -> float:
    """A real number in [0, 1) — [0, 1] when ``closed`` — as a float; a one-element real tensor is accepted.
    TypeError for non-numbers (bool, str, None, ...), ValueError outside the interval (NaN too)."""
    interval = "[0, 1]" if closed else "[0, 1)"
    if torch.is_tensor(value) and value.numel() == 1 and not value.dtype.is_complex and value.dtype != torch.bool:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number in {interval}, got {type(value).__name__} {value!r}")
    value = float(value)
    if not (0.0 <= value <= 1.0 if closed else 0.0 <= value < 1.0):
        raise ValueError(f"{name} must be in {interval}, got {value}")
    return value


def check_probabilities(s, name: str, one_dim: bool = True) -> torch.Tensor:
    """A tensor of probabilities in [0, 1] (a detector's P(target) per point), 1-D unless ``one_dim`` is False."""
    if not torch.is_tensor(s):
        raise TypeError(f"{name} must be a torch.Tensor of probabilities, got {type(s).__name__}")
    if one_dim and s.dim() != 1:
        raise ValueError(f"{name} must be 1-D (one probability per point), got shape {tuple(s.shape)}")
    if s.is_complex():
        raise TypeError(f"{name} must be a real tensor of probabilities, got {s.dtype}")
    if s.numel() and (not torch.isfinite(s).all() or (s < 0).any() or (s > 1).any()):
        raise ValueError(f"{name} must hold probabilities in [0, 1] (P(target) per point), got values in "
                         f"[{float(s.min())}, {float(s.max())}]")
    return s


def check_critic_outputs(d, name: str) -> torch.Tensor:
    """Floating critic outputs of shape (B,) or (B, 1), B >= 1, returned as (B,)."""
    if not torch.is_tensor(d):
        raise TypeError(f"{name} must be a torch.Tensor of critic outputs, got {type(d).__name__}")
    if d.dim() == 2 and d.shape[1] == 1:
        d = d[:, 0]
    if d.dim() != 1 or d.shape[0] == 0:
        raise ValueError(f"{name} must have shape (B,) or (B, 1) with B >= 1, got {tuple(d.shape)}")
    if not d.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {d.dtype}")
    return d


def check_points_or_images(t, name: str, shape: Optional[Tuple[int, ...]] = None) -> torch.Tensor:
    """(N, D) points or (N, C, H, W) images, finite floats (the detector's inputs); with ``shape`` (the fitted
    per-point shape) also accept (N, prod(shape)) flattened images and return them reshaped."""
    if not torch.is_tensor(t):
        raise TypeError(f"{name} must be a torch.Tensor of shape (num_points, dim) or (num_images, C, H, W), "
                        f"got {type(t).__name__}")
    if t.dim() not in (2, 4):
        raise ValueError(f"{name} must be 2-D (num_points, dim) or 4-D (num_images, C, H, W), got shape "
                         f"{tuple(t.shape)}")
    if t.shape[0] == 0 or t[0].numel() == 0:
        raise ValueError(f"{name} must hold at least one point of dimension >= 1, got shape {tuple(t.shape)}")
    if not t.dtype.is_floating_point:
        raise ValueError(f"{name} must have a floating dtype, got {t.dtype}")
    if shape is not None and tuple(t.shape[1:]) != tuple(shape):
        if len(shape) == 3 and t.dim() == 2 and t.shape[1] == math.prod(shape):
            t = t.reshape((t.shape[0],) + tuple(shape))
        else:
            raise ValueError(f"{name} has dimension {tuple(t.shape[1:])} per point but the detector was fitted "
                             f"on dimension {tuple(shape)}" + (" (flattened images are accepted too)"
                                                               if len(shape) == 3 else ""))
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} contains NaN or inf values")
    return t
