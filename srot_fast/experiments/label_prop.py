r"""``srot-fast label-prop``: label propagation through OT plans on corrupted digits (paper §4, "Label propagation
on digits datasets", Fig. 7; protocol of Mukherjee et al. 2021 and Chapel et al. 2021).

Paper: source = 400 USPS 0/1 (200 per class) + 100 Fashion-MNIST class-2 images (type-I outliers: far from the
target); target = 400 MNIST 0/1 (200 per class) + 100 USPS 0/1 (50 per class; type-II outliers: they look like
the source). A target image takes the label of the source image it receives the most mass from, provided the mass
it receives is >= 0.25 b_j. Accuracy = correctly labelled clean target images / clean target images; labelled
accuracy = correctly labelled clean target images / labelled target images (a labelled outlier counts as an
error: it should not have been transported). SROT hard (detector weights) + partial OT vs ROBOT (Mukherjee et al.)
and partial OT, along the transported mass.

Here (no USPS, no internet): the low-resolution digits are scikit-learn's 8x8 digits, upsampled to ``--size``
(USPS is 16x16); MNIST 0/1 from the MNIST 5k subset, downsampled to ``--size``. scikit-learn has only 178 zeros,
so the default keeps the paper's proportions at 0.7 scale: ``--n-per-class 140`` -> source 280 digits + 70
outliers, target 280 MNIST + 70 digits. Type-I outliers: ``--outliers fashion`` (Fashion-MNIST pullovers, class 2;
needs the Debian package dataset-fashion-mnist), ``noise`` (uniform noise images: type I, available everywhere),
``auto`` (fashion when installed, else noise).

Plans: cost C = |x - z|^2 / 2 on flattened images. ``--solver exact`` (default, as the paper: POT) uses
srot_fast.partners.exact_partial / exact_robot; ``--solver sinkhorn`` solves partial OT and SROT with
srot_fast.sinkhorn(mass=...) (entropic, online) and propagates with SinkhornResult.plan_argmax. ROBOT is always
exact: the plan of ot.emd on min(C, 2 lam), where pairs with C > 2 lam count as not transported.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

NAME = "label-prop"
HELP = "label propagation on corrupted digits 0/1: SROT hard + partial OT vs ROBOT and partial OT (paper Fig. 7)"

MASSES = (0.5, 0.6, 0.7, 0.8, 0.9)
MASSES_QUICK = (0.6, 0.8)
ROBOT_QUANTILES = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.7)      # 2 lam = these quantiles of C
ROBOT_QUANTILES_QUICK = (0.1, 0.3, 0.5, 0.7)
ACCEPT = 0.25          # accept a label when the mass into target j is >= ACCEPT * b_j
FASHION_CLASS = 2      # pullover
P = 2
OUTLIERS = ("auto", "fashion", "noise")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from . import _common

    p.add_argument("--outliers", default="auto", choices=OUTLIERS,
                   help="type-I outliers of the source: fashion (Fashion-MNIST class 2, Debian package "
                        "dataset-fashion-mnist), noise (uniform noise images, always available), auto (fashion "
                        "when installed, else noise; default)")
    p.add_argument("--n-per-class", type=_common.int_in(4, 142), default=None,
                   help="clean images per class (0/1) on each side, 4 to 142 (scikit-learn has 178 zeros; "
                        "default 140; quick 60); target outliers: n/4 per class, source outliers: n/2")
    p.add_argument("--size", type=_common.int_at_least(4), default=16, help="image side (default 16, as USPS)")
    p.add_argument("--solver", default="exact", choices=("exact", "sinkhorn"),
                   help="partial OT / SROT plans: exact (POT, as the paper; default) or sinkhorn (entropic, online)")
    p.add_argument("--blur", type=_common.positive_float, default=0.05,
                   help="--solver sinkhorn: blur in units of the median pairwise distance (default 0.05)")
    p.add_argument("--epochs", type=_common.positive_int, default=None, help="detector epochs (default 40; quick 25)")
    p.add_argument("--omega", type=_common.positive_float, default=1e-2,
                   help="weight of the CE term of the VAT detector (default 1e-2, see docs/DETECTOR.md)")


# ----------------------------------------------------------------------------------------------------- data
def _outlier_images(kind: str, n: int, size: int, gen: torch.Generator):
    from ..data import DataUnavailableError, load_fashion_mnist, resize

    if kind in ("auto", "fashion"):
        try:
            imgs, labels = load_fashion_mnist("train")
        except DataUnavailableError:
            if kind == "fashion":
                raise
        else:
            pool = imgs[labels == FASHION_CLASS]
            idx = torch.randperm(len(pool), generator=gen)[:n]
            return resize(pool[idx], size).clamp_(0, 1), "fashion"
    return torch.rand(n, 1, size, size, generator=gen), "noise"


def build_data(n: int, size: int, outliers: str, seed: int):
    """Source: n 8x8 digits per class 0/1 (upsampled) + n/2 type-I outliers (label 2, first);
    target: n MNIST per class 0/1 + n/4 per class 8x8 digits (type-II outliers, first). Images (K, 1, s, s)."""
    from ..data import load_digits, load_mnist_5k, resize

    gen = torch.Generator().manual_seed(int(seed))
    digits, dl = load_digits()
    mnist, ml = load_mnist_5k()
    n_o = n // 4
    src, src_y, tout, tout_y, tgt, tgt_y = [], [], [], [], [], []
    for c in (0, 1):
        pool = digits[dl == c]
        if n + n_o > len(pool):
            raise ValueError(f"n_per_class + n_per_class // 4 = {n + n_o} exceeds the {len(pool)} 8x8 digits of "
                             f"class {c}")
        perm = torch.randperm(len(pool), generator=gen)
        src.append(pool[perm[:n]])
        tout.append(pool[perm[n:n + n_o]])
        mp = mnist[ml == c]
        tgt.append(mp[torch.randperm(len(mp), generator=gen)[:n]])
        src_y.append(torch.full((n,), c))
        tout_y.append(torch.full((n_o,), c))
        tgt_y.append(torch.full((n,), c))
    o_imgs, o_kind = _outlier_images(outliers, max(1, n // 2), size, gen)
    source = torch.cat([o_imgs, resize(torch.cat(src), size).clamp_(0, 1)])
    source_y = torch.cat([torch.full((len(o_imgs),), FASHION_CLASS), *src_y])
    source_out = torch.cat([torch.ones(len(o_imgs), dtype=torch.bool), torch.zeros(2 * n, dtype=torch.bool)])
    target = torch.cat([resize(torch.cat(tout), size).clamp_(0, 1), resize(torch.cat(tgt), size).clamp_(0, 1)])
    target_y = torch.cat([*tout_y, *tgt_y])
    target_out = torch.cat([torch.ones(2 * n_o, dtype=torch.bool), torch.zeros(2 * n, dtype=torch.bool)])
    return dict(source=source, source_y=source_y, source_out=source_out, target=target, target_y=target_y,
                target_out=target_out, outlier_kind=o_kind)


# ----------------------------------------------------------------------------------------------------- labels
def propagate(plan: torch.Tensor, source_y: torch.Tensor, b: torch.Tensor, accept: float = ACCEPT):
    """(N_source, M_target) plan -> (M,) labels (-1 = not labelled): the label of the source point sending the
    most mass to target j, when the mass arriving at j is >= accept * b_j."""
    mass = plan.sum(0)
    lab = source_y[plan.argmax(0)]
    ok = (mass >= accept * b) & (mass > 0)
    return torch.where(ok, lab, torch.full_like(lab, -1))


def scores(labels: torch.Tensor, target_y: torch.Tensor, target_out: torch.Tensor) -> dict:
    clean = ~target_out
    correct = (labels == target_y) & clean
    labelled = labels >= 0
    n_lab = int(labelled.sum())
    return {"accuracy": float(correct.sum()) / max(1, int(clean.sum())),
            "labelled_accuracy": float(correct.sum()) / n_lab if n_lab else float("nan"),
            "labelled_share": n_lab / len(labels),
            "outliers_labelled": float(labelled[target_out].float().mean()) if target_out.any() else 0.0}


def _interp(x, xs, ys):
    """Piecewise-linear interpolation of (xs, ys) (xs increasing) at x; None outside [xs[0], xs[-1]]."""
    if not xs or x < xs[0] - 1e-9 or x > xs[-1] + 1e-9:
        return None
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 - 1e-9 <= x <= x1 + 1e-9:
            return y0 if x1 - x0 < 1e-12 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


# ----------------------------------------------------------------------------------------------------- steps
def _settings(args) -> dict:
    """The run's sizes and options (``--quick`` defaults filled in)."""
    quick = bool(args.quick)
    n = args.n_per_class if args.n_per_class is not None else (60 if quick else 140)
    return {"quick": quick, "seed": int(args.seed), "n": n,
            "epochs": args.epochs if args.epochs is not None else (25 if quick else 40),
            "masses": MASSES_QUICK if quick else MASSES,
            "quantiles": ROBOT_QUANTILES_QUICK if quick else ROBOT_QUANTILES}


