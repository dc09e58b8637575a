"""Triton kernel figures for one GPU: half-precision points and the small-d soft-min against the exp2 limit of
the card (these two sections in under 3 minutes on an H100), and the small-d weighted mean's two kernels (its
first call at each (d, p) autotunes the default kernel).

1. ``loss``: balanced Sinkhorn loss + gradient (``sinkhorn``, p = 2, d = 64, n = m = 50k, blur 0.1 on
   points of scale ~1, GeomLoss's fixed schedule ``tol=None``: every run takes the same passes) with the
   same points as bfloat16 and as float32 (the points are bfloat16 values, so both runs see the same
   problem and differ only in the kernels: half tiles vs float32 ones, at each float32 dot precision
   "ieee", "tf32x3", "tf32"), against a float64 run on the same points: relative error of the value as
   returned (input dtype: bfloat16's unit roundoff is 2^-8 = 3.9e-3), of the dual value <a, f> + <b, g> recomputed in
   float64 from the float32 potentials (the kernels' own error), of the gradient (relative to its largest
   entry), and the median time of loss + gradient over interleaved repetitions.
2. ``softmin_small_d``: the float32 soft-min at d = 2, n = m = 100k, p = 1 and 2 (autotuned launches):
   pairs per second, and their fraction of the exp2 limit SMs x 16 exp2 per clock per SM x SM clock (the
   MUFU throughput of compute capability 8.x / 9.0, CUDA C++ Programming Guide, arithmetic instruction
   throughput). One exp2 per pair is the floor of the online log-sum-exp; p = 1 also takes a square root
   per pair (SASS counts: benchmarks/triton_aot_check.py). The clock is the card's maximum SM clock
   (nvidia-smi or pynvml; ``--clock-mhz`` overrides), so the fraction is a lower bound when the card runs
   below it; the SM clock read after the runs is reported too.
3. ``wmean_small_d``: the float32 weighted mean of the gradient's pass (``phi="grad"``: the unit direction at
   p = 1, x - mean y at p = 2) at d = 2 and 3, n = m = 100k, p = 1 and 2:
   the default small-d kernel (autotuned) against ``trans=True`` (the block-sparse kernel's tile step: a
   thread per row, one accumulator per coordinate) at a few tiles, with the soft-min of the same size beside
   them; seconds, pairs per second and the largest difference from the default kernel's output.

Run: ``python benchmarks/gpu_kernels.py --out kernels.json`` on a CUDA machine (``--sections``: a subset of loss,
softmin, wmean; autotuning of the d = 64 launches is off unless ``--autotune``: it would compile every
candidate, minutes). ``--dry-run``: tiny sizes under the Triton CPU interpreter (``TRITON_INTERPRET=1``), to
check that the script runs; its times and fractions mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

EXP2_PER_CLOCK_PER_SM = 16  # MUFU ex2 results per clock per SM, compute capability 8.0 - 9.0


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="JSON file for the results (also printed)")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes under TRITON_INTERPRET=1 on the CPU")
    ap.add_argument("--autotune", action="store_true", help="autotune the d = 64 launches too (slow first call)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions of each loss case (interleaved)")
    ap.add_argument("--clock-mhz", type=float, default=None, help="SM clock for the exp2 limit (default: max)")
    ap.add_argument("--sections", nargs="+", default=["loss", "softmin", "wmean"], choices=["loss", "softmin", "wmean"])
    return ap.parse_args(argv)


ARGS = _args(sys.argv[1:]) if __name__ == "__main__" else None
if ARGS is not None and ARGS.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
if ARGS is not None and not ARGS.autotune:
    os.environ.setdefault("SROT_TRITON_AUTOTUNE", "0")  # the d = 64 solves; the d = 2 launches ask explicitly

import torch  # noqa: E402

from srot_fast import sinkhorn  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _smi(query: str):
    """A number from ``nvidia-smi --query-gpu=QUERY`` for GPU 0, or None."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        res = subprocess.run([exe, f"--query-gpu={query}", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=20)
        return float(res.stdout.strip().splitlines()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def _max_clock_mhz():
    """(MHz, source) of the card's maximum SM clock: nvidia-smi, else pynvml, else (None, reason)."""
    mhz = _smi("clocks.max.sm")
    if mhz:
        return mhz, "nvidia-smi clocks.max.sm"
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return float(pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)), "pynvml max SM clock"
    except Exception as err:  # noqa: BLE001 - no clock source is a reported result
        return None, f"no clock source ({type(err).__name__})"


def environment(device) -> dict:
    import triton

    env = dict(torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
               device=str(device), dry_run=device.type != "cuda",
               autotune_d64=os.environ.get("SROT_TRITON_AUTOTUNE", "1") != "0")
    if device.type == "cuda":
        prop = torch.cuda.get_device_properties(device)
        env.update(name=prop.name, sm_count=prop.multi_processor_count,
                   capability=".".join(map(str, torch.cuda.get_device_capability(device))),
                   cuda=torch.version.cuda)
    return env


