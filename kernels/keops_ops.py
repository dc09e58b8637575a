r"""KeOps backend of the kernel primitives (SPEC §4): pykeops ``LazyTensor`` reductions, O((N + M) * D)
memory on CPU and GPU.

Same functions and signatures as :mod:`srot_fast.kernels.tensorized`:

- ``softmin(x, y, h, eps, p)``             -> (N,)    out_i = -eps * LSE_j[h_j - C(x_i, y_j) / eps]
- ``weighted_mean(x, y, h, eps, p, phi)``  -> (N, D)  sum_j softmax_j(h_j - C_ij / eps) * phi(x_i, y_j)
- ``plan_argmax(x, y, h, eps, p)``         -> (N,)    int64, argmax_j (h_j - C_ij / eps)
- ``max_cost(x, y, p)``                    -> ()      max_ij C(x_i, y_j)

with C = |x - y| (p = 1) or |x - y|^2 / 2 (p = 2).

To keep the number of compiled formulas small (each is a ~5 s build on CPU, cached by KeOps in
``~/.cache/keops*``), ``eps`` and ``p`` are runtime parameters, not constants of the formula: the cost
is written C = c1 * sqrt(S) + c2 * S with S = |x - y|^2 and (c1, c2) = (1, 0) for p = 1, (0, 1/2) for
p = 2, and the two ``phi`` of :func:`weighted_mean` share one formula the same way. There is one formula
per primitive, per dtype and per D. pykeops is imported inside the functions only, so importing this
module is cheap and works without pykeops.

Tested (tests/test_kernels.py) against the torch reference with pykeops 2.3 on CPU only (no GPU here),
37 x 53 points with coincident pairs and ``-inf`` columns, p in {1, 2}: softmin at (D, dtype) in
{(1, f64), (3, f64), (2, f32), (64, f32)} plus tiny / huge eps and log-weights shifted by up to 1e6;
weighted_mean (both phi), plan_argmax and max_cost at D = 3, float64 only (a small set of formulas
keeps the cold-cache test time down).

Caution:
    - ``-inf`` entries of ``h`` are replaced by a huge finite negative number (KeOps's streaming
      log-sum-exp returns NaN when a row's first term is ``-inf``); rows whose every ``h`` is ``-inf``
      give ``+inf`` in :func:`softmin` and an unspecified value in the other primitives.
    - Outputs are differentiable through KeOps's autograd, but the package uses the envelope theorem.
    - The p = 1 direction uses KeOps's ``Rsqrt``, which is 0 at 0, so it is 0 at coincident points.
    - float32 argmax indices are returned by KeOps as floats: exact for M < 2**24.
    - CUDA: before the first CUDA reduction of a process, one tiny CUDA formula is compiled and run in a
      child process (:func:`check_cuda`), because pykeops 2.3 died with a segmentation fault at its first
      CUDA formula on an H200 image with CUDA 13 (benchmarks/README.md "GPU"), killing the caller. A crash
      there becomes a ``RuntimeError`` here (raised again on later calls); success is remembered per
      (pykeops, CUDA, driver, GPU, nvrtc) in the cache folder. ``SROT_KEOPS_CUDA_PROBE=0`` skips the probe.
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
    check_operands(x, y, h, p)
    if x.is_cuda:
        check_cuda(x.device)


def _params(x, *values):
    """(k,) parameter vector on x's device and dtype (a KeOps 'Pm' variable, not a formula constant)."""
    return torch.tensor(values, dtype=x.dtype, device=x.device)


def _finite_h(h):
    """-inf -> a huge finite negative value (exp underflows to exactly 0 against any real term)."""
    big = -1e30 if h.dtype == torch.float32 else -1e300
    return torch.where(torch.isneginf(h), torch.full_like(h, big), h)


def _vars(x, y, h, eps, p):
    """Lazy (S, C, logits) for the (N, M) problem; S = |x - y|^2."""
    LazyTensor = _lazy()
    x_i = LazyTensor(x.contiguous()[:, None, :])
    y_j = LazyTensor(y.contiguous()[None, :, :])
    s_ij = ((x_i - y_j) ** 2).sum(-1)
    if h is None:
        return x_i, y_j, s_ij, None
    c1, c2 = (1.0, 0.0) if p == 1 else (0.0, 0.5)
    prm = LazyTensor(_params(x, c1, c2, 1.0 / eps))  # (3,) runtime parameters
    h_j = LazyTensor(_finite_h(h).contiguous()[None, :, None])
    c_ij = prm[0] * s_ij.sqrt() + prm[1] * s_ij
    return x_i, y_j, s_ij, h_j - c_ij * prm[2]


def softmin(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int) -> torch.Tensor:
    r"""(N,) soft-min ``out_i = -eps * log sum_j exp(h_j - C(x_i, y_j) / eps)``; ``+inf`` if all ``h = -inf``.

    Example:
        >>> x, y, h = torch.randn(1000, 2), torch.randn(800, 2), torch.zeros(800)
        >>> softmin(x, y, h, 0.01, 2).shape  # doctest: +SKIP
        torch.Size([1000])
    """
    _check(x, y, h, p)
    _, _, _, logits = _vars(x, y, h, eps, p)
    out = -eps * logits.logsumexp(dim=1).view(-1)
    return torch.where(torch.isneginf(h).all(), torch.full_like(out, float("inf")), out)


def weighted_mean(
    x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int, phi: str = "y"
) -> torch.Tensor:
    r"""(N, D) mean of phi(x_i, y_j) under w_ij = softmax_j(h_j - C_ij / eps).

    ``phi="y"``: y_j. ``phi="grad"``: (x_i - y_j) / |x_i - y_j| for p = 1 (0 where x_i = y_j),
    x_i - y_j for p = 2 (computed as x_i - mean of y_j).
    """
    _check(x, y, h, p)
    if phi not in ("y", "grad"):
        raise ValueError(f"phi must be 'y' or 'grad', got {phi!r}")
    LazyTensor = _lazy()
    x_i, y_j, s_ij, logits = _vars(x, y, h, eps, p)
    unit = phi == "grad" and p == 1
    sel = LazyTensor(_params(x, 0.0 if unit else 1.0, 1.0 if unit else 0.0))  # one formula for both phi
    v_ij = sel[0] * y_j + sel[1] * ((x_i - y_j) * s_ij.rsqrt())  # KeOps: rsqrt(0) = 0
    out = logits.sumsoftmaxweight(v_ij, dim=1)
    if phi == "grad" and p == 2:
        out = x - out
    return out


def plan_argmax(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, p: int) -> torch.Tensor:
    """(N,) int64 index of the largest plan entry per row, argmax_j (h_j - C_ij / eps)."""
    _check(x, y, h, p)
    _, _, _, logits = _vars(x, y, h, eps, p)
    return logits.argmax(dim=1).view(-1).long()


def max_cost(x: torch.Tensor, y: torch.Tensor, p: int) -> torch.Tensor:
    """() largest ground cost max_ij C(x_i, y_j) (0-dim tensor of x's dtype)."""
    _check(x, y, None, p)
    _, _, s_ij, _ = _vars(x, y, None, 1.0, p)
    s = s_ij.max(dim=1).max()
    return s.clamp_min(0).sqrt() if p == 1 else s / 2