def _fit(d: dict, cfg: dict, args, device) -> tuple:
    """The VAT detector, source (label 0) vs target (label 1): (P(target) of source, of target, detection summary)."""
    from . import _common

    det, s_src, s_tgt, flag_s, flag_t = _common.vat_scores(d["source"], d["target"], epochs=cfg["epochs"],
                                                           omega=args.omega, seed=cfg["seed"],
                                                           progress=args.progress, device=device)
    detection = {"target_outlier_recall": float(flag_t[d["target_out"]].float().mean()),
                 "target_clean_flagged": float(flag_t[~d["target_out"]].float().mean()),
                 "source_flagged": float(flag_s.float().mean()),
                 "source_outliers_flagged": float(flag_s[d["source_out"]].float().mean()),
                 "eta": float(det.eta_), "epochs": cfg["epochs"]}
    return s_src, s_tgt, detection


def _solve(d: dict, s_src, s_tgt, cfg: dict, args) -> tuple:
    """Labels propagated by partial OT and SROT hard + partial at each mass, and by ROBOT at each cost quantile;
    returns ({method: [scores per mass]}, eps of the sinkhorn solver)."""
    from ..kernels.tensorized import cost_matrix
    from ..partners import exact_partial, exact_robot
    from ..sinkhorn import sinkhorn
    from ..weights import hard_weights
    from . import _common

    x = d["source"].flatten(1).double()
    z = d["target"].flatten(1).double()
    ns, nt = len(x), len(z)
    a = torch.full((ns,), 1.0 / ns, dtype=torch.float64)
    b = torch.full((nt,), 1.0 / nt, dtype=torch.float64)
    try:
        a_h, b_h = hard_weights(a, s_src.double(), b, s_tgt.double())
    except ValueError as err:
        raise _common.CliError(f"the detector flagged a whole side ({err}); try more --epochs") from err
    C = cost_matrix(x, z, P)
    median = float(C.sqrt().median() * 2**0.5)       # median distance |x - z|
    eps = (args.blur * median) ** 2 / 2

    def labels_sinkhorn(wa, wb, m):
        res = sinkhorn(z.float(), x.float(), wb.float(), wa.float(), p=P, eps=eps, mass=m, backend=args.backend,
                       tol=1e-4, max_iter=5000)
        mass = res.row_mass.double()
        lab = d["source_y"][res.plan_argmax().cpu()]
        ok = (mass >= ACCEPT * b) & (mass > 0)
        return torch.where(ok, lab, torch.full_like(lab, -1))

    results = {"partial OT": [], "SROT hard + partial": [], "ROBOT": []}
    for m in cfg["masses"]:
        for name, (wa, wb) in (("partial OT", (a, b)), ("SROT hard + partial", (a_h, b_h))):
            if args.solver == "exact":
                lab = propagate(exact_partial(x, z, wa, wb, mass=m, p=P)[1], d["source_y"], b)
            else:
                lab = labels_sinkhorn(wa, wb, m)
            results[name].append({"mass": m, **scores(lab, d["target_y"], d["target_out"])})
    for q in cfg["quantiles"]:
        two_lam = float(torch.quantile(C.flatten(), q))
        _, plan = exact_robot(x, z, a, b, lam=two_lam / 2, p=P)
        plan = plan * (C <= two_lam)                       # truncated pairs are not transported
        lab = propagate(plan, d["source_y"], b)
        results["ROBOT"].append({"mass": float(plan.sum()), "lam": two_lam / 2, "cost_quantile": q,
                                 **scores(lab, d["target_y"], d["target_out"])})
    results["ROBOT"].sort(key=lambda r: r["mass"])
    return results, eps


