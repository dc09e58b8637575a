"""srot_fast.distributed on gloo process groups of 2 and 3 CPU processes spawned by the test (127.0.0.1 only).

Each spawn runs many checks (process start-up dominates): every rank solves the whole problem single-process
(srot_fast.sinkhorn / SROTLoss, the reference) and its own shards with srot_fast.distributed, and compares
values, potentials, masses, iteration counts and the gradients of its own points, weights and offsets,
in float64 to 1e-10 (absolute and relative; the weights' gradients of balanced losses to 1e-8, up to the
constant that balanced OT leaves free). Shards are uneven; with 3 ranks one rank holds no point at all,
and two of the three also solve on a subgroup (group=). A rank that gets bad input must make every rank raise
the same error. The 2-D flow example runs on 2 ranks. A hang fails the test after TIMEOUT s.
"""
from __future__ import annotations

import datetime
import os
import socket
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import srot_fast
from srot_fast import distributed as sd
from srot_fast.experiments import sharded_flow

TIMEOUT = 240  # seconds for one spawn, start-up included (CI machines are slow and shared)
TOL = dict(rtol=1e-10, atol=1e-10)
# the weights' gradients of balanced losses, after removing the free constant: a difference of two potentials
# solved along different summation orders and accelerated paths (measured at up to 0.6e-10 of 1e-10)
GAUGE_TOL = dict(rtol=1e-8, atol=1e-8)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, world: int, *args) -> None:
    """Run fn(rank, world, port, *args) on ``world`` processes; fail on any exception or after TIMEOUT s."""
    ctx = mp.spawn(fn, args=(world, _free_port(), *args), nprocs=world, join=False)
    deadline = time.monotonic() + TIMEOUT
    while not ctx.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            pytest.fail(f"distributed workers did not finish within {TIMEOUT} s (a hang)")


def _finish() -> None:
    """Leave the group together: without the barrier a rank that finishes first can exit while the others are
    still tearing gloo down, and a process then aborts at exit ("terminate called without an active exception")."""
    dist.barrier()
    dist.destroy_process_group()


def _init(rank: int, world: int, port: int) -> None:
    loopback = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    if loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback[0])
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", srot_fast.ConvergenceWarning)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT // 2))


