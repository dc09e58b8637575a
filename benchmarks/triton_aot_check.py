"""Compile every Triton kernel configuration for a GPU target without a GPU (sm_90 = H100 / H200 by default).

What this checks, on a CPU-only machine: that each kernel of ``kernels/triton/kernels.py`` and
``kernels/triton/sparse_kernels.py`` (block-sparse) compiles through
the real Triton pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with the ptxas shipped in the triton wheel)
for every block configuration the launchers and the autotuner can pick and every (D, p, dtype) the tests use
(float32, float64, and bfloat16 / float16 points with float32 ``h`` and outputs), every tl.dot precision
("ieee", "tf32x3", "tf32"), that its shared memory fits the target (227 KiB per block on sm_90), which
configurations spill registers (a non-zero stack frame, from ``cuobjdump -res-usage``) and the instruction
mix of each cubin (static SASS counts of the exp2 unit, FMAs, tensor-core MMAs, loads, conversions). The CPU
interpreter (``TRITON_INTERPRET=1``) checks the numbers but compiles nothing; a GPU run checks both. What
this cannot check: numbers, speed, or errors that only show when a kernel runs.

Each kernel's signature is read from its definition (argument names and which are ``tl.constexpr``), so a
changed argument list needs no edit here; a configuration that misses or adds a constexpr is an error before
anything compiles.

Run: ``python benchmarks/triton_aot_check.py [--jobs 2] [--quick | --smoke] [--out aot.json]``. The full run
compiles every configuration below (about 1200; most of an hour on 2 cores); ``--quick`` the default blocks
and the autotune candidates at one D per kernel, bfloat16 points on the autotuned kernels and every kernel's
default blocks in bfloat16 / float16 (about 440, a quarter of an hour); ``--smoke`` one configuration per
kernel, point dtype, path and dot precision (a check that every kernel still compiles). ``--only NAME``
keeps the kernels whose name contains NAME.
Exit status 1 if a configuration fails to compile or exceeds the shared memory.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

os.environ.pop("TRITON_INTERPRET", None)  # real compilation
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from srot_fast.kernels.triton import autotune as A  # noqa: E402
from srot_fast.kernels.triton import blocksparse as B  # noqa: E402
from srot_fast.kernels.triton import kernels as K  # noqa: E402
from srot_fast.kernels.triton import sparse_kernels as S  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

SMEM_MAX = 232448  # bytes of shared memory per block on sm_90
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


# runtime arguments that are neither pointers to the compute dtype nor int32 (see the launchers)
_FLOAT_ARGS = {"coinc": "fp32"}  # a Python float: Triton types it float32
_PTR_DTYPES = {("_plan_argmax_fwd_kernel", "out_ptr"): "i64", ("_bs_argmax_kernel", "out_ptr"): "i64"}  # indices
_INDEX_PTRS = {"offs_ptr", "cblk_ptr"}  # the block-sparse kernels' CSR lists: int64
_POINT_PTRS = {"x_ptr", "y_ptr", "xt_ptr", "yt_ptr"}  # the points: in their own dtype (half stays half)
_COMPUTE = {"bf16": "fp32", "fp16": "fp32", "fp32": "fp32", "fp64": "fp64"}  # h, prm, norms, outputs
_SASS_OPS = ("MUFU.EX2", "MUFU.LG2", "MUFU.RSQ", "MUFU.SQRT", "FFMA", "FMUL", "FADD", "FMNMX", "FSETP", "FSEL",
             "HGMMA", "HMMA", "LDG", "LDS", "STS", "F2F", "SHFL", "BAR", "DFMA")


def _sig(name: str, dtype: str, const: dict) -> dict:
    """Triton signature of kernel ``name`` (:mod:`srot_fast.kernels.triton.kernels` or ``.sparse_kernels``), read
    from its definition:
    the point arguments (``_POINT_PTRS``) are pointers to ``dtype``, other ``*_ptr`` arguments pointers to its
    compute dtype (float32 for half points; except ``_PTR_DTYPES``), ``_FLOAT_ARGS`` scalars, other runtime
    arguments int32, the ``tl.constexpr`` parameters "constexpr". ValueError unless ``const`` gives exactly
    the kernel's constexpr parameters."""
    fn = _kernel(name)
    names = list(inspect.signature(fn.fn).parameters)
    if names != list(fn.arg_names):
        raise ValueError(f"{name}: signature {names} differs from the JITFunction's arg_names {fn.arg_names}")
    consts = {names[i] for i in fn.constexprs}
    if set(const) != consts:
        raise ValueError(f"{name}: constexpr values given for {sorted(const)}, the kernel has {sorted(consts)}")
    sig = {}
    for n in names:
        if n in consts:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            sig[n] = "*i64" if n in _INDEX_PTRS else "*" + _PTR_DTYPES.get(
                (name, n), dtype if n in _POINT_PTRS else _COMPUTE[dtype])
        else:
            sig[n] = _FLOAT_ARGS.get(n, "i32")
    return sig


