r"""``srot-fast flow2d``: the paper's 2-D gradient flow (§4, Fig. 3) with the data measure alpha corrupted by
10 % type-II outliers.

alpha = clean annulus alpha_c + 10 % outliers drawn from beta_0's law (:func:`srot_fast.datasets.make_flow_2d`);
beta_t starts at beta_0 and moves by y <- y - lr * M * grad_y h(alpha, beta_t) (explicit Euler, GeomLoss
convention). Losses h: OT, UOT (KL), partial OT (mass 0.9), SROT-CE hard, SROT hard, SROT soft (partial OT,
mass 0.9) with and without the paper's rescaling of beta to mass 0.9. Ground cost |x - y| (p = 1), blur 0.05.
``srot-fast demo`` runs the same flows (:func:`run_flows`) at the default size (``demo --quick``: at the quick
size).

Why p = 1 (the paper's Euclidean cost): with blur 0.05, eps = 0.05 and max C / eps ~ 90, so a warm-started
Sinkhorn step converges in a few iterations. With p = 2 and the same blur, eps = 0.0025 and max C / eps ~ 4000:
each flow step needs hundreds of iterations (and float32 stalls near a 1e-3 marginal error).

The detectors (VAT and CE-only, :class:`srot_fast.OutlierDetector`) are fitted once, on alpha (source) versus
beta_0 (target), before the flows; beta_t's points are never flagged.

Memory is linear in n along the whole path (online Sinkhorn backends 'cpu' / 'blocksparse' / 'keops' /
'triton'; 'auto' picks 'cpu' on CPU ('tensorized' below 64 x 64 points only without the compiled kernel),
'blocksparse' from about n = 32 000, see
:func:`srot_fast.backends.resolve_backend`): W1(alpha_c, beta_t) is exact (``ot.emd2``) on fixed random
subsamples of at most ``--w1-points`` points per measure (exact on the whole measures at the default
n = 1000), the detectors train on at most ``--detector-points`` points per measure (all of them at the
default n) and score every point, and the figures draw at most 2000 points per measure. ``--methods`` runs a
subset of the flows (at a large n, one flow at a time).

Cost at large n: every Sinkhorn pass is O(n^2) pair evaluations unless the block-sparse pass can drop pairs.
At p = 1 with this blur it keeps most of them (e^{-C/eps} decays only exponentially, and the reduced cost
C - f - g of the flow's potentials is small along whole transport rays), so a pass at n = 10^6 is about
10^12 kernel evaluations whatever the backend.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from . import _common
from ._figures import fig_curves, fig_flow, fig_snapshots

NAME = "flow2d"
HELP = "2-D gradient flow with 10 percent type-II outliers in the data (paper §4, Fig. 3): OT, UOT, partial OT, SROT"

DEFAULT_N, DEFAULT_STEPS, DEFAULT_LR, DEFAULT_EVERY = 1000, 400, 0.01, 20
QUICK_N, QUICK_STEPS, QUICK_EVERY = 300, 60, 10   # quick: lr scaled so that lr * steps is the full run's
OUTLIER_FRAC = 0.1
PLOT_POINTS = 2000
MAX_SROT_SHARE = 0.01     # SROT hard / soft: at most 1 % of the transported mass leaves alpha's outliers
SHARE_TOL = 1e-3          # slack below the outliers' 10 % for OT / UOT / partial (Sinkhorn tolerance)
P = 1                     # ground cost |x - y|
BLUR = 0.05               # eps = BLUR**P
FLOW_TOL = 3e-3           # Sinkhorn tolerance per flow step (warm-started); the final plan is re-solved at FINAL_TOL
FINAL_TOL = 1e-4          # plan at beta_T: share metrics accurate to ~1e-4
DETECTOR_POINTS = 20_000  # detectors train on at most this many points per measure (all of them at the default n)
MASS = 0.9                # partial OT and SROT soft: the clean share of alpha
REACH = 3.0               # UOT (KL), tau = reach**p = 3 ~ the initial gap W1(alpha_c, beta_0) ~ 3: moving beta's
#                           mass across the gap costs about as much as destroying it, the regime where UOT acts as
#                           a robust variant yet beta_t still flows to alpha_c (a smaller reach leaves most of
#                           beta at the outliers, a larger one behaves like OT)


def add_arguments(p) -> None:
    p.add_argument("--n", type=_common.int_at_least(20), default=None,
                   help=f"points per measure (default {DEFAULT_N}; --quick {QUICK_N}); linear memory, e.g. "
                        "--n 100000 on a GPU")
    p.add_argument("--steps", type=_common.positive_int, default=None,
                   help=f"flow steps (default {DEFAULT_STEPS}; --quick {QUICK_STEPS})")
    p.add_argument("--lr", type=_common.positive_float, default=None,
                   help=f"learning rate (default {DEFAULT_LR}; --quick {DEFAULT_LR} * {DEFAULT_STEPS} / "
                        f"{QUICK_STEPS}, the same total flow time)")
    p.add_argument("--every", type=_common.positive_int, default=None,
                   help=f"evaluate W1(alpha_c, beta_t) every this many steps (default {DEFAULT_EVERY}; --quick "
                        f"{QUICK_EVERY})")
    p.add_argument("--w1-points", type=_common.int_at_least(10), default=1000,
                   help="W1 is exact (ot.emd2) on fixed random subsamples of at most this many points per "
                        "measure (default 1000: the whole measures at n=1000)")
    p.add_argument("--no-ce", dest="ce", action="store_false", help="skip the SROT-CE hard flow")
    p.add_argument("--methods", default=None,
                   help="comma-separated subset of the flows to run, from " + ", ".join(METHOD_KEYS)
                        + " (default: all; the claims that compare flows need both of them)")
    p.add_argument("--detector-points", type=_common.int_at_least(10), default=DETECTOR_POINTS,
                   help=f"the detectors train on random subsamples of at most this many points of alpha and of "
                        f"beta_0 (default {DETECTOR_POINTS}: all points at the default n) and score every point")


# --methods keys -> flow names of flow_specs (in the order the flows run)
METHOD_KEYS = {"ot": "OT", "uot": f"UOT (KL, reach={REACH:g})", "partial": f"Partial OT (m={MASS:g})",
               "srot-ce-hard": "SROT-CE hard", "srot-hard": "SROT hard",
               "srot-soft": f"SROT soft (partial m={MASS:g})", "srot-soft-rescaled": "SROT soft (rescaled)"}


# --------------------------------------------------------------------------------------------- shared helpers
def subsample_index(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Sorted indices of min(n, k) points drawn without replacement (all of them when n <= k)."""
    if n <= k:
        return torch.arange(n)
    return torch.randperm(n, generator=gen)[:k].sort().values