# ------------------------------------------------------------------------------------------ loss, d = 64
class _Precision:
    """SROT_TRITON_DOT_PRECISION set for a block (the solver reads the launchers' default from it)."""

    def __init__(self, value):
        self.value, self.old = value, None

    def __enter__(self):
        self.old = os.environ.get("SROT_TRITON_DOT_PRECISION")
        if self.value is not None:
            os.environ["SROT_TRITON_DOT_PRECISION"] = self.value

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop("SROT_TRITON_DOT_PRECISION", None)
        else:
            os.environ["SROT_TRITON_DOT_PRECISION"] = self.old


def _loss_grad(x, y, blur, precision):
    """One loss + gradient: (value as returned, dual value from the potentials in float64, gradient, passes)."""
    xg = x.detach().clone().requires_grad_()
    with _Precision(precision):
        res = sinkhorn(xg, y, p=2, eps=blur**2, tol=None, backend="triton")
        (grad,) = torch.autograd.grad(res.value, xg)
    dual = float(res.f.double().mean() + res.g.double().mean())  # <a, f> + <b, g>, uniform weights
    return float(res.value.detach()), dual, grad, res.passes


def section_loss(device, n: int, d: int, reps: int) -> dict:
    """bfloat16 vs float32 points (same values) against float64: errors and median times."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(n, d, generator=gen) / d**0.5).bfloat16().to(device)  # |x - y|^2 ~ 2: costs ~ 1
    y = (torch.randn(n, d, generator=gen) / d**0.5 + 0.1).bfloat16().to(device)
    blur = 0.1
    cases = {"bfloat16": (torch.bfloat16, None), "float32_ieee": (torch.float32, "ieee"),
             "float32_tf32x3": (torch.float32, "tf32x3"), "float32_tf32": (torch.float32, "tf32")}
    t0 = time.perf_counter()
    v64, dual64, g64, passes64 = _loss_grad(x.double(), y.double(), blur, None)
    out = dict(n=n, m=n, d=d, p=2, blur=blur, schedule="tol=None (fixed)", float64=dict(
        value=v64, dual=dual64, passes=passes64, seconds_incl_compile=time.perf_counter() - t0), cases={})
    first = {}
    for name, (dtype, prec) in cases.items():  # first call: compiles (and tunes with --autotune)
        t0 = time.perf_counter()
        value, dual, grad, passes = _loss_grad(x.to(dtype), y.to(dtype), blur, prec)
        _sync(device)
        first[name] = time.perf_counter() - t0
        out["cases"][name] = dict(
            dtype=str(dtype).replace("torch.", ""), precision=prec or "half points: x.y in tf32 (exact)",
            passes=passes, value=value, value_rel_err=abs(value - v64) / abs(v64),
            dual_rel_err=abs(dual - dual64) / abs(dual64),
            grad_rel_err=float((grad.double() - g64).abs().max() / g64.abs().max()),
            grad_dtype=str(grad.dtype).replace("torch.", ""), seconds_first_call=first[name])
    times = {name: [] for name in cases}
    for _ in range(reps):  # interleaved, so drifts of clock or load hit every case alike
        for name, (dtype, prec) in cases.items():
            xc, yc = x.to(dtype), y.to(dtype)
            _sync(device)
            t0 = time.perf_counter()
            _loss_grad(xc, yc, blur, prec)
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    for name in cases:
        out["cases"][name].update(seconds=statistics.median(times[name]), seconds_all=times[name])
    base = out["cases"]["float32_ieee"]["seconds"]
    for name in cases:
        out["cases"][name]["speedup_vs_float32_ieee"] = base / out["cases"][name]["seconds"]
    return out


# --------------------------------------------------------------------------------- soft-min, d = 2
def _timed(fn, device, reps: int):
    """(seconds of max(reps, 5) calls after a first one, seconds of the first call, last output)."""
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    first = time.perf_counter() - t0
    times = []
    for _ in range(max(reps, 5)):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times, first, out


def section_softmin(device, n: int, reps: int, clock_mhz) -> dict:
    """Autotuned float32 small-d soft-min at d = 2: pairs / s and the fraction of the exp2 limit."""
    from srot_fast.kernels import triton_softmin as tri

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 2, generator=gen).to(device)
    y = (torch.randn(n, 2, generator=gen) + 0.5).to(device)
    h = torch.full((n,), -torch.log(torch.tensor(float(n))).item(), device=device)
    out = dict(n=n, m=n, d=2, dtype="float32", cases={})
    limit = None
    if device.type == "cuda":
        if clock_mhz is None:
            clock_mhz, source = _max_clock_mhz()
        else:
            source = "--clock-mhz"
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if clock_mhz:
            limit = sms * EXP2_PER_CLOCK_PER_SM * clock_mhz * 1e6
        out.update(sm_count=sms, clock_mhz=clock_mhz, clock_source=source, exp2_per_clock_per_sm=EXP2_PER_CLOCK_PER_SM,
                   exp2_limit_per_s=limit)
    for p in (1, 2):
        eps = 0.05 if p == 1 else 0.05**2
        # the first call tunes (once per key)
        times, first, _ = _timed(lambda eps=eps, p=p: tri.softmin_fwd(x, y, h, eps, p, autotune=device.type == "cuda"),
                                 device, reps)
        sec = statistics.median(times)
        rate = n * n / sec
        out["cases"][f"p{p}"] = dict(seconds=sec, seconds_all=times, seconds_first_call=first, pairs_per_s=rate,
                                     fraction_of_exp2_limit=None if limit is None else rate / limit)
    if device.type == "cuda":
        out["tuned_configs"] = tri.tuned_configs()
        out["sm_clock_mhz_after"] = _smi("clocks.sm")
    return out


WMEAN_TILES = ({}, dict(block_n=128, block_m=64, num_warps=4), dict(block_n=64, block_m=32, num_warps=2),
               dict(block_n=128, block_m=32, num_warps=4))  # trans=True tiles; {} is its default (64 x 64, 2 warps)


def _wmean_case(tri, device, x, y, h, p: int, reps: int) -> dict:
    """One (d, p) case of :func:`section_wmean`."""
    tune = device.type == "cuda"
    n, eps = x.shape[0], 0.05 if p == 1 else 0.05**2
    case = {}
    times, _, _ = _timed(lambda: tri.softmin_fwd(x, y, h, eps, p, autotune=tune), device, reps)
    sec = statistics.median(times)
    case["softmin"] = dict(seconds=sec, pairs_per_s=n * n / sec)
    times, first, base = _timed(lambda: tri.weighted_mean_fwd(x, y, h, eps, p, "grad", autotune=tune), device,
                                reps)
    sec = statistics.median(times)
    case["default"] = dict(seconds=sec, seconds_first_call=first, pairs_per_s=n * n / sec)
    for kw in WMEAN_TILES:
        times, first, got = _timed(lambda kw=kw: tri.weighted_mean_fwd(x, y, h, eps, p, "grad", trans=True, **kw),
                                   device, reps)
        sec = statistics.median(times)
        name = "trans " + (",".join(f"{k}={v}" for k, v in kw.items()) or "default")
        case[name] = dict(seconds=sec, seconds_first_call=first, pairs_per_s=n * n / sec,
                          speedup_over_default=case["default"]["seconds"] / sec,
                          max_abs_diff_from_default=float((got - base).abs().max()))
    return case


def section_wmean(device, n: int, reps: int) -> dict:
    """float32 small-d weighted mean: the default kernel (autotuned on a GPU) against ``trans=True`` tiles."""
    from srot_fast.kernels import triton_softmin as tri

    out = dict(n=n, m=n, dtype="float32", phi="grad", cases={})
    for d in (2, 3):
        gen = torch.Generator().manual_seed(2)
        x = torch.randn(n, d, generator=gen).to(device)
        y = (torch.randn(n, d, generator=gen) + 0.5).to(device)
        h = torch.full((n,), -torch.log(torch.tensor(float(n))).item(), device=device)
        for p in (1, 2):
            case = out["cases"][f"d{d}_p{p}"] = _wmean_case(tri, device, x, y, h, p, reps)
            print(f"  d = {d}, p = {p}: " + ", ".join(f"{k} {v['seconds'] * 1e3:.2f} ms" for k, v in case.items()),
                  file=sys.stderr, flush=True)
    return out


def main(args) -> dict:
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --dry-run to check the script on the CPU")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # torch's own matmuls (none in the timed path) in fp32
    t0 = time.perf_counter()
    n_loss, d_loss, n_soft = (96, 64, 200) if args.dry_run else (50_000, 64, 100_000)
    reps = 1 if args.dry_run else args.reps
    res = dict(environment=environment(device))
    if "loss" in args.sections:
        print(f"loss + gradient, d = {d_loss}, n = m = {n_loss}", file=sys.stderr, flush=True)
        res["loss"] = section_loss(device, n_loss, d_loss, reps)
    if "softmin" in args.sections:
        print(f"soft-min, d = 2, n = m = {n_soft}", file=sys.stderr, flush=True)
        res["softmin_small_d"] = section_softmin(device, n_soft, reps, args.clock_mhz)
    if "wmean" in args.sections:
        print(f"weighted mean, d = 2 and 3, n = m = {n_soft}", file=sys.stderr, flush=True)
        res["wmean_small_d"] = section_wmean(device, n_soft, reps)
    res["seconds_total"] = time.perf_counter() - t0
    text = json.dumps(res, indent=1, default=str)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return res


if __name__ == "__main__":
    main(ARGS)
