r"""``srot-fast cloud3d``: transport plans between 3-D point clouds with 10 % type-II outliers, large enough for
the block-sparse CPU backend.

Source x: a sphere shell (unit sphere, centre 0) plus 10 % type-II outliers drawn from the target's law;
target y: a torus (major radius 1, tube 0.25) centred at (3, 0, 0) (:func:`srot_fast.datasets.make_cloud_3d`).
Plans, all with cost |x - y|^2 / 2 (p = 2), blur 0.05 (eps = 0.0025), uniform weights, Sinkhorn ``tol=1e-3``:

- OT (balanced): moves all of x, so 10 % of its mass leaves the outliers;
- partial OT (mass 0.9): moves the outliers first (they sit on the target), ~1/9 of its mass;
- SROT hard + OT: the VAT detector (:class:`srot_fast.OutlierDetector`, trained on at most
  ``--detector-points`` points per cloud, then scoring every point) flags the source points it puts on the
  target's side; their weights go to zero (:func:`srot_fast.hard_weights`) and the plan moves none of their mass.

At the default n = 40 000 per cloud, N M = 1.6e9 >= 1e9 and the blur is 0.008 x the bounding-box diagonal (6.2),
so ``backend="auto"`` picks ``blocksparse`` on CPU (:func:`srot_fast.backends.resolve_backend`); ``--quick``
(2000 points) runs the dense ``cpu`` kernel. On these surfaces the block-sparse bound keeps more than half
of the point pairs once the potentials are solved, so the passes at the target eps run the dense kernel and
what the backend saves is the large-eps work (its coarse-to-fine start). Metrics per plan: the share of the
transported mass that leaves x's outliers, the transported mass, the value, iterations, the backend and
(block-sparse) the fraction of point pairs the last pass evaluated.
"""
from __future__ import annotations

import torch

from . import _common
from ._figures import pct
from .flow2d import DETECTOR_POINTS, fit_detectors, subsample_index

NAME = "cloud3d"
HELP = ("3-D point clouds (sphere shell -> torus) with 10 percent type-II outliers: OT, partial OT and SROT hard "
        "plans (block-sparse CPU backend at the default size)")

DEFAULT_N, QUICK_N = 40_000, 2000
OUTLIER_FRAC = 0.1
P = 2                 # ground cost |x - y|^2 / 2
BLUR = 0.05           # eps = BLUR**P
TOL = 1e-3            # Sinkhorn marginal tolerance: shares accurate to ~1e-3
MASS = 0.9            # partial OT: the clean share of x
MAX_SROT_SHARE = 0.01  # SROT hard: at most 1 % of the transported mass leaves x's outliers
SHARE_TOL = 2e-3      # slack below the outliers' 10 % share for OT / partial OT (Sinkhorn tolerance)
PLOT_POINTS = 3000


def add_arguments(p) -> None:
    p.add_argument("--n", type=_common.int_at_least(20), default=None,
                   help=f"points per cloud (default {DEFAULT_N}: block-sparse on CPU; --quick {QUICK_N})")
    p.add_argument("--detector-points", type=_common.int_at_least(10), default=DETECTOR_POINTS,
                   help=f"the VAT detector trains on random subsamples of at most this many points per cloud "
                        f"(default {DETECTOR_POINTS}) and scores every point")


def _settings(args) -> dict:
    return {"n": args.n if args.n is not None else (QUICK_N if args.quick else DEFAULT_N)}


# metrics.json's "detection" uses flow2d's keys: alpha = the source x, beta0 = the target y