def _data(n: int, m: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    d = dict(dtype=torch.float64, generator=g)
    x = torch.randn(n, 2, **d)
    y = torch.randn(m, 2, **d) * 0.8 + 0.7
    a = torch.rand(n, **d) + 0.2
    b = torch.rand(m, **d) + 0.2
    a, b = a / a.sum(), b / b.sum()
    u, v = torch.rand(n, **d), torch.rand(m, **d)
    s_x = torch.rand(n, **d) * 0.62          # P(target) of source points: a few outliers (> 1/2)
    s_y = 0.38 + torch.rand(m, **d) * 0.62   # of target points: a few outliers (< 1/2)
    return x, y, a, b, u, v, s_x, s_y


def _close(got, want, what: str, tol=TOL) -> None:
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{what}: {m}")


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


SOLVES = [  # keyword arguments of sinkhorn; "offsets" adds u, v
    dict(p=2, eps=0.05),
    dict(p=1, eps=0.1, tol=1e-3, offsets=True),
    dict(p=1, eps=0.05, penalty="kl", tau=0.5, tol=1e-3, offsets=True),
    dict(p=2, eps=0.1, penalty="kl", tau=(1.0, 0.3), tol=1e-3, offsets=True),
    dict(p=2, eps=0.1, penalty="tv", tau=0.4, tol=1e-3, offsets=True),
    dict(p=1, eps=0.1, penalty="tv", tau=1.0, tol=1e-3),
    dict(p=1, eps=0.05, mass=0.6, tol=1e-3, offsets=True),
    dict(p=2, eps=0.1, mass=0.8, tol=1e-3),
    dict(p=2, eps=0.05, penalty="kl", tau=1.0, tol=None),
]
LOSSES = [  # keyword arguments of SROTLoss (scores passed to the call)
    dict(p=1, blur=0.1, reach=1.0, debias=False, strategy="hard"),
    dict(p=2, blur=0.2, strategy="hard"),  # balanced, debiased
    dict(p=1, blur=0.1, reach=0.5, debias=False, strategy="soft"),
    dict(p=2, blur=0.2, reach=1.0, penalty="tv", strategy="soft"),  # debiased
    dict(p=1, blur=0.2, reach=(0.7, 1.5), strategy="soft"),  # debiased, a pair of reaches
    dict(p=1, blur=0.1, mass=0.7, debias=False, strategy="soft"),
    # SamplesLoss() defaults but blur, solved to convergence (Anderson's small least-squares solves amplify the
    # rounding differences between sharded and single-process sums: stopped early, the iterates differ by ~1e-9)
    dict(p=2, blur=0.2, tol=1e-9, value_tol=None),
]


def _check_solves(rank, cuts_x, cuts_y, modes, solves, backend="tensorized"):
    x, y, a, b, u, v, _, _ = _data(cuts_x[-1], cuts_y[-1])
    sx, sy = slice(cuts_x[rank], cuts_x[rank + 1]), slice(cuts_y[rank], cuts_y[rank + 1])
    for kw in solves:
        kw = dict(kw)
        offsets = kw.pop("offsets", False)
        ref_in = _leaves(x, y, a, b, u, v)
        ref = srot_fast.sinkhorn(*ref_in[:4], u=ref_in[4] if offsets else None, v=ref_in[5] if offsets else None,
                                 backend="tensorized", **kw)
        ref.value.backward()
        for mode in modes:
            what = f"rank {rank}, {mode}, {backend}, {kw}, offsets={offsets}"
            loc = _leaves(x[sx], y[sy], a[sx], b[sy], u[sx], v[sy])
            res = sd.sinkhorn(*loc[:4], u=loc[4] if offsets else None, v=loc[5] if offsets else None,
                              backend=backend, mode=mode, **kw)
            res.value.backward()
            assert abs(res.n_iter - ref.n_iter) <= 1, what  # sharded sums round in another order (equal here)
            _close(res.value.detach(), ref.value.detach(), what + " value")
            _close(res.f, ref.f[sx], what + " f")
            _close(res.g, ref.g[sy], what + " g")
            _close(res.row_mass, ref.row_mass[sx], what + " row_mass")
            _close(res.col_mass, ref.col_mass[sy], what + " col_mass")
            assert abs(res.transported_mass - ref.transported_mass) <= 1e-10, what
            assert abs(res.marginal_error - ref.marginal_error) <= 1e-10, what
            names = ("x", "y", "a", "b", "u", "v") if offsets else ("x", "y", "a", "b")
            for name, mine, full, sl in zip(names, loc, ref_in, (sx, sy, sx, sy, sx, sy)):
                _close(mine.grad, full.grad[sl], f"{what} grad {name}")


def _check_warm_start(rank, cuts_x, cuts_y, mode):
    """init=(f0, g0): this rank's shard of the previous solve's potentials, for a moved y."""
    x, y, a, b, _, _, _, _ = _data(cuts_x[-1], cuts_y[-1], seed=3)
    sx, sy = slice(cuts_x[rank], cuts_x[rank + 1]), slice(cuts_y[rank], cuts_y[rank + 1])
    kw = dict(p=2, eps=0.02, penalty="kl", tau=1.0)
    first = srot_fast.sinkhorn(x, y, a, b, **kw)
    ref = srot_fast.sinkhorn(x, y + 0.05, a, b, init=(first.f, first.g), **kw)
    res = sd.sinkhorn(x[sx], y[sy] + 0.05, a[sx], b[sy], init=(first.f[sx], first.g[sy]), mode=mode, **kw)
    assert abs(res.n_iter - ref.n_iter) <= 1  # as above
    _close(res.value, ref.value, f"rank {rank}, warm start, value")
    _close(res.f, ref.f[sx], f"rank {rank}, warm start, f")
    _close(res.g, ref.g[sy], f"rank {rank}, warm start, g")
    # at a solution: no update, and the first look's error (rows and columns, summed over ranks) as one process
    for pen in ("kl", "balanced"):
        kw0 = dict(p=2, eps=0.02, penalty=pen, tau=1.0 if pen == "kl" else None, tol=1e-4)
        sol = srot_fast.sinkhorn(x, y, a, b, **dict(kw0, tol=1e-9))
        ref = srot_fast.sinkhorn(x, y, a, b, init=(sol.f, sol.g), **kw0)
        res = sd.sinkhorn(x[sx], y[sy], a[sx], b[sy], init=(sol.f[sx], sol.g[sy]), mode=mode, **kw0)
        assert int(ref.n_iter) == int(res.n_iter) == 0, (pen, ref.n_iter, res.n_iter)
        assert abs(res.marginal_error - ref.marginal_error) <= 1e-10, (pen, res.marginal_error, ref.marginal_error)
        _close(res.col_mass, ref.col_mass[sy], f"rank {rank}, warm start at a solution, {pen}, col_mass")


def _check_warm_losses(rank, cuts_x, cuts_y, mode):
    """SROTLoss(warm_start=True) with debiasing, three calls on a moving y: the transport and both debiasing terms
    start from the previous call's potentials on every rank, as in one process (same values, updates, gradients)."""
    x, y, a, b, _, _, _, _ = _data(cuts_x[-1], cuts_y[-1], seed=6)
    sx, sy = slice(cuts_x[rank], cuts_x[rank + 1]), slice(cuts_y[rank], cuts_y[rank + 1])
    kw = dict(p=2, blur=0.3, reach=1.0, warm_start=True, tol=1e-9, value_tol=None, max_iter=5000)
    ref_loss, loss = srot_fast.SROTLoss(**kw), sd.SROTLoss(mode=mode, **kw)
    debias = {"ref": [], "sharded": []}  # updates of the debiasing solves, call by call

    def spy(solve, key, first, second):
        def run(*args, **kwargs):
            res = solve(*args, **kwargs)
            if args[first] is args[second]:
                debias[key].append(int(res.n_iter))
            return res
        return run

    ref_loss._solve = spy(ref_loss._solve, "ref", 0, 1)
    loss._run = spy(loss._run, "sharded", 1, 2)  # _run(comm, x, y, ...)
    for step in range(3):
        y_step = y + 0.05 * step
        xr = x.clone().requires_grad_()
        ref = ref_loss(a, xr, b, y_step)
        ref.backward()
        xl = x[sx].clone().requires_grad_()
        value = loss(a[sx], xl, b[sy], y_step[sy])
        value.backward()
        _close(value, ref, f"rank {rank}, warm debiased loss, step {step}, value")
        _close(xl.grad, xr.grad[sx], f"rank {rank}, warm debiased loss, step {step}, grad x")
        # sharded sums round in another order: a stopping threshold may be crossed one update apart
        assert abs(int(loss.last_result.n_iter) - int(ref_loss.last_result.n_iter)) <= 1, step
    assert len(debias["sharded"]) == len(debias["ref"]) == 6, debias
    assert all(abs(s - r) <= 1 for s, r in zip(debias["sharded"], debias["ref"])), debias
    assert max(debias["sharded"][2:]) < min(debias["sharded"][:2]), debias
    assert max(debias["ref"][2:]) < min(debias["ref"][:2]), debias  # the warm-started ones take fewer updates


def _check_losses(rank, cuts_x, cuts_y, modes, losses):
    x, y, a, b, _, _, s_x, s_y = _data(cuts_x[-1], cuts_y[-1], seed=1)
    sx, sy = slice(cuts_x[rank], cuts_x[rank + 1]), slice(cuts_y[rank], cuts_y[rank + 1])
    for kw in losses:
        # balanced OT leaves its potentials free up to (f + c, g - c), and the weights' gradients with them; a
        # solve picks the c with <a, f> = <b, g>, so two runs whose iterates differ by rounding agree on it to
        # their tolerance (1e-7 here); what is left after removing c is held to GAUGE_TOL
        gauge = not any(k in kw for k in ("reach", "penalty", "mass"))
        ref_in = _leaves(a, x, b, y)
        scores = (s_x, s_y) if kw.get("strategy") else None
        want = srot_fast.SROTLoss(backend="tensorized", **kw)(*ref_in, scores=scores)
        want.backward()
        for mode in modes:
            what = f"rank {rank}, {mode}, SROTLoss({kw})"
            loc = _leaves(a[sx], x[sx], b[sy], y[sy])
            got = sd.SROTLoss(backend="tensorized", mode=mode, **kw)(*loc, scores=scores and (s_x[sx], s_y[sy]))
            got.backward()
            _close(got.detach(), want.detach(), what + " value")
            shift = {}
            for name, mine, full, sl in zip(("a", "x", "b", "y"), loc, ref_in, (sx, sx, sy, sy)):
                ref_grad, tol = full.grad[sl], TOL
                if gauge and name in ("a", "b") and mine.grad.numel():
                    shift[name] = float((mine.grad - ref_grad).mean())
                    ref_grad, tol = ref_grad + shift[name], GAUGE_TOL
                _close(mine.grad, ref_grad, f"{what} grad {name}", tol)
            if len(shift) == 2:  # (f + c, g - c): opposite shifts, small
                assert abs(shift["a"] + shift["b"]) <= GAUGE_TOL["atol"] and abs(shift["a"]) <= 1e-7, (what, shift)


def _expect_same_error(rank, world, fn, kind, text) -> None:
    """fn() must raise ``kind`` on every rank, with the same message, containing ``text``."""
    try:
        fn()
    except kind as e:
        msg = str(e)
    else:
        raise AssertionError(f"rank {rank}: no {kind.__name__} raised (expected {text!r})")
    assert text in msg, (rank, msg)
    msgs = [None] * world
    dist.all_gather_object(msgs, msg)
    assert len(set(msgs)) == 1, msgs


def _check_errors(rank, world, bad_rank):
    x, y, _, _, _, _, _, _ = _data(6 * world, 5 * world, seed=2)
    xs, ys = x[6 * rank:6 * rank + 6].clone(), y[5 * rank:5 * rank + 5]
    if rank == bad_rank:
        xs[0, 0] = float("nan")
    _expect_same_error(rank, world, lambda: sd.sinkhorn(xs, ys, eps=0.1), ValueError,
                       f"rank {bad_rank} of {world}: x contains NaN or inf")
    xs = x[6 * rank:6 * rank + 6]
    a = torch.full((5 if rank == bad_rank else 6,), 1.0 / (6 * world), dtype=x.dtype)
    _expect_same_error(rank, world, lambda: sd.sinkhorn(xs, ys, a, eps=0.1), ValueError,
                       f"rank {bad_rank} of {world}: a must have shape (6,)")
    eps = 0.2 if rank == bad_rank else 0.1
    _expect_same_error(rank, world, lambda: sd.sinkhorn(xs, ys, eps=eps), ValueError,
                       f"eps is 0.1 on rank 0 but 0.2 on rank {bad_rank}")
    xg = xs.clone().requires_grad_(rank == bad_rank)  # backward would be a collective on one rank only
    _expect_same_error(rank, world, lambda: sd.SROTLoss()(xg, ys), ValueError,
                       f"requires_grad of (x, y, a, b) is [False, False, False, False] on rank 0 but "
                       f"[True, False, False, False] on rank {bad_rank}")
    _expect_same_error(rank, world, lambda: sd.SROTLoss(strategy="hard")(xs, ys), ValueError,
                       "needs a fitted detector")
    s_x, s_y = torch.full((6,), 0.9, dtype=x.dtype), torch.full((5,), 0.9, dtype=x.dtype)  # every source point flagged
    _expect_same_error(rank, world, lambda: sd.SROTLoss(strategy="hard")(xs, ys, scores=(s_x, s_y)), ValueError,
                       "flags every point of the source")
    s_x = torch.full((6,), 1.5 if rank == bad_rank else 0.2, dtype=x.dtype)
    _expect_same_error(rank, world, lambda: sd.SROTLoss(strategy="soft", reach=1.0)(xs, ys, scores=(s_x, s_y)),
                       ValueError, f"rank {bad_rank} of {world}: scores[0] must hold probabilities in [0, 1]")
    prec = "fp16" if rank == bad_rank else None
    _expect_same_error(rank, world, lambda: sd.sinkhorn(xs, ys, eps=0.1, precision=prec), ValueError,
                       f"rank {bad_rank} of {world}: precision must be one of")
    # the group is still usable afterwards
    res = sd.sinkhorn(xs, ys, eps=0.1)
    assert torch.isfinite(res.value)


def _check_precision(rank, world):
    """``precision=`` reaches every rank's Triton launchers (interpreter, D = 32 float32 points: the tl.dot
    path), for the sharded solve and the sharded loss, and the value matches the single-process Triton solve
    to 1e-5 relative (float32 sums in another order)."""
    try:
        from srot_fast.kernels.triton import launchers
    except ImportError:
        return
    seen, real = [], launchers.softmin_fwd

    def spy(*args, **kw):
        seen.append(kw.get("precision"))
        return real(*args, **kw)
    launchers.softmin_fwd = spy
    try:
        g = torch.Generator().manual_seed(5)
        x, y = torch.randn(16, 32, generator=g), torch.randn(12, 32, generator=g) + 0.3
        sx, sy = (slice(0, 7), slice(0, 5)) if rank == 0 else (slice(7, 16), slice(5, 12))
        kw = dict(p=2, eps=10.0, penalty="kl", tau=50.0, tol=1e-6, backend="triton", precision="ieee")
        ref = srot_fast.sinkhorn(x, y, **kw)
        seen.clear()
        res = sd.sinkhorn(x[sx], y[sy], mode="ring", **kw)
        torch.testing.assert_close(res.value, ref.value, rtol=1e-5, atol=0)
        loss = sd.SROTLoss(p=2, blur=3.0, reach=7.0, backend="triton", precision="tf32x3", mode="gather")
        assert torch.isfinite(loss(x[sx], y[sy]))
        assert "ieee" in seen and "tf32x3" in seen and None not in seen, seen
    finally:
        launchers.softmin_fwd = real


def _worker_2(rank, world, port):
    _init(rank, world, port)
    cuts_x, cuts_y = [0, 13, 40], [0, 25, 37]
    _check_solves(rank, cuts_x, cuts_y, ("gather", "ring"), SOLVES)
    _check_solves(rank, cuts_x, cuts_y, ("auto",), SOLVES[2:3], backend="cpu")
    _check_warm_start(rank, cuts_x, cuts_y, "ring")
    _check_warm_losses(rank, cuts_x, cuts_y, "gather")
    _check_losses(rank, cuts_x, cuts_y, ("gather",), LOSSES[::2])
    _check_losses(rank, cuts_x, cuts_y, ("ring",), LOSSES[1::2])
    _check_errors(rank, world, bad_rank=1)
    _check_precision(rank, world)
    _check_flow_example(rank, world)
    _finish()


def _check_flow_example(rank, world):
    """The example of ``python -m srot_fast.distributed`` runs and its loss decreases."""
    import argparse

    args = argparse.Namespace(points=300, steps=3, lr=0.5, blur=0.1, reach=1.0, mode="ring", backend="auto",
                              seed=0)
    values = sharded_flow.flow(rank, world, args)
    assert all(b < a for a, b in zip(values, values[1:])), values


def _check_subgroup(rank):
    """group=: ranks 0 and 2 of the 3 solve on their own (ring steps address global ranks 0 and 2)."""
    sub = dist.new_group([0, 2])  # every rank must take part in creating it
    if rank == 1:
        return
    x, y, a, b, u, v, _, _ = _data(30, 26, seed=4)
    sx, sy = (slice(0, 12), slice(0, 9)) if rank == 0 else (slice(12, 30), slice(9, 26))
    kw = dict(p=1, eps=0.05, penalty="kl", tau=0.5, tol=1e-3)
    ref = srot_fast.sinkhorn(x, y, a, b, u=u, v=v, **kw)
    for mode in ("ring", "gather"):
        res = sd.sinkhorn(x[sx], y[sy], a[sx], b[sy], u=u[sx], v=v[sy], group=sub, mode=mode, **kw)
        assert res.world_size == 2 and res.rank == (0 if rank == 0 else 1)
        _close(res.value, ref.value, f"rank {rank}, subgroup, {mode}, value")
        _close(res.f, ref.f[sx], f"rank {rank}, subgroup, {mode}, f")
        _close(res.g, ref.g[sy], f"rank {rank}, subgroup, {mode}, g")


def _worker_3(rank, world, port):
    _init(rank, world, port)
    cuts_x, cuts_y = [0, 20, 20, 45], [0, 14, 14, 41]  # rank 1 holds no point
    _check_solves(rank, cuts_x, cuts_y, ("gather", "ring"), SOLVES[2:8:2])
    _check_losses(rank, cuts_x, cuts_y, ("ring",), LOSSES[:4])
    _check_losses(rank, cuts_x, cuts_y, ("gather",), LOSSES[4:])
    _check_warm_start(rank, cuts_x, cuts_y, "gather")
    _check_errors(rank, world, bad_rank=2)
    _check_subgroup(rank)
    _finish()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_two_ranks_match_single_process():
    _spawn(_worker_2, 2)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_three_ranks_with_an_empty_rank_match_single_process():
    _spawn(_worker_3, 3)


def test_needs_a_process_group():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    x = torch.randn(5, 2)
    with pytest.raises(RuntimeError, match="init_process_group"):
        sd.sinkhorn(x, x)
