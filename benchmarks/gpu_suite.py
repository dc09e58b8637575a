"""One script for a CUDA machine: GPU tests, primitive and SROTLoss benchmarks, the
large-d Triton path, flash-sinkhorn, and a 100k-point 2-D gradient flow; one JSON results file.

Sections (``--sections``, comma-separated; all by default), each with its own wall-time budget, each
recorded even when it fails (its traceback goes in the file), the file rewritten after every section so
that a run cut short still leaves what it measured:

- ``env``:        device, driver-visible name, versions (torch, triton, pykeops, geomloss, POT,
                  flash-sinkhorn), date, commit;
- ``tests``:      ``pytest tests -m "gpu or triton or keops"`` (on CUDA the Triton tests compile for the GPU);
- ``primitives``: ``benchmarks/bench_primitives.py`` (softmin pairs/s: triton, keops, raw KeOps, tensorized)
                  on n = m in ``--prim-sizes``;
- ``large_d``:    Triton softmin / weighted_mean with the tl.dot path at d in {64, 3072, 12288} against the
                  dense torch formula (fp32, TF32 disabled), with the max error to a float64 reference;
- ``sinkhorn``:   ``benchmarks/bench_sinkhorn.py`` (SROTLoss soft KL p = 1 loss + gradient vs GeomLoss online /
                  tensorized and POT, equal iterations) on n = m in ``--sinkhorn-sizes``;
- ``flash``:      p = 2, d = 64, n = m = ``--flash-n`` (50k): SROTLoss(backend='triton') loss + gradient vs
                  ``flash_sinkhorn.SamplesLoss`` (same blur, scaling, debias off, half cost, TF32 off; with
                  ``--flash-tf32`` also its TF32 default) at equal soft-min passes (2 L + 4: SROTLoss with
                  ``max_iter = L``; also timed with L + 1), SROTLoss with the tl.dot precision "ieee" and
                  "tf32x3" (the default), forward-only times and one pass of each primitive -- flash-sinkhorn is
                  skipped with the reason when not importable;
- ``flow``:       a 2-D gradient flow of ``--flow-n`` (100k) points for ``--flow-steps`` (400) steps of
                  x <- x - lr * grad / a with SROTLoss(p=2, blur=0.05, debias=False) on ``--flow-backend``
                  ('auto'; 'blocksparse' for the block-sparse passes): GeomLoss's pass budget
                  per step, or with ``--flow-tol`` each step solved to that tolerance (warm-started), with
                  the updates, kernel passes and host syncs per solve; stops at its budget and extrapolates;
- ``keops_diag``: KeOps' health check, the CUDA libraries it can see and a one-formula probe in a subprocess
                  (with a gdb backtrace if it crashes and gdb is there): why KeOps segfaulted on the H200 image.

``--dry-run``: everything on the CPU at tiny sizes (Triton under ``TRITON_INTERPRET=1``, test and benchmark
subsets), to check that the script works end to end without a GPU: ~2-4 minutes on 2 cores.

On a device machine that cannot reach PyPI, flash-sinkhorn is installed from a wheel carried along:
``pip download flash-sinkhorn --no-deps -d benchmarks/wheels`` here, then ``--wheels benchmarks/wheels``.

Run: ``python benchmarks/gpu_suite.py --out benchmarks/out/gpu_suite.json`` (GPU) or
``python benchmarks/gpu_suite.py --dry-run --out benchmarks/out/gpu_suite_dry.json``. With the default budgets
all sections take up to ~18 minutes; to fit 10-minute device calls, run two:
``--sections env,tests,flow,flash`` (~9 min: tests 300 s, flow 120 s, flash ~100 s of which ~50 s are
flash-sinkhorn's own compilation and autotuning) and ``--sections env,large_d,primitives,sinkhorn`` (~8 min).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import glob
import json
import math
import os
import platform
import subprocess
import sys
import sysconfig
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ["env", "tests", "primitives", "large_d", "sinkhorn", "flash", "flow", "keops_diag"]


# ---------------------------------------------------------------------------------------------- helpers
def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _version(dist: str):
    """Installed version of a distribution, without importing it (importing pykeops compiles its engine)."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timeit(fn, *, min_rounds=3, max_rounds=20, target_s=2.0, budget_s=60.0) -> dict:
    """Median wall time of ``fn()`` (synchronised) after one warm-up call (compilation)."""
    t0 = time.perf_counter()
    fn()
    _sync()
    first = time.perf_counter() - t0
    times = []
    start = time.perf_counter()
    while len(times) < max_rounds:
        t = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t)
        spent = time.perf_counter() - start
        if len(times) >= min_rounds and (spent > target_s or spent > budget_s):
            break
        if spent > budget_s:
            break
    times.sort()
    return dict(median_s=times[len(times) // 2], min_s=times[0], rounds=len(times), first_call_s=first)


LOG = {"path": None}  # every subprocess's whole output is appended here (set by main: --logdir)


def _portable(text: str, workdir) -> str:
    """``text`` without this machine's paths: the interpreter becomes ``python``, paths under the repository and
    the work folder become relative, installed packages ``site-packages/...`` (commands, warnings and
    tracebacks are recorded in the results file)."""
    prefixes = ((sys.executable, "python"), (sysconfig.get_paths()["purelib"] + os.sep, "site-packages" + os.sep),
                (str(ROOT) + os.sep, ""), (str(Path(workdir).resolve()) + os.sep, ""))
    for prefix, repl in prefixes:
        text = text.replace(prefix, repl)
    return text


def _run(cmd, env=None, timeout=600) -> dict:
    """Run ``cmd`` in its own process group; at ``timeout`` the whole group (xdist workers too) is killed.
    The whole output is appended to ``LOG['path']``; the result keeps its last 40 lines."""
    import signal

    t = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        rc = "timeout"
    if LOG["path"]:
        with open(LOG["path"], "a") as f:
            f.write(f"\n===== {_now()} rc={rc}: {' '.join(cmd)}\n{out}")
    lines = [ln for ln in out.splitlines() if ln.strip()]
    summary = next((ln for ln in reversed(lines) if " passed" in ln or " failed" in ln or " error" in ln), None)
    return dict(cmd=" ".join(cmd), returncode=rc, seconds=round(time.perf_counter() - t, 1), summary=summary,
                tail="\n".join(lines[-40:]))


def _bench_rows(path: str) -> list:
    """Compact rows from a pytest-benchmark JSON file."""
    with open(path) as f:
        data = json.load(f)
    rows = []
    for b in data.get("benchmarks", []):
        row = dict(name=b["name"], median_s=b["stats"]["median"], rounds=b["stats"]["rounds"])
        row.update({k: v for k, v in b.get("extra_info", {}).items() if not isinstance(v, (list, dict))})
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------- sections
def section_env(args) -> dict:
    import torch

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return dict(
        date=_now(), dry_run=args.dry_run, python=platform.python_version(), platform=platform.platform(),
        cpu=platform.processor() or platform.machine(), cpu_count=os.cpu_count(),
        cuda=torch.cuda.is_available(), device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        cuda_version=torch.version.cuda, torch=torch.__version__,
        **{m: _version(m) for m in ("triton", "pykeops", "geomloss", "pot", "flash-sinkhorn", "srot_fast")},
        commit=commit or None, triton_interpret=os.environ.get("TRITON_INTERPRET"),
    )


def section_tests(args) -> dict:
    """GPU tests and every Triton test (on CUDA tensors against the CPU float64 reference); xdist workers
    when pytest-xdist is there (Triton compiles are CPU-bound). KeOps tests are left out on the GPU (each
    formula is a compile; the KeOps path is exercised by the benchmarks)."""
    cmd = [sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", "-m", "gpu or triton", "-rfE",
           "--tb=short"]
    if args.logdir:
        cmd += [f"--junitxml={Path(args.logdir) / 'tests.xml'}"]
    try:
        import xdist  # noqa: F401

        cmd += ["-n", str(min(16, os.cpu_count() or 1))]
    except ImportError:
        pass
    if args.dry_run:
        cmd = [sys.executable, "-m", "pytest", "tests/test_kernels.py", "-q", "-p", "no:cacheprovider",
               "-m", "gpu or triton", "-k", "dot_path"]
    return _run(cmd, timeout=args.budget_tests)


def _bench(args, file: str, sizes: str, kfilter: str | None, budget: float) -> dict:
    """Three pytest processes: the cases without KeOps, GeomLoss 'online' (KeOps), srot_fast's KeOps backend,
    so that a KeOps crash (seen on an H200: a segfault at the first KeOps case) keeps the rest."""
    if args.dry_run:
        return _bench_once(args, file, sizes, kfilter, budget, Path(file).stem)
    base = f"({kfilter}) and " if kfilter else ""
    stem = Path(file).stem
    res = dict(no_keops=_bench_once(args, file, sizes, base + "not keops and not online", budget / 3, stem),
               geomloss_online=_bench_once(args, file, sizes, base + "online", budget / 3, stem + "_online"),
               keops=_bench_once(args, file, sizes, base + "keops", budget / 3, stem + "_keops"))
    res["rows"] = sum((res[k].pop("rows", []) for k in ("no_keops", "geomloss_online", "keops")), [])
    return res


def _bench_once(args, file: str, sizes: str, kfilter: str | None, budget: float, stem: str) -> dict:
    out = Path(args.workdir) / f"{stem}.json"
    jsonl = Path(args.workdir) / f"{stem}.jsonl"
    jsonl.unlink(missing_ok=True)
    env = dict(os.environ, SROT_BENCH_SIZES=sizes, SROT_BENCH_JSONL=str(jsonl))
    cmd = [sys.executable, "-m", "pytest", file, "-q", "-p", "no:cacheprovider", "--benchmark-only",
           f"--benchmark-json={out}"]
    if kfilter:
        cmd += ["-k", kfilter]
    res = _run(cmd, env=env, timeout=budget)
    if out.exists() and out.stat().st_size > 0:
        res["rows"] = _bench_rows(str(out))
    elif jsonl.exists():  # killed at its budget: the cases that finished
        res["rows"] = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    return res


def section_primitives(args) -> dict:
    # dry run: no KeOps compiles; GPU: raw KeOps stands for the KeOps path (our keops backend is the same
    # LazyTensor reduction, and each formula costs a compile)
    kf = "not keops" if args.dry_run else "triton or keops_raw or tensorized"
    return _bench(args, "benchmarks/bench_primitives.py", args.prim_sizes, kf, args.budget_bench)


def section_sinkhorn(args) -> dict:
    # GPU: srot_fast on its GPU backends and GeomLoss; POT and the offsets overhead are CPU benchmarks
    kf = "not keops and not online" if args.dry_run else "(test_srot and not cpu) or test_geomloss"
    return _bench(args, "benchmarks/bench_sinkhorn.py", args.sinkhorn_sizes, kf, args.budget_bench)


def section_large_d(args) -> dict:
    """Triton tl.dot path at large d vs the dense torch formula (TF32 off), errors vs float64."""
    import torch
    from srot_fast.kernels import tensorized as ref
    from srot_fast.kernels import triton_softmin as tri

    torch.backends.cuda.matmul.allow_tf32 = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n, dims = (64, [64, 300]) if args.dry_run else (args.large_d_n, [64, 3072, 12288])
    rows = []
    g = torch.Generator().manual_seed(0)
    for d in dims:
        x = torch.rand(n, d, generator=g).to(device)  # image-like values in [0, 1]
        y = torch.rand(n, d, generator=g).to(device)
        scale = float(ref.max_cost(x[:256].double(), y[:256].double(), 2))
        eps = 0.05 * scale
        h = torch.full((n,), -math.log(n), device=device)
        exp64 = ref.softmin(x[:256].double(), y.double(), h.double(), eps, 2)
        for name, fn in (("triton", functools.partial(tri.softmin_fwd, x, y, h, eps, 2, precision="ieee")),
                         ("triton_tf32x3", functools.partial(tri.softmin_fwd, x, y, h, eps, 2, precision="tf32x3")),
                         ("tensorized", functools.partial(ref.softmin, x, y, h, eps, 2))):
            row = dict(primitive="softmin", backend=name, n=n, m=n, d=d, p=2)
            try:
                row.update(_timeit(fn, budget_s=args.budget_large_d / 12))
                row["pairs_per_s"] = n * n / row["median_s"]
                row["max_rel_err_vs_f64"] = float(((fn()[:256].double() - exp64).abs() / exp64.abs()).max())
            except Exception as e:  # noqa: BLE001 - OOM etc. is a result
                row["error"] = f"{type(e).__name__}: {e}"[:500]
            rows.append(row)
        r = 64 if d <= 3072 else 8  # rows of the float64 reference: its (r, n, d) difference tensor must fit
        for prec in ("ieee", "tf32x3"):
            row = dict(primitive="weighted_mean_grad", backend="triton" if prec == "ieee" else "triton_tf32x3",
                       n=n, m=n, d=d, p=1)
            try:
                fn = functools.partial(tri.weighted_mean_fwd, x, y, h, eps, 1, "grad", precision=prec)
                row.update(_timeit(fn, budget_s=args.budget_large_d / 12))
                row["pairs_per_s"] = n * n / row["median_s"]
                want = ref.weighted_mean(x[:r].double(), y.double(), h.double(), eps, 1, "grad")
                row["max_abs_err_vs_f64"] = float((fn()[:r].double() - want).abs().max())
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"[:500]
            rows.append(row)
    return dict(rows=rows)


def _install_wheels(args) -> str | None:
    """Offline install of the flash-sinkhorn wheel from ``--wheels`` unless it is importable already."""
    try:
        import flash_sinkhorn  # noqa: F401

        return "already importable"
    except ImportError:
        pass
    if not args.wheels:
        return None
    wheels = sorted(glob.glob(str(Path(args.wheels) / "flash_sinkhorn-*.whl")))
    if not wheels:
        return f"no flash_sinkhorn wheel in {args.wheels}"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", wheels[-1]],
                         capture_output=True, text=True)
    return f"pip install {Path(wheels[-1]).name}: rc={res.returncode}"


def _srot_loss_grad(loss, x0, y):
    import torch

    def run():
        x = x0.clone().requires_grad_()
        value = loss(x, y)
        (grad,) = torch.autograd.grad(value, x)
        return value.detach(), grad

    return run


def section_flash(args) -> dict:
    """p = 2, d = 64: SROTLoss on Triton vs flash-sinkhorn, loss + gradient, same eps schedule."""
    import warnings

    import torch

    from srot_fast.geometry import bbox_diameter
    from srot_fast.loss import SROTLoss
    from srot_fast.sinkhorn import epsilon_schedule

    res = dict(install=_install_wheels(args))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n, d, blur = (256 if args.dry_run else args.flash_n), 64, 0.05
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(n, d, generator=g) / math.sqrt(d)).to(device)
    y = (torch.randn(n, d, generator=g) / math.sqrt(d) + 0.1).to(device)
    diam = bbox_diameter(x, y)
    n_eps = len(epsilon_schedule(2, diam, blur, 0.5))
    backend = "triton" if device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else "cpu"
    if args.dry_run:
        backend = "cpu"  # the interpreter at d = 64 is minutes per solve
    res.update(n=n, d=d, blur=blur, eps_steps=n_eps, srot_backend=backend)
    # max_iter = L (eps-scaling only): 2 L + 4 soft-min passes, flash-sinkhorn's (GeomLoss's) count for its L
    # symmetric updates + last extrapolation; max_iter = L + 1 adds one alternating update (+1 pass).
    # The large-d path's tl.dot precision: "ieee" (fp32 FMA) and "tf32x3" (the default: fp32 from three TF32
    # tensor-core products), both fp32-accurate; the opt-in plain "tf32" is not timed here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for key, iters, prec in (("srot", n_eps, "ieee"), ("srot_tf32x3", n_eps, "tf32x3"),
                                 ("srot_max_iter_L_plus_1", n_eps + 1, "ieee")):
            with _env(SROT_TRITON_DOT_PRECISION=prec):
                loss = SROTLoss(p=2, blur=blur, scaling=0.5, diameter=diam, backend=backend, tol=1e-30,
                                max_iter=iters, debias=False)
                res[key] = _timeit(_srot_loss_grad(loss, x, y), budget_s=args.budget_flash / 6)
                res[key].update(n_iter=loss.last_result.n_iter, precision=prec)
                res[key]["value"] = float(loss(x, y))
                if key != "srot_max_iter_L_plus_1":  # where the time goes: the solve alone, one pass of each
                    res[key]["forward_only"] = _timeit(functools.partial(loss, x, y), budget_s=args.budget_flash / 12)
                    res[key]["passes"] = _pass_times(x, y, blur, backend, prec, args)
    try:
        import flash_sinkhorn
    except Exception as e:  # noqa: BLE001
        res["flash_sinkhorn"] = f"not importable: {type(e).__name__}: {e}"[:300]
        return res
    res["flash_sinkhorn_version"] = getattr(flash_sinkhorn, "__version__", None)
    for tf32 in (False, True) if args.flash_tf32 else (False,):
        key = f"flash_sinkhorn_tf32_{'on' if tf32 else 'off'}"
        try:
            fl = flash_sinkhorn.SamplesLoss("sinkhorn", p=2, blur=blur, scaling=0.5, debias=False, half_cost=True,
                                            diameter=diam, allow_tf32=tf32)
            res[key] = _timeit(_srot_loss_grad(fl, x, y), budget_s=args.budget_flash / 6)
            res[key]["value"] = float(fl(x, y))
            res[key]["forward_only"] = _timeit(functools.partial(fl, x, y), budget_s=args.budget_flash / 12)
        except Exception as e:  # noqa: BLE001
            res[key] = f"{type(e).__name__}: {e}"[:500]
    if isinstance(res.get("flash_sinkhorn_tf32_off"), dict):
        for key in ("srot", "srot_tf32x3"):
            res[f"{key}_over_flash_time_ratio"] = (res[key]["median_s"]
                                                   / res["flash_sinkhorn_tf32_off"]["median_s"])
    res["triton_tuned_configs"] = _tuned_configs()
    return res


