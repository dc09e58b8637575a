"""A sharded 2-D gradient flow with :mod:`srot_fast.distributed`, the example that
``python -m srot_fast.distributed`` runs: particles beta follow the gradient of an (unbalanced) OT loss
towards a mixture of four Gaussians, every rank holding a shard of both clouds. Under ``torchrun`` it joins
the job's process group (NCCL when CUDA is available, else gloo); otherwise it spawns ``--nproc`` gloo ranks
on 127.0.0.1 (:func:`main`). Rank 0 prints the loss, the update count, the mode and the time every tenth step.
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .._sharded import MODES
from ..distributed import SROTLoss
from . import _common

__all__ = ["build_parser", "flow", "main"]


def flow(rank: int, world: int, args) -> list:
    """One rank of the sharded 2-D gradient flow: the particles beta (``args.points`` in all) follow the gradient of
    the (unbalanced) OT loss towards a mixture of four Gaussians alpha; each rank holds its shard of both clouds
    and moves its own particles. Rank 0 prints the loss; returns the losses (every rank)."""
    torch.manual_seed(args.seed)
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    n = args.points
    centers = torch.tensor([[2.0, 2.0], [-2.0, 2.0], [-2.0, -2.0], [2.0, -2.0]])
    alpha = centers[torch.randint(0, 4, (n,))] + 0.4 * torch.randn(n, 2)
    beta = torch.randn(n, 2) * 0.5
    cut = [n * r // world for r in range(world + 1)]
    x = alpha[cut[rank]:cut[rank + 1]].to(dev)
    y = beta[cut[rank]:cut[rank + 1]].to(dev)
    reach = None if args.reach == 0 else args.reach
    loss = SROTLoss(p=2, blur=args.blur, reach=reach, debias=False, warm_start=True, backend=args.backend,
                    mode=args.mode)
    start = time.perf_counter()
    values = []
    for step in range(args.steps + 1):
        y = y.detach().requires_grad_()
        value = loss(x, y)
        value.backward()
        values.append(value.item())
        if rank == 0 and (step % max(args.steps // 10, 1) == 0 or step == args.steps):
            res = loss.last_result
            print(f"step {step:4d}  OT {float(value.detach()):.5f}  updates {res.n_iter:4d}  {res.mode} on "
                  f"{world} rank(s), {res.backend}, {time.perf_counter() - start:7.2f} s", flush=True)
        if step < args.steps:
            y = y - args.lr * n * y.grad  # n * grad_j = b_j^-1 grad_j: the flow's velocity of particle j
    return values


def _spawned(rank: int, world: int, port: int, args) -> None:
    loopback = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    if loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback[0])
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    try:
        flow(rank, world, args)
    finally:
        dist.destroy_process_group()


def build_parser() -> argparse.ArgumentParser:
    """The options of :func:`main`."""
    ap = argparse.ArgumentParser(prog="python -m srot_fast.distributed", description=main.__doc__)
    ap.add_argument("--nproc", type=_common.positive_int, default=2, help="gloo ranks to spawn when not under torchrun")
    ap.add_argument("--threads", type=_common.positive_int, default=1, help="torch threads per spawned rank")
    ap.add_argument("--points", type=_common.positive_int, default=4000, help="points per cloud, over all ranks")
    ap.add_argument("--steps", type=_common.non_negative_int, default=20, help="flow steps (0: the loss only)")
    ap.add_argument("--lr", type=_common.positive_float, default=0.5)
    ap.add_argument("--blur", type=_common.positive_float, default=0.1)
    ap.add_argument("--reach", type=_common.non_negative_float, default=1.0,
                    help="reach of the unbalanced (KL) loss; 0: balanced OT")
    ap.add_argument("--mode", default="auto", choices=MODES)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--seed", type=_common.uint32, default=0)
    return ap


def main(argv=None) -> None:
    """``python -m srot_fast.distributed`` (or ``python -m srot_fast.experiments.sharded_flow``): a sharded 2-D
    gradient flow. Under ``torchrun`` it joins the job's
    process group (NCCL when CUDA is available, else gloo); otherwise it spawns ``--nproc`` gloo ranks on
    127.0.0.1."""
    args = build_parser().parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
        try:
            flow(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(args.nproc, port, args), nprocs=args.nproc)


if __name__ == "__main__":
    main()