def exact_w(x: torch.Tensor, y: torch.Tensor, p: int) -> float:
    """Exact W_p between uniform measures on x and y (``ot.emd2``; cost |x - y|^p, result to the power 1/p)."""
    ot = _common.require("ot")

    xn = x.detach().to("cpu", torch.float64).numpy()
    yn = y.detach().to("cpu", torch.float64).numpy()
    c = ot.dist(xn, yn, metric="euclidean" if p == 1 else "sqeuclidean")
    a = torch.full((len(xn),), 1.0 / len(xn), dtype=torch.float64).numpy()
    b = torch.full((len(yn),), 1.0 / len(yn), dtype=torch.float64).numpy()
    return float(max(ot.emd2(a, b, c, numItermax=10_000_000), 0.0)) ** (1.0 / p)


def run_flow(name: str, alpha: torch.Tensor, beta0: torch.Tensor, *, a: torch.Tensor, b: torch.Tensor, p: int,
             eps: float, solver_kw: dict, soft_scores: Optional[torch.Tensor], lr: float, steps: int, every: int,
             evaluate: Callable[[torch.Tensor], float], tol: float, final_tol: float, backend: str,
             progress: bool, snapshot_steps=(), snapshot_index: Optional[torch.Tensor] = None,
             w0: Optional[float] = None, max_iter: int = 2000) -> dict:
    """Explicit-Euler flow y <- y - lr * M * grad_y h(alpha, y), h = the (partial / unbalanced) Sinkhorn value.

    ``soft_scores``: P(target) of alpha's points -> SROT soft offsets on alpha with the paper's gamma = max C
    (recomputed each step, treated as a constant). Warm-started Sinkhorn (the previous step's potentials).
    Returns beta_T, the curve [(t, evaluate(beta_t))], the loss values, iterations per step, snapshots of
    beta_t[snapshot_index] at ``snapshot_steps`` and the plan-at-beta_T metrics (re-solved at ``final_tol``)."""
    from tqdm.auto import tqdm

    from ..backends import get_ops, resolve_backend
    from ..sinkhorn import sinkhorn
    from ..weights import soft_offsets

    timer = _common.Timer()
    y = beta0.clone()
    m = len(y)
    ones = torch.ones(1, dtype=alpha.dtype, device=alpha.device)
    # the backend the solves use (with the points, so that 'auto' may pick 'blocksparse'): gamma = max C is
    # then exact without a dense N x M pass on large low-dimensional clouds
    ops = get_ops(resolve_backend(backend, len(alpha), m, alpha.device, points=(alpha, y), eps=eps, p=p))
    snapshot_steps = set(snapshot_steps)
    snaps = {}

    def keep(t, y_):
        if t in snapshot_steps:
            snaps[t] = (y_ if snapshot_index is None else y_[snapshot_index]).detach().cpu()

    def solve(y_, init_, tol_, max_iter_):
        u = None
        if soft_scores is not None:
            gamma = float(ops.max_cost(alpha, y_.detach(), p)) or 1.0
            u, _ = soft_offsets(soft_scores, ones, gamma)
        return sinkhorn(alpha, y_, a, b, p=p, eps=eps, u=u, tol=tol_, max_iter=max_iter_, backend=backend,
                        init=init_, **solver_kw)

    init = None
    iters, values, step_s = [], [], []
    curve = [(0, evaluate(y) if w0 is None else w0)]
    keep(0, y)
    bar = tqdm(range(1, steps + 1), desc=f"flow: {name}", disable=not progress, leave=False)
    for t in bar:
        t_step = _common.Timer()
        y.requires_grad_(True)
        res = solve(y, init, tol, max_iter)
        (grad,) = torch.autograd.grad(res.value, y)
        init = (res.f.detach(), res.g.detach())
        iters.append(res.n_iter)
        values.append(float(res.value.detach()))
        y = (y.detach() - lr * m * grad).detach()
        step_s.append(t_step.read(5))  # a step of a small flow takes milliseconds
        if not bool(torch.isfinite(y).all()):
            raise FloatingPointError(f"flow {name!r} diverged at step {t} (non-finite points); lower --lr")
        keep(t, y)
        if t % every == 0 or t == steps:
            curve.append((t, evaluate(y)))
    bar.close()
    t_final = _common.Timer()
    final = solve(y, init, final_tol, 5 * max_iter)
    return {"beta_T": y, "curve": curve, "values": values, "iters": iters, "step_s": step_s,
            "final_s": t_final.read(), "snapshots": snaps,
            "row_mass": final.row_mass.detach(), "col_mass": final.col_mass.detach(),
            "final_value": float(final.value.detach()), "final_iters": final.n_iter,
            "final_marginal_error": float(final.marginal_error), "backend": final.backend, "wall_s": timer.read(),
            "cpu_s": timer.cpu()}


