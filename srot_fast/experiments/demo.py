r"""``srot-fast demo``: the paper's 2-D story in one run (toy plans, Figs. 1-2; 2-D gradient flow, §4).

Part 1 -- toy plans (:func:`srot_fast.datasets.make_toy_2d`: 75 + 75 points, 6 type-I and 4 type-II outliers
per side), cost C = |x - y| (p = 1). Plans of exact OT, unbalanced OT (KL, several tau), exact partial OT
(mass = clean share), SROT-CE (hard weights from a CE-only detector), SROT hard (VAT weights) and SROT soft
(VAT cost offsets, gamma = max C). Metric: the share of the transported mass sum(pi) that leaves source
type-II (type-I) outliers or arrives at target type-II (type-I) outliers.

Part 2 -- the 2-D gradient flow of ``srot-fast flow2d`` (:func:`srot_fast.experiments.flow2d.run_flows`, same
losses, cost |x - y|, blur 0.05): the data measure alpha (clean annulus alpha_c + 10 % type-II outliers drawn
from beta0's law) is fixed; the flowing measure beta_t starts at beta0 and moves by
y <- y - lr * M * grad_y h(alpha, beta_t) (GeomLoss convention, M = number of beta points). Metrics:
W1(alpha_c, beta_t) (exact, ``ot.emd2`` on |x - y|) along the flow, and the share of the transported mass that
leaves alpha's outliers in the plan at beta_T. The detector scores are computed once, on alpha (the data side).
beta_t is the model: its points are never flagged (b stays uniform, no offsets on beta), since scoring them
while they move onto alpha_c would call them outliers.

The toy part runs on the CPU; the flow runs on ``--device`` (default cpu).
"""
from __future__ import annotations

import torch

from . import _common, flow2d
from ._figures import fig_flow, fig_flow_w, fig_toy_boundaries, fig_toy_plans, pct
from .flow2d import MAX_SROT_SHARE, OUTLIER_FRAC, SHARE_TOL, exact_w

NAME = "demo"
HELP = "2-D story of the paper: toy plans (Figs. 1-2) and the 2-D gradient flow (§4)"
DEFAULT_DEVICE = "cpu"

TOY_N = 75
TOY_P = 1
TOY_BLUR = 0.02               # eps = 0.02 in cost units (p = 1): crisp plans, cheap at 75 x 75
TOY_TOL = 1e-6
TOY_TAUS = (10.0, 1.0, 0.1)   # large tau: close to OT, still moves type-I mass; small tau: drops the type-I
TOY_TAUS_QUICK = (10.0, 0.1)  # outliers and moves mostly type-II outliers (the paper's Fig. 1)


def add_arguments(p) -> None:
    """No options beyond the common ones: ``--quick`` runs fewer tau values on the toy and the flow with
    n = 300 points and 60 steps (same lr * steps)."""


