"""Convergence of :func:`srot_fast.sinkhorn`: plain alternating updates (``accelerate=False``, "before") against
the accelerated loop (``accelerate=True``, "after": safeguarded Anderson acceleration, loose eps-scaling), and
GeomLoss's fixed schedule.

Problem: two float64 Gaussian clouds, n points each in R^d (unit variance, means 1 apart along the first axis,
fixed seed), uniform weights, cost |x - y| (p = 1) or |x - y|^2 / 2 (p = 2), blur = ratio x diameter (bounding-box
diagonal), eps = blur**p, eps-scaling 0.5, backend 'cpu'. Penalties: balanced, kl and tv (tau = 1), partial
(mass 0.5); optionally soft cost offsets u, v = 0.1 diameter**p x U(0, 1). For each case: updates (eps-scaling
included) and seconds to a relative marginal error of 1e-4 (max_iter 20000; a run at the cap is "not
converged"), and the relative value error of each run against a converged float64 reference (tol 1e-9); GeomLoss
``SamplesLoss('sinkhorn', debias=False, scaling=0.5, backend='tensorized')`` (balanced and kl only) is scored
against the same reference.

Run:
- ``pytest benchmarks/bench_convergence.py --benchmark-only``: a small representative subset (d = 2, n = 500,
  blur/diam 0.05, offsets for kl/tv/partial);
- ``python benchmarks/bench_convergence.py [--quick] [--n 1000 4000] [--d 2 64] [--out FILE.json]``: the grid
  (or a subset), a Markdown table and summary lines (``--md FILE`` writes the table);
- ``--dropin --n 1000 5000 --d 2 64``: ``SROTLoss()`` against ``geomloss.SamplesLoss()`` (both defaults), loss +
  gradient, values against a float64 solve (``dropin_case``; ``--refs FILE`` keeps those references, which take
  tens of minutes at n = 5000, so that ``--refs-only`` can compute them apart from the timed run); ``--pot N``
  adds POT's log-domain Sinkhorn divergence on the same problem at n <= N (``pot_dropin_case``);
- ``--batch``: B = 64 problems of 256 points, one batched call against a loop and GeomLoss tensorized
  (``batch_case``).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import platform
import statistics
import sys
import time
import warnings

import pytest
import torch

from srot_fast.geometry import bbox_diameter
from srot_fast.sinkhorn import ConvergenceWarning, sinkhorn

TOL, MAX_ITER = 1e-4, 20_000
REF_TOL, REF_MAX_ITER = 1e-9, 100_000
SCALING, TAU, MASS, OFFSET_SCALE = 0.5, 1.0, 0.5, 0.1
PS = (1, 2)
PENALTIES = ("balanced", "kl", "tv", "partial")
DIMS = (2, 64)
RATIOS = (0.1, 0.02, 0.005)
SIZES = (1000, 4000)


# ------------------------------------------------------------------------------------------------ problem
def problem(n: int, d: int, p: int, offsets: bool, seed: int = 0):
    """(x, y, u, v, diameter): x ~ N(0, I), y ~ N(e_1, I), (n, d) float64; u, v (n,) or None."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    y = torch.randn(n, d, generator=gen, dtype=torch.float64)
    y[:, 0] += 1.0
    diam = bbox_diameter(x, y)
    u = v = None
    if offsets:
        gamma = OFFSET_SCALE * diam**p
        u = gamma * torch.rand(n, generator=gen, dtype=torch.float64)
        v = gamma * torch.rand(n, generator=gen, dtype=torch.float64)
    return x, y, u, v, diam


def penalty_kwargs(penalty: str) -> dict:
    if penalty == "partial":
        return dict(penalty="balanced", mass=MASS)
    if penalty in ("kl", "tv"):
        return dict(penalty=penalty, tau=TAU)
    return dict(penalty="balanced")