claim = _common.claim


def fit_detectors(alpha: torch.Tensor, beta0: torch.Tensor, is_out: torch.Tensor, methods, *, seed: int,
                  progress: bool, device, max_points: Optional[int] = None, **kw) -> tuple[dict, dict]:
    """Detectors fitted once, alpha (source) vs beta_0 (target), before the flows: per method, alpha's (N,)
    P(target) scores and a detection summary (outliers found, clean points flagged, eta, epochs).
    ``max_points``: train on fixed random subsamples of at most this many points per measure (None: all);
    the scores and the summary cover every point."""
    from ..detector import OutlierDetector

    src, tgt = alpha, beta0
    if max_points is not None:
        gen = torch.Generator().manual_seed(seed + 2)
        src = alpha[subsample_index(len(alpha), max_points, gen).to(alpha.device)]
        tgt = beta0[subsample_index(len(beta0), max_points, gen).to(beta0.device)]
    scores, detection = {}, {}
    for k in methods:
        det = OutlierDetector(method=k, seed=seed, progress=progress, device=device, **kw).fit(src, tgt)
        scores[k] = det.predict_proba(alpha).to(device, alpha.dtype)
        flagged = scores[k] > 0.5
        detection[k] = {"alpha_outliers_found": int((flagged & is_out).sum()), "n_alpha_outliers": int(is_out.sum()),
                        "alpha_clean_flagged": int((flagged & ~is_out).sum()),
                        "beta0_flagged": int((det.predict_proba(beta0) < 0.5).sum()), "eta": det.eta_,
                        "epochs": det.n_epochs_, "train_points": [len(src), len(tgt)]}
    return scores, detection


