r"""KeOps backend of the kernel primitives (docs/DESIGN.md, "Kernel primitive"): pykeops ``LazyTensor``
reductions, O((N + M) * D) memory on CPU and GPU.

Same functions and signatures as :mod:`srot_fast.kernels.tensorized`:

- ``softmin(x, y, h, eps, p)``             -> (N,)    out_i = -eps * LSE_j[h_j - C(x_i, y_j) / eps]
- ``weighted_mean(x, y, h, eps, p, phi)``  -> (N, D)  sum_j softmax_j(h_j - C_ij / eps) * phi(x_i, y_j)
- ``plan_argmax(x, y, h, eps, p)``         -> (N,)    int64, argmax_j (h_j - C_ij / eps)
- ``max_cost(x, y, p)``                    -> ()      max_ij C(x_i, y_j)

with C = |x - y| (p = 1) or |x - y|^2 / 2 (p = 2). Batches: x (B, N, D), y (B, M, D), h (B, M) with one
``eps`` give (B, N), (B, N, D), (B, N), (B,) by one reduction with a KeOps batch dimension (x_i
(B, N, 1, D), y_j (B, 1, M, D), h_j (B, 1, M, 1)); B = 0 returns empty outputs without calling KeOps.
float32 and float64 are computed as given; float16 / bfloat16 inputs are upcast to float32 copies and the
results returned in float32 (the solver upcasts the points once for this backend; only the Triton backend
reads half points as they are).

To keep the number of compiled formulas small (each is a build of several seconds on CPU, cached by
KeOps in ``~/.cache/keops*``), ``eps`` and ``p`` are runtime parameters, not constants of the formula: the
cost is written C = c1 * sqrt(S) + c2 * S with S = |x - y|^2 and (c1, c2) = (1, 0) for p = 1, (0, 1/2) for
p = 2, and the two ``phi`` of :func:`weighted_mean` share one formula the same way. There is one formula
per primitive, dtype, D and batched / unbatched call. pykeops is imported inside the functions only, so
importing this module is cheap and works without pykeops.

Caution:
    - ``-inf`` entries of ``h`` are replaced by a huge finite negative number (KeOps's streaming
      log-sum-exp returns NaN when a row's first term is ``-inf``); rows whose every ``h`` is ``-inf``
      give ``+inf`` in :func:`softmin` and an unspecified value in the other primitives.
    - Outputs are differentiable through KeOps's autograd, but the package uses the envelope theorem.
    - The p = 1 direction uses KeOps's ``Rsqrt``, which is 0 at 0, so it is 0 at coincident points.
    - float32 argmax indices are returned by KeOps as floats: exact for M < 2**24.
    - CUDA: before the first CUDA reduction of a process, one tiny CUDA formula is compiled and run in a
      child process (:func:`check_cuda`), because pykeops 2.3 has died with a segmentation fault at its
      first CUDA formula on a CUDA 13 image, killing the caller. A crash there becomes a ``RuntimeError``
      here (raised again on later calls); success is remembered per (pykeops, CUDA, driver, GPU, nvrtc) in
      the cache folder. ``SROT_KEOPS_CUDA_PROBE=0`` skips the probe.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import torch

from ._common import cache_dir, check_operands

__all__ = ["available", "check_cuda", "softmin", "weighted_mean", "plan_argmax", "max_cost"]

_available = None
_cuda_checked: set = set()  # CUDA device indices whose probe succeeded in this process
_cuda_failed: dict = {}  # device index -> the RuntimeError of its failed probe (raised again, not re-probed)
# one small CUDA reduction on the device given as argv[1], run in a child process by check_cuda()
_CUDA_PROBE = """
import sys, torch
from pykeops.torch import LazyTensor
dev = torch.device("cuda", int(sys.argv[1]))
x = LazyTensor(torch.rand(64, 1, 3, device=dev))
y = LazyTensor(torch.rand(1, 48, 3, device=dev))
assert torch.isfinite((-((x - y) ** 2).sum(2)).exp().sum(1)).all()
"""


def available() -> bool:
    """True when pykeops imports (compilation problems only show at the first call)."""
    global _available
    if _available is None:
        try:
            import pykeops.torch  # noqa: F401
        except ImportError:
            _available = False
        else:
            _available = True
    return _available


def _lazy():
    try:
        from pykeops.torch import LazyTensor
    except ImportError as e:
        raise ImportError("backend 'keops' needs pykeops: pip install 'srot_fast[keops]'") from e
    return LazyTensor


def _probe_key(index: int) -> str:
    """What the probe's verdict depends on: pykeops / keopscore versions, torch's CUDA and the driver
    version, the GPU's name and compute capability, and the nvrtc library KeOps would load."""
    import ctypes.util
    import importlib.metadata

    versions = []
    for dist in ("pykeops", "keopscore"):
        try:
            versions.append(importlib.metadata.version(dist))
        except importlib.metadata.PackageNotFoundError:
            versions.append("-")
    props = torch.cuda.get_device_properties(index)
    driver = getattr(torch._C, "_cuda_getDriverVersion", lambda: "?")()
    key = "|".join(map(str, (*versions, torch.version.cuda, driver, props.name, props.major, props.minor,
                             ctypes.util.find_library("nvrtc"))))
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def check_cuda(device=None, timeout: float = 900.0) -> None:
    """Compile and run one small KeOps CUDA formula on ``device`` in a child process, once per process and
    device. ``RuntimeError`` if it crashes, fails or does not finish within ``timeout`` seconds (a
    segmentation fault in KeOps's CUDA compiler would otherwise kill this process); a failure is raised
    again on later calls without a new probe. Success is remembered in the cache folder per (pykeops,
    CUDA, driver, GPU, nvrtc). ``SROT_KEOPS_CUDA_PROBE=0`` skips it."""
    if os.environ.get("SROT_KEOPS_CUDA_PROBE", "1") == "0":
        return
    index = torch.device(device if device is not None else "cuda").index
    index = torch.cuda.current_device() if index is None else index
    if index in _cuda_checked:
        return
    if index in _cuda_failed:
        raise _cuda_failed[index]
    marker = cache_dir() / f"keops_cuda_ok_{_probe_key(index)}"
    if marker.exists():
        _cuda_checked.add(index)
        return
    try:
        res = subprocess.run([sys.executable, "-c", _CUDA_PROBE, str(index)], capture_output=True, text=True,
                             timeout=timeout)
        rc, tail = res.returncode, (res.stdout + res.stderr)[-1500:]
        what = "a segmentation fault" if rc == -11 else f"exit status {rc}"
    except subprocess.TimeoutExpired:
        rc, tail, what = None, "", f"no result within {timeout:.0f} s"
    if rc != 0:
        _cuda_failed[index] = RuntimeError(
            f"backend='keops' cannot run on cuda:{index}: a one-formula KeOps CUDA probe ended with {what} "
            "(seen with pykeops 2.3 on CUDA 13, inside KeOps's nvrtc compile). Use backend='triton' "
            f"(pip install 'srot_fast[triton]') or 'tensorized'. Probe output:\n{tail}")
        raise _cuda_failed[index]
    _cuda_checked.add(index)
    try:  # a read-only cache folder only costs a probe per process
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:
        pass