def solve(x, y, u, v, *, p, eps, diam, penalty, accelerate, tol, max_iter) -> dict:
    """One srot_fast solve on backend 'cpu'; status 'ok', 'cap' (max_iter reached, or ConvergenceWarning) or
    'nan' / 'error: ...' (FloatingPointError or another exception)."""
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            res = sinkhorn(x, y, p=p, eps=eps, u=u, v=v, scaling=SCALING, diameter=diam, tol=tol,
                           max_iter=max_iter, backend="cpu", accelerate=accelerate, **penalty_kwargs(penalty))
        except FloatingPointError:
            return dict(status="nan", seconds=time.perf_counter() - t0, n_iter=None, marginal_error=None,
                        value=None, converged=False)
        except Exception as e:  # noqa: BLE001 - recorded, the grid goes on
            return dict(status=f"error: {type(e).__name__}: {e}"[:200], seconds=time.perf_counter() - t0,
                        n_iter=None, marginal_error=None, value=None, converged=False)
    seconds = time.perf_counter() - t0
    warned = any(issubclass(w.category, ConvergenceWarning) for w in caught)
    value, err = float(res.value), float(res.marginal_error)
    converged = math.isfinite(value) and err <= tol and res.n_iter < max_iter
    status = "ok" if converged else ("nan" if not math.isfinite(value) else "cap")
    return dict(status=status, seconds=seconds, n_iter=int(res.n_iter), marginal_error=err, value=value,
                converged=converged, warned=warned, passes=int(res.passes))


def reference(x, y, u, v, *, p, eps, diam, penalty, max_iter=REF_MAX_ITER) -> dict:
    """Float64 reference value at tol 1e-9: the accelerated loop, or plain updates where it fails. Where neither
    reaches 1e-9 within ``max_iter``, the run with the smaller marginal error (``converged`` False: the table
    shows its marginal error)."""
    kw = dict(p=p, eps=eps, diam=diam, penalty=penalty, tol=REF_TOL, max_iter=max_iter)
    ref = solve(x, y, u, v, accelerate=True, **kw)
    ref["mode"] = "accelerated"
    if not ref["converged"]:
        plain = solve(x, y, u, v, accelerate=False, **kw)
        plain["mode"] = "plain"
        if plain["converged"] or ref["value"] is None or (
                plain["value"] is not None and plain["marginal_error"] < ref["marginal_error"]):
            ref = plain
    return ref


def _geomloss_cost(p: int, d: int, offsets: bool):
    """Tensorized cost for GeomLoss on points (B, N, d [+1]); the extra column carries the offset u_i or v_j.
    p = 1 is passed explicitly: GeomLoss's own distance clamps |x - y|^2 at 1e-8."""
    def cost(xa, ya):
        xs, ys = xa[..., :d], ya[..., :d]
        sq = ((xs[:, :, None, :] - ys[:, None, :, :]) ** 2).sum(-1)
        c = sq.sqrt() if p == 1 else 0.5 * sq
        if offsets:
            c = c + xa[..., d][:, :, None] + ya[..., d][:, None, :]
        return c

    return cost


def geomloss_run(x, y, u, v, *, p, blur, diam, penalty) -> dict:
    """GeomLoss's fixed schedule (debias=False, scaling 0.5); 'n/a' for the penalties it has no form for."""
    if penalty not in ("balanced", "kl"):
        return dict(status="n/a")
    try:
        import geomloss
    except ImportError:
        return dict(status="not installed")
    d = x.shape[1]
    offsets = u is not None
    xa, ya = (torch.cat([x, u[:, None]], 1), torch.cat([y, v[:, None]], 1)) if offsets else (x, y)
    loss = geomloss.SamplesLoss("sinkhorn", p=p, blur=blur, reach=None if penalty == "balanced" else TAU ** (1 / p),
                                debias=False, scaling=SCALING, diameter=diam, backend="tensorized",
                                cost=_geomloss_cost(p, d, offsets))
    t0 = time.perf_counter()
    try:
        value = float(loss(xa, ya))
    except Exception as e:  # noqa: BLE001
        return dict(status=f"error: {type(e).__name__}: {e}"[:200], seconds=time.perf_counter() - t0)
    return dict(status="ok" if math.isfinite(value) else "nan", seconds=time.perf_counter() - t0, value=value)