def _uniform(n: int, dtype) -> torch.Tensor:
    return torch.full((n,), 1.0 / n, dtype=dtype)


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
    from ..datasets import make_toy_2d
    from ..detector import OutlierDetector
    from ..kernels.tensorized import cost_matrix
    from ..partners import exact_ot, exact_partial
    from ..sinkhorn import sinkhorn
    from ..weights import hard_weights, outlier_masks, soft_offsets

    d = make_toy_2d(n=TOY_N, n_type1=6, n_type2=4, seed=seed, dtype=torch.float64)
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
def _flow_part(seed: int, quick: bool, backend: str, progress: bool, device) -> dict:
    """The flows of :mod:`srot_fast.experiments.flow2d` at its default (or quick) size, W1 on all points."""
    from ..datasets import make_flow_2d

    f = flow2d
    n, steps, every = (f.QUICK_N, f.QUICK_STEPS, f.QUICK_EVERY) if quick else (f.DEFAULT_N, f.DEFAULT_STEPS,
                                                                                f.DEFAULT_EVERY)
    lr = f.DEFAULT_LR * f.DEFAULT_STEPS / steps  # quick: same total flow time lr * steps as the full run
    d = make_flow_2d(n, OUTLIER_FRAC, seed=seed, dtype=torch.float32)
    alpha, beta0, out = d.alpha.to(device), d.beta0.to(device), d.alpha_outlier.to(device)
    alpha_c = alpha[~out]
    s_alpha, detection = f.fit_detectors(alpha, beta0, out, ("ce", "vat"), seed=seed, progress=progress,
                                         device=device)
    a = torch.full((n,), 1.0 / n, dtype=alpha.dtype, device=device)
    b = torch.full((n,), 1.0 / n, dtype=alpha.dtype, device=device)
    w0 = exact_w(alpha_c, beta0, 1)
    runs, methods = f.run_flows(f.flow_specs(a, b, s_alpha, with_ce=True), alpha, beta0, out, lr=lr, steps=steps,
                                every=every, evaluate=lambda y: exact_w(alpha_c, y, 1), w0=w0, backend=backend,
                                progress=progress)
    for m in methods.values():
        m["W1_alpha_c_beta_0"] = w0
    return {"data": d, "runs": {k: {"beta_T": r["beta_T"].cpu()} for k, r in runs.items()}, "methods": methods,
            "detection": detection, "n": n, "steps": steps, "every": every, "lr": lr, "blur": f.BLUR}


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
                        "bound": MAX_SROT_SHARE, "passed": worst <= MAX_SROT_SHARE})
        elif key.startswith(("OT", "UOT", "Partial")):
            low = min(m["src_type2"], m["tgt_type2"])
            out.append({"part": "toy", "method": key, "claim": "type-II share >= 4/75 (outliers' share)",
                        "value": low, "bound": share_toy - SHARE_TOL, "passed": low >= share_toy - SHARE_TOL})
    for key, m in flow["methods"].items():
        v = m["alpha_outlier_share"]
        if key.startswith(("SROT hard", "SROT soft")):
            out.append({"part": "flow", "method": key, "claim": "alpha-outlier share <= 1 %", "value": v,
                        "bound": MAX_SROT_SHARE, "passed": v <= MAX_SROT_SHARE})
        elif key.startswith(("OT", "UOT", "Partial")):
            out.append({"part": "flow", "method": key, "claim": "alpha-outlier share >= 10 % (outliers' share)",
                        "value": v, "bound": OUTLIER_FRAC - SHARE_TOL, "passed": v >= OUTLIER_FRAC - SHARE_TOL})
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
             f"Outliers' share of the uniform mass: type II 4/75 = {pct(4 / 75)}, type I 6/75 = {pct(6 / 75)}.", "",
             "| method | transported mass | src type II | tgt type II | src type I | tgt type I |",
             "|---|---:|---:|---:|---:|---:|"]
    for key, m in metrics["toy"]["methods"].items():
        lines.append(f"| {key} | {m['transported_mass']:.3f} | {pct(m['src_type2'])} | {pct(m['tgt_type2'])} | "
                     f"{pct(m['src_type1'])} | {pct(m['tgt_type1'])} |")
    det = metrics["toy"]["detection"]
    lines += ["", "Detectors (type II flagged per side / clean points flagged): "
              + ", ".join(f"{m.upper()}: source {v['src_type2_found']}/{v['n_type2_per_side']}, target "
                          f"{v['tgt_type2_found']}/{v['n_type2_per_side']}, clean {v['clean_flagged']}"
                          for m, v in det.items()), ""]
    fl = metrics["flow"]
    lines += [f"## 2-D gradient flow (p=1, blur={fl['blur']}, n={fl['n']}, {fl['steps']} steps, lr={fl['lr']:.3g}, "
              f"{int(OUTLIER_FRAC * 100)} % type-II outliers in alpha)", "",
              "W1 = exact W1 (ot.emd2, cost |x-y|) between alpha_c and beta_T. Outlier share = share of the "
              "transported mass leaving alpha's outliers (plan at beta_T, tol 1e-4). 'left at outliers' = share of "
              "beta_T within distance 1 of beta0's mean.", "",
              "| method | W1(alpha_c, beta_T) | alpha-outlier share | transported mass | beta_T left at outliers "
              "| Sinkhorn iters/step (mean / max) | time (s) |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for key, m in fl["methods"].items():
        lines.append(f"| {key} | {m['W1_alpha_c_beta_T']:.4f} | {pct(m['alpha_outlier_share'])} | "
                     f"{m['transported_mass']:.3f} | {pct(m['beta_T_left_at_outliers'])} | "
                     f"{m['mean_iters_per_step']:.1f} / {m['max_iters_per_step']} | {m['wall_s']:.1f} |")
    w0 = next(iter(fl["methods"].values()))["W1_alpha_c_beta_0"]
    lines += ["", f"W1(alpha_c, beta_0) = {w0:.4f}. Detectors on alpha: "
              + ", ".join(f"{m.upper()}: outliers {v['alpha_outliers_found']}/{v['n_alpha_outliers']}, clean flagged "
                          f"{v['alpha_clean_flagged']}" for m, v in fl["detection"].items()), "",
              "## Claims", "", "| part | method | claim | value | bound | passed |", "|---|---|---|---:|---:|---|"]
    for c in metrics["claims"]:
        val = f"{c['value']:.4f}" if "W1" in c["claim"] else pct(c["value"])
        bnd = f"{c['bound']:.4f}" if "W1" in c["claim"] else pct(c["bound"])
        lines.append(f"| {c['part']} | {c['method']} | {c['claim']} | {val} | {bnd} | "
                     f"{'yes' if c['passed'] else '**NO**'} |")
    tm = metrics["timing"]
    lines += ["", f"Time: toy {tm['toy']['wall_s']} s wall / {tm['toy']['cpu_s']} s CPU, flow {tm['flow']['wall_s']} s "
              f"/ {tm['flow']['cpu_s']} s, figures {tm['figures']['wall_s']} s, total {tm['total']['wall_s']} s wall / "
              f"{tm['total']['cpu_s']} s CPU ({cfg['num_threads']} torch thread(s)).", ""]
    return "\n".join(lines)




# --------------------------------------------------------------------------------------------------- run
def run(args) -> dict:
    """Run both parts; write ``toy_plans.png``, ``toy_boundaries.png``, ``flow2d.png``, ``flow_w.png``,
    ``metrics.json`` and ``metrics.md`` into ``args.out``; print the Markdown; return the metrics dict."""
    _common.require("ot")
    with _common.threads(args.threads):
        total, device, out = _common.start(args)
        quick, seed, backend, progress = bool(args.quick), int(args.seed), args.backend, args.progress
        tm = _common.Timer()
        toy = _toy_part(seed, TOY_TAUS_QUICK if quick else TOY_TAUS, backend, progress)
        t_toy = tm.both()
        tm = _common.Timer()
        flow = _flow_part(seed, quick, backend, progress, device)
        t_flow = tm.both()
        tm = _common.Timer()
        files = {"toy_plans": out / "toy_plans.png", "toy_boundaries": out / "toy_boundaries.png",
                 "flow2d": out / "flow2d.png", "flow_w": out / "flow_w.png"}
        fig_toy_plans(toy, files["toy_plans"], 80)
        fig_toy_boundaries(toy, files["toy_boundaries"], 80)
        fig_flow(flow, files["flow2d"], 80)
        fig_flow_w(flow, files["flow_w"], 80)
        t_fig = tm.both()
        metrics = {
            "config": {"quick": quick, "seed": seed, "backend": backend, "device": str(device),
                       "num_threads": torch.get_num_threads(), "toy_n": TOY_N, "toy_p": TOY_P, "toy_blur": TOY_BLUR,
                       "toy_tol": TOY_TOL, "toy_taus": toy["taus"], "toy_gamma": toy["gamma"],
                       "toy_partial_mass": toy["clean_share"], "flow_n": flow["n"], "flow_steps": flow["steps"],
                       "flow_lr": flow["lr"], "flow_p": flow2d.P, "flow_blur": flow2d.BLUR,
                       "flow_tol": flow2d.FLOW_TOL, "final_tol": flow2d.FINAL_TOL, "flow_reach": flow2d.REACH,
                       "flow_mass": flow2d.MASS, "outlier_frac": OUTLIER_FRAC, "w1_every": flow["every"]},
            "toy": {"methods": toy["methods"], "detection": toy["detection"]},
            "flow": {"methods": flow["methods"], "detection": flow["detection"], "n": flow["n"],
                     "steps": flow["steps"], "lr": flow["lr"], "blur": flow["blur"]},
            "claims": _claims(toy, flow),
        }
        metrics["timing"] = {"toy": t_toy, "flow": t_flow, "figures": t_fig, "total": total.both()}
        metrics["files"] = {k: str(v) for k, v in files.items()} | {"json": str(out / "metrics.json"),
                                                                     "md": str(out / "metrics.md")}
        _common.write_metrics(out, metrics, _markdown(metrics))
        return metrics
