"""Figures shared by ``srot-fast demo`` and the flow experiments (``flow2d``, ``flow-images``): toy plans as
weighted segments, the detectors' decision boundaries, beta_T per loss and snapshots of the 2-D gradient flow,
and the W / loss curves of a flow."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ._common import savefig

_COLORS = {"src": "#1f77b4", "tgt": "#d62728"}


def pct(v: float) -> str:
    """A share as a percentage with two decimals."""
    return f"{100 * v:.2f} %"


def _scatter_toy(ax, d, small: bool = False):
    s = 10 if small else 22
    for pts, t1, t2, col, lab in ((d.x, d.x_type1, d.x_type2, _COLORS["src"], "source"),
                                  (d.y, d.y_type1, d.y_type2, _COLORS["tgt"], "target")):
        clean = ~(t1 | t2)
        ax.scatter(*pts[clean].T.numpy(), s=s, c=col, edgecolors="none", label=f"{lab} clean", zorder=3)
        ax.scatter(*pts[t1].T.numpy(), s=s * 3, c=col, marker="X", edgecolors="k", linewidths=0.6,
                   label=f"{lab} type I", zorder=4)
        ax.scatter(*pts[t2].T.numpy(), s=s * 6, c=col, marker="*", edgecolors="k", linewidths=0.7,
                   label=f"{lab} type II", zorder=5)


_SEG = {"clean": (0.25, 0.25, 0.25), "type1": (0.58, 0.40, 0.74), "type2": (1.0, 0.50, 0.05)}


def _plot_plan(ax, d, plan: torch.Tensor):
    """Segments x_i -- y_j with opacity pi_ij / max pi; orange when they touch a type-II outlier, purple for
    type I, grey otherwise."""
    from matplotlib.collections import LineCollection

    pmax = float(plan.max())
    if pmax > 0:
        inten = (plan / pmax).numpy()
        ii, jj = (inten > 1e-3).nonzero()
        kind = ["type2" if (d.x_type2[i] or d.y_type2[j]) else "type1" if (d.x_type1[i] or d.y_type1[j])
                else "clean" for i, j in zip(ii, jj)]
        for group, z, lw in (("clean", 2, 0.7), ("type1", 3.5, 0.9), ("type2", 3.5, 1.3)):  # outliers above points
            ks = [k for k in range(len(ii)) if kind[k] == group]
            if ks:
                segs = [[d.x[ii[k]].tolist(), d.y[jj[k]].tolist()] for k in ks]
                rgba = [(*_SEG[group], float(min(1.0, inten[ii[k], jj[k]]))) for k in ks]
                ax.add_collection(LineCollection(segs, colors=rgba, linewidths=lw, zorder=z))
    _scatter_toy(ax, d, small=True)
    ax.set_xlim(-0.3, 3.3)
    ax.set_ylim(-4.3, 4.3)
    ax.set_xticks([])
    ax.set_yticks([])


def _legend_below(fig, handles, labels, **kw):
    """Figure legend below the axes (matplotlib >= 3.7 'outside' placement; inside on older versions)."""
    try:
        fig.legend(handles, labels, loc="outside lower center", **kw)
    except ValueError:
        fig.legend(handles, labels, loc="lower center", **kw)


def _figure(figsize):
    from matplotlib.figure import Figure

    return Figure(figsize=figsize, layout="constrained")


def fig_toy_plans(toy: dict, path: Path, dpi: int):
    """Toy plans, one panel per method (``toy["rows"]`` of (row label, [(title, key, plan, n_iter)]))."""
    rows = toy["rows"]
    ncol = max(len(p) for _, p in rows)
    fig = _figure((2.3 * ncol, 2.9 * len(rows) + 0.4))
    axes = fig.subplots(len(rows), ncol, squeeze=False)
    d = toy["data"]
    for r, (_, panels) in enumerate(rows):
        for c in range(ncol):
            ax = axes[r][c]
            if c >= len(panels):
                ax.axis("off")
                continue
            title, key, plan, _ = panels[c]
            _plot_plan(ax, d, plan)
            m = toy["methods"][key]
            ax.set_title(f"{title}\nmass {m['transported_mass']:.3f}, type II {pct(m['src_type2'])} / "
                         f"{pct(m['tgt_type2'])}", fontsize=7.5)
    handles, labels = axes[0][0].get_legend_handles_labels()
    _legend_below(fig, handles, labels, ncol=6, fontsize=7)
    fig.suptitle("Toy plans, cost |x-y|; opacity = plan entry / max entry\norange: segment touches a type-II "
                 "outlier, purple: a type-I outlier\ntitles: transported mass; share of it leaving source / "
                 "reaching target type-II outliers", fontsize=8.5)
    fig.savefig(path, dpi=dpi)


def fig_toy_boundaries(toy: dict, path: Path, dpi: int):
    """P(target) of the CE and VAT detectors on a grid, with the toy points."""
    d = toy["data"]
    fig = _figure((7.0, 5.6))
    axes = fig.subplots(1, 2, squeeze=False)[0]
    gx, gy = torch.meshgrid(torch.linspace(-0.5, 3.5, 161, dtype=torch.float64),
                            torch.linspace(-4.5, 4.5, 241, dtype=torch.float64), indexing="xy")
    grid = torch.stack([gx.reshape(-1), gy.reshape(-1)], 1)
    for ax, m, title in ((axes[0], "ce", "CE classifier (SROT-CE)"), (axes[1], "vat", "VAT classifier (SROT)")):
        prob = toy["detectors"][m].predict_proba(grid).reshape(gx.shape).numpy()
        cs = ax.contourf(gx.numpy(), gy.numpy(), prob, levels=11, cmap="RdBu_r", vmin=0, vmax=1, alpha=0.6)
        ax.contour(gx.numpy(), gy.numpy(), prob, levels=[0.5], colors="k", linewidths=1.2)
        _scatter_toy(ax, d)
        det = toy["detection"][m]
        ax.set_title(f"{title}\ntype II flagged: source {det['src_type2_found']}/{det['n_type2_per_side']}, "
                     f"target {det['tgt_type2_found']}/{det['n_type2_per_side']}", fontsize=8.5)
        ax.set_aspect("equal")
        ax.set_xlim(-0.5, 3.5)
        ax.set_ylim(-4.5, 4.5)
    fig.colorbar(cs, ax=axes, shrink=0.7, label="P(target)")
    handles, labels = axes[0].get_legend_handles_labels()
    _legend_below(fig, handles, labels, ncol=3, fontsize=7)
    fig.savefig(path, dpi=dpi)


def fig_flow(flow: dict, path: Path, dpi: int):
    """beta_0 and beta_T of each flow over alpha. ``flow``: "data" (a Flow2D), "runs" {name: {"beta_T"}},
    "methods" {name: metrics}, "lr", "steps", "blur"."""
    d = flow["data"]
    names = list(flow["runs"])
    panels = ["beta_0 (start)"] + names
    ncol = 4
    nrow = math.ceil(len(panels) / ncol)
    fig = _figure((3.0 * ncol, 1.75 * nrow + 0.6))
    axes = fig.subplots(nrow, ncol, squeeze=False)
    out = d.alpha_outlier
    for k, ax in enumerate(axes.flat):
        if k >= len(panels):
            ax.axis("off")
            continue
        name = panels[k]
        beta = d.beta0 if k == 0 else flow["runs"][name]["beta_T"]
        ax.scatter(*d.alpha[~out].T.numpy(), s=3, c=_COLORS["src"], edgecolors="none", label="alpha_c (clean data)")
        ax.scatter(*beta.T.numpy(), s=3, c=_COLORS["tgt"], edgecolors="none", alpha=0.7, label="beta_t")
        ax.scatter(*d.alpha[out].T.numpy(), s=5, c="k", edgecolors="none", label="alpha outliers")
        if k == 0:
            ax.set_title(name, fontsize=9)
        else:
            m = flow["methods"][name]
            ax.set_title(f"{name}\nW1(alpha_c, beta_T)={m['W1_alpha_c_beta_T']:.3f}, "
                         f"outl. share {pct(m['alpha_outlier_share'])}", fontsize=7.5)
        ax.set_aspect("equal")
        ax.set_xlim(-1.4, 4.3)
        ax.set_ylim(-1.4, 1.4)
        ax.set_xticks([])
        ax.set_yticks([])
    handles, labels = axes[0][0].get_legend_handles_labels()
    _legend_below(fig, handles, labels, ncol=3, fontsize=8, markerscale=3)
    fig.suptitle(f"2-D gradient flow, p=1, blur={flow['blur']}, lr={flow['lr']:.3g}, {flow['steps']} steps: "
                 "beta_T per loss", fontsize=9)
    fig.savefig(path, dpi=dpi)


def fig_flow_w(flow: dict, path: Path, dpi: int):
    """W1(alpha_c, beta_t) and the normalised loss along each flow."""
    fig = _figure((9.5, 3.6))
    ax_w, ax_h = fig.subplots(1, 2)
    for name, m in flow["methods"].items():
        ts, ws = zip(*m["W1_curve"])
        ax_w.plot(ts, ws, marker="o", ms=2.5, lw=1.2, label=name)
        h = torch.tensor(m["loss_curve"], dtype=torch.float64)
        ax_h.plot(range(1, len(h) + 1), (h / h[0]).numpy(), lw=1.2, label=name)
    ax_w.set_yscale("log")
    ax_w.set_xlabel("flow step t")
    ax_w.set_title("W1(alpha_c, beta_t) (exact, ot.emd2)", fontsize=9)
    ax_h.set_xlabel("flow step t")
    ax_h.set_title("loss h(alpha, beta_t) / h(alpha, beta_1)", fontsize=9)
    ax_h.legend(fontsize=7)
    fig.savefig(path, dpi=dpi)


def fig_snapshots(d, runs: dict, snap_steps: list, path: Path):
    """beta_t at ``snap_steps`` (columns) for each flow (rows), over alpha_c and the outliers."""
    import matplotlib.pyplot as plt

    names = list(runs)
    fig, axes = plt.subplots(len(names), len(snap_steps), figsize=(2.2 * len(snap_steps), 1.25 * len(names) + 0.5),
                             squeeze=False)
    ac, ao = d.alpha[~d.alpha_outlier].numpy(), d.alpha[d.alpha_outlier].numpy()
    for r, name in enumerate(names):
        for c, t in enumerate(snap_steps):
            ax = axes[r][c]
            ax.scatter(*ac.T, s=1.5, c="#1f77b4", edgecolors="none")
            ax.scatter(*runs[name]["snapshots"][t].numpy().T, s=1.5, c="#d62728", edgecolors="none", alpha=0.7)
            ax.scatter(*ao.T, s=2.5, c="k", edgecolors="none")
            ax.set_xlim(-1.4, 4.3)
            ax.set_ylim(-1.4, 1.4)
            ax.set_aspect("equal")
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(f"t = {t}", fontsize=8)
            if c == 0:
                ax.set_ylabel(name, fontsize=6.5)
    fig.suptitle("beta_t (red) flowing to alpha = alpha_c (blue) + outliers (black)", fontsize=9)
    fig.tight_layout()
    savefig(fig, path)


def fig_curves(methods: dict, w0: float, path: Path, n_c: int, n_b: int, *, metric: str, linthresh: float,
               cost: str):
    """W(alpha_c, beta_t) (``metric``: "W1" / "W2", the ``<metric>_curve`` of each method) and loss curves."""
    import matplotlib.pyplot as plt

    fig, (ax_w, ax_h) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, m in methods.items():
        ts, ws = zip(*m[f"{metric}_curve"])
        ax_w.plot(ts, ws, marker="o", ms=2, lw=1.2, label=name)
        ax_h.plot(range(1, len(m["loss_curve"]) + 1), m["loss_curve"], lw=1.2, label=name)
    ax_w.set_yscale("log")
    ax_w.set_xlabel("flow step t")
    ax_w.set_title(f"{metric}(alpha_c, beta_t), exact on {n_c} x {n_b} points (t=0: {w0:.3g})", fontsize=9)
    ax_h.set_xlabel("flow step t")
    ax_h.set_yscale("symlog", linthresh=linthresh)
    ax_h.set_title(f"loss h(alpha, beta_t) (Sinkhorn value, {cost})", fontsize=9)
    ax_h.legend(fontsize=7)
    fig.tight_layout()
    savefig(fig, path)