def _sass_counts(sass: str) -> dict:
    """Static count of each opcode family of ``_SASS_OPS`` in a SASS listing (instructions in the code, not
    executed ones: a loop body counts once), plus the total instruction count."""
    ops = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, flags=re.M)
    out = {op: sum(1 for o in ops if o == op or o.startswith(op + ".")) for op in _SASS_OPS}
    out["total"] = len(ops)
    return out


def _compile(job):
    name, sig, const, warps, stages, arch = job
    points = next(sig[n] for n in ("x_ptr", "xt_ptr") if n in sig)
    row = dict(kernel=name, points=points.lstrip("*"), const=const, num_warps=warps, num_stages=stages)
    try:
        src = ASTSource(fn=_kernel(name), signature=sig, constexprs=const)
        kern = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=warps, num_stages=stages))
        row["shared_bytes"] = kern.metadata.shared
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(kern.asm["cubin"])
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True).stdout
        os.unlink(f.name)
        # which units the dots use: HGMMA (Hopper wgmma), HMMA (mma.sync), else FFMA (CUDA cores)
        row["mma"] = next((op for op in ("HGMMA", "HMMA") if op in sass), "FFMA")
        row["sass"] = _sass_counts(sass)
        for key, pat in (("registers", r"REG:(\d+)"), ("stack_bytes", r"STACK:(\d+)")):
            m = re.search(pat, usage)
            row[key] = int(m.group(1)) if m else None
    except Exception as e:  # noqa: BLE001 - a compile failure is the result
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    return row


_DOT_KERNELS = ("_softmin_fwd_kernel", "_weighted_mean_dot_kernel", "_weighted_sum_dot_kernel",
                "_plan_argmax_fwd_kernel", "_max_sq_fwd_kernel")


