"""Block-size autotuning on a GPU: the candidate configurations (``_CFG_DOT``, ``_CFG_SMALL``,
``_CFG_WMEAN_DOT``, ``_CFG_WMEAN_SMALL``), pruning, the CUDA-event timer, the autotuned kernels, the decision
whether a launch is tuned (``_tune``: from ``_TUNE_MIN_PAIRS`` pairs on a GPU; the launchers' ``autotune=False``,
or ``SROT_TRITON_AUTOTUNE=0`` when that is not given, turns it off) and :func:`tuned_configs`. When tuning
happens and what it costs: the "Block sizes" paragraph of :mod:`srot_fast.kernels.triton`."""

from __future__ import annotations

import os

import torch
import triton

from .kernels import _softmin_fwd_kernel, _softmin_small_kernel, _weighted_mean_dot_kernel, _weighted_mean_fwd_kernel
from .options import check_autotune


def _configs(blocks, names=("BLOCK_N", "BLOCK_M", "BLOCK_K")):
    """triton.Config list from (block sizes..., num_warps, num_stages) tuples."""
    return [triton.Config(dict(zip(names, b[:-2])), num_warps=b[-2], num_stages=b[-1]) for b in blocks]


# Candidates benchmarked on the first large call per (kernel, D, P, path, phi, precision, dtype, size bucket)
# on a GPU.
# (BLOCK_N, BLOCK_M, BLOCK_K, num_warps, num_stages); BLOCK_K is unused on the small-d path.
_CFG_DOT = _configs([
    (64, 64, 32, 4, 2), (64, 64, 32, 4, 3), (128, 64, 32, 8, 3), (128, 64, 32, 4, 3), (64, 128, 32, 4, 3),
    (64, 128, 32, 8, 3), (128, 128, 32, 8, 3), (128, 128, 32, 8, 2), (128, 64, 16, 8, 3), (64, 64, 16, 4, 3),
    (128, 32, 32, 4, 3), (64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (64, 128, 32, 4, 4),
    # 8-warp tiles with 16-coordinate steps (0-16 B of register spill for sm_90 at D = 64 with "ieee")
    (64, 128, 16, 8, 3), (128, 128, 16, 8, 3), (64, 256, 16, 8, 3),
])
# small-d softmin: (BLOCK_N, BLOCK_M, TRANS, num_warps, num_stages)
_CFG_SMALL = _configs([
    (32, 64, False, 4, 1), (64, 64, False, 4, 1), (64, 128, False, 4, 1), (128, 64, False, 4, 1),
    (128, 128, False, 8, 1), (64, 256, False, 8, 1), (32, 128, False, 4, 1),
    (128, 32, True, 4, 1), (128, 64, True, 4, 1), (256, 32, True, 8, 1), (256, 64, True, 8, 1),
    (128, 16, True, 4, 1), (512, 32, True, 8, 1),
], names=("BLOCK_N", "BLOCK_M", "TRANS"))
# weighted means: (BLOCK_N, BLOCK_M, num_warps, num_stages)
_CFG_WMEAN_DOT = _configs([  # the 8-warp and 32-row ones compile without register spills for sm_90 at D = 64
    (64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 3), (32, 64, 4, 3), (64, 32, 8, 2), (32, 64, 8, 2),
    (32, 32, 4, 2), (32, 32, 4, 3),
], names=("BLOCK_N", "BLOCK_M"))
_CFG_WMEAN_SMALL = _configs([
    (16, 32, 4, 1), (32, 64, 4, 1), (64, 64, 4, 1), (64, 128, 8, 1), (128, 64, 8, 1), (32, 128, 4, 1),
], names=("BLOCK_N", "BLOCK_M"))
_TUNE_MIN_PAIRS = 1 << 26  # N * M from which a launch is tuned (~67M pairs, e.g. 8192^2); fixed blocks below


def _prune_register_tiles(configs, named_args, **kwargs):
    """Small-d weighted mean: drop configs whose (BLOCK_N, BLOCK_M, BLOCK_D) broadcast exceeds 16k values."""
    bd = kwargs.get("BLOCK_D", named_args.get("BLOCK_D", 1))
    keep = [c for c in configs if c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_M"] * bd <= 16384]
    return keep or configs[:1]


def _bench(fn, quantiles=None):
    """Autotuner timing: one call (compile, warm-up), then the median / min / max of 3 timed calls (ms).
    Not triton.testing.do_bench: it allocates a 256 MB buffer to flush the L2 cache, which would break
    the O(N + M) memory promise on the first call."""
    fn()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return [times[1], times[0], times[2]] if quantiles else times[1]


def _autotune(kernel, configs, key, prune=None):
    kw = dict(configs=configs, key=key, do_bench=_bench)
    if prune is not None:
        kw["prune_configs_by"] = {"early_config_prune": prune}
    return triton.autotune(**kw)(kernel)


_TUNED = {
    "softmin_dot": _autotune(_softmin_fwd_kernel, _CFG_DOT, ["D", "P", "DOT", "PREC", "SIZE_KEY"]),
    "softmin_small": _autotune(_softmin_small_kernel, _CFG_SMALL, ["D", "P", "SIZE_KEY"]),
    "wmean_dot": _autotune(_weighted_mean_dot_kernel, _CFG_WMEAN_DOT, ["D", "P", "UNIT", "PREC", "SIZE_KEY"]),
    "wmean_small": _autotune(_weighted_mean_fwd_kernel, _CFG_WMEAN_SMALL, ["D", "P", "UNIT", "SIZE_KEY"],
                             prune=_prune_register_tiles),
}


def _autotune_flag(autotune) -> bool:
    """``autotune`` (True / False) if given, else the environment: on unless ``SROT_TRITON_AUTOTUNE`` is '0'."""
    if autotune is None:
        return os.environ.get("SROT_TRITON_AUTOTUNE", "1") != "0"
    return check_autotune(autotune)


def _tune(x: torch.Tensor, pairs: int, fixed, autotune=None) -> bool:
    """Autotune this launch? Only on a GPU (not the interpreter), from ``_TUNE_MIN_PAIRS`` pairs (B * N * M),
    when no block size was given and :func:`_autotune_flag` (``autotune``, else ``SROT_TRITON_AUTOTUNE``)
    allows it. ``autotune`` is checked on every call, so a wrong value shows at once."""
    allowed = _autotune_flag(autotune)
    return (allowed and x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1" and pairs >= _TUNE_MIN_PAIRS
            and not any(fixed))


def _size_key(b: int, n: int, m: int) -> int:
    """Autotuning bucket: problems within a factor 2 in each of B, N and M share a tuned config."""
    return (b.bit_length() * 64 + n.bit_length()) * 64 + m.bit_length()


def tuned_configs() -> dict:
    """{kernel: {tuning key: chosen config}} of the launches autotuned so far in this process."""
    return {name: {str(k): str(c) for k, c in kern.cache.items()} for name, kern in _TUNED.items()}