# ----------------------------------------------------------------------------------------------------- report
def _figures(d: dict, results: dict, n: int, out: Path) -> dict:
    """label_prop_accuracy.png (accuracies along the mass) and label_prop_data.png (sample images)."""
    import matplotlib.pyplot as plt

    from . import _common

    src, tgt = d["source"], d["target"]
    files = {}
    fig, axs = plt.subplots(1, 2, figsize=(10, 3.6))
    style = {"partial OT": ("C0", "o"), "SROT hard + partial": ("C3", "s"), "ROBOT": ("C2", "^")}
    for name, rows in results.items():
        col, mk = style[name]
        ms = [r["mass"] for r in rows]
        axs[0].plot(ms, [100 * r["accuracy"] for r in rows], color=col, marker=mk, label=name)
        axs[1].plot(ms, [100 * r["labelled_accuracy"] for r in rows], color=col, marker=mk, label=name)
    axs[0].set_ylabel("accuracy on clean target (%)")
    axs[1].set_ylabel("labelled accuracy (%)")
    for ax in axs:
        ax.set_xlabel("transported mass")
        ax.grid(alpha=0.3)
    axs[0].legend(fontsize=8)
    fig.tight_layout()
    files["acc"] = _common.savefig(fig, out / "label_prop_accuracy.png")

    ncol = 10
    rows_img = [("source: digits 0/1", src[~d["source_out"]][torch.linspace(0, 2 * n - 1, ncol).long()]),
                (f"source outliers ({d['outlier_kind']})", src[d["source_out"]][:ncol]),
                ("target: MNIST 0/1", tgt[~d["target_out"]][torch.linspace(0, 2 * n - 1, ncol).long()]),
                ("target outliers: digits", tgt[d["target_out"]][torch.linspace(0, int(d["target_out"].sum()) - 1,
                                                                                ncol).long()])]
    fig, axes = plt.subplots(len(rows_img), ncol, figsize=(ncol * 0.8, len(rows_img) * 0.9))
    for r, (label, imgs) in enumerate(rows_img):
        for c in range(ncol):
            axes[r, c].axis("off")
            if c < len(imgs):
                axes[r, c].imshow(imgs[c, 0].numpy(), cmap="gray", vmin=0, vmax=1, interpolation="nearest")
        axes[r, 0].text(-0.1, 0.5, label, transform=axes[r, 0].transAxes, ha="right", va="center", fontsize=8)
    files["data"] = _common.savefig(fig, out / "label_prop_data.png")
    return files