def _plan(name, x, y, a, b, is_out, backend, **kw) -> dict:
    """One Sinkhorn plan and its metrics (share of the moved mass leaving x's outliers, ...)."""
    from ..kernels import blocksparse
    from ..sinkhorn import sinkhorn

    t = _common.Timer()
    res = sinkhorn(x, y, a, b, p=P, eps=BLUR**P, tol=TOL, backend=backend, **kw)
    row = res.row_mass.detach()
    moved = float(row.sum())
    share = float(row[is_out].sum()) / moved if moved > 0 else float("nan")
    if not (torch.isfinite(row).all() and moved > 0):
        raise FloatingPointError(f"{name}: the plan's row masses are not finite and positive")
    return {"alpha_outlier_share": share, "transported_mass": moved, "value": float(res.value.detach()),
            "n_iter": int(res.n_iter), "marginal_error": float(res.marginal_error), "converged": bool(res.converged),
            "backend": res.backend,
            "kept_fraction_last_pass": blocksparse.last_kept_fraction() if res.backend == "blocksparse" else None,
            **t.both()}


def run(args) -> dict:
    from ..backends import resolve_backend
    from ..datasets import make_cloud_3d
    from ..geometry import bbox_diameter
    from ..weights import hard_weights

    n = _settings(args)["n"]
    total, device, out = _common.start(args)
    d = make_cloud_3d(n, outlier_frac=OUTLIER_FRAC, seed=args.seed, dtype=torch.float32)
    x, y, is_out = d.x.to(device), d.y.to(device), d.x_outlier.to(device)

    tm = _common.Timer()
    scores, detection = fit_detectors(x, y, is_out, ("vat",), seed=args.seed, progress=args.progress, device=device,
                                      max_points=args.detector_points)
    t_det = tm.read()

    a = torch.full((n,), 1.0 / n, dtype=x.dtype, device=device)
    b = torch.full((n,), 1.0 / n, dtype=x.dtype, device=device)
    a_hard = hard_weights(a, scores["vat"], b, torch.ones_like(b))[0]
    tm = _common.Timer()
    methods = {
        "OT": _plan("OT", x, y, a, b, is_out, args.backend),
        f"Partial OT (m={MASS:g})": _plan("partial OT", x, y, a, b, is_out, args.backend, mass=MASS),
        "SROT hard": _plan("SROT hard", x, y, a_hard, b, is_out, args.backend),
    }
    t_plans = tm.read()

    tm = _common.Timer()
    files = {"cloud3d": out / "cloud3d.png"}
    gen = torch.Generator().manual_seed(args.seed + 1)
    _figure(d, subsample_index(n, PLOT_POINTS, gen), subsample_index(n, PLOT_POINTS, gen), scores["vat"].cpu(),
            methods, files["cloud3d"])
    t_fig = tm.read()

    diam = float(bbox_diameter(x, y))
    config = {"quick": bool(args.quick), "seed": args.seed, "backend": args.backend,
              "backend_auto_pick": resolve_backend("auto", n, n, device, points=(x, y), eps=BLUR**P, p=P),
              "device": str(device), "threads": torch.get_num_threads(), "n": n, "p": P, "blur": BLUR, "tol": TOL,
              "partial_mass": MASS, "outlier_frac": OUTLIER_FRAC, "bbox_diameter": diam,
              "blur_over_diameter": BLUR / diam, "detector_points": args.detector_points}
    metrics = {"config": config, "results": {"methods": methods, "detection": detection},
               "claims": _claims(methods, detection),
               "timing": {"detector_s": t_det, "plans_s": t_plans, "figures_s": t_fig, "total_s": total.read()},
               "files": {k: str(v) for k, v in files.items()} | {"json": str(out / "metrics.json"),
                                                                 "md": str(out / "metrics.md")}}
    _common.write_metrics(out, metrics, _markdown(metrics))
    return metrics


def _claims(methods: dict, detection: dict) -> list:
    claim = _common.claim
    share = {k: v["alpha_outlier_share"] for k, v in methods.items()}
    out = [claim("SROT hard moves <= 1 % of its mass from the source's outliers", share["SROT hard"] <= MAX_SROT_SHARE,
                 f"share {pct(share['SROT hard'])}")]
    for k in methods:
        if k != "SROT hard":
            out.append(claim(f"{k} moves >= the outliers' 10 % share from them", share[k] >= OUTLIER_FRAC - SHARE_TOL,
                             f"share {pct(share[k])}"))
    v = detection["vat"]
    out.append(claim("the VAT detector flags all of the source's outliers",
                     v["alpha_outliers_found"] == v["n_alpha_outliers"],
                     f"{v['alpha_outliers_found']}/{v['n_alpha_outliers']} found, {v['alpha_clean_flagged']} clean "
                     "flagged"))
    return out