def flow_metrics(r: dict, is_out: torch.Tensor) -> dict:
    """Metrics every flow reports from :func:`run_flow`'s result (the plan at beta_T, iterations, timing)."""
    row = r["row_mass"]
    moved = float(row.sum())
    it = torch.tensor(r["iters"], dtype=torch.float64)
    return {"alpha_outlier_share": float(row[is_out].sum()) / moved if moved > 0 else float("nan"),
            "transported_mass": moved, "mean_iters_per_step": float(it.mean()), "max_iters_per_step": int(it.max()),
            "total_iters": int(it.sum()), "final_plan_iters": r["final_iters"],
            "final_marginal_error": r["final_marginal_error"], "backend": r["backend"],
            "step_s": {"first": r["step_s"][0], "mean": sum(r["step_s"]) / len(r["step_s"]), "max": max(r["step_s"])},
            "final_plan_s": r["final_s"], "wall_s": r["wall_s"],
            "cpu_s": r["cpu_s"], "loss_curve": r["values"]}


def flow_specs(a: torch.Tensor, b: torch.Tensor, s_alpha: dict, with_ce: bool) -> list:
    """The flows of the 2-D experiment, [(name, run_flow keywords)]: OT, UOT (KL), partial OT, SROT-CE hard
    (``with_ce``), SROT hard, SROT soft without and with the rescaling of beta to mass MASS. ``a`` (N,), ``b``
    (M,): uniform weights; ``s_alpha``: {"vat"/"ce": (N,) P(target) of alpha's points}."""
    from ..weights import hard_weights

    n = len(b)
    beta_clean = torch.ones(n, dtype=b.dtype, device=b.device)  # P(target) = 1: beta's points are never flagged

    def hard(k):
        return hard_weights(a, s_alpha[k], b, beta_clean)[0]

    specs = [
        ("OT", dict(a=a, b=b, solver_kw={}, soft_scores=None)),
        (f"UOT (KL, reach={REACH:g})", dict(a=a, b=b, solver_kw=dict(penalty="kl", tau=REACH**P), soft_scores=None)),
        (f"Partial OT (m={MASS:g})", dict(a=a, b=b, solver_kw=dict(mass=MASS), soft_scores=None)),
    ]
    if with_ce:
        specs.append(("SROT-CE hard", dict(a=hard("ce"), b=b, solver_kw={}, soft_scores=None)))
    b_scaled = torch.full((n,), MASS / n, dtype=b.dtype, device=b.device)
    specs += [
        ("SROT hard", dict(a=hard("vat"), b=b, solver_kw={}, soft_scores=None)),
        (f"SROT soft (partial m={MASS:g})", dict(a=a, b=b, solver_kw=dict(mass=MASS), soft_scores=s_alpha["vat"])),
        ("SROT soft (rescaled)", dict(a=a, b=b_scaled, solver_kw=dict(mass=MASS), soft_scores=s_alpha["vat"])),
    ]
    return specs


