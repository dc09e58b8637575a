r"""Sharded solves over a ``torch.distributed`` process group (NCCL on GPUs, gloo on CPUs), launched with
``torchrun`` or any other launcher; docs/DISTRIBUTED.md has the guide and the performance model.

Each rank passes its own shard of the points: x (N_r, D) with its weights a (N_r,) and offsets u (N_r,),
y (M_r, D) with b (M_r,) and v (M_r,). Shards may have any sizes, zero included, on any backend. The
solve is the one of :func:`srot_fast.sinkhorn` (the same loop, :mod:`srot_fast._loop`) on a sharded
geometry (:mod:`srot_fast._sharded`): each soft-min pass runs the local x block against every y shard
and merges the per-shard log-sum-exps; sums over points are all-reduced. So, up to floating-point
rounding, every rank gets

- the value (global, the same on every rank), the iteration count and the marginal error of the
  single-process solve on the concatenated shards (in rank order);
- its own shard of the potentials f, g and of the transported masses;
- after ``value.backward()`` on every rank, the gradients of the value w.r.t. its own x, y, a, b, u, v.

Why a separate module rather than a ``group=`` argument on :func:`srot_fast.sinkhorn`: the sharded call
has different semantics (local shards in, local potentials out, a global value, and every call -- the
backward pass included -- is a collective that every rank must make in the same order), and keeping it
apart leaves the single-process path free of any collective. The arguments are otherwise the same.

Rules of a collective call: every rank calls with the same scalar arguments (p, eps, penalty, ...; checked),
the same dtype and feature dimension, the same ``requires_grad`` flags (backward is a collective too), and
calls ``backward`` on the value (or neither does). A bad argument on one rank raises the same error on
every rank (naming the rank) instead of leaving the others waiting.

``mode``: 'gather' keeps a copy of the other ranks' points on each rank (gathered once per call), and a pass
moves only the log-weights (8 M bytes in float64); 'ring' passes the shards (points and log-weights) around
the ring of ranks at every pass, overlapped with compute, for clouds whose copy does not fit;
'auto' gathers when all points take at most ``GATHER_BYTES``. Inputs are unbatched.

Run ``python -m srot_fast.distributed --help`` for a sharded 2-D gradient flow (spawns gloo ranks itself,
or runs under ``torchrun``; :mod:`srot_fast.experiments.sharded_flow`).

Modules: the collectives and the sharded geometry are in :mod:`srot_fast._sharded`, the solve, its argument
checks, envelope backward and :class:`ShardedResult` in :mod:`srot_fast._sharded_solve`, the loss in
:mod:`srot_fast._sharded_loss`; this module holds the public :func:`sinkhorn` and re-exports the rest.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from . import _checks
from ._sharded import GATHER_BYTES, Comm
from ._sharded_loss import SROTLoss
from ._sharded_solve import ShardedResult, _checksum, _consistent, _mode, _points, _solve, _weights
from .backends import resolve_backend
from .kernels.triton.options import check_autotune, check_precision
from .sinkhorn import _penalties

__all__ = ["sinkhorn", "SROTLoss", "ShardedResult", "GATHER_BYTES", "main"]


# ------------------------------------------------------------------------------------------- solver
def sinkhorn(
    x: torch.Tensor,
    y: torch.Tensor,
    a: Optional[torch.Tensor] = None,
    b: Optional[torch.Tensor] = None,
    *,
    group=None,
    mode: str = "auto",
    p: int = 2,
    eps: Optional[float] = None,
    penalty: str = "balanced",
    tau: Union[float, tuple, None] = None,
    mass: Optional[float] = None,
    u: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    scaling: float = 0.5,
    diameter: Optional[float] = None,
    tol: Optional[float] = 1e-4,
    max_iter: int = 1000,
    backend: str = "auto",
    init: Optional[tuple] = None,
    accelerate: bool = True,
    check_every: Optional[int] = None,
    value_tol: Optional[float] = None,
    precision: Optional[str] = None,
    autotune: Optional[bool] = None,
) -> ShardedResult:
    r""":func:`srot_fast.sinkhorn` on points sharded over the ranks of ``group`` (a collective call).

    Args:
        x: (N_r, D) this rank's source points (N_r may be 0). y: (M_r, D) this rank's target points.
        a: (N_r,) this rank's source weights (default 1/N, N = the total over ranks). b: (M_r,) (default 1/M).
        group: the process group (default: the default group of ``torch.distributed.init_process_group``).
        mode: 'auto' | 'gather' | 'ring', how the other ranks' shards reach this one (module docstring).
        u: (N_r,), v: (M_r,) this rank's cost offsets. init: (f0 (N_r,), g0 (M_r,)) this rank's warm start.
        p, eps, penalty, tau, mass, scaling, diameter, tol, max_iter, backend, accelerate, check_every, value_tol,
            precision, autotune: as in :func:`srot_fast.sinkhorn`, the same on every rank; ``backend`` is this
            rank's kernel backend (``precision`` and ``autotune`` act on Triton only).

    Returns:
        :class:`ShardedResult`: this rank's potentials and masses, the global value, n_iter, marginal error.

    Example (on every rank of a ``torchrun --nproc-per-node 2`` job):
        >>> dist.init_process_group("gloo")
        >>> x, y = my_shard_of_x, my_shard_of_y
        >>> res = srot_fast.distributed.sinkhorn(x, y, p=1, eps=0.01, penalty="kl", tau=1.0)
        >>> res.value.backward()          # x.grad: the gradient of the global value w.r.t. this rank's x
    """
    comm = Comm(group)
    key = dict(p=p, eps=eps, penalty=penalty, tau=tau, mass=mass, scaling=scaling, diameter=diameter, tol=tol,
               max_iter=max_iter, backend=backend, accelerate=accelerate, check_every=check_every, mode=mode,
               value_tol=value_tol, precision=precision, autotune=autotune)

    def check():
        p_, eps_ = _checks.check_p(p), _checks.check_positive(0.05**p if eps is None else eps, "eps")
        _mode(mode)
        xs, ys = _points(x, "x"), _points(y, "y")
        _checks.check_pair(xs, ys)
        out = dict(x=xs, y=ys, a=_weights(a, xs, "a"), b=_weights(b, ys, "b"),
                   u=_checks.check_offsets(u, xs, "u"), v=_checks.check_offsets(v, ys, "v"), p=p_, eps=eps_)
        _scalar_checks(penalty, tau, mass, scaling, tol, max_iter, check_every, diameter)
        _checks.check_flag(accelerate, "accelerate")
        out["value_tol"] = None if value_tol is None else _checks.check_positive(value_tol, "value_tol")
        check_precision(precision)
        check_autotune(autotune)
        resolve_backend(backend, xs.shape[0], ys.shape[0], xs.device)  # this rank can run it
        if init is not None:
            if not (isinstance(init, (tuple, list)) and len(init) == 2):
                raise TypeError("init must be a pair (f0, g0) of this rank's potentials")
            out["init"] = (_checks.check_offsets(init[0], xs, "init[0]"), _checks.check_offsets(init[1], ys, "init[1]"))
        else:
            out["init"] = None
        full = dict(key, dtype=str(xs.dtype), dim=xs.shape[-1], device=xs.device.type,
                    **{"requires_grad of (x, y, a, b, u, v)": [t is not None and t.requires_grad
                                                                for t in (xs, ys, a, b, u, v)],
                       "given (a, b, u, v, init)": [t is not None for t in (a, b, u, v, init)]})
        out["key"] = full
        return out

    args, rows = comm.agree(check, lambda o: [o["x"].shape[0], o["y"].shape[0], _checksum(o["key"])], 3)
    _consistent(comm, rows, args["key"])
    ns, ms = [r[0] for r in rows], [r[1] for r in rows]
    pen_a, pen_b = _penalties(penalty, tau)
    return _solve(comm, args["x"], args["y"], args["a"], args["b"], args["u"], args["v"], ns, ms, p=args["p"],
                  eps=args["eps"], pen_a=pen_a, pen_b=pen_b, mass=mass, scaling=scaling, diameter=diameter, tol=tol,
                  max_iter=max_iter, backend=backend, init=args["init"], accelerate=accelerate,
                  check_every=check_every, mode=mode, value_tol=args["value_tol"], precision=precision,
                  autotune=autotune)


def _scalar_checks(penalty, tau, mass, scaling, tol, max_iter, check_every, diameter) -> None:
    _penalties(penalty, tau)
    if mass is not None:
        if penalty != "balanced":
            raise ValueError("mass (partial OT) needs penalty='balanced'")
        _checks.check_positive(mass, "mass")
    _checks.check_scaling(scaling)
    if tol is not None:
        _checks.check_positive(tol, "tol")
    _checks.non_negative_int(max_iter, "max_iter")
    _checks.positive_int(check_every, "check_every", allow_none=True)
    if diameter is not None:
        _checks.check_positive(diameter, "diameter")


def main(argv=None) -> None:
    """``python -m srot_fast.distributed``: the sharded 2-D gradient flow of
    :mod:`srot_fast.experiments.sharded_flow` (spawns gloo ranks, or joins a ``torchrun`` job)."""
    from .experiments.sharded_flow import main as flow_main

    flow_main(argv)


if __name__ == "__main__":
    main()