def _rel(value, ref):
    if value is None or ref is None or not math.isfinite(value):
        return None
    return abs(value - ref) / max(abs(ref), 1e-300)


def run_case(p, penalty, d, ratio, n, offsets, *, with_geomloss=True, ref_max_iter=REF_MAX_ITER) -> dict:
    x, y, u, v, diam = problem(n, d, p, offsets)
    blur = ratio * diam
    eps = blur**p
    kw = dict(p=p, eps=eps, diam=diam, penalty=penalty)
    row = dict(p=p, penalty=penalty, d=d, ratio=ratio, n=n, offsets=offsets, diameter=diam, blur=blur, eps=eps)
    ref = reference(x, y, u, v, max_iter=ref_max_iter, **kw)
    before = solve(x, y, u, v, accelerate=False, tol=TOL, max_iter=MAX_ITER, **kw)
    after = solve(x, y, u, v, accelerate=True, tol=TOL, max_iter=MAX_ITER, **kw)
    gl = geomloss_run(x, y, u, v, p=p, blur=blur, diam=diam, penalty=penalty) if with_geomloss else dict(status="off")
    vref = ref["value"]
    for r in (before, after, gl):
        r["value_error"] = _rel(r.get("value"), vref)
    row.update(ref=ref, before=before, after=after, geomloss=gl)
    ib, ia = before["n_iter"], after["n_iter"]
    row["update_ratio"] = ib / ia if ib and ia else None
    row["time_ratio"] = before["seconds"] / after["seconds"] if before["n_iter"] and after["n_iter"] else None
    return row


def grid(ps=PS, penalties=PENALTIES, dims=DIMS, ratios=RATIOS, sizes=SIZES, offsets=(False, True)):
    return list(itertools.product(ps, penalties, dims, ratios, sizes, offsets))


# ------------------------------------------------------------------------------------ drop-in and batch
def _timed(fn, repeats: int):
    """(best seconds, last output) of ``repeats`` calls of fn."""
    best, out = math.inf, None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _dropin_data(n: int, d: int):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=gen)
    y = torch.randn(n, d, generator=gen)
    y[:, 0] += 0.5
    return x, y


def dropin_reference(n: int, d: int, ref_max_iter: int = REF_MAX_ITER) -> dict:
    """The converged value of ``dropin_case``'s problem: a float64 ``SROTLoss`` (the defaults otherwise) solved to
    tol 1e-6 / value_tol 1e-9; {"ref": value, "ref_marginal_error": its marginal error}."""
    from srot_fast import SROTLoss

    x, y = _dropin_data(n, d)
    ref_loss = SROTLoss(tol=1e-6, value_tol=1e-9, max_iter=ref_max_iter)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = float(ref_loss(x.double(), y.double()))
    return dict(ref=ref, ref_marginal_error=float(ref_loss.last_result.marginal_error))


