"""Strong scaling of the sharded solve (srot_fast.distributed) on CPU with gloo, and gloo's communication costs.

    python benchmarks/bench_distributed.py --n 65536 --out benchmarks/out/dist.json

For each repeat, interleaved: (1) one process, one thread: srot_fast.sinkhorn on the whole problem; (2) two
gloo ranks on 127.0.0.1, one thread each: srot_fast.distributed.sinkhorn, each rank holding half of x and of y.
Both use the compiled ``cpu`` backend in float32 and GeomLoss's fixed schedule (``tol=None``), so they run the
same passes; the JSON records wall times, passes, time per pass and both values. In the two-rank job each rank
also times (a) its local compute alone: its x half against all of y and its y half against all of x with the
backend's ``softmin`` (the work of one row and one column pass, no communication), and (b) the collectives a
pass uses (an all-gather of the log-weights, a ring step of a shard) and gloo's latency and bandwidth at
several message sizes, for the performance model of docs/DISTRIBUTED.md.

Not a pytest-benchmark file (it spawns processes); it defines no test.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _problem(n: int, m: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = torch.randn(m, d, generator=g) * 0.8 + 1.0
    return x, y


def _solve_kwargs(args) -> dict:
    return dict(p=args.p, eps=args.blur**args.p, scaling=args.scaling, tol=None, backend="cpu")


def _single(args) -> dict:
    import srot_fast

    torch.set_num_threads(1)
    x, y = _problem(args.n, args.n, args.d)
    srot_fast.sinkhorn(x[:256], y[:256], **_solve_kwargs(args))  # loads the compiled kernel
    t0, c0 = time.perf_counter(), time.process_time()
    res = srot_fast.sinkhorn(x, y, **_solve_kwargs(args))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return dict(wall_s=wall, cpu_s=cpu, passes=res.passes, s_per_pass=wall / res.passes, value=float(res.value))


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _comm_figures(rank: int, world: int, reps: int) -> list:
    """Median time of an all-gather and of a ring step (isend to rank + 1, irecv from rank - 1) of float32
    messages of several sizes."""
    out = []
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for numel in (1 << 8, 1 << 12, 1 << 16, 1 << 20, 1 << 22):
        t = torch.randn(numel)
        parts = [torch.empty_like(t) for _ in range(world)]
        buf = torch.empty_like(t)

        def gather(t=t, parts=parts):
            dist.all_gather(parts, t)

        def ring(t=t, buf=buf):
            reqs = [dist.isend(t, nxt), dist.irecv(buf, prv)]
            for r in reqs:
                r.wait()
        dist.barrier()
        tg = _median_time(gather, reps)
        dist.barrier()
        tr = _median_time(ring, reps)
        out.append(dict(bytes=4 * numel, all_gather_s=tg, ring_step_s=tr))
    return out


def _worker(rank: int, world: int, port: int, args, path: str) -> None:
    from srot_fast import distributed as sd
    from srot_fast.backends import get_ops

    torch.set_num_threads(1)
    lo = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    if lo:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo[0])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=1800))
    x, y = _problem(args.n, args.n, args.d)
    cut = [args.n * r // world for r in range(world + 1)]
    xs, ys = x[cut[rank]:cut[rank + 1]], y[cut[rank]:cut[rank + 1]]
    sd.sinkhorn(xs[:128], ys[:128], **_solve_kwargs(args))  # loads the compiled kernel
    out = {}
    for mode in args.modes.split(","):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        res = sd.sinkhorn(xs, ys, mode=mode, **_solve_kwargs(args))
        cpu = time.process_time() - c0
        dist.barrier()
        wall = time.perf_counter() - t0
        out[mode] = dict(wall_s=wall, cpu_s=cpu, passes=res.passes, s_per_pass=wall / res.passes,
                         value=float(res.value))
    # local compute of one row and one column pass, both ranks at once (same contention as in the solve)
    ops = get_ops("cpu")
    eps = args.blur**args.p
    h_y = h_x = torch.full((1, args.n), -torch.log(torch.tensor(float(args.n))).item())

    def local():
        ops.softmin(xs[None], y[None], h_y, eps, args.p)
        ops.softmin(ys[None], x[None], h_x, eps, args.p)
    dist.barrier()
    c0 = time.process_time()
    local_s = _median_time(local, args.local_reps) / 2
    local_cpu_s = (time.process_time() - c0) / (2 * args.local_reps)
    h_local = torch.randn(1, ys.shape[0])
    parts = [torch.empty_like(h_local) for _ in range(world)]
    dist.barrier()
    gather_h_s = _median_time(lambda: dist.all_gather(parts, h_local), 20)
    comm = _comm_figures(rank, world, 20)
    results = [None] * world
    dist.all_gather_object(results, dict(rank=rank, n_local=xs.shape[0], sharded=out, local_compute_s_per_pass=local_s,
                                         local_compute_cpu_s_per_pass=local_cpu_s,
                                         all_gather_h_s=gather_h_s, comm=comm))
    if rank == 0:
        Path(path).write_text(json.dumps(results))
    dist.destroy_process_group()


def _two_ranks(args) -> list:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ranks.json")
        mp.spawn(_worker, args=(args.world, port, args, path), nprocs=args.world)
        return json.loads(Path(path).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=65536, help="points per cloud (n = m)")
    ap.add_argument("--d", type=int, default=2)
    ap.add_argument("--p", type=int, default=2)
    ap.add_argument("--blur", type=float, default=0.1)
    ap.add_argument("--scaling", type=float, default=0.5)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--modes", default="gather", help="comma-separated modes of the sharded solve")
    ap.add_argument("--repeat", type=int, default=1, help="interleaved (single, sharded) pairs")
    ap.add_argument("--local-reps", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args()
    runs = []
    for k in range(args.repeat):
        single = _single(args)
        print(f"[{k}] 1 rank x 1 thread: {single['wall_s']:.2f} s, {single['passes']} passes, "
              f"{single['s_per_pass']:.3f} s/pass, value {single['value']:.6f}", flush=True)
        ranks = _two_ranks(args)
        for mode, r in ranks[0]["sharded"].items():
            slow = max(rr["sharded"][mode]["s_per_pass"] for rr in ranks)
            local = max(rr["local_compute_s_per_pass"] for rr in ranks)
            cpu_pass = max(rr["sharded"][mode]["cpu_s"] / rr["sharded"][mode]["passes"] for rr in ranks)
            local_cpu = max(rr["local_compute_cpu_s_per_pass"] for rr in ranks)
            print(f"[{k}] CPU s per pass: sharded {cpu_pass:.3f}, local compute {local_cpu:.3f} "
                  f"(ratio {cpu_pass / local_cpu:.3f}); single {single['cpu_s'] / single['passes']:.3f}", flush=True)
            print(f"[{k}] {args.world} ranks x 1 thread ({mode}): {r['wall_s']:.2f} s, {r['passes']} passes, "
                  f"{slow:.3f} s/pass (local compute {local:.3f} s/pass, ratio {slow / local:.3f}), "
                  f"speed-up {single['wall_s'] / r['wall_s']:.2f}x, CPU s of the ranks "
                  f"{[round(rr['sharded'][mode]['cpu_s'], 1) for rr in ranks]} (single {single['cpu_s']:.1f}), "
                  f"value {r['value']:.6f}", flush=True)
        runs.append(dict(single=single, ranks=ranks))
    record = dict(args=vars(args), machine=dict(platform=platform.platform(), cpus=os.cpu_count(),
                                                torch=torch.__version__, load_at_end=os.getloadavg()),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), runs=runs)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
