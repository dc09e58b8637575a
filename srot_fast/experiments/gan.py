r"""``srot-fast gan``: GANs on a real image set contaminated with noise images (paper §4 "GAN", appendix B):
WGAN-GP, the ROT critic of Nietert et al. (delta = 0.1) and ROT + hard SROT weights on the real batch.

Data (paper: CIFAR-10 + 5/10/15 % outliers; here small grey digits so the run fits a laptop CPU):
- clean real images alpha_c: the MNIST 5k subset resized to ``--size`` (default 14x14), or scikit-learn's 8x8
  digits (``--dataset digits``, the ``--quick`` default); pixels scaled to [-1, 1] and flattened;
- outliers (paper appendix B): samples of the *initialised* generator plus Gaussian noise,
  Z_o = clamp(G_init(z) + sigma psi, -1, 1), psi ~ N(0, I). The paper's sigma comes from a signal-to-noise
  ratio of its CIFAR generator; our MLP generator's initial outputs are almost constant and small, so the
  paper's formula would give nearly no noise; we fix sigma (``--sigma``, default 0.5) so the outliers are
  visibly noise images;
- alpha = (1 - kappa) alpha_c + kappa outliers for kappa in ``--noise`` (default 0.05 0.10 0.15).

SROT weights (paper: "we train our classifier on 50,000 images generated from our generator as source measure
and the corrupted CIFAR-10 as target"): an :class:`srot_fast.OutlierDetector` (VAT, MLP) is fitted once per
noise level with source = as many samples of the initialised generator as there are real images and target =
the contaminated real set; a real image with P(target) < 1/2 gets weight 0 (hard SROT weights, renormalised).
These fixed weights are passed to :func:`srot_fast.partners.rot_critic_loss` for every real batch.

Methods (same initial generator and critic for all three at a given noise level; critic steps ``--n-critic``
per generator step, gradient penalty 10, Adam ``--lr`` (default 1e-3), betas (0.5, 0.9)):
- ``wgan_gp``: critic loss -E D(real) + E D(fake) + 10 GP;
- ``rot``: ROT critic loss -E D(real) + (1 - delta) E D(fake) + delta max D(real) + 10 GP (delta = 0.1);
- ``rot_srot``: the ROT loss with the hard SROT weights on the real batch.

Metrics (no Inception network offline): ``noise_share``, the share of ``--n-eval`` generated samples that a
held-out classifier (logistic regression trained on held-out clean images vs fresh noise images) calls noise;
``w_clean``, the entropic W1 (srot_fast.sinkhorn, p = 1, eps = 0.05 x median distance) between generated
samples and held-out clean images (lower is better; the clean-vs-clean value is reported as a floor).
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from ._gan_nets import GP_WEIGHT, LABELS, LATENT, METHODS, Critic, Generator, noise_images, train_gan

NAME = "gan"
HELP = "GANs on digits with 5, 10 or 15 percent noise outliers: WGAN-GP vs ROT critic vs ROT + hard SROT weights"

# CE weight of the detector: the paper's 1e-3. The outliers (noisy generator samples) form a cluster near, not
# inside, the source (generator samples); the points default 3e-2 lets the CE term label that cluster as target
# (outlier recall ~0 here) and 1e-2 is on the edge (recall 0.74 with one CPU kernel set), while 1e-3 leaves it
# to the VAT term (docs/DETECTOR.md, "Defaults on points").
DET_OMEGA = 1e-3


def _fractions(text: str) -> list:
    """--noise: one or more outlier fractions, each in (0, 0.5)."""
    from . import _common

    vals = [_common.fraction(0.5)(t) for t in text.replace(",", " ").split()]
    if not vals:
        raise argparse.ArgumentTypeError(f"must be numbers like '0.05 0.1 0.15', got {text!r}")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    from . import _common

    p.add_argument("--noise", type=_fractions, default=None,
                   help="outlier fractions kappa, comma/space separated (default '0.05,0.1,0.15'; quick '0.15')")
    p.add_argument("--iters", type=_common.positive_int, default=None,
                   help="generator steps per GAN (default 800; quick 300)")
    p.add_argument("--lr", type=_common.positive_float, default=1e-3,
                   help="Adam learning rate of generator and critic (default 1e-3)")
    p.add_argument("--batch", type=_common.int_at_least(2), default=64,
                   help="batch size of real and fake samples (default 64)")
    p.add_argument("--n-critic", type=_common.positive_int, default=5,
                   help="critic steps per generator step (default 5)")
    p.add_argument("--dataset", choices=("mnist", "digits"), default=None,
                   help="mnist: MNIST 5k subset resized to --size (default); digits: scikit-learn 8x8 (quick)")
    p.add_argument("--size", type=_common.int_at_least(4), default=14,
                   help="image side for --dataset mnist (default 14)")
    p.add_argument("--sigma", type=_common.positive_float, default=0.5,
                   help="std of the Gaussian noise of the outliers (default 0.5)")
    p.add_argument("--delta", type=_common.fraction(zero=True), default=0.1,
                   help="ROT robustness parameter delta (default 0.1, paper)")
    p.add_argument("--det-epochs", type=_common.positive_int, default=None,
                   help="detector epochs (default 20; quick 15)")
    p.add_argument("--n-eval", type=_common.int_at_least(10), default=1000,
                   help="generated samples for the metrics (default 1000)")


# ---------------------------------------------------------------------------------------------------- data
def load_clean(dataset: str, size: int, seed: int):
    """Clean images (N, side*side) in [-1, 1], shuffled with ``seed``, and the side length."""
    from ..data import load_digits, load_mnist_5k, resize

    if dataset == "digits":
        images, _ = load_digits()
    else:
        images, _ = load_mnist_5k()
        images = resize(images, size).clamp(0, 1)
    gen = torch.Generator().manual_seed(int(seed))
    images = images[torch.randperm(len(images), generator=gen)]
    return images.flatten(1) * 2 - 1, images.shape[-1]


# ---------------------------------------------------------------------------------------------------- metrics
def _w1(x: torch.Tensor, y: torch.Tensor, backend: str, eps: float) -> float:
    from ..sinkhorn import sinkhorn

    return float(sinkhorn(x.double(), y.double(), p=1, eps=eps, backend=backend, tol=1e-3, max_iter=2000).value)


def _grid(images: torch.Tensor, side: int, ncol: int = 8) -> torch.Tensor:
    """(K, side*side) in [-1, 1] -> one (rows*side, ncol*side) image in [0, 1]."""
    k = images.shape[0]
    rows = math.ceil(k / ncol)
    canvas = torch.ones(rows * (side + 1), ncol * (side + 1))
    img = (images.reshape(k, side, side) + 1) / 2
    for t in range(k):
        r, c = divmod(t, ncol)
        canvas[r * (side + 1):r * (side + 1) + side, c * (side + 1):c * (side + 1) + side] = img[t]
    return canvas.clamp(0, 1)


# ---------------------------------------------------------------------------------------------------- steps
def _settings(args) -> dict:
    """The run's sizes and options (``--quick`` defaults filled in)."""
    quick = bool(args.quick)
    noise = args.noise if args.noise is not None else ([0.15] if quick else [0.05, 0.10, 0.15])
    iters = args.iters if args.iters is not None else (300 if quick else 800)
    det_epochs = args.det_epochs if args.det_epochs is not None else (15 if quick else 20)
    return {"quick": quick, "seed": int(args.seed), "noise": noise, "iters": iters, "det_epochs": det_epochs,
            "dataset": args.dataset or ("digits" if quick else "mnist")}