def dropin_case(n: int, d: int, repeats: int = 2, ref_max_iter: int = REF_MAX_ITER, ref: dict | None = None) -> dict:
    """``SROTLoss()`` against ``geomloss.SamplesLoss()`` (both defaults: p = 2, blur 0.05, debiased), float32,
    loss + gradient w.r.t. x, two unit Gaussians 0.5 apart; values against ``dropin_reference`` (computed here
    unless ``ref`` gives it). Timings interleaved, best of ``repeats``."""
    import geomloss

    from srot_fast import SROTLoss

    x, y = _dropin_data(n, d)
    if ref is None:
        ref = dropin_reference(n, d, ref_max_iter)
    ref, ref_err = ref["ref"], ref["ref_marginal_error"]

    def run(loss):
        xg = x.clone().requires_grad_()
        v = loss(xg, y)
        v.backward()
        return float(v.detach())

    ours, theirs = SROTLoss(), geomloss.SamplesLoss()
    run(theirs)  # warm-up
    t_ours, t_gl = math.inf, math.inf
    warned = False
    for _ in range(repeats):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t, v_ours = _timed(lambda: run(ours), 1)
        warned |= any(issubclass(w.category, ConvergenceWarning) for w in caught)
        t_ours = min(t_ours, t)
        t, v_gl = _timed(lambda: run(theirs), 1)
        t_gl = min(t_gl, t)
    res = ours.last_result
    return dict(n=n, d=d, ref=ref, ref_marginal_error=ref_err, srot_seconds=t_ours, srot_value=v_ours,
                srot_error=_rel(v_ours, ref), srot_updates=int(res.n_iter),
                srot_marginal_error=float(res.marginal_error),
                srot_warned=warned, geomloss_seconds=t_gl, geomloss_value=v_gl, geomloss_error=_rel(v_gl, ref),
                time_ratio=t_ours / t_gl)


def pot_dropin_case(n: int, d: int, ref: dict, tol: float = 1e-4, max_iter: int = 100_000) -> dict:
    """POT's route to ``SamplesLoss()``'s value on ``dropin_case``'s problem, float32, loss + gradient w.r.t. x, one
    timed call: the Sinkhorn divergence from three ``ot.solve`` calls (xy, xx, yy) on ``ot.dist`` cost matrices
    (|x - y|^2, so reg = 2 eps and the value is halved: the same quantity as SROTLoss's), method 'sinkhorn_log'
    (plain 'sinkhorn' underflows at this eps), envelope gradients, stopped at POT's ``tol`` (the L2 norm of the
    second marginal's violation). ``ot.solve_sample(..., debias=True)`` would be the one-call route, but with
    'sinkhorn_log' it returns no value for the self-transport terms (POT 0.9.7). Relative marginal error (both
    marginals, L1, as SROTLoss's stopping test) of the xy solve and the value error against ``ref``."""
    import ot

    x, y = _dropin_data(n, d)
    eps = 0.05 ** 2
    xg = x.clone().requires_grad_()
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = [ot.solve(ot.dist(s, t), reg=2 * eps, method="sinkhorn_log", grad="envelope", tol=tol, max_iter=max_iter)
               for s, t in ((xg, y), (xg, xg), (y, y))]
        value = (res[0].value - 0.5 * (res[1].value + res[2].value)) / 2
        value.backward()
    seconds = time.perf_counter() - t0
    plan = res[0].plan.detach().double()
    marg = float(((plan.sum(1) - 1 / n).abs().sum() + (plan.sum(0) - 1 / n).abs().sum()) / 2)
    v = float(value.detach())
    return dict(pot_seconds=seconds, pot_value=v, pot_error=_rel(v, ref["ref"]), pot_marginal_error=marg,
                pot_warned=bool(caught), pot=ot.__version__, pot_tol=tol, pot_max_iter=max_iter)


def batch_case(batch: int = 64, n: int = 256, d: int = 2, repeats: int = 3) -> dict:
    """B problems of n points (p = 2, blur 0.05, debias off, float32), loss + gradient: one batched ``SROTLoss``
    call, a Python loop of B calls, and GeomLoss tensorized on the same batch. Interleaved, best of repeats."""
    import geomloss

    from srot_fast import SROTLoss

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, n, d, generator=gen)
    y = torch.randn(batch, n, d, generator=gen) + 0.5
    ours = SROTLoss(p=2, blur=0.05, debias=False)
    gl = geomloss.SamplesLoss(p=2, blur=0.05, debias=False, backend="tensorized")

    def batched():
        xg = x.clone().requires_grad_()
        ours(xg, y).sum().backward()
        return ours.last_result

    def loop():
        xg = x.clone().requires_grad_()
        sum(ours(xg[k], y[k]) for k in range(batch)).backward()

    def geom():
        xg = x.clone().requires_grad_()
        gl(xg, y).sum().backward()

    batched(), geom()  # warm-up
    t_b = t_l = t_g = math.inf
    for _ in range(repeats):
        t, res = _timed(batched, 1)
        t_b = min(t_b, t)
        t_g = min(t_g, _timed(geom, 1)[0])
        t_l = min(t_l, _timed(loop, 1)[0])
    return dict(batch=batch, n=n, d=d, batched_seconds=t_b, loop_seconds=t_l, geomloss_seconds=t_g,
                loop_over_batched=t_l / t_b, geomloss_over_batched=t_g / t_b, passes=res.passes,
                updates_max=int(res.n_iter.max()), updates_median=float(res.n_iter.double().median()))