class _env:
    """Context manager: set environment variables, restore them on exit."""

    def __init__(self, **kw):
        self.kw, self.old = kw, {}

    def __enter__(self):
        for k, v in self.kw.items():
            self.old[k] = os.environ.get(k)
            os.environ[k] = v

    def __exit__(self, *exc):
        for k, v in self.old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _pass_times(x, y, blur, backend, prec, args) -> dict:
    """Median time of one soft-min pass and one weighted-mean ('grad') pass at the flash problem's size."""
    if backend != "triton":
        return {}
    import torch
    from srot_fast.kernels import triton_softmin as tri

    h = torch.full((y.shape[0],), -math.log(y.shape[0]), device=x.device)
    eps = blur ** 2
    return dict(softmin=_timeit(lambda: tri.softmin_fwd(x, y, h, eps, 2, precision=prec),
                                budget_s=args.budget_flash / 24)["median_s"],
                weighted_mean=_timeit(lambda: tri.weighted_mean_fwd(x, y, h, eps, 2, "grad", precision=prec),
                                      budget_s=args.budget_flash / 24)["median_s"])


def _tuned_configs():
    """The Triton launch configurations the autotuner chose so far (empty off GPU)."""
    try:
        from srot_fast.kernels import triton_softmin

        return triton_softmin.tuned_configs()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"[:300]


