r"""``srot-fast demo``: the paper's 2-D story in one run (toy plans, Figs. 1-2; 2-D gradient flow, §4).

Part 1 -- toy plans (:func:`srot_fast.datasets.make_toy_2d`: 75 + 75 points, 6 type-I and 4 type-II outliers
per side), cost C = |x - y| (p = 1). Plans of exact OT, unbalanced OT (KL, several tau), exact partial OT
(mass = clean share), SROT-CE (hard weights from a CE-only detector), SROT hard (VAT weights) and SROT soft
(VAT cost offsets, gamma = max C). Metric: the share of the transported mass sum(pi) that leaves source
type-II (type-I) outliers or arrives at target type-II (type-I) outliers.

Part 2 -- 2-D gradient flow (:func:`srot_fast.datasets.make_flow_2d`): the data measure alpha (clean annulus
alpha_c + 10 % type-II outliers drawn from beta0's law) is fixed; the flowing measure beta_t starts at beta0
and moves by y <- y - lr * M * grad_y h(alpha, beta_t) (GeomLoss convention, M = number of beta points).
Metrics: W1(alpha_c, beta_t) (exact, ``ot.emd2`` on |x - y|) along the flow, and the share of the transported
mass that leaves alpha's outliers in the plan at beta_T.

Why p = 1 in the flow (the paper's Euclidean cost): with blur 0.05, eps = 0.05 and max C / eps ~ 90, so a
warm-started Sinkhorn step converges in a few iterations. With p = 2 and the same blur, eps = 0.0025 and
max C / eps ~ 4000: each flow step needs hundreds of iterations (and float32 stalls near a 1e-3 marginal error).

The detector scores are computed once, on alpha (the data side). beta_t is the model: its points are never
flagged (b stays uniform, no offsets on beta), since scoring them while they move onto alpha_c would call them
outliers.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Optional

import torch

from .backends import get_ops, resolve_backend
from .datasets import make_flow_2d, make_toy_2d
from .detector import OutlierDetector
from .kernels.tensorized import cost_matrix
from .sinkhorn import sinkhorn
from .weights import hard_weights, outlier_masks, soft_offsets

__all__ = ["run", "TOY_TAUS", "TOY_TAUS_QUICK", "FLOW_REACH"]

EXTRAS_HINT = "pip install 'srot_fast[experiments]'"

# -- toy (paper Figs. 1 and 2) ---------------------------------------------------------------------------------
TOY_P = 1
TOY_BLUR = 0.02               # eps = 0.02 in cost units (p = 1): crisp plans, cheap at 75 x 75
TOY_TOL = 1e-6
TOY_TAUS = (10.0, 1.0, 0.1)   # large tau: close to OT, still moves type-I mass; small tau: drops the type-I
TOY_TAUS_QUICK = (10.0, 0.1)  # outliers and moves mostly type-II outliers (the paper's Fig. 1)

# -- 2-D gradient flow (paper §4) ------------------------------------------------------------------------------
FLOW_P = 1
FLOW_BLUR = 0.05
FLOW_TOL = 3e-3               # per flow step (warm-started); the final plan is re-solved at FINAL_TOL
FINAL_TOL = 1e-4              # plan at beta_T: share metrics accurate to ~1e-4
FLOW_MASS = 0.9               # partial OT: the clean share of alpha
FLOW_REACH = 3.0              # UOT (KL), tau = reach**p = 3 ~ the initial gap W1(alpha_c, beta_0) ~ 3: moving beta's
#                               mass across the gap costs about as much as destroying it, the regime where UOT acts as
#                               a robust variant yet beta_t still flows to alpha_c (a smaller reach leaves most of
#                               beta at the outliers, a larger one behaves like OT)
FLOW_LR = 0.01
FLOW_STEPS, FLOW_N, FLOW_EVERY = 400, 1000, 20
QUICK_STEPS, QUICK_N, QUICK_EVERY = 60, 300, 10
OUTLIER_FRAC = 0.1
CLAIM_MAX_SROT = 0.01         # SROT hard / soft: at most 1 % of the transported mass from / to type-II outliers
CLAIM_TOL = 1e-3              # slack below the outliers' share allowed for OT / UOT / partial (Sinkhorn tol, eps)


# ------------------------------------------------------------------------------------------------- helpers
def _require(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(f"srot-fast demo needs {module!r}: {EXTRAS_HINT}") from err


class _Timer:
    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def read(self) -> dict:
        return {"wall_s": round(time.perf_counter() - self.wall, 2), "cpu_s": round(time.process_time() - self.cpu, 2)}


def _uniform(n: int, dtype, mass: float = 1.0) -> torch.Tensor:
    return torch.full((n,), mass / n, dtype=dtype)


def _w1(x: torch.Tensor, y: torch.Tensor) -> float:
    """Exact W1 between uniform measures on x (N, 2) and y (M, 2) (``ot.emd2``, cost |x - y|)."""
    ot = _require("ot")
    xn, yn = x.detach().double().numpy(), y.detach().double().numpy()
    c = ot.dist(xn, yn, metric="euclidean")
    return float(ot.emd2(_uniform(len(xn), torch.float64).numpy(), _uniform(len(yn), torch.float64).numpy(), c,
                         numItermax=10_000_000))


def _pct(v: float) -> str:
    return f"{100 * v:.2f} %"


# ------------------------------------------------------------------------------------------------- toy part
def _toy_shares(plan: torch.Tensor, d) -> dict:
    """Share of the transported mass sum(pi) that leaves / reaches each outlier type."""
    total = float(plan.sum())
    share = (lambda v: float(v) / total) if total > 0 else (lambda v: float("nan"))
    return {
        "transported_mass": total,
        "src_type2": share(plan[d.x_type2].sum()),
        "tgt_type2": share(plan[:, d.y_type2].sum()),
        "src_type1": share(plan[d.x_type1].sum()),
        "tgt_type1": share(plan[:, d.y_type1].sum()),
    }


def _toy_part(seed: int, taus, backend: str, progress: bool) -> dict:
    from .partners import exact_ot, exact_partial

    d = make_toy_2d(n=75, n_type1=6, n_type2=4, seed=seed, dtype=torch.float64)
    x, y = d.x, d.y
    n = len(x)
    det = {m: OutlierDetector(method=m, seed=seed, progress=progress).fit(x, y) for m in ("ce", "vat")}
    scores = {m: (det[m].predict_proba(x), det[m].predict_proba(y)) for m in det}
    detection = {}
    for m, (s_x, s_y) in scores.items():
        ox, oy = outlier_masks(s_x, s_y)
        detection[m] = {"src_type2_found": int((ox & d.x_type2).sum()), "tgt_type2_found": int((oy & d.y_type2).sum()),
                        "n_type2_per_side": int(d.x_type2.sum()),
                        "clean_flagged": int((ox & ~d.x_type2).sum() + (oy & ~d.y_type2).sum())}
    a, b = _uniform(n, x.dtype), _uniform(n, y.dtype)
    gamma = float(cost_matrix(x, y, TOY_P).max())
    u, v = soft_offsets(*scores["vat"], gamma)
    w_ce = hard_weights(a, scores["ce"][0], b, scores["ce"][1])
    w_vat = hard_weights(a, scores["vat"][0], b, scores["vat"][1])

    def uot(tau, ww=(a, b), offsets=(None, None)):
        res = sinkhorn(x, y, ww[0], ww[1], p=TOY_P, eps=TOY_BLUR**TOY_P, penalty="kl", tau=tau, u=offsets[0],
                       v=offsets[1], tol=TOY_TOL, max_iter=50_000, backend=backend)
        return res.plan(), res.n_iter

    # rows of the figure: (row label, [(panel title, method key, plan, n_iter)])
    rows = []
    clean_share = float((~(d.x_type1 | d.x_type2)).sum()) / n
    rows.append(("OT / UOT", [("OT (exact)", "OT", exact_ot(x, y, a, b, p=TOY_P)[1], None)]
                 + [(f"UOT tau={t:g}", f"UOT tau={t:g}", *uot(t)) for t in taus]))
    rows.append(("SROT-CE hard", [("SROT-CE hard + OT", "SROT-CE hard + OT", exact_ot(x, y, *w_ce, p=TOY_P)[1], None)]
                 + [(f"SROT-CE hard + UOT tau={t:g}", f"SROT-CE hard + UOT tau={t:g}", *uot(t, w_ce)) for t in taus]))
    rows.append(("SROT hard", [("SROT hard + OT", "SROT hard + OT", exact_ot(x, y, *w_vat, p=TOY_P)[1], None)]
                 + [(f"SROT hard + UOT tau={t:g}", f"SROT hard + UOT tau={t:g}", *uot(t, w_vat)) for t in taus]))
    partial = exact_partial(x, y, a, b, mass=clean_share, p=TOY_P)[1]
    rows.append(("partial / SROT soft", [(f"Partial OT (exact, m={clean_share:.3f})", "Partial OT", partial, None)]
                 + [(f"SROT soft + UOT tau={t:g}", f"SROT soft + UOT tau={t:g}", *uot(t, offsets=(u, v)))
                    for t in taus]))
    methods = {}
    for _, panels in rows:
        for _, key, plan, n_iter in panels:
            methods[key] = {**_toy_shares(plan, d), "sinkhorn_iters": n_iter}
    return {"data": d, "detectors": det, "scores": scores, "rows": rows, "methods": methods, "detection": detection,
            "gamma": gamma, "clean_share": clean_share, "taus": list(taus)}


# ------------------------------------------------------------------------------------------------ flow part
def _flow_method(name: str, alpha, beta0, alpha_c, *, a, b, solver_kw: dict, soft_scores, lr: float, steps: int,
                 every: int, backend: str, progress: bool, w0: Optional[float] = None) -> dict:
    """Run one flow; returns beta_T, the W1 curve, per-step iterations and the plan-at-beta_T metrics."""
    from tqdm.auto import tqdm

    timer = _Timer()
    y = beta0.clone()
    m = len(y)
    init = None
    iters, values, curve = [], [], [(0, _w1(alpha_c, y) if w0 is None else w0)]
    ones = torch.ones(1, dtype=alpha.dtype)

    ops = get_ops(resolve_backend(backend, len(alpha), m, alpha.device))

    def solve(y_, init_, tol, max_iter):
        u = None
        if soft_scores is not None:  # paper's gamma = max_ij C(x_i, y_j), per step; offsets on alpha only
            gamma = float(ops.max_cost(alpha, y_.detach(), FLOW_P))
            u, _ = soft_offsets(soft_scores, ones, gamma)
        return sinkhorn(alpha, y_, a, b, p=FLOW_P, eps=FLOW_BLUR**FLOW_P, u=u, tol=tol, max_iter=max_iter,
                        backend=backend, init=init_, **solver_kw)

    bar = tqdm(range(1, steps + 1), desc=f"flow: {name}", disable=not progress, leave=False)
    for t in bar:
        y.requires_grad_(True)
        res = solve(y, init, FLOW_TOL, 2000)
        (grad,) = torch.autograd.grad(res.value, y)
        init = (res.f.detach(), res.g.detach())
        iters.append(res.n_iter)
        values.append(float(res.value.detach()))
        y = (y.detach() - lr * m * grad).detach()
        if t % every == 0 or t == steps:
            curve.append((t, _w1(alpha_c, y)))
    bar.close()
    final = solve(y, init, FINAL_TOL, 5000)
    return {"beta_T": y, "curve": curve, "iters": iters, "values": values, "row_mass": final.row_mass,
            "final_value": float(final.value.detach()), "final_iters": final.n_iter,
            "final_marginal_error": final.marginal_error, "time": timer.read(), "backend": final.backend}


def _flow_part(seed: int, quick: bool, backend: str, progress: bool) -> dict:
    n, steps, every = (QUICK_N, QUICK_STEPS, QUICK_EVERY) if quick else (FLOW_N, FLOW_STEPS, FLOW_EVERY)
    lr = FLOW_LR * FLOW_STEPS / steps  # quick: same total flow time lr * steps as the full run
    d = make_flow_2d(n, OUTLIER_FRAC, seed=seed, dtype=torch.float32)
    alpha, beta0, out = d.alpha, d.beta0, d.alpha_outlier
    alpha_c = alpha[~out]
    det = {m: OutlierDetector(method=m, seed=seed, progress=progress).fit(alpha, beta0) for m in ("ce", "vat")}
    s_alpha = {m: det[m].predict_proba(alpha) for m in det}
    detection = {}
    for m in det:
        flagged = s_alpha[m] > 0.5
        detection[m] = {"alpha_outliers_found": int((flagged & out).sum()), "n_alpha_outliers": int(out.sum()),
                        "alpha_clean_flagged": int((flagged & ~out).sum()),
                        "beta0_flagged": int((det[m].predict_proba(beta0) < 0.5).sum())}
    a, b = _uniform(n, alpha.dtype), _uniform(n, beta0.dtype)
    beta_clean = torch.ones(n, dtype=beta0.dtype)  # P(target) = 1: beta's points are never flagged

    def hard(m):
        return hard_weights(a, s_alpha[m], b, beta_clean)

    specs = [
        ("OT", dict(a=a, b=b, solver_kw={}, soft_scores=None)),
        (f"UOT (KL, reach={FLOW_REACH:g})", dict(a=a, b=b, solver_kw=dict(penalty="kl", tau=FLOW_REACH**FLOW_P),
                                                 soft_scores=None)),
        (f"Partial OT (m={FLOW_MASS:g})", dict(a=a, b=b, solver_kw=dict(mass=FLOW_MASS), soft_scores=None)),
        ("SROT-CE hard", dict(a=hard("ce")[0], b=b, solver_kw={}, soft_scores=None)),
        ("SROT hard", dict(a=hard("vat")[0], b=b, solver_kw={}, soft_scores=None)),
        (f"SROT soft (partial m={FLOW_MASS:g})", dict(a=a, b=b, solver_kw=dict(mass=FLOW_MASS),
                                                      soft_scores=s_alpha["vat"])),
        ("SROT soft (rescaled)", dict(a=a, b=_uniform(n, beta0.dtype, FLOW_MASS), solver_kw=dict(mass=FLOW_MASS),
                                      soft_scores=s_alpha["vat"])),
    ]
    runs, methods = {}, {}
    w0 = _w1(alpha_c, beta0)
    for name, kw in specs:
        r = _flow_method(name, alpha, beta0, alpha_c, lr=lr, steps=steps, every=every, backend=backend,
                         progress=progress, w0=w0, **kw)
        runs[name] = r
        row = r["row_mass"]
        total = float(row.sum())
        near = (r["beta_T"] - beta0.mean(0)).norm(dim=1) < 1.0  # beta_T points left in beta0's blob (3.3 sigma)
        iters = torch.tensor(r["iters"], dtype=torch.float64)
        methods[name] = {
            "W1_alpha_c_beta_0": w0,
            "W1_alpha_c_beta_T": r["curve"][-1][1],
            "alpha_outlier_share": float(row[out].sum()) / total,
            "transported_mass": total,
            "beta_T_left_at_outliers": float(near.double().mean()),
            "mean_iters_per_step": float(iters.mean()),
            "max_iters_per_step": int(iters.max()),
            "total_iters": int(iters.sum()),
            "final_plan_iters": r["final_iters"],
            "final_marginal_error": r["final_marginal_error"],
            "backend": r["backend"],
            "time": r["time"],
            "W1_curve": [[t, w] for t, w in r["curve"]],
            "loss_curve": r["values"],
        }
    return {"data": d, "runs": runs, "methods": methods, "detection": detection, "n": n, "steps": steps,
            "every": every, "lr": lr}


# ------------------------------------------------------------------------------------------------- figures
_COLORS = {"src": "#1f77b4", "tgt": "#d62728"}


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


def _fig_toy_plans(toy: dict, path: Path, dpi: int):
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
            ax.set_title(f"{title}\nmass {m['transported_mass']:.3f}, type II {_pct(m['src_type2'])} / "
                         f"{_pct(m['tgt_type2'])}", fontsize=7.5)
    handles, labels = axes[0][0].get_legend_handles_labels()
    _legend_below(fig, handles, labels, ncol=6, fontsize=7)
    fig.suptitle("Toy plans, cost |x-y|; opacity = plan entry / max entry\norange: segment touches a type-II "
                 "outlier, purple: a type-I outlier\ntitles: transported mass; share of it leaving source / "
                 "reaching target type-II outliers", fontsize=8.5)
    fig.savefig(path, dpi=dpi)


def _fig_toy_boundaries(toy: dict, path: Path, dpi: int):
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


def _fig_flow(flow: dict, path: Path, dpi: int):
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
                         f"outl. share {_pct(m['alpha_outlier_share'])}", fontsize=7.5)
        ax.set_aspect("equal")
        ax.set_xlim(-1.4, 4.3)
        ax.set_ylim(-1.4, 1.4)
        ax.set_xticks([])
        ax.set_yticks([])
    handles, labels = axes[0][0].get_legend_handles_labels()
    _legend_below(fig, handles, labels, ncol=3, fontsize=8, markerscale=3)
    fig.suptitle(f"2-D gradient flow, p=1, blur={FLOW_BLUR}, lr={flow['lr']:.3g}, {flow['steps']} steps: "
                 "beta_T per loss", fontsize=9)
    fig.savefig(path, dpi=dpi)


def _fig_flow_w(flow: dict, path: Path, dpi: int):
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


# ------------------------------------------------------------------------------------------------- claims
def _claims(toy: dict, flow: dict) -> list:
    """Headline claims of the paper checked on this run: (claim, value, bound, passed)."""
    out = []
    t = toy["methods"]
    share_toy = toy["data"].x_type2.float().mean().item()  # 4 / 75
    for key, m in t.items():
        worst = max(m["src_type2"], m["tgt_type2"])
        if key.startswith(("SROT hard", "SROT soft")):
            out.append({"part": "toy", "method": key, "claim": "type-II share <= 1 %", "value": worst,
                        "bound": CLAIM_MAX_SROT, "passed": worst <= CLAIM_MAX_SROT})
        elif key.startswith(("OT", "UOT", "Partial")):
            low = min(m["src_type2"], m["tgt_type2"])
            out.append({"part": "toy", "method": key, "claim": "type-II share >= 4/75 (outliers' share)",
                        "value": low, "bound": share_toy - CLAIM_TOL, "passed": low >= share_toy - CLAIM_TOL})
    for key, m in flow["methods"].items():
        v = m["alpha_outlier_share"]
        if key.startswith(("SROT hard", "SROT soft")):
            out.append({"part": "flow", "method": key, "claim": "alpha-outlier share <= 1 %", "value": v,
                        "bound": CLAIM_MAX_SROT, "passed": v <= CLAIM_MAX_SROT})
        elif key.startswith(("OT", "UOT", "Partial")):
            out.append({"part": "flow", "method": key, "claim": "alpha-outlier share >= 10 % (outliers' share)",
                        "value": v, "bound": OUTLIER_FRAC - CLAIM_TOL, "passed": v >= OUTLIER_FRAC - CLAIM_TOL})
    w_ot, w_hard = flow["methods"]["OT"]["W1_alpha_c_beta_T"], flow["methods"]["SROT hard"]["W1_alpha_c_beta_T"]
    out.append({"part": "flow", "method": "SROT hard vs OT", "claim": "W1(alpha_c, beta_T): SROT hard < OT",
                "value": w_hard, "bound": w_ot, "passed": w_hard < w_ot})
    return out


# ------------------------------------------------------------------------------------------------- report
def _markdown(metrics: dict) -> str:
    cfg = metrics["config"]
    lines = [f"# srot-fast demo ({'quick' if cfg['quick'] else 'full'}, seed {cfg['seed']})", "",
             f"## Toy plans (p=1, blur={TOY_BLUR}, {cfg['toy_n']} + {cfg['toy_n']} points, 6 type-I + 4 type-II "
             "outliers per side)", "",
             "Share of the transported mass sum(pi) that leaves source / reaches target outliers. "
             f"Outliers' share of the uniform mass: type II 4/75 = {_pct(4 / 75)}, type I 6/75 = {_pct(6 / 75)}.", "",
             "| method | transported mass | src type II | tgt type II | src type I | tgt type I |",
             "|---|---:|---:|---:|---:|---:|"]
    for key, m in metrics["toy"]["methods"].items():
        lines.append(f"| {key} | {m['transported_mass']:.3f} | {_pct(m['src_type2'])} | {_pct(m['tgt_type2'])} | "
                     f"{_pct(m['src_type1'])} | {_pct(m['tgt_type1'])} |")
    det = metrics["toy"]["detection"]
    lines += ["", "Detectors (type II flagged per side / clean points flagged): "
              + ", ".join(f"{m.upper()}: source {v['src_type2_found']}/{v['n_type2_per_side']}, target "
                          f"{v['tgt_type2_found']}/{v['n_type2_per_side']}, clean {v['clean_flagged']}"
                          for m, v in det.items()), ""]
    fl = metrics["flow"]
    lines += [f"## 2-D gradient flow (p=1, blur={FLOW_BLUR}, n={fl['n']}, {fl['steps']} steps, lr={fl['lr']:.3g}, "
              f"{int(OUTLIER_FRAC * 100)} % type-II outliers in alpha)", "",
              "W1 = exact W1 (ot.emd2, cost |x-y|) between alpha_c and beta_T. Outlier share = share of the "
              "transported mass leaving alpha's outliers (plan at beta_T, tol 1e-4). 'left at outliers' = share of "
              "beta_T within distance 1 of beta0's mean.", "",
              "| method | W1(alpha_c, beta_T) | alpha-outlier share | transported mass | beta_T left at outliers "
              "| Sinkhorn iters/step (mean / max) | time (s) |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for key, m in fl["methods"].items():
        lines.append(f"| {key} | {m['W1_alpha_c_beta_T']:.4f} | {_pct(m['alpha_outlier_share'])} | "
                     f"{m['transported_mass']:.3f} | {_pct(m['beta_T_left_at_outliers'])} | "
                     f"{m['mean_iters_per_step']:.1f} / {m['max_iters_per_step']} | {m['time']['wall_s']:.1f} |")
    w0 = next(iter(fl["methods"].values()))["W1_alpha_c_beta_0"]
    lines += ["", f"W1(alpha_c, beta_0) = {w0:.4f}. Detectors on alpha: "
              + ", ".join(f"{m.upper()}: outliers {v['alpha_outliers_found']}/{v['n_alpha_outliers']}, clean flagged "
                          f"{v['alpha_clean_flagged']}" for m, v in fl["detection"].items()), "",
              "## Claims", "", "| part | method | claim | value | bound | passed |", "|---|---|---|---:|---:|---|"]
    for c in metrics["claims"]:
        val = f"{c['value']:.4f}" if "W1" in c["claim"] else _pct(c["value"])
        bnd = f"{c['bound']:.4f}" if "W1" in c["claim"] else _pct(c["bound"])
        lines.append(f"| {c['part']} | {c['method']} | {c['claim']} | {val} | {bnd} | "
                     f"{'yes' if c['passed'] else '**NO**'} |")
    tm = metrics["timing"]
    lines += ["", f"Time: toy {tm['toy']['wall_s']} s wall / {tm['toy']['cpu_s']} s CPU, flow {tm['flow']['wall_s']} s "
              f"/ {tm['flow']['cpu_s']} s, figures {tm['figures']['wall_s']} s, total {tm['total']['wall_s']} s wall / "
              f"{tm['total']['cpu_s']} s CPU ({cfg['num_threads']} torch thread(s)).", ""]
    return "\n".join(lines)


def run(out_dir, quick: bool = False, seed: int = 0, backend: str = "auto", progress: bool = True,
        num_threads: Optional[int] = 1, dpi: int = 80) -> dict:
    """Run the 2-D demo and write ``toy_plans.png``, ``toy_boundaries.png``, ``flow2d.png``, ``flow_w.png``,
    ``metrics.json`` and ``metrics.md`` into ``out_dir``; print the Markdown table; return the metrics dict.

    Args:
        out_dir: output folder (created).
        quick: fewer tau values on the toy, flow with n = 300 points and 60 steps (same lr * steps).
        seed: data and detector seed.
        backend: Sinkhorn backend ('auto', 'tensorized', 'cpu', 'keops', 'triton').
        progress: tqdm bars (detector training, flow steps).
        num_threads: torch threads during the run (restored after). 1 by default: the kernels here are small,
            and OpenMP threads that wait for busy cores slow them down. None keeps torch's setting.
        dpi: resolution of the PNG figures.
    """
    _require("matplotlib")
    _require("ot")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    old_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(int(num_threads))
    try:
        total = _Timer()
        tm = _Timer()
        toy = _toy_part(seed, TOY_TAUS_QUICK if quick else TOY_TAUS, backend, progress)
        t_toy = tm.read()
        tm = _Timer()
        flow = _flow_part(seed, quick, backend, progress)
        t_flow = tm.read()
        tm = _Timer()
        files = {"toy_plans": out / "toy_plans.png", "toy_boundaries": out / "toy_boundaries.png",
                 "flow2d": out / "flow2d.png", "flow_w": out / "flow_w.png"}
        _fig_toy_plans(toy, files["toy_plans"], dpi)
        _fig_toy_boundaries(toy, files["toy_boundaries"], dpi)
        _fig_flow(flow, files["flow2d"], dpi)
        _fig_flow_w(flow, files["flow_w"], dpi)
        t_fig = tm.read()
        metrics = {
            "config": {"quick": quick, "seed": seed, "backend": backend, "num_threads": torch.get_num_threads(),
                       "toy_n": 75, "toy_p": TOY_P, "toy_blur": TOY_BLUR, "toy_tol": TOY_TOL, "toy_taus": toy["taus"],
                       "toy_gamma": toy["gamma"], "toy_partial_mass": toy["clean_share"],
                       "flow_n": flow["n"], "flow_steps": flow["steps"], "flow_lr": flow["lr"], "flow_p": FLOW_P,
                       "flow_blur": FLOW_BLUR, "flow_tol": FLOW_TOL, "final_tol": FINAL_TOL, "flow_reach": FLOW_REACH,
                       "flow_mass": FLOW_MASS, "outlier_frac": OUTLIER_FRAC, "w1_every": flow["every"]},
            "toy": {"methods": toy["methods"], "detection": toy["detection"]},
            "flow": {"methods": flow["methods"], "detection": flow["detection"], "n": flow["n"],
                     "steps": flow["steps"], "lr": flow["lr"]},
            "claims": _claims(toy, flow),
        }
        metrics["timing"] = {"toy": t_toy, "flow": t_flow, "figures": t_fig, "total": total.read()}
        metrics["files"] = {k: str(v) for k, v in files.items()} | {"json": str(out / "metrics.json"),
                                                                     "md": str(out / "metrics.md")}
        md = _markdown(metrics)
        (out / "metrics.md").write_text(md)
        (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
        print(md)
        return metrics
    finally:
        if num_threads is not None:
            torch.set_num_threads(old_threads)
