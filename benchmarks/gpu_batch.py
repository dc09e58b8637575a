"""A batch of problems as one solve, on CUDA: B = 64 problems of 256 points (d = 2, p = 2, blur 0.05, debias
off), loss + gradient, one batched ``SROTLoss`` call against a Python loop of 64 calls and GeomLoss tensorized
on the same batch; soft-min passes and host syncs per solve. Prints JSON and writes ``batch.json`` to ``$OUT``
(or the current folder).

Run: ``python benchmarks/gpu_batch.py``.
"""
import json
import os
import time

import torch

from srot_fast import SROTLoss


def _timed(fn, x):
    """Seconds of the last of three runs of loss + gradient, and the values."""
    for _ in range(3):
        xg = x.clone().requires_grad_()
        torch.cuda.synchronize()
        start = time.perf_counter()
        values = fn(xg)
        values.sum().backward()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return seconds, values.detach()


def main() -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, 2, generator=gen).cuda()
    y = (torch.randn(64, 256, 2, generator=gen) + 0.5).cuda()
    out = {}
    batched = SROTLoss(debias=False)
    looped = SROTLoss(debias=False)
    runs = {"batched": (batched, lambda xg: batched(xg, y)),
            "loop": (looped, lambda xg: torch.stack([looped(xg[k], y[k]) for k in range(x.shape[0])]))}
    for name, (loss, fn) in runs.items():
        seconds, values = _timed(fn, x)
        out[name] = dict(seconds=seconds, passes=loss.last_result.passes, syncs=loss.last_result.syncs,
                         value0=float(values[0]))
    try:
        import geomloss

        gl = geomloss.SamplesLoss(debias=False, backend="tensorized")
        seconds, values = _timed(lambda xg: gl(xg, y), x)
        out["geomloss_tensorized"] = dict(seconds=seconds, value0=float(values[0]))
    except ImportError as err:
        out["geomloss_tensorized"] = f"not run: {err}"
    print(json.dumps(out))
    with open(os.path.join(os.environ.get("OUT", "."), "batch.json"), "w") as fh:
        json.dump(out, fh)
    return out


if __name__ == "__main__":
    main()