def _claims(results: dict, detection: dict) -> tuple:
    """(claims, mean accuracy gap SROT - ROBOT at matched masses or None)."""
    P_, S_, R_ = results["partial OT"], results["SROT hard + partial"], results["ROBOT"]
    rx, ry = [r["mass"] for r in R_], [r["accuracy"] for r in R_]
    robot_at = [(s["mass"], s["accuracy"], _interp(s["mass"], rx, ry)) for s in S_]
    matched = [(m, sa, ra) for m, sa, ra in robot_at if ra is not None]
    gap = (sum(sa - ra for _, sa, ra in matched) / len(matched)) if matched else None
    claims = [
        {"claim": "the VAT detector flags the target's low-resolution digits (recall >= 0.9, <= 5 % clean target "
                  "flagged)",
         "passed": detection["target_outlier_recall"] >= 0.9 and detection["target_clean_flagged"] <= 0.05,
         "detail": f"recall {detection['target_outlier_recall']:.3f}, clean target flagged "
                   f"{detection['target_clean_flagged']:.3f}, source flagged {detection['source_flagged']:.3f}"},
        {"claim": "SROT hard + partial: higher accuracy than partial OT at every mass",
         "passed": all(s["accuracy"] > p["accuracy"] for s, p in zip(S_, P_)),
         "detail": ", ".join(f"m={s['mass']:g}: {100 * s['accuracy']:.1f} vs {100 * p['accuracy']:.1f}"
                             for s, p in zip(S_, P_))},
        {"claim": "SROT hard + partial: higher labelled accuracy than partial OT at every mass",
         "passed": all(s["labelled_accuracy"] > p["labelled_accuracy"] for s, p in zip(S_, P_)),
         "detail": ", ".join(f"m={s['mass']:g}: {100 * s['labelled_accuracy']:.1f} vs "
                             f"{100 * p['labelled_accuracy']:.1f}" for s, p in zip(S_, P_))},
        {"claim": "SROT hard + partial beats ROBOT by >= 2 points of accuracy on average (at the same transported "
                  "mass, ROBOT interpolated)",
         "passed": gap is not None and gap >= 0.02,
         "detail": "no overlapping masses" if gap is None else
                   f"mean gap {100 * gap:.1f} points over {len(matched)} masses"},
        {"claim": "SROT hard + partial: accuracy rises and labelled accuracy falls as the mass grows",
         "passed": S_[-1]["accuracy"] > S_[0]["accuracy"] and S_[-1]["labelled_accuracy"] < S_[0]["labelled_accuracy"],
         "detail": f"accuracy {100 * S_[0]['accuracy']:.1f} -> {100 * S_[-1]['accuracy']:.1f}, labelled "
                   f"{100 * S_[0]['labelled_accuracy']:.1f} -> {100 * S_[-1]['labelled_accuracy']:.1f} (partial OT: "
                   f"{100 * P_[0]['accuracy']:.1f} -> {100 * P_[-1]['accuracy']:.1f}, labelled "
                   f"{100 * P_[0]['labelled_accuracy']:.1f} -> {100 * P_[-1]['labelled_accuracy']:.1f})"},
    ]
    return claims, gap