def run_flows(specs: list, alpha: torch.Tensor, beta0: torch.Tensor, is_out: torch.Tensor, **flow_kw) -> tuple:
    """Run :func:`run_flow` for each of :func:`flow_specs` (p = P, eps = BLUR**P, tolerances FLOW_TOL / FINAL_TOL;
    ``flow_kw``: lr, steps, every, evaluate, w0, backend, progress, snapshots). Returns ({name: run_flow result},
    {name: metrics}): the W1 curve and its last value, the share of beta_T left in beta_0's blob, and
    :func:`flow_metrics`."""
    runs, methods = {}, {}
    centre = beta0.mean(0)
    for name, kw in specs:
        r = run_flow(name, alpha, beta0, p=P, eps=BLUR**P, tol=FLOW_TOL, final_tol=FINAL_TOL, **flow_kw, **kw)
        runs[name] = r
        near = (r["beta_T"] - centre).norm(dim=1) < 1.0  # beta_T points left in beta_0's blob (3.3 sigma)
        methods[name] = {"W1_alpha_c_beta_T": r["curve"][-1][1], "beta_T_left_at_outliers": float(near.double().mean()),
                         "W1_curve": [list(c) for c in r["curve"]], **flow_metrics(r, is_out)}
    return runs, methods


def detector_claim(detection: dict) -> dict:
    v = detection["vat"]
    return claim("the VAT detector flags all of alpha's outliers", v["alpha_outliers_found"] == v["n_alpha_outliers"],
                 f"{v['alpha_outliers_found']}/{v['n_alpha_outliers']} found, {v['alpha_clean_flagged']} clean flagged")


def markdown_tail(metrics: dict) -> list:
    """Detectors, claims and timing lines of a flow's metrics.md."""
    det = ", ".join(f"{k.upper()}: {v['alpha_outliers_found']}/{v['n_alpha_outliers']} outliers found, "
                    f"{v['alpha_clean_flagged']} clean flagged" for k, v in metrics["results"]["detection"].items())
    return ["", f"Detectors (fitted once, alpha vs beta_0): {det}.", "", "## Claims", "",
            _common.claims_table(metrics["claims"]), "",
            "Timing (s): " + ", ".join(f"{k} {v}" for k, v in metrics["timing"].items())
            + f" ({metrics['config']['threads']} torch thread(s)).", ""]


# --------------------------------------------------------------------------------------------------- run
def _settings(args) -> dict:
    quick = bool(args.quick)
    n = args.n if args.n is not None else (QUICK_N if quick else DEFAULT_N)
    steps = args.steps if args.steps is not None else (QUICK_STEPS if quick else DEFAULT_STEPS)
    lr = args.lr if args.lr is not None else (DEFAULT_LR * DEFAULT_STEPS / steps if quick else DEFAULT_LR)
    every = args.every if args.every is not None else (QUICK_EVERY if quick else DEFAULT_EVERY)
    return {"n": n, "steps": steps, "lr": lr, "every": every, "methods": _methods(args)}


def _methods(args) -> list:
    """The flow names selected by --methods (all by default; SROT-CE hard unless --no-ce)."""
    if args.methods is None:
        keys = [k for k in METHOD_KEYS if args.ce or k != "srot-ce-hard"]
    else:
        keys = [k.strip() for k in args.methods.split(",") if k.strip()]
        bad = [k for k in keys if k not in METHOD_KEYS]
        if bad or not keys:
            raise _common.CliError(f"--methods: unknown or empty flow name(s) {bad or args.methods!r}; choose "
                                   f"from {', '.join(METHOD_KEYS)}")
        if "srot-ce-hard" in keys and not args.ce:
            raise _common.CliError("--methods names srot-ce-hard but --no-ce skips it")
        keys = [k for k in METHOD_KEYS if k in keys]  # the usual order, no duplicates
    return [METHOD_KEYS[k] for k in keys]