def _figure(d, ia, ib, s_x, methods, path):
    """The clouds (x clean / x flagged / x outliers / y, subsampled) and the outlier share of each plan."""
    import matplotlib.pyplot as plt

    from ._common import savefig

    fig = plt.figure(figsize=(11, 4.5))
    ax = fig.add_subplot(1, 2, 1, projection="3d")
    x, out_mask, flagged = d.x[ia], d.x_outlier[ia], s_x[ia] > 0.5
    ax.scatter(*d.y[ib].T.numpy(), s=2, c="#d62728", alpha=0.3, label="target (torus)")
    ax.scatter(*x[~out_mask].T.numpy(), s=2, c="#1f77b4", alpha=0.4, label="source clean (sphere)")
    ax.scatter(*x[out_mask].T.numpy(), s=8, c="#ff7f0e", label="source type-II outliers")
    ax.scatter(*x[flagged & ~out_mask].T.numpy(), s=20, c="k", marker="x", label="clean points flagged")
    ax.set_box_aspect((5.25, 2.5, 2.0))
    ax.legend(loc="upper left", fontsize=7)
    ax.set_title(f"{len(d.x)} + {len(d.y)} points (plotted: {len(ia)} + {len(ib)})", fontsize=9)
    ax2 = fig.add_subplot(1, 2, 2)
    names = list(methods)
    ax2.bar(names, [100 * methods[k]["alpha_outlier_share"] for k in names], color=["#7f7f7f", "#9467bd", "#2ca02c"])
    ax2.axhline(100 * OUTLIER_FRAC, color="k", ls="--", lw=0.8, label="outliers' share of the source")
    ax2.set_ylabel("transported mass leaving the outliers (%)")
    ax2.legend(fontsize=8)
    savefig(fig, path, 80)


def _markdown(metrics: dict) -> str:
    cfg, res = metrics["config"], metrics["results"]
    rows = [[k, pct(m["alpha_outlier_share"]), m["transported_mass"], m["value"], m["n_iter"], m["backend"],
             "-" if m["kept_fraction_last_pass"] is None else f"{m['kept_fraction_last_pass']:.3f}", m["wall_s"]]
            for k, m in res["methods"].items()]
    v = res["detection"]["vat"]
    lines = [f"# srot-fast cloud3d ({'quick' if cfg['quick'] else 'full'}, seed {cfg['seed']}, device {cfg['device']})",
             "", f"n={cfg['n']} points per cloud (sphere shell + {int(100 * cfg['outlier_frac'])} % type-II outliers "
             f"-> torus), p={cfg['p']}, blur={cfg['blur']} ({cfg['blur_over_diameter']:.4f} x the bounding-box "
             f"diagonal), tol={cfg['tol']}; backend {cfg['backend']!r} (auto picks {cfg['backend_auto_pick']!r}). "
             "Outlier share = share of the transported mass leaving the source's outliers.", "",
             _common.md_table(["method", "outlier share", "transported mass", "value", "iterations", "backend",
                               "kept pairs (last pass)", "wall (s)"], rows), "",
             f"VAT detector (trained on {v['train_points'][0]} + {v['train_points'][1]} points): "
             f"{v['alpha_outliers_found']}/{v['n_alpha_outliers']} outliers found, {v['alpha_clean_flagged']} clean "
             "points flagged.", "", "## Claims", "", _common.claims_table(metrics["claims"]), "",
             "Timing (s): " + ", ".join(f"{k} {v}" for k, v in metrics["timing"].items())
             + f" ({cfg['threads']} torch thread(s)).", ""]
    return "\n".join(lines)