def section_flow(args) -> dict:
    """x <- x - lr * grad_x L / a_i for ``flow_steps`` steps, SROTLoss(p=2, blur=0.05) on ``--flow-backend``,
    GeomLoss's kernel-pass budget per step (``max_iter = len(eps_list)``: 2 L + 4 soft-min passes as GeomLoss's
    L updates + last extrapolation, then one weighted-mean pass for the gradient), no warm start; with ``--flow-tol``
    each step to that tolerance, warm-started."""
    import warnings

    import torch

    from srot_fast.geometry import bbox_diameter
    from srot_fast.loss import SROTLoss
    from srot_fast.sinkhorn import epsilon_schedule

    device = "cuda" if torch.cuda.is_available() else "cpu"
    n, steps = (1000, 3) if args.dry_run else (args.flow_n, args.flow_steps)
    g = torch.Generator().manual_seed(0)
    theta = 2 * math.pi * torch.rand(n, generator=g)
    y = torch.stack([theta.cos(), theta.sin()], 1) + 0.05 * torch.randn(n, 2, generator=g)  # a ring
    x = 0.3 * torch.randn(n, 2, generator=g)  # a blob
    x, y = x.to(device), y.to(device)
    iters = len(epsilon_schedule(2, bbox_diameter(x, y), 0.05, 0.5))  # 2 L + 4 passes, GeomLoss's count
    if args.flow_tol:  # each step solved to tol, warm-started from the previous step's potentials
        loss = SROTLoss(p=2, blur=0.05, scaling=0.5, backend=args.flow_backend, tol=args.flow_tol, max_iter=2000,
                        debias=False, warm_start=True)
    else:
        loss = SROTLoss(p=2, blur=0.05, scaling=0.5, backend=args.flow_backend, tol=1e-30, max_iter=iters,
                        debias=False)
    lr = 0.05
    times, n_iters, passes, syncs, errors = [], [], [], [], []
    start = time.perf_counter()
    failure = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(steps):
            t = time.perf_counter()
            xg = x.clone().requires_grad_()
            try:
                (grad,) = torch.autograd.grad(loss(xg, y), xg)
            except FloatingPointError as e:  # seen once on an H200 at n = 100k: record where and what
                failure = dict(step=step, error=str(e)[:300], x_finite=bool(torch.isfinite(x).all()),
                               x_abs_max=float(x.abs().max()))
                break
            if step == 0:
                failure_probe = dict(grad_finite=bool(torch.isfinite(grad).all()))
            x = x - lr * n * grad
            _sync()
            times.append(time.perf_counter() - t)
            n_iters.append(loss.last_result.n_iter)
            passes.append(loss.last_result.passes)
            syncs.append(loss.last_result.syncs)
            errors.append(loss.last_result.marginal_error)
            if time.perf_counter() - start > args.budget_flow:
                break
    done = len(times)
    if done == 0:
        return dict(n=n, failure=failure)
    total = sum(times)
    rest = times[1:]  # step 0 includes compilation and autotuning of the kernels
    return dict(failure=failure, first_step=failure_probe, n=n, steps_requested=steps, steps_done=done,
                max_iter=iters, lr=lr, seconds=total, first_step_s=times[0],
                seconds_without_first=sum(rest),
                backend=loss.last_result.backend,
                seconds_per_step_median=sorted(times)[done // 2], n_iter_mean=sum(n_iters) / done,
                tol=args.flow_tol, passes_mean=sum(passes) / done, syncs_mean=sum(syncs) / done,
                syncs_max=max(syncs), marginal_error_max=max(errors), n_iter_max=max(n_iters),
                extrapolated_seconds_for_all_steps=(times[0] + sum(rest) / max(len(rest), 1) * (steps - 1)
                                                    if rest else total * steps),
                final_mean_radius=float(x.norm(dim=1).mean()), triton_tuned_configs=_tuned_configs())


_KEOPS_PROBE = """
import faulthandler, torch, pykeops
faulthandler.enable()
pykeops.check_health()
from pykeops.torch import LazyTensor
x = LazyTensor(torch.rand(100, 1, 3, device="cuda")); y = LazyTensor(torch.rand(1, 100, 3, device="cuda"))
print("keops reduction:", (-((x - y) ** 2).sum(2)).exp().sum(1).sum().item())
"""


def section_keops_diag(args) -> dict:
    """Why KeOps crashes on this GPU (seen on an H200 image with CUDA 13: a segfault in its nvrtc compile):
    KeOps' own health check, the CUDA libraries and headers it can find, a one-formula probe in a
    subprocess, and a native backtrace under gdb when gdb is there. Output in subprocess.log."""
    import shutil

    res = dict(libs=_run(["bash", "-c", "ldconfig -p | grep -E 'nvrtc|libcuda.so|cudart'; ls -d /usr/local/cuda* "
                                        "2>&1; python3 -m pip list 2>/dev/null | grep -i -E 'nvidia|cuda'"],
                         timeout=30))
    res["probe"] = _run([sys.executable, "-c", _KEOPS_PROBE], timeout=args.budget_keops)
    if res["probe"].get("returncode") != 0 and shutil.which("gdb"):
        res["gdb"] = _run(["gdb", "-batch", "-ex", "run", "-ex", "bt 25", "--args", sys.executable, "-c",
                           _KEOPS_PROBE], timeout=args.budget_keops)
    return res


# ------------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default_out = Path(os.environ.get("OUT") or ROOT / "benchmarks" / "out") / "gpu_suite.json"
    ap.add_argument("--out", default=str(default_out), help="results file (default: $OUT/gpu_suite.json if set)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, TRITON_INTERPRET=1: checks the script")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--prim-sizes", default="1024,4096,16384,65536")
    ap.add_argument("--sinkhorn-sizes", default="4096,16384,50000")
    ap.add_argument("--large-d-n", type=int, default=8192)
    ap.add_argument("--flash-n", type=int, default=50000)
    ap.add_argument("--flow-n", type=int, default=100000)
    ap.add_argument("--flow-steps", type=int, default=400)
    ap.add_argument("--flow-tol", type=float, default=None, help="solve each flow step to this tolerance")
    ap.add_argument("--flow-backend", default="auto", help="backend of the flow's solves (e.g. 'blocksparse')")
    ap.add_argument("--flash-tf32", action="store_true", help="also time flash-sinkhorn with its TF32 default")
    ap.add_argument("--wheels", default=None, help="folder with a flash_sinkhorn wheel to pip install (offline)")
    ap.add_argument("--logdir", default=None, help="subprocess output and the tests' JUnit XML (default: beside --out)")
    ap.add_argument("--workdir", default=None, help="where the pytest-benchmark JSON files go (default: next to --out)")
    ap.add_argument("--budget-tests", type=float, default=300)
    ap.add_argument("--budget-bench", type=float, default=200, help="per benchmark file (pytest is killed after)")
    ap.add_argument("--budget-large-d", type=float, default=60)
    ap.add_argument("--budget-flash", type=float, default=90)
    ap.add_argument("--budget-flow", type=float, default=120)
    ap.add_argument("--budget-keops", type=float, default=60, help="per KeOps probe process")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any import of triton
        args.prim_sizes, args.sinkhorn_sizes = "256", "256"
        args.budget_tests = args.budget_bench = min(args.budget_bench, 300)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    args.workdir = args.workdir or str(out.parent)
    args.logdir = args.logdir or str(out.parent)
    Path(args.logdir).mkdir(parents=True, exist_ok=True)
    LOG["path"] = str(Path(args.logdir) / "subprocess.log")
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    results = dict(suite="srot_fast gpu_suite", started=_now(), sections={})
    funcs = {"env": section_env, "tests": section_tests, "primitives": section_primitives,
             "large_d": section_large_d, "sinkhorn": section_sinkhorn, "flash": section_flash, "flow": section_flow,
             "keops_diag": section_keops_diag}
    for name in [s for s in args.sections.split(",") if s]:
        t = time.perf_counter()
        print(f"[gpu_suite] {name} ...", flush=True)
        try:
            res = funcs[name](args)
        except Exception:  # noqa: BLE001 - record and go on with the next section
            res = dict(error=traceback.format_exc()[-3000:])
        res["section_seconds"] = round(time.perf_counter() - t, 1)
        results["sections"][name] = res
        results["finished"] = _now()
        out.write_text(_portable(json.dumps(results, indent=1, default=str), args.workdir))
        brief = {k: v for k, v in res.items() if k not in ("rows", "tail")}
        print(f"[gpu_suite] {name}: {json.dumps(brief, default=str)[:1500]}", flush=True)
    print(f"[gpu_suite] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