def run(args) -> dict:
    from ..datasets import Flow2D, make_flow_2d

    cfg = _settings(args)
    n, steps, lr, every, names = cfg["n"], cfg["steps"], cfg["lr"], cfg["every"], cfg["methods"]
    with_ce = "SROT-CE hard" in names
    total, device, out = _common.start(args)
    d = make_flow_2d(n, OUTLIER_FRAC, seed=args.seed, dtype=torch.float32)
    alpha, beta0, is_out = d.alpha.to(device), d.beta0.to(device), d.alpha_outlier.to(device)
    alpha_c = alpha[~is_out]

    # detectors: fitted once, alpha (source) vs beta_0 (target), before the flows
    tm = _common.Timer()
    s_alpha, detection = fit_detectors(alpha, beta0, is_out, ("vat", "ce") if with_ce else ("vat",), seed=args.seed,
                                       progress=args.progress, device=device, max_points=args.detector_points)
    t_det = tm.read()

    # fixed subsamples for W1 and the figures (linear memory at any n)
    gen = torch.Generator().manual_seed(args.seed + 1)
    w_ic = subsample_index(len(alpha_c), args.w1_points, gen).to(device)
    w_ib = subsample_index(n, args.w1_points, gen).to(device)
    alpha_c_w = alpha_c[w_ic]

    def w1(y):
        return exact_w(alpha_c_w, y[w_ib], 1)

    w0 = w1(beta0)
    p_ia = subsample_index(n, PLOT_POINTS, gen)
    p_ib = subsample_index(n, PLOT_POINTS, gen).to(device)
    snap_steps = sorted({0, steps // 8, steps // 4, steps // 2, steps})

    a = torch.full((n,), 1.0 / n, dtype=alpha.dtype, device=device)
    b = torch.full((n,), 1.0 / n, dtype=alpha.dtype, device=device)
    specs = [sp for sp in flow_specs(a, b, s_alpha, with_ce) if sp[0] in names]
    runs, methods = run_flows(specs, alpha, beta0, is_out, lr=lr, steps=steps,
                              every=every, evaluate=w1, w0=w0, backend=args.backend, progress=args.progress,
                              snapshot_steps=snap_steps, snapshot_index=p_ib)
    t_flow = tm.read() - t_det

    # figures
    tm = _common.Timer()
    files = {"flow2d_final": out / "flow2d_final.png", "flow2d_snapshots": out / "flow2d_snapshots.png",
             "flow2d_w1": out / "flow2d_w1.png"}
    sub = Flow2D(d.alpha[p_ia], d.alpha_outlier[p_ia], d.beta0[p_ib.cpu()])
    fig_flow({"data": sub, "runs": {k: {"beta_T": r["beta_T"][p_ib].cpu()} for k, r in runs.items()},
              "methods": methods, "lr": lr, "steps": steps, "blur": BLUR}, files["flow2d_final"], 80)
    fig_snapshots(sub, runs, snap_steps, files["flow2d_snapshots"])
    fig_curves(methods, w0, files["flow2d_w1"], len(w_ic), len(w_ib), metric="W1", linthresh=1e-3,
               cost="cost |x-y|")
    t_fig = tm.read()

    claims = _claims(methods, detection)
    config = {"quick": bool(args.quick), "seed": args.seed, "backend": args.backend, "device": str(device),
              "threads": torch.get_num_threads(), "n": n, "steps": steps, "lr": lr, "w1_every": every,
              "w1_points": args.w1_points, "w1_points_used": [len(w_ic), len(w_ib)], "p": P, "blur": BLUR,
              "methods": names, "detector_points": args.detector_points,
              "flow_tol": FLOW_TOL, "final_tol": FINAL_TOL, "uot_reach": REACH, "partial_mass": MASS,
              "outlier_frac": OUTLIER_FRAC, "detector": "OutlierDetector(method='vat'/'ce'), fitted once on "
                                                         "alpha (source) vs beta_0 (target)",
              "snapshot_steps": snap_steps}
    metrics = {"config": config, "results": {"W1_alpha_c_beta_0": w0, "methods": methods, "detection": detection},
               "claims": claims,
               "timing": {"detectors_s": t_det, "flows_s": round(t_flow, 2), "figures_s": t_fig,
                          "total_s": total.read()},
               "files": {k: str(v) for k, v in files.items()} | {"json": str(out / "metrics.json"),
                                                                 "md": str(out / "metrics.md")}}
    _common.write_metrics(out, metrics, _markdown(metrics))
    return metrics


def _claims(methods: dict, detection: dict) -> list:
    """The paper's claims on the flows that ran (a comparison only when both of its flows ran)."""
    out = []
    robust = [k for k in methods if k.startswith(("SROT hard", "SROT soft"))]
    classic = [k for k in methods if k.startswith(("OT", "UOT", "Partial"))]
    for k in robust:
        v = methods[k]["alpha_outlier_share"]
        out.append(claim(f"{k} moves <= 1 % of its mass from alpha's outliers", v <= MAX_SROT_SHARE,
                         f"share {100 * v:.2f} %"))
    for k in classic:
        v = methods[k]["alpha_outlier_share"]
        out.append(claim(f"{k} moves >= the outliers' 10 % share from them", v >= OUTLIER_FRAC - SHARE_TOL,
                         f"share {100 * v:.2f} %"))
    w = {k: m["W1_alpha_c_beta_T"] for k, m in methods.items()}
    part, soft = METHOD_KEYS["partial"], METHOD_KEYS["srot-soft"]

    def closer(text, lo, hi, swap=False):  # claim w[lo] < w[hi], when both flows ran
        if lo in w and hi in w:
            a, b = (hi, lo) if swap else (lo, hi)
            out.append(claim(text, w[lo] < w[hi], f"W1 {w[a]:.4f} vs {w[b]:.4f}"))

    closer("SROT hard ends closer to alpha_c than OT", "SROT hard", "OT")
    closer("SROT hard ends closer to alpha_c than partial OT", "SROT hard", part)
    closer("partial OT does worse than OT (transports the outliers, leaves clean beta mass)", "OT", part, swap=True)
    closer("SROT soft with rescaling ends closer to alpha_c than without", "SROT soft (rescaled)", soft)
    out.append(detector_claim(detection))
    return out


def _markdown(metrics: dict) -> str:
    cfg, res = metrics["config"], metrics["results"]
    rows = [[k, m["W1_alpha_c_beta_T"], f"{100 * m['alpha_outlier_share']:.2f} %", m["transported_mass"],
             f"{100 * m['beta_T_left_at_outliers']:.1f} %", f"{m['mean_iters_per_step']:.1f}", m["wall_s"]]
            for k, m in res["methods"].items()]
    lines = [f"# srot-fast flow2d ({'quick' if cfg['quick'] else 'full'}, seed {cfg['seed']}, device {cfg['device']})",
             "", f"n={cfg['n']} points per measure, {cfg['steps']} steps, lr={cfg['lr']:.4g}, p=1, blur={cfg['blur']}, "
             f"{int(100 * cfg['outlier_frac'])} % type-II outliers in alpha. W1 = exact W1(alpha_c, beta_T) on "
             f"{cfg['w1_points_used'][0]} x {cfg['w1_points_used'][1]} points; W1(alpha_c, beta_0) = "
             f"{res['W1_alpha_c_beta_0']:.4f}. Outlier share = share of the transported mass leaving alpha's "
             "outliers (plan at beta_T). 'left at outliers' = share of beta_T within distance 1 of beta_0's mean.", "",
             _common.md_table(["method", "W1(alpha_c, beta_T)", "outlier share", "transported mass",
                               "beta_T left at outliers", "Sinkhorn iters/step", "wall (s)"], rows)]
    return "\n".join(lines + markdown_tail(metrics))