def _data(cfg: dict, args) -> dict:
    """Clean images split into held-out / training, the shared initial generator and critic, the held-out noise
    classifier (half of the held-out clean images vs fresh noise images, scored on the other half) and the
    entropic W1 floor (training clean vs held-out clean)."""
    import numpy as np
    from sklearn.linear_model import LogisticRegression

    seed = cfg["seed"]
    clean, side = load_clean(cfg["dataset"], args.size, seed)
    n_hold = min(1000, len(clean) // 4)
    held, train_clean = clean[:n_hold], clean[n_hold:]
    dim = clean.shape[1]
    n_eval = min(args.n_eval, n_hold)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    g0, d0 = Generator(dim), Critic(dim)  # the shared initial generator / critic of all methods
    init_state = {"g": {k: v.clone() for k, v in g0.state_dict().items()},
                  "d": {k: v.clone() for k, v in d0.state_dict().items()}}
    half = n_hold // 2
    noise_fit = noise_images(g0, half, args.sigma, gen)
    noise_test = noise_images(g0, n_hold - half, args.sigma, gen)
    clf = LogisticRegression(max_iter=2000, C=1.0)
    clf.fit(torch.cat([held[:half], noise_fit]).numpy(), np.r_[np.zeros(half), np.ones(half)])
    clf_acc = float(clf.score(torch.cat([held[half:], noise_test]).numpy(),
                              np.r_[np.zeros(n_hold - half), np.ones(n_hold - half)]))
    med = float(torch.cdist(held[:200], held[200:400] if n_hold >= 400 else held[:200]).median())
    eps = 0.05 * med
    w_floor = _w1(train_clean[:n_eval], held[:n_eval], args.backend, eps)
    return {"side": side, "held": held, "train_clean": train_clean, "n_hold": n_hold, "n_eval": n_eval, "g0": g0,
            "init_state": init_state, "clf": clf, "clf_acc": clf_acc, "eps": eps, "w_floor": w_floor}


def _noise_share(data: dict, x: torch.Tensor) -> float:
    """Share of the images x that the held-out classifier calls noise."""
    return float(data["clf"].predict(x.numpy()).mean())


def _fit(kappa: float, data: dict, cfg: dict, args) -> tuple:
    """The real set at outlier rate kappa (outliers first) and its hard SROT weights from a VAT detector fitted
    with source = initialised-generator samples, target = the contaminated real set (paper). Returns (real,
    weights (N,), detection summary)."""
    from ..detector import OutlierDetector
    from . import _common

    seed, g0, train_clean = cfg["seed"], data["g0"], data["train_clean"]
    n_clean = len(train_clean)
    n_out = int(round(kappa * n_clean / (1 - kappa)))
    gk = torch.Generator().manual_seed(seed * 1000 + int(round(kappa * 1000)))
    outliers = noise_images(g0, n_out, args.sigma, gk)
    real = torch.cat([outliers, train_clean])
    is_out = torch.zeros(len(real), dtype=torch.bool)
    is_out[:n_out] = True
    t0 = _common.Timer()
    with torch.no_grad():
        source = g0(torch.randn(len(real), LATENT, generator=gk))
    det = OutlierDetector(hidden=(128, 128), method="vat", epochs=cfg["det_epochs"], omega=DET_OMEGA, seed=seed,
                          progress=args.progress, num_threads=None)
    det.fit(source, real)
    _, w_real = det.hard_weights(source, real)
    flagged = w_real == 0
    detection = {"n_real": len(real), "n_outliers": n_out,
                 "outlier_recall": float(flagged[is_out].float().mean()),
                 "clean_flagged_share": float(flagged[~is_out].float().mean()),
                 "eta": det.eta_, "seconds": t0.read()}
    return real, w_real, detection


def _solve(real: torch.Tensor, w_real: torch.Tensor, data: dict, cfg: dict, args) -> tuple:
    """The three GANs on one real set: ({method: metrics}, {method: 32 samples}, {method: seconds})."""
    from . import _common

    seed, n_eval = cfg["seed"], data["n_eval"]
    results, samples, seconds = {}, {}, {}
    for meth in METHODS:
        t0 = _common.Timer()
        g, hist = train_gan(meth, real, w_real if meth == "rot_srot" else None, data["init_state"],
                            iters=cfg["iters"], batch=args.batch, n_critic=args.n_critic, delta=args.delta, seed=seed,
                            lr=args.lr, progress=args.progress)
        with torch.no_grad():
            xs = g(torch.randn(n_eval, LATENT, generator=torch.Generator().manual_seed(seed + 7)))
        results[meth] = {"noise_share": _noise_share(data, xs),
                         "w_clean": _w1(xs, data["held"][:n_eval], args.backend, data["eps"]),
                         "loss_first_last": [hist[0][1:], hist[-1][1:]]}
        samples[meth] = xs[:32]
        seconds[meth] = t0.read()
    return results, samples, seconds


# ---------------------------------------------------------------------------------------------------- report
def _figures(results: dict, samples: dict, detection: dict, data: dict, cfg: dict, args, out: Path) -> dict:
    """gan_samples.png (real data and each method's samples per outlier rate) and gan_noise_share.png."""
    import matplotlib.pyplot as plt
    import numpy as np

    from . import _common

    noise, seed, side = cfg["noise"], cfg["seed"], data["side"]
    files = {}
    ncols = len(METHODS) + 1
    fig, axes = plt.subplots(len(noise), ncols, figsize=(3.0 * ncols, 2.1 * len(noise)), squeeze=False)
    for r, kappa in enumerate(noise):
        key = f"{kappa:g}"
        n_out = detection[key]["n_outliers"]
        gk = torch.Generator().manual_seed(seed + 11)
        cont = torch.cat([noise_images(data["g0"], 32, args.sigma, gk)[: max(1, round(32 * kappa))],
                          data["train_clean"][:32]])[:32]
        panels = [("real data", cont)] + [(LABELS[m], samples[key][m]) for m in METHODS]
        for c, (title, imgs) in enumerate(panels):
            ax = axes[r, c]
            ax.imshow(_grid(imgs, side).numpy(), cmap="gray", vmin=0, vmax=1)
            ax.set_xticks([])
            ax.set_yticks([])
            if c == 0:
                extra = f"{n_out} outliers"
            else:
                extra = f"noise {results[key][METHODS[c - 1]]['noise_share']:.1%}"
            ax.set_title(f"{title}\nkappa={kappa:g}, {extra}", fontsize=9)
    fig.tight_layout()
    files["samples"] = _common.savefig(fig, out / "gan_samples.png")

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    width = 0.8 / len(METHODS)
    xs_pos = np.arange(len(noise))
    for i, m in enumerate(METHODS):
        axes[0].bar(xs_pos + (i - 1) * width, [results[f"{k:g}"][m]["noise_share"] for k in noise], width,
                    label=LABELS[m])
        axes[1].bar(xs_pos + (i - 1) * width, [results[f"{k:g}"][m]["w_clean"] for k in noise], width,
                    label=LABELS[m])
    axes[0].plot(xs_pos, noise, "k_", markersize=20, label="outlier rate kappa")
    axes[1].axhline(data["w_floor"], color="k", ls="--", lw=1, label="clean vs clean")
    for ax, title in ((axes[0], "share of generated samples called noise"),
                      (axes[1], "entropic W1(generated, clean held-out)")):
        ax.set_xticks(xs_pos, [f"{k:.0%}" for k in noise])
        ax.set_xlabel("outlier rate")
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    files["noise_share"] = _common.savefig(fig, out / "gan_noise_share.png")
    return files


def _claims(results: dict, detection: dict, noise: list) -> list:
    claims = []
    for kappa in noise:
        key = f"{kappa:g}"
        r = results[key]
        ns = {m: r[m]["noise_share"] for m in METHODS}
        claims.append({"claim": f"kappa={key}: ROT+SROT generates fewer noise samples than WGAN-GP",
                       "passed": ns["rot_srot"] < ns["wgan_gp"],
                       "detail": f"noise share {ns['rot_srot']:.3f} vs {ns['wgan_gp']:.3f}"})
        claims.append({"claim": f"kappa={key}: ROT+SROT generates no more noise samples than ROT",
                       "passed": ns["rot_srot"] <= ns["rot"],
                       "detail": f"noise share {ns['rot_srot']:.3f} vs {ns['rot']:.3f}"})
        claims.append({"claim": f"kappa={key}: the detector flags most outliers and few clean images",
                       "passed": detection[key]["outlier_recall"] >= 0.9 and detection[key]["clean_flagged_share"]
                       <= 0.05,
                       "detail": f"recall {detection[key]['outlier_recall']:.3f}, clean flagged "
                                 f"{detection[key]['clean_flagged_share']:.3f}"})
    return claims


def _markdown(metrics: dict) -> str:
    from . import _common

    cfg, res, timing = metrics["config"], metrics["results"], metrics["timing"]
    results, detection, side = res["per_noise"], res["detection"], cfg["side"]
    rows = []
    for kappa in cfg["noise"]:
        key = f"{kappa:g}"
        for m in METHODS:
            rows.append([f"{kappa:.0%}", LABELS[m], results[key][m]["noise_share"], results[key][m]["w_clean"]])
    md = [f"# srot-fast gan ({cfg['dataset']}, {side}x{side}, {cfg['iters']} generator steps, seed {cfg['seed']}"
          f"{', quick' if cfg['quick'] else ''})", "",
          _common.md_table(["outlier rate", "method", "noise share", "W1 to clean"], rows), "",
          f"Held-out noise classifier accuracy {res['classifier_heldout_accuracy']:.3f}; W1(clean, clean) floor "
          f"{res['w_clean_floor']:.4g}.", "",
          _common.md_table(["outlier rate", "outliers", "detector recall", "clean flagged"],
                           [[f"{float(k):.0%}", v["n_outliers"], v["outlier_recall"], v["clean_flagged_share"]]
                            for k, v in detection.items()]), "",
          _common.claims_table(metrics["claims"]),
          "", f"Wall time {timing['total_s']} s."]
    return "\n".join(md) + "\n"


# ---------------------------------------------------------------------------------------------------- run
def run(args) -> dict:
    """Steps: settings, data (clean images, initial nets, noise classifier), then per outlier rate fit (detector
    and SROT weights) and solve (the three GANs), then report (figures, claims, metrics files)."""
    from . import _common

    cfg = _settings(args)
    seed, noise = cfg["seed"], cfg["noise"]
    timer, device, out = _common.start(args)  # the GANs are tiny MLPs: trained on the CPU regardless
    torch.manual_seed(seed)
    data = _data(cfg, args)
    t_data = timer.read()

    results, samples, detection, t_methods = {}, {}, {}, {}
    for kappa in noise:
        key = f"{kappa:g}"
        real, w_real, detection[key] = _fit(kappa, data, cfg, args)
        results[key], samples[key], seconds = _solve(real, w_real, data, cfg, args)
        results[key] = {"real_data_noise_share": _noise_share(data, real), **results[key]}
        t_methods.update({f"{key}/{m}": t for m, t in seconds.items()})

    files = _figures(results, samples, detection, data, cfg, args, out)
    claims = _claims(results, detection, noise)
    config = {"quick": cfg["quick"], "seed": seed, "backend": args.backend, "device": str(device),
              "train_device": "cpu", "threads": args.threads, "dataset": cfg["dataset"], "side": data["side"],
              "noise": noise, "iters": cfg["iters"], "batch": args.batch, "lr": args.lr, "n_critic": args.n_critic,
              "sigma": args.sigma, "delta": args.delta, "det_epochs": cfg["det_epochs"], "det_omega": DET_OMEGA,
              "n_eval": data["n_eval"], "n_train_clean": len(data["train_clean"]), "n_heldout": data["n_hold"],
              "gp_weight": GP_WEIGHT, "latent": LATENT, "w_eps": data["eps"]}
    timing = {"total_s": None, "data_s": t_data, "per_gan_s": t_methods,
              "detector_s": {k: v["seconds"] for k, v in detection.items()}}
    metrics = {"config": config,
               "results": {"per_noise": results, "detection": detection,
                           "classifier_heldout_accuracy": data["clf_acc"], "w_clean_floor": data["w_floor"]},
               "claims": claims, "timing": timing,
               "files": [Path(f).name for f in files.values()] + ["metrics.json", "metrics.md"]}
    timing["total_s"] = timer.read()
    _common.write_metrics(out, metrics, _markdown(metrics))
    return metrics
