"""Before / after in one process, interleaved: the loop (srot_fast/_loop.py, and _anderson.py where the revision
has it) of a git revision against the working tree's.

    python ab_revisions.py partial REV [OUT.json]   # partial vs balanced OT, n = 1000, d = 2 (bench_convergence's
                                                    # problem), updates to tol 1e-4 and value error against the
                                                    # float64 references in partial_refs.json
    python ab_revisions.py batch REV [REPEATS] [OUT.json]  # bench_convergence.batch_case's problem: batched call,
                                                    # loop of single calls (both revisions), GeomLoss tensorized
"""
import json
import math
import os
import subprocess
import sys
import time
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_convergence import problem, solve  # noqa: E402

import srot_fast.sinkhorn  # noqa: E402,F401

SK = sys.modules["srot_fast.sinkhorn"]  # the module (srot_fast.sinkhorn is also the function's name)
NEW = SK._loop


def _module(rev: str, path: str, name: str, replace=()):
    src = subprocess.check_output(["git", "-C", ROOT, "show", f"{rev}:{path}"]).decode()
    for a, b in replace:
        src = src.replace(a, b)
    mod = types.ModuleType(name)
    mod.__package__ = "srot_fast"
    sys.modules[name] = mod
    exec(compile(src, f"{rev}:{path}", "exec"), mod.__dict__)
    return mod


def old_loop(rev: str):
    try:
        _module(rev, "srot_fast/_anderson.py", "srot_fast._anderson_old")
        repl = [("from ._anderson import", "from ._anderson_old import")]
    except subprocess.CalledProcessError:  # the revision has no _anderson.py
        repl = []
    return _module(rev, "srot_fast/_loop.py", "srot_fast._loop_old", repl)


def partial(rev: str, out=None):
    old = old_loop(rev)
    refs = json.load(open(os.path.join(HERE, "partial_refs.json")))
    rows = []
    for off in (False, True):
        for p, ratio in [(2, 0.1), (2, 0.02), (2, 0.005), (1, 0.02), (1, 0.005)]:
            x, y, u, v, diam = problem(1000, 2, p, off)
            kw = dict(p=p, eps=(ratio * diam) ** p, diam=diam, accelerate=True, tol=1e-4, max_iter=20000)
            row = dict(p=p, ratio=ratio, offsets=off)
            for pen in ("balanced", "partial"):
                ref = refs[f"{p}-{ratio}-{off}-{pen}"]
                for name, mod in (("before", old), ("after", NEW)):
                    SK._loop = mod
                    r = solve(x, y, u, v, penalty=pen, **kw)
                    row[f"{pen}_{name}"] = dict(n_iter=r["n_iter"], seconds=r["seconds"], status=r["status"],
                                                value_error=abs(r["value"] - ref) / abs(ref))
            SK._loop = NEW
            rows.append(row)
            pb, pa, ba = row["partial_before"], row["partial_after"], row["balanced_after"]
            print(f"p={p} blur/diam={ratio} offsets={off}: balanced {row['balanced_before']['n_iter']}/{ba['n_iter']}"
                  f" | partial {pb['n_iter']} -> {pa['n_iter']} (x{pa['n_iter'] / ba['n_iter']:.2f} of balanced), "
                  f"value err {pb['value_error']:.1e} -> {pa['value_error']:.1e} (balanced {ba['value_error']:.1e}),"
                  f" s {pb['seconds']:.2f} -> {pa['seconds']:.2f}", flush=True)
    if out:
        json.dump(dict(command=" ".join(sys.argv), rows=rows), open(out, "w"), indent=1)


def batch(rev: str, repeats: int = 3, out=None):
    import geomloss

    from srot_fast import SROTLoss

    old = old_loop(rev)
    gen = torch.Generator().manual_seed(0)
    B, n = 64, 256
    x = torch.randn(B, n, 2, generator=gen)
    y = torch.randn(B, n, 2, generator=gen) + 0.5
    ours = SROTLoss(p=2, blur=0.05, debias=False)
    gl = geomloss.SamplesLoss(p=2, blur=0.05, debias=False, backend="tensorized")

    def batched():
        xg = x.clone().requires_grad_()
        v = ours(xg, y)
        v.sum().backward()
        return v.detach(), xg.grad, ours.last_result.passes

    def loop():
        xg = x.clone().requires_grad_()
        torch.stack([ours(xg[k], y[k]) for k in range(B)]).sum().backward()

    def geom():
        xg = x.clone().requires_grad_()
        gl(xg, y).sum().backward()

    runs = {"batched old": (old, batched), "batched new": (NEW, batched), "loop old": (old, loop),
            "loop new": (NEW, loop), "geomloss": (NEW, geom)}
    best, outs = {k: math.inf for k in runs}, {}
    for mod, fn in runs.values():  # warm-up
        SK._loop = mod
        fn()
    for _ in range(repeats):
        for name, (mod, fn) in runs.items():
            SK._loop = mod
            t0 = time.perf_counter()
            outs[name] = fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    SK._loop = NEW
    bo, bn = outs["batched old"], outs["batched new"]
    res = dict(command=" ".join(sys.argv), seconds=best,
               loop_over_batched_old=best["loop old"] / best["batched old"],
               loop_over_batched_new=best["loop new"] / best["batched new"],
               geomloss_over_batched_old=best["geomloss"] / best["batched old"],
               geomloss_over_batched_new=best["geomloss"] / best["batched new"],
               batched_old_over_new=best["batched old"] / best["batched new"], passes_old=bo[2], passes_new=bn[2],
               value_diff_old_new=float((bo[0] - bn[0]).abs().max()),
               grad_diff_old_new=float((bo[1] - bn[1]).abs().max()))
    print(json.dumps(res, indent=1))
    if out:
        json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "partial":
        partial(sys.argv[2], *sys.argv[3:4])
    else:
        batch(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 3, *sys.argv[4:5])