# ------------------------------------------------------------------------------------------------- report
def _f(v, fmt="{:.3g}"):
    return "-" if v is None else fmt.format(v)


def markdown(rows) -> str:
    head = ("| p | penalty | d | blur/diam | n | offsets | updates before | updates after | ratio | s before | s after "
            "| s ratio | before | after | value err before | value err after | GeomLoss value err | GeomLoss s | ref |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        b, a, gl, ref = r["before"], r["after"], r["geomloss"], r["ref"]
        lines.append("| " + " | ".join([
            str(r["p"]), r["penalty"], str(r["d"]), f"{r['ratio']:g}", str(r["n"]), "yes" if r["offsets"] else "no",
            _f(b["n_iter"], "{}"), _f(a["n_iter"], "{}"), _f(r["update_ratio"], "{:.2f}"),
            _f(b["seconds"], "{:.3f}"), _f(a["seconds"], "{:.3f}"), _f(r["time_ratio"], "{:.2f}"),
            b["status"], a["status"], _f(b["value_error"], "{:.1e}"), _f(a["value_error"], "{:.1e}"),
            _f(gl.get("value_error"), "{:.1e}") if gl["status"] == "ok" else gl["status"],
            _f(gl.get("seconds"), "{:.3f}") if gl["status"] == "ok" else "-",
            f"{ref['mode']} {_f(ref['n_iter'], '{}')}" if ref["converged"]
            else f"{ref['mode']} {ref['status']} err {_f(ref['marginal_error'], '{:.0e}')}",
        ]) + " |")
    return "\n".join(lines)


def summary(rows) -> list[str]:
    def med(vals):
        vals = [v for v in vals if v is not None]
        return f"{statistics.median(vals):.2f} (over {len(vals)})" if vals else "-"

    both = [r for r in rows if r["before"]["converged"] and r["after"]["converged"]]
    out = [
        f"cases: {len(rows)}; both converged: {len(both)}",
        f"median updates before/after (both converged): {med([r['update_ratio'] for r in both])}",
        f"median seconds before/after (both converged): {med([r['time_ratio'] for r in both])}",
        f"cases with more updates after than before: {sum(r['after']['n_iter'] > r['before']['n_iter'] for r in both)}"
        f"; slower (seconds) after: {sum(r['time_ratio'] < 1 for r in both)}",
    ]
    for mode in ("before", "after"):
        st = [r[mode]["status"] for r in rows]
        out.append(f"{mode}: not converged (cap {MAX_ITER}) {st.count('cap')}, diverged (nan) {st.count('nan')}, "
                   f"errors {sum(s.startswith('error') for s in st)}, ConvergenceWarning "
                   f"{sum(bool(r[mode].get('warned')) for r in rows)}; median value error "
                   f"{_f(_median([r[mode]['value_error'] for r in rows]), '{:.1e}')}")
    out.append(f"references not converged to {REF_TOL:g}: {sum(not r['ref']['converged'] for r in rows)}; "
               f"plain-loop references: {sum(r['ref']['mode'] == 'plain' for r in rows)}")
    gl = [r for r in rows if r["geomloss"].get("value_error") is not None]
    if gl:
        errs = [r["geomloss"]["value_error"] for r in gl]
        out.append(f"GeomLoss fixed schedule: median value error {_median(errs):.1e}, max {max(errs):.1e} "
                   f"(over {len(gl)})")
    for pen in PENALTIES:
        sub = [r for r in both if r["penalty"] == pen]
        if sub:
            out.append(f"  {pen}: median updates before/after {med([r['update_ratio'] for r in sub])}, "
                       f"seconds {med([r['time_ratio'] for r in sub])}")
    return out


def _median(vals):
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return dict(cpu=cpu, torch=torch.__version__, torch_threads=torch.get_num_threads(),
                python=platform.python_version(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="d = 2, n = 1000, blur/diam in {0.1, 0.02}, no offsets")
    ap.add_argument("--n", type=int, nargs="+", default=list(SIZES))
    ap.add_argument("--d", type=int, nargs="+", default=list(DIMS))
    ap.add_argument("--p", type=int, nargs="+", default=list(PS))
    ap.add_argument("--penalty", nargs="+", default=list(PENALTIES), choices=PENALTIES)
    ap.add_argument("--ratio", type=float, nargs="+", default=list(RATIOS), help="blur / diameter")
    ap.add_argument("--offsets", choices=("both", "no", "yes"), default="both")
    ap.add_argument("--no-geomloss", action="store_true")
    ap.add_argument("--ref-max-iter", type=int, default=REF_MAX_ITER)
    ap.add_argument("--out", help="JSON file (rewritten after every case)")
    ap.add_argument("--md", help="Markdown file for the table and summary")
    ap.add_argument("--from-json", nargs="+", metavar="FILE", help="no solving: merge these --out files, report")
    ap.add_argument("--dropin", action="store_true", help="SROTLoss() vs SamplesLoss() at each --n x --d instead")
    ap.add_argument("--pot", type=int, default=0, metavar="N", help="--dropin: also time POT (one call; see "
                    "pot_dropin_case) at n <= N (minutes at n = 1000: plain log-domain iterations, no eps-scaling)")
    ap.add_argument("--batch", action="store_true", help="the batched solve (B = 64 x 256 points) instead")
    ap.add_argument("--refs", metavar="FILE", help="--dropin: JSON of the float64 reference values by n and d, "
                    "read when it exists, completed and rewritten with those computed (--refs-only: no timing)")
    ap.add_argument("--refs-only", action="store_true", help="--dropin: compute the references (--refs) only")
    args = ap.parse_args(argv)
    if args.refs_only and not (args.dropin and args.refs):
        ap.error("--refs-only needs --dropin and --refs FILE")
    if args.dropin or args.batch:
        rows = ([_dropin_row(n, d, args) for n in args.n for d in args.d] if args.dropin else [batch_case()])
        if args.refs_only:
            return 0
        for r in rows:
            print(json.dumps(r), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(meta=dict(machine(), command=" ".join(sys.argv)), rows=rows), f, indent=1)
        return 0
    if args.from_json:
        rows = []
        for name in args.from_json:
            with open(name) as f:
                rows += json.load(f)["rows"]
        order = {c: k for k, c in enumerate(grid())}
        rows.sort(key=lambda r: order.get(tuple(r[k] for k in ("p", "penalty", "d", "ratio", "n", "offsets")), 0))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(meta=dict(sources=args.from_json), rows=rows), f, indent=1)
        return _report(rows, args.md)
    offsets = {"both": (False, True), "no": (False,), "yes": (True,)}[args.offsets]
    if args.quick:
        args.n, args.d, args.ratio, offsets = [1000], [2], [0.1, 0.02], (False,)
    cases = grid(args.p, args.penalty, args.d, args.ratio, args.n, offsets)
    sinkhorn(torch.zeros(4, 2, dtype=torch.float64), torch.ones(4, 2, dtype=torch.float64), backend="cpu")  # load
    meta = dict(machine(), command=" ".join(sys.argv), tol=TOL, max_iter=MAX_ITER, ref_tol=REF_TOL,
                ref_max_iter=args.ref_max_iter, scaling=SCALING, tau=TAU, mass=MASS, offset_scale=OFFSET_SCALE)
    rows = []
    for k, case in enumerate(cases):
        row = run_case(*case, with_geomloss=not args.no_geomloss, ref_max_iter=args.ref_max_iter)
        rows.append(row)
        print(f"[{k + 1}/{len(cases)}] p={row['p']} {row['penalty']} d={row['d']} ratio={row['ratio']:g} "
              f"n={row['n']} offsets={row['offsets']}: updates {row['before']['n_iter']} -> {row['after']['n_iter']}"
              f" ({row['before']['status']}/{row['after']['status']}), ref {row['ref']['mode']} "
              f"{row['ref']['n_iter']}", file=sys.stderr, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return _report(rows, args.md)


def _dropin_row(n: int, d: int, args) -> dict:
    """``dropin_case`` at (n, d), its reference read from the ``--refs`` file or computed (and added to it)."""
    refs, key = {}, f"n={n},d={d},ref_max_iter={args.ref_max_iter}"
    if args.refs:
        try:
            with open(args.refs) as f:
                refs = json.load(f)
        except FileNotFoundError:
            pass
    if key not in refs:
        refs[key] = dict(dropin_reference(n, d, args.ref_max_iter), **machine())
        if args.refs:
            with open(args.refs, "w") as f:
                json.dump(refs, f, indent=1)
    if args.refs_only:
        return refs[key]
    row = dropin_case(n, d, ref_max_iter=args.ref_max_iter, ref=refs[key])
    if n <= args.pot:
        row.update(pot_dropin_case(n, d, refs[key]))
        row["pot_over_srot"] = row["pot_seconds"] / row["srot_seconds"]
    return row


def _report(rows, md) -> int:
    text = markdown(rows) + "\n\n" + "\n".join(summary(rows)) + "\n"
    print(text)
    if md:
        with open(md, "w") as f:
            f.write(text)
    return 0


# ----------------------------------------------------------------------------------------- pytest-benchmark
BENCH_CASES = [(p, pen, 2, 0.05, 500, pen != "balanced") for p in PS for pen in PENALTIES]
_REFS: dict = {}


@pytest.mark.parametrize("accelerate", [False, True], ids=["before", "after"])
@pytest.mark.parametrize("p,penalty,d,ratio,n,offsets", BENCH_CASES)
def test_convergence(benchmark, warm_up, load_backend, p, penalty, d, ratio, n, offsets, accelerate):
    """Seconds to tol 1e-4 on backend 'cpu'; extra_info holds updates, marginal and value errors."""
    load_backend("cpu")
    x, y, u, v, diam = problem(n, d, p, offsets)
    eps = (ratio * diam) ** p
    kw = dict(p=p, eps=eps, diam=diam, penalty=penalty)
    key = (p, penalty, d, ratio, n, offsets)
    if key not in _REFS:
        _REFS[key] = reference(x, y, u, v, **kw)
    ref = _REFS[key]
    out = {}

    def step():
        out.update(solve(x, y, u, v, accelerate=accelerate, tol=TOL, max_iter=MAX_ITER, **kw))

    rounds = warm_up(step)
    benchmark.pedantic(step, rounds=min(rounds, 3), iterations=1, warmup_rounds=0)
    benchmark.extra_info.update(
        solver="srot_fast", backend="cpu", p=p, penalty=penalty, d=d, blur_over_diameter=ratio, n=n,
        offsets=offsets, accelerate=accelerate, n_iter=out["n_iter"], marginal_error=out["marginal_error"],
        status=out["status"], ref_mode=ref["mode"],
        value_error=_rel(out["value"], ref["value"] if ref["converged"] else None))
    assert ref["converged"], ref
    assert out["converged"], out


if __name__ == "__main__":
    sys.exit(main())