def _markdown(metrics: dict, d: dict) -> str:
    from . import _common

    cfg, res, timing = metrics["config"], metrics["results"], metrics["timing"]
    detection, n, size = res["detection"], cfg["n_per_class"], cfg["size"]
    header = ["method", "mass", "accuracy %", "labelled acc. %", "outliers labelled %"]
    table = [[name, r["mass"], 100 * r["accuracy"], 100 * r["labelled_accuracy"], 100 * r["outliers_labelled"]]
             for name, rows in res["curves"].items() for r in rows]
    md = [f"# srot-fast label-prop ({'quick' if cfg['quick'] else 'full'}, seed {cfg['seed']})", "",
          f"source = {2 * n} 8x8 digits 0/1 + {int(d['source_out'].sum())} {d['outlier_kind']} outliers; target = "
          f"{2 * n} MNIST 0/1 + {int(d['target_out'].sum())} 8x8 digits; {size}x{size}, solver "
          f"{cfg['solver']}", "", _common.md_table(header, table), "",
          f"Detector: recall {detection['target_outlier_recall']:.3f}, clean target flagged "
          f"{detection['target_clean_flagged']:.3f}, source flagged {detection['source_flagged']:.3f}", "",
          "## Claims", "",
          _common.claims_table(metrics["claims"]),
          "", f"Wall time {timing['total_s']} s (detector {timing['detector_s']} s)."]
    return "\n".join(md) + "\n"


# ----------------------------------------------------------------------------------------------------- run
def run(args) -> dict:
    """Steps: settings, data, fit (detector), solve (plans and propagated labels), report (figures, claims,
    metrics files)."""
    from . import _common

    cfg = _settings(args)
    timer, device, out = _common.start(args)
    n = cfg["n"]
    d = build_data(n, args.size, args.outliers, cfg["seed"])
    t_data = timer.read()
    s_src, s_tgt, detection = _fit(d, cfg, args, device)
    t_det = timer.read()
    results, eps = _solve(d, s_src, s_tgt, cfg, args)

    files = _figures(d, results, n, out)
    claims, gap = _claims(results, detection)
    config = {"quick": cfg["quick"], "seed": cfg["seed"], "backend": args.backend, "device": str(device),
              "threads": args.threads, "outliers": args.outliers, "outliers_used": d["outlier_kind"],
              "n_per_class": n, "n_source": len(d["source"]), "n_target": len(d["target"]), "size": args.size,
              "p": P, "solver": args.solver, "blur": args.blur, "eps": eps if args.solver == "sinkhorn" else None,
              "accept": ACCEPT, "masses": list(cfg["masses"]), "robot_cost_quantiles": list(cfg["quantiles"]),
              "detector_epochs": cfg["epochs"], "omega": args.omega}
    timing = {"total_s": timer.read(), "data_s": t_data, "detector_s": round(t_det - t_data, 2)}
    metrics = {"config": config, "results": {"curves": results, "detection": detection,
                                             "srot_minus_robot_mean_accuracy": gap},
               "claims": claims, "timing": timing,
               "files": [Path(f).name for f in files.values()] + ["metrics.json", "metrics.md"]}
    _common.write_metrics(out, metrics, _markdown(metrics, d))
    return metrics