def _check(x, y, h=None, p=1):
    """Argument checks; returns whether the operands are batched (see _common.check_operands)."""
    batched = check_operands(x, y, h, p, allow_batch=True) is not None
    if x.is_cuda:
        check_cuda(x.device)
    return batched


_LOW = (torch.float16, torch.bfloat16)  # computed in float32


def _upcast(*ts):
    """float16 / bfloat16 tensors -> float32 (None and other dtypes unchanged)."""
    return tuple(t.float() if t is not None and t.dtype in _LOW else t for t in ts)


def _params(x, *values):
    """(k,) parameter vector on x's device and dtype (a KeOps 'Pm' variable, not a formula constant)."""
    return torch.tensor(values, dtype=x.dtype, device=x.device)


def _finite_h(h):
    """-inf -> a huge finite negative value (exp underflows to exactly 0 against any real term)."""
    big = -1e30 if h.dtype == torch.float32 else -1e300
    return torch.where(torch.isneginf(h), torch.full_like(h, big), h)


def _vars(x, y, h, eps, p):
    """Lazy (x_i, y_j, S, logits) of the (N, M) problem, or of the (B, N, M) problems with one KeOps batch
    dimension (x_i (B, N, 1, D), y_j (B, 1, M, D), h_j (B, 1, M, 1)); S = |x - y|^2."""
    LazyTensor = _lazy()
    x_i = LazyTensor(x.contiguous()[..., :, None, :])
    y_j = LazyTensor(y.contiguous()[..., None, :, :])
    s_ij = ((x_i - y_j) ** 2).sum(-1)
    if h is None:
        return x_i, y_j, s_ij, None
    c1, c2 = (1.0, 0.0) if p == 1 else (0.0, 0.5)
    prm = LazyTensor(_params(x, c1, c2, 1.0 / eps))  # (3,) runtime parameters, shared by the batch
    h_j = LazyTensor(_finite_h(h).contiguous()[..., None, :, None])
    c_ij = prm[0] * s_ij.sqrt() + prm[1] * s_ij
    return x_i, y_j, s_ij, h_j - c_ij * prm[2]


