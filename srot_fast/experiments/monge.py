r"""``srot-fast monge``: Monge map by barycentric projection + MLP regression (paper §4 "Monge map" and
appendix C, following Seguy et al. 2018), with type-II outliers in the source measure.

Data (MNIST -> MNIST-M-like, the paper's appendix task, at low resolution):
- alpha (the measure the map should land on) = ``n_clean`` MNIST-M-like images (an MNIST digit blended with a
  random patch of one of the two photos bundled with scikit-learn, china / flower: |patch - digit|, as MNIST-M
  does) + ``n_out`` plain MNIST digits (grey, replicated to 3 channels): type-II outliers, they sit on top of
  the other measure;
- beta (the inputs of the map) = ``n_target`` MNIST digits (grey x 3), disjoint from the outliers.
Paper: 1700 + 300 (15 %) vs 1700 "1" digits at 28x28 (32x32 for SVHN). Here: 1700 + 300 vs 1700 images of all
ten classes (the MNIST 5k subset has only 500 "1"s) at 12x12x3 (:mod:`._mnist_m`).

Plans (cost C = |x - z|^2 / 2 on flattened images, entropic, srot_fast.sinkhorn, one plan per method):
OT (balanced), partial OT (mass m), SROT hard (balanced OT on the detector's hard weights), SROT soft (partial
OT with m = 0.85 on the soft cost C + u_i + v_j, gamma = max C, and beta rescaled to mass m: the paper's
"rescaling trick", so all of beta goes to the cheapest 85 % of alpha).
For every target z_j the barycentric projection P_j = sum_i pi_ij x_i / sum_i pi_ij (one online kernel pass,
SinkhornResult.barycentric_projection) is the regression target of the map T_theta (an MLP), trained on
||T(z_j) - P_j||^2 with z_j drawn in proportion to the mass it sends (= sum_ij pi_ij ||x_i - T(z_j)||^2 up to a
constant, the paper's objective).

Metrics per method: W(alpha_c, T#beta) (entropic OT value, same eps) for the MLP map and for the barycentric
projection itself; the share of the transported mass that lands on alpha's outliers; the share of grey mapped
images (colourfulness below half the 5 % quantile of the clean MNIST-M-like images: "generates MNIST samples",
paper Figs. 8-9).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ._mnist_m import build_data

NAME = "monge"
HELP = "Monge map MNIST -> MNIST-M-like with 15 percent MNIST type-II outliers: OT / partial OT / SROT hard / soft"

PARTIAL_MASSES = (0.9, 0.85, 0.7, 0.5)      # paper
PARTIAL_MASSES_QUICK = (0.85,)
SOFT_MASS = 0.85                            # paper: SROT soft = partial OT with m = 0.85 (+ rescaling of beta)
P = 2
MAX_ITER_PARTIAL = 300        # entropic partial OT has a slow tail: capped, marginal error reported


def add_arguments(p: argparse.ArgumentParser) -> None:
    from . import _common

    p.add_argument("--n-clean", type=_common.int_at_least(10), default=None,
                   help="clean MNIST-M-like source images (default 1700; quick 255)")
    p.add_argument("--outlier-rate", type=_common.fraction(zero=True), default=0.15,
                   help="share of MNIST outliers in alpha (default 0.15)")
    p.add_argument("--n-target", type=_common.int_at_least(10), default=None,
                   help="MNIST target images (default: = --n-clean)")
    p.add_argument("--size", type=_common.int_at_least(4), default=12,
                   help="image side (default 12; the paper uses 28)")
    p.add_argument("--blur", type=_common.positive_float, default=None,
                   help="entropic blur in units of the median pairwise distance; eps = (blur * median)^2 / 2 "
                        "(default 0.15)")
    p.add_argument("--map-steps", type=_common.positive_int, default=None,
                   help="Adam steps of the MLP map (default 600; quick 100)")
    p.add_argument("--map-hidden", type=_common.positive_int, default=256,
                   help="hidden width of the MLP map (default 256)")
    p.add_argument("--epochs", type=_common.positive_int, default=None, help="detector epochs (default 20; quick 8)")
    p.add_argument("--omega", type=_common.positive_float, default=None,
                   help="weight of the CE term of the VAT detector (default: OutlierDetector's, 3e-2 on images; "
                        "see docs/DETECTOR.md)")


# ----------------------------------------------------------------------------------------------------- map
def train_map(z: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, steps: int, hidden: int, seed: int,
              progress: bool = False):
    """MLP T_theta (D -> hidden -> hidden -> D, ReLU) regressing ``target`` from ``z``: Adam on the mean squared
    error of mini-batches drawn with probabilities proportional to ``weight`` (the plan's row mass)."""
    from torch import nn

    gen = torch.Generator().manual_seed(int(seed))
    torch.manual_seed(int(seed))     # layer init (the MLP is local to this run)
    d = z.shape[1]
    net = nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, d))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, betas=(0.0, 0.9))   # betas as the paper
    w = weight.clamp_min(0)
    w = w / w.sum()
    batch = min(256, len(z))
    losses = []
    it = range(steps)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc="map", leave=False)
    for step in it:
        idx = torch.multinomial(w, batch, replacement=True, generator=gen)
        loss = ((net(z[idx]) - target[idx]) ** 2).sum(1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            losses.append(float(loss.detach()))
    net.eval()
    return net, losses


# ----------------------------------------------------------------------------------------------------- solve
def _plan(method, zb, xa, w_beta, w_alpha, eps, backend, offsets):
    """Plan with rows = beta (map inputs), columns = alpha; returns the SinkhornResult."""
    import warnings

    from ..sinkhorn import ConvergenceWarning, sinkhorn

    kind, mass = method["kind"], method.get("mass")
    if kind == "ot" or kind == "hard":
        return sinkhorn(zb, xa, w_beta, w_alpha, p=P, eps=eps, backend=backend, tol=1e-3, max_iter=2000)
    with warnings.catch_warnings():   # slow tail of entropic partial OT: capped, marginal error reported
        warnings.simplefilter("ignore", ConvergenceWarning)
        if kind == "partial":
            return sinkhorn(zb, xa, w_beta, w_alpha, p=P, eps=eps, mass=mass, backend=backend, tol=1e-3,
                            max_iter=MAX_ITER_PARTIAL)
        if kind == "soft":
            u_alpha, v_beta = offsets
            # rescaling trick: beta carries mass m, so partial OT with mass m moves all of beta
            return sinkhorn(zb, xa, w_beta * mass, w_alpha, p=P, eps=eps, mass=mass * float(w_beta.sum()) * 0.999999,
                            u=v_beta, v=u_alpha, backend=backend, tol=1e-3, max_iter=MAX_ITER_PARTIAL)
    raise ValueError(kind)


def _settings(args) -> dict:
    """The run's sizes and options (``--quick`` defaults filled in); CliError when the images do not suffice."""
    from . import _common

    quick = bool(args.quick)
    n_clean = args.n_clean if args.n_clean is not None else (255 if quick else 1700)
    n_out = int(round(args.outlier_rate * n_clean / (1 - args.outlier_rate)))
    n_target = args.n_target if args.n_target is not None else n_clean
    if n_clean + n_out + n_target > 5000:
        raise _common.CliError(f"--n-clean/--n-target: {n_clean} + {n_out} outliers + {n_target} exceeds the 5000 "
                               "MNIST images of the bundled subset")
    blur = 0.15 if args.blur is None else float(args.blur)
    return {"quick": quick, "seed": int(args.seed), "n_clean": n_clean, "n_out": n_out, "n_target": n_target,
            "size": args.size, "blur": blur, "map_steps": args.map_steps if args.map_steps is not None else
            (100 if quick else 600), "epochs": args.epochs if args.epochs is not None else (8 if quick else 20),
            "masses": PARTIAL_MASSES_QUICK if quick else PARTIAL_MASSES}


def _fit(alpha_img, is_out, beta_img, cfg: dict, args, device) -> tuple:
    """The VAT detector, source = alpha (label 0), target = beta (label 1); an alpha image with P(target) > 1/2
    is an outlier. Returns (detector, s_alpha, s_beta, detection summary)."""
    from . import _common

    det, s_alpha, s_beta, flag_a, flag_b = _common.vat_scores(alpha_img, beta_img, epochs=cfg["epochs"],
                                                              omega=args.omega, seed=cfg["seed"],
                                                              progress=args.progress, device=device)
    detection = {"recall": float(flag_a[is_out].float().mean()) if cfg["n_out"] else None,
                 "clean_flagged": float(flag_a[~is_out].float().mean()),
                 "target_flagged": float(flag_b.float().mean()),
                 "eta": float(det.eta_), "epochs": cfg["epochs"]}
    return det, s_alpha, s_beta, detection


def _solve(alpha_img, is_out, beta_img, s_alpha, s_beta, cfg: dict, args, device) -> dict:
    """Every method's plan, barycentric projection and MLP map, with the metrics of the module docstring.
    Returns the problem's scales (eps, median distance, gamma), per-method results, the mapped images and
    W(alpha_c, beta) of the identity map."""
    from ..sinkhorn import sinkhorn
    from ..weights import hard_weights, soft_offsets
    from . import _common

    dt = torch.float32
    xa = alpha_img.flatten(1).to(device, dt)
    zb = beta_img.flatten(1).to(device, dt)
    xc = xa[~is_out.to(device)]
    na, nb = len(xa), len(zb)
    w_alpha = torch.full((na,), 1.0 / na, device=device, dtype=dt)
    w_beta = torch.full((nb,), 1.0 / nb, device=device, dtype=dt)
    # eps from the data scale: median pairwise distance between beta and alpha (subsample)
    median = float(torch.cdist(zb[:300], xa[:300]).median())
    eps = (cfg["blur"] * median) ** 2 / 2
    backend = args.backend

    # offsets for soft SROT (gamma = max C) and hard weights
    gamma = float(((torch.cdist(zb, xa) ** 2) / 2).max())
    u_alpha, v_beta = soft_offsets(s_alpha, s_beta, gamma)
    try:
        wa_hard, wb_hard = hard_weights(w_alpha.cpu(), s_alpha, w_beta.cpu(), s_beta)
    except ValueError as err:
        raise _common.CliError(f"the detector flagged a whole side ({err}); try more --epochs") from err

    methods = [{"name": "OT", "kind": "ot"}]
    methods += [{"name": f"partial {m:g}", "kind": "partial", "mass": m} for m in cfg["masses"]]
    methods += [{"name": "SROT hard", "kind": "hard"}, {"name": "SROT soft", "kind": "soft", "mass": SOFT_MASS}]

    def w_dist(points):
        res = sinkhorn(xc, points, p=P, eps=eps, backend=backend, tol=1e-3, max_iter=2000)
        return float(res.value)

    # colourfulness = mean over pixels of the std over the 3 channels (0 for a grey MNIST image); a mapped image
    # is "grey" (an MNIST-like output) below half the 5 % quantile of the clean MNIST-M-like images
    def colour(points):
        return points.reshape(len(points), 3, -1).std(dim=1).mean(dim=1)

    grey_thr = 0.5 * float(torch.quantile(colour(xc), 0.05))

    def grey_share(points):
        return float((colour(points) < grey_thr).float().mean())

    results, maps, t_methods = {}, {}, {}
    for k, meth in enumerate(methods):
        t0 = _common.Timer()
        if meth["kind"] == "hard":
            res = _plan(meth, zb, xa, wb_hard.to(device, dt), wa_hard.to(device, dt), eps, backend, None)
        else:
            res = _plan(meth, zb, xa, w_beta, w_alpha, eps, backend, (u_alpha.to(device, dt), v_beta.to(device, dt)))
        col = res.col_mass.detach()               # mass arriving at each alpha image
        row = res.row_mass.detach()               # mass leaving each beta image
        bary = res.barycentric_projection().detach()
        total = float(col.sum())
        out_share = float(col[is_out.to(device)].sum()) / total
        net, losses = train_map(zb.cpu(), bary.cpu(), row.cpu(), cfg["map_steps"], args.map_hidden, cfg["seed"] + k,
                                progress=args.progress)
        with torch.no_grad():
            mapped = net(zb.cpu()).to(device, dt)
        maps[meth["name"]] = mapped.cpu()
        results[meth["name"]] = {
            "W_alpha_c_T_beta": w_dist(mapped),
            "W_alpha_c_bary": w_dist(bary),
            "outlier_mass_share": out_share,
            "transported_mass": total,
            "grey_share_T": grey_share(mapped),
            "grey_share_bary": grey_share(bary),
            "map_loss_first_last": [losses[0], losses[-1]],
            "sinkhorn_iters": res.n_iter,
            "marginal_error": res.marginal_error,
        }
        t_methods[meth["name"]] = t0.read()
    return {"results": results, "maps": maps, "t_methods": t_methods, "w_clean_ref": w_dist(zb),
            "eps": eps, "median": median, "gamma": gamma, "dim": xa.shape[1]}


# ----------------------------------------------------------------------------------------------------- report
def _figures(alpha_img, is_out, beta_img, sol: dict, out: Path) -> dict:
    """monge_samples.png (inputs, clean and outlier images, each method's T(z)) and monge_w.png."""
    import matplotlib.pyplot as plt

    from . import _common

    results, maps, w_clean_ref = sol["results"], sol["maps"], sol["w_clean_ref"]
    files = {}
    ncol = 10
    nb = len(beta_img)
    pick = torch.arange(ncol) * max(1, nb // ncol)
    rows = [("beta (input, MNIST)", beta_img[pick]),
            ("alpha_c (clean MNIST-M-like)", alpha_img[~is_out][:ncol]),
            ("alpha outliers (MNIST)", alpha_img[is_out][:ncol])]
    shape = beta_img.shape[1:]
    for name, mapped in maps.items():
        rows.append((f"T({name})", mapped[pick].reshape((-1,) + tuple(shape))))
    fig, axes = plt.subplots(len(rows), ncol, figsize=(ncol * 0.9, len(rows) * 0.95))
    for r, (label, imgs) in enumerate(rows):
        for c in range(ncol):
            ax = axes[r, c]
            ax.axis("off")
            if c < len(imgs):
                im = imgs[c].clamp(0, 1).permute(1, 2, 0).numpy()
                ax.imshow(im, interpolation="nearest")
        axes[r, 0].text(-0.1, 0.5, label, transform=axes[r, 0].transAxes, ha="right", va="center", fontsize=8)
    files["samples"] = _common.savefig(fig, out / "monge_samples.png")

    names = list(results)
    fig, axs = plt.subplots(1, 2, figsize=(10, 3.4))
    xs = range(len(names))
    axs[0].bar(xs, [results[n]["W_alpha_c_T_beta"] for n in names], color="C0", label="T_theta")
    axs[0].plot(xs, [results[n]["W_alpha_c_bary"] for n in names], "k_", ms=20, mew=2, label="bary. projection")
    axs[0].axhline(w_clean_ref, color="gray", ls=":", label="identity (W(alpha_c, beta))")
    axs[0].set_ylabel("W(alpha_c, T#beta) (entropic)")
    axs[0].legend(fontsize=7)
    axs[1].bar(xs, [100 * results[n]["outlier_mass_share"] for n in names], color="C3")
    axs[1].set_ylabel("% of transported mass on alpha's outliers")
    for ax in axs:
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    files["w"] = _common.savefig(fig, out / "monge_w.png")
    return files


def _claims(r: dict, detection: dict, n_out: int, n_clean: int) -> list:
    names = list(r)
    partners = [n for n in names if n.startswith("partial") or n == "OT"]
    best_partner = min(r[n]["W_alpha_c_T_beta"] for n in partners)
    return [
        {"claim": "the VAT detector flags the MNIST outliers of alpha (recall >= 0.9, <= 5 % clean flagged)",
         "passed": bool((detection["recall"] or 0) >= 0.9 and detection["clean_flagged"] <= 0.05),
         "detail": f"recall {detection['recall']:.3f}, clean flagged {detection['clean_flagged']:.3f}, "
                   f"target flagged {detection['target_flagged']:.3f}"},
        {"claim": "SROT hard: lower W(alpha_c, T#beta) than OT",
         "passed": r["SROT hard"]["W_alpha_c_T_beta"] < r["OT"]["W_alpha_c_T_beta"],
         "detail": f"{r['SROT hard']['W_alpha_c_T_beta']:.3f} vs {r['OT']['W_alpha_c_T_beta']:.3f}"},
        {"claim": "SROT hard and soft: lower W(alpha_c, T#beta) than OT and every partial OT",
         "passed": max(r["SROT hard"]["W_alpha_c_T_beta"], r["SROT soft"]["W_alpha_c_T_beta"]) < best_partner,
         "detail": f"hard {r['SROT hard']['W_alpha_c_T_beta']:.3f}, soft {r['SROT soft']['W_alpha_c_T_beta']:.3f}, "
                   f"best partner {best_partner:.3f}"},
        {"claim": "SROT hard and soft: lower W(alpha_c, bary#beta) (barycentric projection) than OT and partial OT",
         "passed": max(r["SROT hard"]["W_alpha_c_bary"], r["SROT soft"]["W_alpha_c_bary"])
         < min(r[n]["W_alpha_c_bary"] for n in partners),
         "detail": ", ".join(f"{n} {r[n]['W_alpha_c_bary']:.3f}" for n in names)},
        {"claim": "competitors transport (nearly) all of the outliers' mass, SROT (almost) none",
         "passed": all(r[n]["outlier_mass_share"] > 0.8 * n_out / (n_out + n_clean) for n in partners)
         and max(r["SROT hard"]["outlier_mass_share"], r["SROT soft"]["outlier_mass_share"]) < 0.02,
         "detail": ", ".join(f"{n} {100 * r[n]['outlier_mass_share']:.1f} %" for n in names)},
        {"claim": "SROT maps generate no MNIST (grey) images: < 2 % of T(z) are grey",
         "passed": max(r["SROT hard"]["grey_share_T"], r["SROT soft"]["grey_share_T"]) < 0.02,
         "detail": ", ".join(f"{n} {100 * r[n]['grey_share_T']:.1f} %" for n in names)},
    ]


def _markdown(metrics: dict) -> str:
    from . import _common

    cfg, res, timing = metrics["config"], metrics["results"], metrics["timing"]
    r, detection = res["methods"], res["detection"]
    header = ["method", "W(a_c, T#b)", "W(a_c, bary#b)", "outlier mass %", "grey outputs % (T)",
              "transported mass"]
    table = [[n, r[n]["W_alpha_c_T_beta"], r[n]["W_alpha_c_bary"], 100 * r[n]["outlier_mass_share"],
              100 * r[n]["grey_share_T"], r[n]["transported_mass"]] for n in r]
    size = cfg["size"]
    md = [f"# srot-fast monge ({'quick' if cfg['quick'] else 'full'}, seed {cfg['seed']})", "",
          f"alpha = {cfg['n_clean']} MNIST-M-like + {cfg['n_outliers']} MNIST outliers, beta = {cfg['n_target']} "
          f"MNIST, {size}x{size}x3, p = 2, eps = {cfg['eps']:.4g}; W(alpha_c, beta) = "
          f"{res['W_alpha_c_beta_identity']:.4g}", "",
          _common.md_table(header, table), "",
          f"Detector: recall {detection['recall']:.3f}, clean flagged {detection['clean_flagged']:.3f}, "
          f"target flagged {detection['target_flagged']:.3f}", "", "## Claims", "",
          _common.claims_table(metrics["claims"]),
          "", f"Wall time {timing['total_s']} s (detector {timing['detector_s']} s)."]
    return "\n".join(md) + "\n"


# ----------------------------------------------------------------------------------------------------- run
def run(args) -> dict:
    """Steps: settings, data, fit (detector), solve (plans and maps), report (figures, claims, metrics files)."""
    from . import _common

    cfg = _settings(args)
    timer, device, out = _common.start(args)
    alpha_img, is_out, beta_img = build_data(cfg["n_clean"], cfg["n_out"], cfg["n_target"], cfg["size"], cfg["seed"])
    t_data = timer.read()
    det, s_alpha, s_beta, detection = _fit(alpha_img, is_out, beta_img, cfg, args, device)
    t_det = timer.read()
    sol = _solve(alpha_img, is_out, beta_img, s_alpha, s_beta, cfg, args, device)

    files = _figures(alpha_img, is_out, beta_img, sol, out)
    claims = _claims(sol["results"], detection, cfg["n_out"], cfg["n_clean"])
    config = {"quick": cfg["quick"], "seed": cfg["seed"], "backend": args.backend, "device": str(device),
              "threads": args.threads, "n_clean": cfg["n_clean"], "n_outliers": cfg["n_out"],
              "n_target": cfg["n_target"], "size": cfg["size"], "dim": sol["dim"], "p": P, "blur": cfg["blur"],
              "eps": sol["eps"], "median_distance": sol["median"], "gamma": sol["gamma"],
              "partial_masses": list(cfg["masses"]), "soft_mass": SOFT_MASS, "map_steps": cfg["map_steps"],
              "map_hidden": args.map_hidden, "detector_epochs": cfg["epochs"], "omega": float(det.omega_)}
    timing = {"total_s": timer.read(), "data_s": t_data, "detector_s": round(t_det - t_data, 2),
              "per_method_s": sol["t_methods"]}
    metrics = {"config": config, "results": {"methods": sol["results"], "detection": detection,
                                             "W_alpha_c_beta_identity": sol["w_clean_ref"]},
               "claims": claims, "timing": timing,
               "files": [Path(f).name for f in files.values()] + ["metrics.json", "metrics.md"]}
    _common.write_metrics(out, metrics, _markdown(metrics))
    return metrics