def jobs(quick: bool, arch: int) -> list:
    """(kernel, signature, constexprs, num_warps, num_stages, arch) for every configuration to compile. The
    kernels with a tl.dot take every configuration at PREC = "ieee"; float32 dot-path configurations at
    D = 64, the softmin's at D = 300 / 3072 and the two-pass weighted sum's at D = 300 / 3072 also at
    "tf32x3" and, at the launchers' default blocks, at the opt-in "tf32". Half points (the kernels take
    "tf32" for their x.y whatever PREC says; PREC still sets the weighted means' w @ y): bfloat16 at every
    configuration of the autotuned kernels at the D they are tuned at, and bfloat16 / float16 at every
    kernel's default blocks."""
    out = []

    def add(name, dtype, const, w, s, half=()):
        consts = [const]
        if name in _DOT_KERNELS:
            consts = [{**const, "PREC": "ieee"}]
            if dtype == "fp32" and const.get("DOT", True) and const["D"] in (64, 300, 3072) and (
                    const["D"] == 64 or "UNIT" in const or name == "_softmin_fwd_kernel"):
                consts.append({**const, "PREC": "tf32x3"})
                if (w, s) == (4, 3) and const["BLOCK_N"] in (64, 32) and const["BLOCK_M"] == 64:
                    consts.append({**const, "PREC": "tf32"})
            elif dtype in ("bf16", "fp16") and "UNIT" in const and (const["BLOCK_N"], w, s) == (64, 4, 3):
                consts.append({**const, "PREC": "tf32x3"})  # the means' w @ y of half points
        out.extend((name, _sig(name, dtype, c), c, w, s, arch) for c in consts)
        for hdt in half:  # the same configuration with half points
            add(name, hdt, const, w, s)

    def halves(default: bool, tuned: bool) -> tuple:
        """Half point dtypes for a configuration: both at the default blocks, bfloat16 for tuned candidates."""
        return ("bf16", "fp16") if default else ("bf16",) if tuned else ()

    # softmin, dot path (float32): autotune candidates, the same blocks at the default 4 warps / 3 stages,
    # the launcher's default and the tests' 16 x 16 x 16
    cand = [(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_M"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages)
            for c in A._CFG_DOT]
    for d in (64,) if quick else (37, 64, 300, 3072):
        for p in (1, 2):
            cfgs = set(cand) | {(64, 64, 32, 4, 3), (16, 16, 16, 4, 3)}
            if not quick and d in (37, 64):
                cfgs |= {(bn, bm, bk, 4, 3) for bn, bm, bk, _, _ in cand}
            for bn, bm, bk, w, s in sorted(cfgs):
                add("_softmin_fwd_kernel", "fp32",
                    dict(D=d, P=p, DOT=True, FOLD=p == 2, BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=bk), w, s,
                    half=halves((bn, bm, bk, w, s) == (64, 64, 32, 4, 3), d == 64 and (bn, bm, bk, w, s) in cand))
    # softmin, small-d path (float32 and float64), both tile orientations
    cand = [(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_M"], c.kwargs["TRANS"], c.num_warps, c.num_stages)
            for c in A._CFG_SMALL]
    for dt, dims in (("fp32", (2,) if quick else (1, 2, 3, 20)), ("fp64", (3,) if quick else (2, 3, 20, 70, 300))):
        for d in dims:
            for p in (1, 2):
                cfgs = set(cand) | {(32, 64, False, 4, 3), (16, 16, False, 4, 3), (16, 16, True, 4, 3)}
                if not quick and dt == "fp32" and d == 3:
                    cfgs |= {(bn, bm, tr, 4, 3) for bn, bm, tr, _, _ in cand}
                for bn, bm, tr, w, s in sorted(cfgs):
                    add("_softmin_small_kernel", dt,
                        dict(D=d, P=p, TRANS=tr, BLOCK_N=bn, BLOCK_M=bm), w, s,
                        half=halves((bn, bm, tr, w, s) == (32, 64, False, 4, 3),
                                    d == 2 and (bn, bm, tr, w, s) in cand) if dt == "fp32" else ())
    # one-pass tl.dot weighted mean (float32, 16 <= BLOCK_D <= 128)
    cand = [(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_M"], c.num_warps, c.num_stages) for c in A._CFG_WMEAN_DOT]
    for d in (64,) if quick else (37, 40, 64, 128):
        for p, unit in ((1, True), (1, False), (2, False)):
            cfgs = set(cand) | {(64, 64, 4, 3), (16, 16, 4, 3)}
            if not quick:
                cfgs |= {(bn, bm, 4, 3) for bn, bm, _, _ in cand}
            for bn, bm, w, s in sorted(cfgs):
                add("_weighted_mean_dot_kernel", "fp32",
                    dict(D=d, P=p, UNIT=unit, BLOCK_N=bn, BLOCK_M=bm, BLOCK_D=max(16, triton.next_power_of_2(d))),
                    w, s, half=halves((bn, bm, w, s) == (64, 64, 4, 3), d == 64 and (bn, bm, w, s) in cand))
    # small-d weighted mean (broadcast products), candidates kept by the autotuner's register-tile prune
    for dt in ("fp32", "fp64"):
        for d in (2,) if quick else (1, 2, 3, 64):
            bd = max(2, triton.next_power_of_2(d))
            for p, unit in ((1, True), (2, False), (1, False)):
                cfgs = {(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_M"], c.num_warps, c.num_stages)
                        for c in A._CFG_WMEAN_SMALL if c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_M"] * bd <= 16384}
                for bn, bm, w, s in sorted(cfgs | {(16, 32, 4, 3), (16, 16, 4, 3)}):
                    add("_weighted_mean_fwd_kernel", dt,
                        dict(D=d, P=p, UNIT=unit, BLOCK_N=bn, BLOCK_M=bm, BLOCK_D=bd), w, s,
                        half=halves((bn, bm, w, s) == (16, 32, 4, 3), d == 2 and (bn, bm, w, s) in cfgs)
                        if dt == "fp32" else ())
    # two-pass weighted sum (large D), plan argmax, max |x - y|^2 at their fixed blocks
    for dt, dot, d in (("fp32", True, 300), ("fp64", False, 70)) if quick else (
            ("fp32", True, 129), ("fp32", True, 300), ("fp32", True, 3072), ("fp64", False, 70), ("fp64", False, 300)):
        for p, unit in ((1, True), (2, False)):
            for bn, bm, bk in ((64, 64, 32), (16, 16, 16)) if dot else ((16, 16, 16),):
                add("_weighted_sum_dot_kernel", dt,
                    dict(D=d, P=p, UNIT=unit, BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=bk, DOT=dot), 4, 3,
                    half=halves(dot and bn == 64 and d in (300, 129), False))
    for dt, dot, d in (("fp32", False, 2), ("fp32", True, 64)) if quick else (
            ("fp32", False, 2), ("fp32", True, 37), ("fp32", True, 64), ("fp64", False, 3), ("fp32", True, 3072)):
        blocks = ((64 if dot else 32, 64, 32), (16, 16, 16))
        for bn, bm, bk in blocks:
            half = halves(bn != 16 and dt == "fp32" and d in (2, 64), False)
            for p in (1, 2):
                add("_plan_argmax_fwd_kernel", dt,
                    dict(D=d, P=p, DOT=dot, BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=bk), 4, 3, half=half)
            add("_max_sq_fwd_kernel", dt,
                dict(D=d, DOT=dot, BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=bk), 4, 3, half=half)
    # small-d weighted mean with a thread per row (trans=True, D <= 3): the launcher's default and the benchmark's
    # tiles (benchmarks/gpu_kernels.py), half points at the default
    for dt in ("fp32", "fp64"):
        for d in (2,) if quick else (1, 2, 3):
            for p, unit in ((1, True), (2, False), (1, False)):
                for bn, bm, w in ((64, 64, 2),) if quick else ((64, 64, 2), (128, 64, 4), (64, 32, 2), (128, 32, 4)):
                    add("_weighted_mean_soa_kernel", dt, dict(D=d, P=p, UNIT=unit, BLOCK_N=bn, BLOCK_M=bm), w, 3,
                        half=halves(bn == 64 and bm == 64, False) if dt == "fp32" else ())
    # block-sparse kernels at the launchers' tiles (blocksparse.TILE for the soft-min and the weighted mean, 32 x 64
    # for the argmax; rows of 64-point blocks)
    tile_n, tile_m, trans, warps = B.TILE
    for dt in ("fp32", "fp64"):
        for d in (2,) if quick else (1, 2, 3):
            for p in (1, 2):
                add("_bs_softmin_kernel", dt, dict(D=d, P=p, BLOCK=B.BLOCK, BLOCK_N=tile_n, BLOCK_M=tile_m,
                                                   TRANS=trans), warps, 3)
                add("_bs_argmax_kernel", dt, dict(D=d, P=p, BLOCK=B.BLOCK, BLOCK_N=32, BLOCK_M=64), 4, 3)
                for unit in (p == 1, False) if p == 1 else (False,):
                    add("_bs_wmean_kernel", dt, dict(D=d, P=p, UNIT=unit, BLOCK=B.BLOCK, BLOCK_N=tile_n,
                                                     BLOCK_M=tile_m), warps, 3)
    return out


def _kernel(name: str):
    """The JITFunction ``name`` of the dense or the block-sparse kernel module."""
    return getattr(K, name) if hasattr(K, name) else getattr(S, name)


def smoke(todo: list) -> list:
    """The first job of each (kernel, pointer dtype, DOT, PREC) of ``todo``."""
    seen, out = set(), []
    for job in todo:
        name, sig, const = job[:3]
        key = (name, next(iter(sig.values())), const.get("DOT"), const.get("PREC"))
        if key not in seen:
            seen.add(key)
            out.append(job)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100 / H200)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="default blocks and autotune candidates at one D")
    mode.add_argument("--smoke", action="store_true", help="one configuration per kernel, dtype, path and precision")
    ap.add_argument("--only", default=None, help="keep the kernels whose name contains this string")
    ap.add_argument("--out", default=None, help="JSON file with one row per configuration")
    args = ap.parse_args(argv)
    todo = jobs(args.quick or args.smoke, args.arch)
    if args.smoke:
        todo = smoke(todo)
    if args.only:
        todo = [j for j in todo if args.only in j[0]]
    print(f"compiling {len(todo)} configurations for sm_{args.arch} with {args.jobs} processes", flush=True)
    with ProcessPoolExecutor(args.jobs) as ex:
        rows = list(ex.map(_compile, todo))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    bad = [r for r in rows if "error" in r or r.get("shared_bytes", 0) > SMEM_MAX]
    spills = [r for r in rows if (r.get("stack_bytes") or 0) > 0]
    print(f"{len(rows) - len(bad)} of {len(rows)} compiled within {SMEM_MAX} bytes of shared memory; "
          f"{len(spills)} with a stack frame (register spills)")
    for r in bad + spills:
        print(("FAIL " if r in bad else "spill ") + json.dumps(r, default=str)[:400])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