def _prepare(x, y, h, p):
    """Checked, upcast (float16 / bfloat16 -> float32) operands, the KeOps reduction axis over the columns
    (1, or 2 with a batch dimension) and whether the batch is empty (B = 0: no KeOps call)."""
    x, y, h = _upcast(x, y, h)
    batched = _check(x, y, h, p)
    return x, y, h, 1 + batched, batched and x.shape[0] == 0


def softmin(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int) -> torch.Tensor:
    r"""(N,) or (B, N) soft-min ``out_i = -eps * log sum_j exp(h_j - C(x_i, y_j) / eps)``; ``+inf`` if all
    ``h = -inf``.

    Example:
        >>> x, y, h = torch.randn(1000, 2), torch.randn(800, 2), torch.zeros(800)
        >>> softmin(x, y, h, 0.01, 2).shape  # doctest: +SKIP
        torch.Size([1000])
    """
    x, y, h, axis, empty = _prepare(x, y, h, p)
    if empty:
        return x.new_empty(x.shape[:-1])
    _, _, _, logits = _vars(x, y, h, eps, p)
    out = -eps * logits.logsumexp(dim=axis)[..., 0]
    return torch.where(torch.isneginf(h).all(-1, keepdim=True), torch.full_like(out, float("inf")), out)


def weighted_mean(
    x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int, phi: str = "y"
) -> torch.Tensor:
    r"""(N, D) or (B, N, D) mean of phi(x_i, y_j) under w_ij = softmax_j(h_j - C_ij / eps).

    ``phi="y"``: y_j. ``phi="grad"``: (x_i - y_j) / |x_i - y_j| for p = 1 (0 where x_i = y_j),
    x_i - y_j for p = 2 (computed as x_i - mean of y_j).
    """
    x, y, h, axis, empty = _prepare(x, y, h, p)
    if phi not in ("y", "grad"):
        raise ValueError(f"phi must be 'y' or 'grad', got {phi!r}")
    if empty:
        return x.new_empty(x.shape)
    LazyTensor = _lazy()
    x_i, y_j, s_ij, logits = _vars(x, y, h, eps, p)
    unit = phi == "grad" and p == 1
    sel = LazyTensor(_params(x, 0.0 if unit else 1.0, 1.0 if unit else 0.0))  # one formula for both phi
    v_ij = sel[0] * y_j + sel[1] * ((x_i - y_j) * s_ij.rsqrt())  # KeOps: rsqrt(0) = 0
    out = logits.sumsoftmaxweight(v_ij, dim=axis)
    if phi == "grad" and p == 2:
        out = x - out
    return out


def plan_argmax(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int) -> torch.Tensor:
    """(N,) or (B, N) int64 index of the largest plan entry per row, argmax_j (h_j - C_ij / eps)."""
    x, y, h, axis, empty = _prepare(x, y, h, p)
    if empty:
        return torch.empty(x.shape[:-1], dtype=torch.int64, device=x.device)
    _, _, _, logits = _vars(x, y, h, eps, p)
    return logits.argmax(dim=axis)[..., 0].long()


def max_cost(x: torch.Tensor, y: torch.Tensor, p: int) -> torch.Tensor:
    """() largest ground cost max_ij C(x_i, y_j) (0-dim tensor of x's dtype), or (B,) one per problem."""
    x, y, _, axis, empty = _prepare(x, y, None, p)
    if empty:
        return x.new_empty(0)
    _, _, s_ij, _ = _vars(x, y, None, 1.0, p)
    s = s_ij.max(dim=axis)[..., 0].amax(dim=-1)
    return s.clamp_min(0).sqrt() if p == 1 else s / 2
