"""The sharded code path on one GPU: srot_fast.distributed with a one-rank NCCL group against srot_fast itself.

    python benchmarks/gpu_distributed.py --n 100000 --out benchmarks/out/gpu_distributed.json

Loss + gradient of ``SROTLoss(p=2, blur=0.05, debias=False, tol=None)`` (GeomLoss's fixed schedule, so both
runs take the same passes) on n = m points in 2-D, on the triton backend: ``srot_fast.SROTLoss`` and
``srot_fast.distributed.SROTLoss`` over a process group of one rank (NCCL, on 127.0.0.1), timed interleaved
(median of ``--reps`` pairs after one warm-up each). With one rank the sharded path moves no data: the ratio
measures its overhead (argument agreement, all-reduces of scalars, the extra bookkeeping). The values must
agree to float32 rounding. Needs CUDA; it defines no test.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_distributed.py needs a CUDA device")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    import srot_fast
    import srot_fast.distributed as sd

    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(args.n, 2, generator=g).cuda()
    y0 = (torch.randn(args.n, 2, generator=g) * 0.8 + 1.0).cuda()
    kw = dict(p=2, blur=0.05, debias=False, tol=None, backend=args.backend)
    losses = {"single": srot_fast.SROTLoss(**kw), "sharded_nccl_1rank": sd.SROTLoss(**kw)}

    def run(loss):
        x = x0.clone().requires_grad_()
        torch.cuda.synchronize()
        t = time.perf_counter()
        value = loss(x, y0)
        value.backward()
        torch.cuda.synchronize()
        return time.perf_counter() - t, float(value), x.grad

    out = {name: dict(first_s=run(loss)[0], times=[]) for name, loss in losses.items()}
    grads = {}
    for _ in range(args.reps):
        for name, loss in losses.items():
            dt, value, grad = run(loss)
            out[name]["times"].append(dt)
            out[name]["value"] = value
            grads[name] = grad
    for row in out.values():
        row["median_s"] = statistics.median(row["times"])
    res = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               device=torch.cuda.get_device_name(), torch=torch.__version__, n=args.n, backend=args.backend, **out,
               ratio_sharded_over_single=out["sharded_nccl_1rank"]["median_s"] / out["single"]["median_s"],
               value_rel_diff=abs(out["sharded_nccl_1rank"]["value"] - out["single"]["value"])
               / abs(out["single"]["value"]),
               grad_max_abs_diff=float((grads["sharded_nccl_1rank"] - grads["single"]).abs().max()))
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
