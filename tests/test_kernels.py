"""Online backends of the kernel primitives against the torch reference ``kernels.tensorized``.

Backends: ``cpu`` (compiled C++ kernel of ``kernels.cpu_ops``), ``cpu_torch`` (its blocked-torch
fallback), ``keops`` (``kernels.keops_ops``, marker ``keops``) and ``triton`` (``kernels.triton_softmin``
under ``TRITON_INTERPRET=1`` on CPU, marker ``triton``). The reference is evaluated in float64 on the
same inputs, so float32 results are checked for their own error. Shapes are odd (37 x 53, several
tiles). KeOps compiles one formula per (primitive, dtype, D) (several seconds each on CPU, cached in
``~/.cache/keops*``): its cases are a small selection. The Triton interpreter is slow for large D:
D = 64 and D = 300 get a few cases each; the large-d (``tl.dot``) path is also forced at D = 37 with small
blocks. GPU-only tests check that the ``tl.dot`` path is fp32-accurate at "ieee" / "tf32x3" and that
the opt-in plain "tf32" stays within its documented error, which a CPU simulation of the TF32 rounding
estimates here.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from reference import optional_backend
from srot_fast.kernels import cpu_ops
from srot_fast.kernels import tensorized as ref

N, M = 37, 53
INF = float("inf")
# dtype -> (atol, rtol), the table of conftest.TOL (not imported: tests must run with --import-mode=importlib);
# atol is relative to the cost scale of the problem.
TOL = {torch.float64: (1e-10, 1e-9), torch.float32: (1e-4, 1e-4)}


# ------------------------------------------------------------------------------------------ helpers
def _backend(name: str):
    """Module-like object with the four primitives for ``name``."""
    if name == "cpu":
        if not cpu_ops.available():
            pytest.skip(f"compiled CPU kernel unavailable: {cpu_ops.build_error()}")
        return cpu_ops
    if name == "cpu_torch":
        return types.SimpleNamespace(
            softmin=cpu_ops.torch_softmin,
            weighted_mean=cpu_ops.torch_weighted_mean,
            plan_argmax=cpu_ops.torch_plan_argmax,
            max_cost=cpu_ops.torch_max_cost,
        )
    return optional_backend(name)


def _problem(d, dtype, p, *, n=N, m=M, seed=0):
    """Points with coincident pairs, log-weights with -inf columns (first, middle, last), eps ~ scale."""
    g = torch.Generator().manual_seed(seed + 100 * d + p)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = torch.randn(m, d, generator=g, dtype=torch.float64) + 0.3
    if m > 12:
        y[5] = x[3]  # coincident points: the p = 1 kink
        y[11] = x[0]
        y[12] = x[0]
    h = torch.randn(m, generator=g, dtype=torch.float64) - math.log(m)
    h[[0, m // 2, m - 1]] = -INF  # zero-weight columns (the first one trips naive streaming LSE)
    scale = ref.max_cost(x, y, p).item()
    return x.to(dtype), y.to(dtype), h.to(dtype), scale


def _tol(dtype, scale=1.0):
    atol, rtol = TOL[dtype]
    return dict(atol=atol * max(scale, 1.0), rtol=rtol)


def _ref64(fn, x, y, *args, **kw):
    return fn(x.double(), y.double(), *args, **kw)


def _close(out, expected, dtype, scale=1.0):
    torch.testing.assert_close(out.double(), expected, check_dtype=False, **_tol(dtype, scale))


CPU = ["cpu", "cpu_torch"]
KEOPS = pytest.mark.keops
TRITON = pytest.mark.triton
DTYPES = [torch.float32, torch.float64]


def _grid(backends, dims, dtypes=DTYPES, ps=(1, 2)):
    return [(b, d, dt, p) for b in backends for d in dims for dt in dtypes for p in ps]


# KeOps: one compiled formula per (primitive, dtype, D) -> a small selection of cases.
_KEOPS_SOFTMIN = [
    pytest.param("keops", d, dt, p, marks=KEOPS)
    for d, dt in ((1, torch.float64), (3, torch.float64), (2, torch.float32), (64, torch.float32))
    for p in (1, 2)
]
_KEOPS_OTHER = [pytest.param("keops", 3, torch.float64, p, marks=KEOPS) for p in (1, 2)]
_TRITON_SMALL = [pytest.param(*c, marks=TRITON) for c in _grid(["triton"], (1, 2, 3))]
_TRITON_BIG = [pytest.param("triton", 64, torch.float32, 1, marks=TRITON)]  # D >= 32: the tl.dot path


# ------------------------------------------------------------------------------------------ softmin
@pytest.mark.parametrize("backend,d,dtype,p", _grid(CPU, (1, 2, 3, 64)) + _KEOPS_SOFTMIN + _TRITON_SMALL + _TRITON_BIG)
def test_softmin_matches_reference(backend, d, dtype, p):
    mod = _backend(backend)
    x, y, h, scale = _problem(d, dtype, p)
    eps = 0.05 * scale
    out = mod.softmin(x, y, h, eps, p)
    assert out.shape == (N,) and out.dtype == dtype
    _close(out, _ref64(ref.softmin, x, y, h.double(), eps, p), dtype, scale)


@pytest.mark.parametrize("backend", CPU + [pytest.param("keops", marks=KEOPS), pytest.param("triton", marks=TRITON)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps_rel", [1e-3, 1e2])
def test_softmin_extreme_eps(backend, dtype, eps_rel):
    """Tiny eps (logits down to -1e3: the exp flush / underflow path) and huge eps (near-uniform)."""
    mod = _backend(backend)
    if backend == "keops" and dtype == torch.float32:
        pytest.skip("keeps the number of KeOps formulas small (float32 covered at D = 2, 64)")
    d = 3 if backend == "keops" else 2  # reuse the D = 3 float64 KeOps formula
    x, y, h, scale = _problem(d, dtype, 1)
    eps = eps_rel * scale
    _close(mod.softmin(x, y, h, eps, 1), _ref64(ref.softmin, x, y, h.double(), eps, 1), dtype, scale)


@pytest.mark.parametrize("backend", CPU + [pytest.param("keops", marks=KEOPS), pytest.param("triton", marks=TRITON)])
@pytest.mark.parametrize("shift", [1e6, -1e6, "columns"])
def test_softmin_large_offsets(backend, shift):
    """Offset-sized log-weights (soft SROT: h_j - v_j / eps): LSE must stay finite and shift exactly."""
    mod = _backend(backend)
    dtype = torch.float64
    x, y, h, scale = _problem(3, dtype, 1)
    eps = 0.05 * scale
    if shift == "columns":  # offsets that differ by up to 1e6 between columns
        h2 = h + 1e6 * torch.rand(M, generator=torch.Generator().manual_seed(1), dtype=dtype)
        _close(mod.softmin(x, y, h2, eps, 1), ref.softmin(x, y, h2, eps, 1), dtype, 1e6 * eps)
    else:
        out = mod.softmin(x, y, h + shift, eps, 1)
        assert torch.isfinite(out).all()
        _close(out, ref.softmin(x, y, h, eps, 1) - eps * shift, dtype, abs(shift) * eps)


@pytest.mark.parametrize("backend", CPU + [pytest.param("keops", marks=KEOPS), pytest.param("triton", marks=TRITON)])
def test_softmin_all_columns_masked_is_inf(backend):
    mod = _backend(backend)
    x, y, _, _ = _problem(3, torch.float64, 1)
    out = mod.softmin(x, y, torch.full((M,), -INF, dtype=torch.float64), 0.1, 1)
    assert torch.isposinf(out).all()


def test_softmin_several_tiles_and_threads():
    """Sizes across tile and row-block boundaries of the compiled kernel, with 1 and several threads."""
    mod = _backend("cpu")
    x, y, h, scale = _problem(2, torch.float64, 1, n=1031, m=517)
    expected = ref.softmin(x, y, h, 0.05 * scale, 1)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            _close(mod.softmin(x, y, h, 0.05 * scale, 1), expected, torch.float64, scale)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("d,dtype,p", [c[1:] for c in _grid(["cpu"], (1, 3, 64))])
def test_softmin_reads_stored_squared_distances(d, dtype, p, batched, compiled, monkeypatch):
    """``softmin(..., sq=squared_distances(x, y))`` (the solver's stored distances in high dimension) equals the
    float64 reference, compiled and through torch ops (no compiled library), with zero-weight columns, coincident
    points (the p = 1 kink) and, batched, a second problem; an all -inf h gives +inf."""
    if compiled:
        _backend("cpu")
    else:
        monkeypatch.setattr(cpu_ops, "_native", lambda *ts: None)
    x, y, h, scale = _problem(d, dtype, p)
    eps = 0.05 * scale
    expected = _ref64(ref.softmin, x, y, h.double(), eps, p)
    if batched:
        x, y, h = torch.stack([x, x.flip(0)]), torch.stack([y, y]), torch.stack([h, h])
        expected = torch.stack([expected, expected.flip(0)])
    out = cpu_ops.softmin(x, y, h, eps, p, sq=cpu_ops.squared_distances(x, y))
    assert out.shape == expected.shape and out.dtype == dtype
    _close(out, expected, dtype, scale)
    masked = cpu_ops.softmin(x, y, torch.full_like(h, -INF), eps, p, sq=cpu_ops.squared_distances(x, y))
    assert torch.isposinf(masked).all()


@pytest.mark.parametrize("compiled", [True, False])
def test_squared_distances_are_exact_and_checked(compiled, monkeypatch):
    """``squared_distances`` is the difference form |x_i - y_j|^2 (exact for clouds far from the origin, 0 on
    coincident points), compiled or not; a soft-min pass over it equals the streaming pass to rounding; and
    ``softmin`` refuses an ``sq`` of the wrong shape, dtype or device, naming it (half points: TypeError)."""
    if compiled:
        _backend("cpu")
    else:
        monkeypatch.setattr(cpu_ops, "_native", lambda *ts: None)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 16, generator=g, dtype=torch.float64) + 1e4
    y = torch.randn(300, 16, generator=g, dtype=torch.float64) + 1e4
    y[3] = x[5]
    sq = cpu_ops.squared_distances(x, y)
    # 1e-13: the order of the 16 terms (and fused multiply-adds) differ between the kernel and torch's sum
    torch.testing.assert_close(sq, ((x[:, None, :] - y[None, :, :]) ** 2).sum(-1), rtol=1e-13, atol=0)
    assert sq[5, 3] == 0
    h = torch.randn(300, generator=g, dtype=torch.float64)
    for dtype, rtol in ((torch.float64, 1e-13), (torch.float32, 1e-6)):
        xd, yd, hd = x.to(dtype) - 1e4, y.to(dtype) - 1e4, h.to(dtype)
        for p in (1, 2):
            stream = cpu_ops.softmin(xd, yd, hd, 0.5, p)
            stored = cpu_ops.softmin(xd, yd, hd, 0.5, p, sq=cpu_ops.squared_distances(xd, yd))
            torch.testing.assert_close(stored, stream, rtol=rtol, atol=rtol)
    assert cpu_ops.squared_distances(x[:0], y).shape == (0, 300)
    with pytest.raises(ValueError, match="sq"):
        cpu_ops.softmin(x, y, h, 1.0, 2, sq=sq.T)
    with pytest.raises(ValueError, match="sq"):
        cpu_ops.softmin(x, y, h, 1.0, 2, sq=sq.float())
    with pytest.raises(ValueError, match="sq"):
        cpu_ops.softmin(x, y, h, 1.0, 2, sq=sq.to("meta"))
    with pytest.raises(TypeError, match="squared_distances"):
        cpu_ops.squared_distances(x.half(), y.half())
    with pytest.raises(ValueError, match=r"h \(B, M\)"):
        cpu_ops.softmin_sq(sq[None], h[None, :5], 1.0, 2)
    with pytest.raises(ValueError, match="non-contiguous"):  # softmin_sq reads sq raw: strides are refused
        cpu_ops.softmin_sq(sq.T.contiguous().T[None], h[None], 1.0, 2)
    with pytest.raises(ValueError, match="sq"):
        cpu_ops.softmin_sq(sq[None].expand(5, -1, -1), h[None].expand(5, -1), 1.0, 2)
    with pytest.raises(ValueError, match="p must be"):
        cpu_ops.softmin_sq(sq[None], h[None], 1.0, 3)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("d,p", [(2, 1), (3, 2), (20, 1)])
def test_triton_softmin_small_tiles(dtype, trans, d, p):
    """Block sizes smaller than the problem: rows and columns both span several tiles; both tile
    orientations of the small-d kernel; D = 20 takes its non-unrolled coordinate loop."""
    mod = _backend("triton")
    x, y, h, scale = _problem(d, dtype, p)
    out = mod.softmin_fwd(x, y, h, 0.05 * scale, p, block_n=16, block_m=16, trans=trans)
    _close(out, _ref64(ref.softmin, x, y, h.double(), 0.05 * scale, p), dtype, scale)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("phi", ["y", "grad"])
@pytest.mark.parametrize("d,p", [(1, 2), (2, 1), (2, 2), (3, 1), (3, 2)])
def test_triton_weighted_mean_thread_per_row_tile(dtype, phi, d, p):
    """``trans=True`` (D <= 3): the block-sparse kernel's weighted-mean tile step over every column, with block
    sizes smaller than the problem (several row and column tiles, a partial last tile) and with its defaults;
    the p = 1 direction stays finite (0) where a row sits on a column. D = 4 is refused."""
    mod = _backend("triton")
    x, y, h, scale = _problem(d, dtype, p)
    expected = _ref64(ref.weighted_mean, x, y, h.double(), 0.05 * scale, p, phi)
    for blocks in (dict(block_n=16, block_m=16), {}):
        out = mod.weighted_mean_fwd(x, y, h, 0.05 * scale, p, phi, trans=True, **blocks)
        assert torch.isfinite(out).all()
        _close(out, expected, dtype, y.abs().max().item() + x.abs().max().item())
    if d == 3:
        kink = mod.weighted_mean_fwd(x, y, h, 1e-4, p, phi, trans=True)  # row 3 sits on column 5, row 0 on 11, 12
        assert torch.isfinite(kink).all()
        if p == 1 and phi == "grad":
            assert kink[3].abs().max() < 1e-6 and kink[0].abs().max() < 1e-6
        x4, y4, h4, _ = _problem(4, dtype, p)
        with pytest.raises(ValueError, match="trans=True"):
            mod.weighted_mean_fwd(x4, y4, h4, 0.05 * scale, p, phi, trans=True)
        if dtype == torch.float32:  # the tl.dot path has no such tile
            with pytest.raises(ValueError, match="trans=True"):
                mod.weighted_mean_fwd(x, y, h, 0.05 * scale, p, phi, path="dot", trans=True)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d,p", [(2, 1), (3, 2)])
def test_triton_weighted_mean_thread_per_row_tile_half_points(dtype, d, p):
    """Half points through ``trans=True``: loaded as they are and computed in float32, so the result matches the
    float64 reference on the same (rounded) points to float32 accuracy; the output is float32."""
    mod = _backend("triton")
    x, y, h, scale = _problem(d, dtype, p)
    h = h.float()
    for phi in ("y", "grad"):
        out = mod.weighted_mean_fwd(x, y, h, 0.05 * scale, p, phi, trans=True, block_n=16, block_m=16)
        assert out.dtype == torch.float32
        expected = _ref64(ref.weighted_mean, x, y, h.double(), 0.05 * scale, p, phi)
        _close(out, expected, torch.float32, y.abs().max().item() + x.abs().max().item())


@pytest.mark.triton
@pytest.mark.parametrize("path", ["small", "dot"])
def test_triton_softmin_large_d(path):
    mod = _backend("triton")
    x, y, h, scale = _problem(300, torch.float32, 2, n=19, m=23)
    _close(
        mod.softmin_fwd(x, y, h, 0.05 * scale, 2, path=path),
        _ref64(ref.softmin, x, y, h.double(), 0.05 * scale, 2),
        torch.float32,
        scale,
    )


# ----------------------------------------------------------------------------------- weighted mean
_WM_KEOPS = [pytest.param("keops", 3, torch.float64, p, marks=KEOPS) for p in (1, 2)]
_WM_TRITON = [pytest.param(*c, marks=TRITON) for c in _grid(["triton"], (1, 3))] + [
    pytest.param("triton", 64, torch.float64, 1, marks=TRITON)
]


@pytest.mark.parametrize("phi", ["y", "grad"])
@pytest.mark.parametrize("backend,d,dtype,p", _grid(CPU, (1, 2, 3, 64)) + _WM_KEOPS + _WM_TRITON)
def test_weighted_mean_matches_reference(backend, d, dtype, p, phi):
    mod = _backend(backend)
    x, y, h, scale = _problem(d, dtype, p)
    eps = 0.05 * scale
    out = mod.weighted_mean(x, y, h, eps, p, phi)
    assert out.shape == (N, d) and out.dtype == dtype
    assert torch.isfinite(out).all()  # p = 1 direction is 0 (not NaN) at coincident points
    expected = _ref64(ref.weighted_mean, x, y, h.double(), eps, p, phi)
    _close(out, expected, dtype, y.abs().max().item() + x.abs().max().item())


@pytest.mark.parametrize("backend", CPU + [pytest.param("keops", marks=KEOPS), pytest.param("triton", marks=TRITON)])
def test_weighted_mean_p1_direction_at_kink(backend):
    """A row sitting on a column that holds (almost) all the weight: direction ~ 0, never NaN."""
    mod = _backend(backend)
    x, y, h, _ = _problem(3, torch.float64, 1)
    out = mod.weighted_mean(x, y, h, 1e-4, 1, "grad")  # row 3 sits on column 5, row 0 on 11 and 12
    assert torch.isfinite(out).all()
    assert out[3].abs().max() < 1e-6 and out[0].abs().max() < 1e-6


@pytest.mark.triton
@pytest.mark.parametrize("phi", ["y", "grad"])
def test_triton_weighted_mean_large_d(phi):
    """D = 300 > 64: the two-pass tl.dot path (softmin normalisers, then tl.dot(w, y) per column tile)."""
    mod = _backend("triton")
    x, y, h, scale = _problem(300, torch.float32, 1, n=19, m=23)
    x[4] = y[7]  # a coincident pair in this smaller problem too
    out = mod.weighted_mean(x, y, h, 0.05 * scale, 1, phi)
    assert out.shape == (19, 300) and torch.isfinite(out).all()
    expected = _ref64(ref.weighted_mean, x, y, h.double(), 0.05 * scale, 1, phi)
    _close(out, expected, torch.float32, y.abs().max().item() + x.abs().max().item())


_DOT_CASES = [
    pytest.param(prim, p, marks=TRITON)
    for prim in ("softmin", "wmean_y", "wmean_grad", "argmax", "max_sq")
    for p in (1, 2)
]


@pytest.mark.parametrize("prim,p", _DOT_CASES)
def test_triton_dot_path_small_blocks(prim, p):
    """The large-d (tl.dot, float32 only) path forced at D = 37 with 16 x 16 x 16 blocks: rows, columns and
    coordinates all span several tiles, with partial last tiles; coincident pairs and -inf columns."""
    mod = _backend("triton")
    dt = torch.float32
    x, y, h, scale = _problem(37, dt, p)
    eps = 0.05 * scale
    blocks = dict(path="dot", block_n=16, block_m=16, block_k=16)
    if prim == "softmin":
        _close(mod.softmin_fwd(x, y, h, eps, p, **blocks), _ref64(ref.softmin, x, y, h.double(), eps, p), dt, scale)
    elif prim.startswith("wmean"):
        phi = prim.split("_")[1]
        out = mod.weighted_mean_fwd(x, y, h, eps, p, phi, **blocks)
        _close(out, _ref64(ref.weighted_mean, x, y, h.double(), eps, p, phi), dt, 10.0)
    elif prim == "argmax":
        got, want = mod.plan_argmax_fwd(x, y, h, eps, p, **blocks), ref.plan_argmax(x.double(), y.double(),
                                                                                     h.double(), eps, p)
        assert (got == want).float().mean() > 0.9  # float32 near-ties may pick another column
    else:
        expected = (ref.cost_matrix(x.double(), y.double(), 2) * 2).max(1).values
        _close(mod.max_sq_fwd(x, y, **blocks), expected, dt, expected.max().item())


@pytest.mark.triton
@pytest.mark.parametrize("d", [40, 128, 129])
@pytest.mark.parametrize("p", [1, 2])
def test_triton_weighted_mean_float32_paths(d, p):
    """float32 weighted_mean by 'auto': one tl.dot pass for 32 <= D <= 128 (both dots in one kernel), two
    passes above; 16 x 16 blocks so rows and columns span several tiles; a coincident pair."""
    mod = _backend("triton")
    x, y, h, scale = _problem(d, torch.float32, p, n=23, m=37)
    x[4] = y[7]
    for phi in ("y", "grad"):
        out = mod.weighted_mean_fwd(x, y, h, 0.05 * scale, p, phi, block_n=16, block_m=16, block_k=16)
        assert torch.isfinite(out).all()
        expected = _ref64(ref.weighted_mean, x, y, h.double(), 0.05 * scale, p, phi)
        _close(out, expected, torch.float32, y.abs().max().item() + x.abs().max().item())


@pytest.mark.triton
@pytest.mark.parametrize("table", ["_CFG_DOT", "_CFG_SMALL", "_CFG_WMEAN_DOT", "_CFG_WMEAN_SMALL"])
def test_triton_every_autotune_candidate_is_correct(table):
    """Each block configuration the GPU autotuner may pick gives the reference numbers (run here with fixed
    blocks under the interpreter; num_warps / num_stages only matter on a GPU). Skipped on CUDA: there it is
    ~80 compilations in one worker, and the autotuner itself compiles and runs them (tests/test_gpu.py checks
    tuned results; benchmarks/triton_aot_check.py compiles every configuration for sm_90 without a GPU)."""
    if torch.cuda.is_available():
        pytest.skip("interpreter check; on CUDA the autotuner runs these configurations itself")
    mod = _backend("triton")
    from srot_fast.kernels.triton import autotune

    for cfg in getattr(autotune, table):
        kw = dict(block_n=cfg.kwargs["BLOCK_N"], block_m=cfg.kwargs["BLOCK_M"])
        for p in (1, 2):
            if table in ("_CFG_DOT", "_CFG_SMALL"):
                d = 37 if table == "_CFG_DOT" else 3
                x, y, h, scale = _problem(d, torch.float32, p)
                extra = dict(block_k=cfg.kwargs["BLOCK_K"]) if d == 37 else dict(trans=cfg.kwargs["TRANS"])
                out = mod.softmin_fwd(x, y, h, 0.05 * scale, p, path="dot" if d == 37 else "small", **extra, **kw)
                _close(out, _ref64(ref.softmin, x, y, h.double(), 0.05 * scale, p), torch.float32, scale)
            else:
                d = 37 if table == "_CFG_WMEAN_DOT" else 3
                x, y, h, scale = _problem(d, torch.float32, p)
                out = mod.weighted_mean_fwd(x, y, h, 0.05 * scale, p, "grad", **kw)
                expected = _ref64(ref.weighted_mean, x, y, h.double(), 0.05 * scale, p, "grad")
                _close(out, expected, torch.float32, 10.0)


@pytest.mark.triton
def test_triton_float64_never_takes_the_dot_path():
    """float64: 'auto' at large D uses the exact difference form (float64 tl.dot failed to compile
    with Triton 3.6 for sm_90), path='dot' is refused, and weighted_mean's two-pass path for D > 64 sums in
    registers."""
    mod = _backend("triton")
    x, y, h, scale = _problem(70, torch.float64, 1, n=19, m=23)
    eps = 0.05 * scale
    with pytest.raises(ValueError, match="float32 only"):
        mod.softmin_fwd(x, y, h, eps, 1, path="dot")
    with pytest.raises(ValueError, match="float32 only"):
        mod.weighted_mean_fwd(x, y, h, eps, 1, "y", path="dot")
    _close(mod.softmin(x, y, h, eps, 1), ref.softmin(x, y, h, eps, 1), torch.float64, scale)
    for phi in ("y", "grad"):
        out = mod.weighted_mean_fwd(x, y, h, eps, 1, phi, block_n=16, block_m=16, block_k=16)
        _close(out, ref.weighted_mean(x, y, h, eps, 1, phi), torch.float64, 10.0)


@pytest.mark.triton
def test_triton_dot_path_kink():
    """Large-d path, p = 1: exactly coincident points get distance 0 despite the |x|^2 + |y|^2 - 2 x.y
    rounding, so the direction is 0 (not NaN, not a random unit vector) where a row sits on its column."""
    mod = _backend("triton")
    x, y, h, _ = _problem(64, torch.float32, 1)
    out = mod.weighted_mean_fwd(x, y, h, 1e-4, 1, "grad", path="dot")
    assert torch.isfinite(out).all()
    assert out[3].abs().max() < 1e-5 and out[0].abs().max() < 1e-5


@pytest.mark.triton
def test_triton_dot_precision_choice(monkeypatch):
    """Every tl.dot of the large-d path takes its precision from the launcher (``PREC``; half points: "tf32"
    for x.y, exact for them). The choice: ``precision=`` first, then SROT_TRITON_DOT_PRECISION, then
    ``_DEFAULT_PRECISION``, which is fp32-accurate ("ieee" or "tf32x3", never plain "tf32"); plain "tf32"
    only when asked; anything else refused, naming the argument or the variable (the interpreter ignores the
    precision, so on CPU only the source and the choice can be checked; the GPU tests below check numbers)."""
    import inspect

    mod = _backend("triton")
    from srot_fast.kernels.triton import kernels, launchers, tiles

    for fn in (tiles._xy_dot_tile, kernels._weighted_sum_dot_kernel, kernels._weighted_mean_dot_kernel):
        calls = re.findall(r"= tl\.dot\((.*)\)", inspect.getsource(fn.fn))
        assert calls and all("input_precision=PREC" in c for c in calls), calls
    assert launchers._DEFAULT_PRECISION in ("ieee", "tf32x3")
    monkeypatch.delenv("SROT_TRITON_DOT_PRECISION", raising=False)
    assert launchers._precision(None) == launchers._DEFAULT_PRECISION
    assert launchers._precision("tf32x3") == "tf32x3"
    assert launchers._precision("tf32") == "tf32"
    monkeypatch.setenv("SROT_TRITON_DOT_PRECISION", "tf32x3")
    assert launchers._precision(None) == "tf32x3"
    assert launchers._precision("ieee") == "ieee"
    monkeypatch.setenv("SROT_TRITON_DOT_PRECISION", "tf32")
    assert launchers._precision(None) == "tf32"
    monkeypatch.setenv("SROT_TRITON_DOT_PRECISION", "fp16")
    with pytest.raises(ValueError, match="SROT_TRITON_DOT_PRECISION"):
        launchers._precision(None)
    with pytest.raises(ValueError, match="precision"):
        launchers._precision("TF32")
    x, y, h, _ = _problem(40, torch.float32, 2)
    with pytest.raises(ValueError, match="SROT_TRITON_DOT_PRECISION"):
        mod.softmin_fwd(x, y, h, 0.1, 2)
    # a "tf32x3" default falls back to "ieee" on a GPU without TF32 tensor cores (an explicit choice stays)
    monkeypatch.delenv("SROT_TRITON_DOT_PRECISION")
    monkeypatch.setattr(launchers, "_DEFAULT_PRECISION", "tf32x3")
    gpu = torch.device("cuda")
    monkeypatch.setattr(launchers, "_has_tf32", lambda device: False)
    assert launchers._precision(None, gpu) == "ieee" and launchers._precision("tf32x3", gpu) == "tf32x3"
    monkeypatch.setattr(launchers, "_has_tf32", lambda device: True)
    assert launchers._precision(None, gpu) == "tf32x3"


@pytest.mark.triton
def test_triton_autotune_argument_and_variable(monkeypatch):
    """Autotuning: ``autotune=`` on the launchers first (True / False), then SROT_TRITON_AUTOTUNE (off only
    at '0'); a non-bool is a TypeError naming the argument. The interpreter never tunes, so the launch
    itself runs with fixed blocks either way."""
    mod = _backend("triton")
    from srot_fast.kernels.triton import autotune

    monkeypatch.delenv("SROT_TRITON_AUTOTUNE", raising=False)
    assert autotune._autotune_flag(None) is True
    assert autotune._autotune_flag(False) is False
    monkeypatch.setenv("SROT_TRITON_AUTOTUNE", "0")
    assert autotune._autotune_flag(None) is False
    assert autotune._autotune_flag(True) is True
    with pytest.raises(TypeError, match="autotune"):
        autotune._autotune_flag("yes")
    x, y, h, scale = _problem(3, torch.float32, 2, n=9, m=7)
    with pytest.raises(TypeError, match="autotune"):
        mod.softmin_fwd(x, y, h, 0.1 * scale, 2, autotune=1)
    want = ref.softmin(x.double(), y.double(), h.double(), 0.1 * scale, 2)
    for flag in (True, False):
        got = mod.softmin_fwd(x, y, h, 0.1 * scale, 2, autotune=flag)
        torch.testing.assert_close(got.double(), want, atol=1e-5 * scale, rtol=1e-5)
        got = mod.weighted_mean_fwd(x, y, h, 0.1 * scale, 2, autotune=flag)
        torch.testing.assert_close(got.double(), ref.weighted_mean(x.double(), y.double(), h.double(),
                                                                   0.1 * scale, 2), atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------ TF32 rounding, simulated
def _round_tf32(t: torch.Tensor) -> torch.Tensor:
    """float32 -> the nearest TF32 value (10 stored significand bits, ties away from zero, as the GPU's
    cvt.rna.tf32.f32), still a float32 tensor."""
    i = t.float().contiguous().view(torch.int32)
    return ((i + 0x1000) & ~0x1FFF).view(torch.float32)


def _sim_sq_dist(x: torch.Tensor, y: torch.Tensor, precision: str) -> torch.Tensor:
    """(N, M) float64 |x|^2 + |y|^2 - 2 x.y of the centred float32 points as the large-d path forms them,
    with the cross term's operands rounded as ``precision`` rounds them ("tf32": each operand to TF32;
    "tf32x3": hi.hi + hi.lo + lo.hi of the TF32 splits); products and sums exact (float64), so only the
    operand rounding shows."""
    c = (x.sum(0) + y.sum(0)) / (len(x) + len(y))
    x, y = x - c, y - c
    xx, yy = x.double().square().sum(1), y.double().square().sum(1)
    xh, yh = _round_tf32(x).double(), _round_tf32(y).double()
    xy = xh @ yh.T
    if precision == "tf32x3":
        xl, yl = _round_tf32(x - xh.float()).double(), _round_tf32(y - yh.float()).double()
        xy = xy + xh @ yl.T + xl @ yh.T
    return xx[:, None] + yy[None, :] - 2 * xy


def test_tf32_rounding_error_is_as_documented():
    """The error the Triton backend documents for the opt-in "tf32" dots (kernels.triton): squared distances
    of 512 x 256 Gaussian / uniform float32 points at D = 64, 300, 3072 carry relative errors up to ~3e-4
    (D = 64; ~8e-5 at 300, ~3e-5 at 3072) under TF32 operand rounding (bound asserted: 5e-4, and at least
    1e-5 at D = 64, i.e. far from fp32); "tf32x3" stays at fp32 level (bound 2e-7). The soft-min value
    (eps = 5 % of the mean cost) moves by less than the largest relative cost error (times the cost scale)."""
    g = torch.Generator().manual_seed(0)
    for d in (64, 300, 3072):
        for x, y in ((torch.randn(512, d, generator=g), torch.randn(256, d, generator=g) + 0.3),
                     (torch.rand(512, d, generator=g), torch.rand(256, d, generator=g))):
            exact = torch.cdist(x.double(), y.double()).square()
            sq = _sim_sq_dist(x, y, "tf32")
            err = ((sq - exact).abs() / exact).max().item()
            assert err < 5e-4, (d, err)
            if d == 64:
                assert err > 1e-5, err
            assert (((_sim_sq_dist(x, y, "tf32x3") - exact).abs() / exact).max().item()) < 2e-7
            eps = 0.05 * exact.mean().item() / 2
            h = torch.zeros(len(y), dtype=torch.float64)
            v_exact = -eps * torch.logsumexp(h - exact / 2 / eps, 1)
            v_tf32 = -eps * torch.logsumexp(h - sq / 2 / eps, 1)
            assert ((v_tf32 - v_exact).abs() / (exact.max() / 2)).max().item() <= err


class _LaunchRecorder:
    """Stands in for a @triton.jit kernel: records each launch's PREC, then launches the real kernel."""

    def __init__(self, kernel, name, seen):
        self.kernel, self.name, self.seen = kernel, name, seen

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.seen.append((self.name, kw.get("PREC")))
            return self.kernel[grid](*args, **kw)

        return launch


@pytest.mark.triton
@pytest.mark.parametrize("precision,env,want", [("tf32x3", None, "tf32x3"), (None, "tf32x3", "tf32x3"),
                                                ("ieee", "tf32x3", "ieee"), (None, None, "default"),
                                                ("tf32", None, "tf32"), (None, "tf32", "tf32")])
def test_triton_launchers_pass_the_precision_to_every_dot_kernel(monkeypatch, precision, env, want):
    """Every dot-path launch (softmin, one- and two-pass weighted mean, argmax, max cost) gets the asked
    precision: ``precision=`` first, then SROT_TRITON_DOT_PRECISION, then ``_DEFAULT_PRECISION``. The
    interpreter ignores the precision, so this is what the CPU can check; the GPU tests check the numbers."""
    mod = _backend("triton")
    from srot_fast.kernels.triton import launchers as real  # the launchers look the kernels up in their module

    if want == "default":
        want = real._DEFAULT_PRECISION
    seen = []
    names = ("_softmin_fwd_kernel", "_weighted_mean_dot_kernel", "_weighted_sum_dot_kernel",
             "_plan_argmax_fwd_kernel", "_max_sq_fwd_kernel")
    for name in names:
        monkeypatch.setattr(real, name, _LaunchRecorder(getattr(real, name), name, seen))
    if env is None:
        monkeypatch.delenv("SROT_TRITON_DOT_PRECISION", raising=False)
    else:
        monkeypatch.setenv("SROT_TRITON_DOT_PRECISION", env)
    for d in (40, 129):  # one-pass (D <= 128) and two-pass weighted mean
        x, y, h, scale = _problem(d, torch.float32, 2, n=20, m=17)
        kw = dict(precision=precision)
        mod.softmin_fwd(x, y, h, 0.1 * scale, 2, **kw)
        mod.weighted_mean_fwd(x, y, h, 0.1 * scale, 1, "grad", **kw)
        mod.plan_argmax_fwd(x, y, h, 0.1 * scale, 2, **kw)
        mod.max_sq_fwd(x, y, **kw)
    assert {name for name, _ in seen} == set(names)
    assert all(prec == want for _, prec in seen), seen


@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (TF32 only exists there)")
@pytest.mark.parametrize("precision", ["ieee", "tf32x3"])
def test_triton_dot_path_is_fp32_accurate(precision):
    """On GPU, squared distances from the tl.dot path at D = 300 and 3072 (image-like data in [0, 1])
    within 2e-6 relative of float64, for both precisions: TF32 inputs would give ~2e-5 to 6e-5 (simulated
    on CPU); fp32 and a CPU simulation of tf32x3 give ~2e-7."""
    mod = _backend("triton")
    g = torch.Generator().manual_seed(0)
    for d in (300, 3072):
        x = torch.rand(256, d, generator=g)
        y = torch.rand(64, d, generator=g)
        expected = (torch.cdist(x.double(), y.double()) ** 2).max(1).values
        out = mod.max_sq_fwd(x.cuda(), y.cuda(), path="dot", precision=precision).cpu().double()
        assert ((out - expected).abs() / expected).max() < 2e-6
        # per pair: one column at a time through the softmin (M = 1: out_i = C(x_i, y_0) exactly)
        for j in range(4):
            h = torch.zeros(1, device="cuda")
            got = mod.softmin_fwd(x.cuda(), y[j : j + 1].cuda(), h, 1.0, 2, path="dot",
                                  precision=precision).cpu().double()
            want = (x.double() - y[j].double()).square().sum(1) / 2
            assert ((got - want).abs() / want).max() < 2e-6


@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                    reason="needs a CUDA device with TF32 tensor cores")
def test_triton_plain_tf32_is_within_its_documented_error():
    """On GPU, the opt-in precision="tf32": squared distances of centred Gaussian points at D = 64, 300, 3072
    within the documented 5e-4 relative of float64 (test_tf32_rounding_error_is_as_documented), and above
    1e-6 at D = 64, which shows the tensor cores did round the operands (fp32 gives ~1e-7)."""
    mod = _backend("triton")
    g = torch.Generator().manual_seed(0)
    for d in (64, 300, 3072):
        x = torch.randn(256, d, generator=g)
        y = torch.randn(64, d, generator=g) + 0.3
        exact = torch.cdist(x.double(), y.double()).square()
        worst = 0.0
        for j in range(8):  # one column at a time through the softmin (M = 1: out_i = C(x_i, y_j) exactly)
            got = mod.softmin_fwd(x.cuda(), y[j : j + 1].cuda(), torch.zeros(1, device="cuda"), 1.0, 2, path="dot",
                                  precision="tf32").cpu().double()
            worst = max(worst, ((2 * got - exact[:, j]).abs() / exact[:, j]).max().item())
        assert worst < 5e-4, (d, worst)
        if d == 64:
            assert worst > 1e-6, worst


# ------------------------------------------------------------------------------------ argmax / max C
_AM_KEOPS = [pytest.param("keops", 3, torch.float64, p, marks=KEOPS) for p in (1, 2)]
_AM_TRITON = [pytest.param(*c, marks=TRITON) for c in _grid(["triton"], (2, 3))] + [
    pytest.param("triton", 64, torch.float32, 2, marks=TRITON)
]


@pytest.mark.parametrize("backend,d,dtype,p", _grid(CPU, (1, 2, 3, 64)) + _AM_KEOPS + _AM_TRITON)
def test_plan_argmax_matches_reference(backend, d, dtype, p):
    mod = _backend(backend)
    x, y, h, scale = _problem(d, dtype, p)
    eps = 0.05 * scale
    out = mod.plan_argmax(x, y, h, eps, p)
    assert out.shape == (N,) and out.dtype == torch.int64
    logits = h.double()[None, :] - _ref64(ref.cost_matrix, x, y, p) / eps
    if dtype == torch.float64:
        assert torch.equal(out, logits.argmax(1))
    else:  # float32 rounding may swap near-ties: the chosen entry must be maximal up to rounding
        chosen = logits.gather(1, out[:, None])[:, 0]
        assert (chosen >= logits.max(1).values - 1e-4 * (1 + logits.max(1).values.abs())).all()


@pytest.mark.parametrize("backend,d,dtype,p", _grid(CPU, (1, 2, 3, 64)) + _AM_KEOPS + _AM_TRITON)
def test_max_cost_matches_reference(backend, d, dtype, p):
    mod = _backend(backend)
    x, y, _, _ = _problem(d, dtype, p)
    out = mod.max_cost(x, y, p)
    assert out.shape == () and out.dtype == dtype
    expected = _ref64(ref.max_cost, x, y, p)
    _close(out, expected, dtype, expected.item())


# ------------------------------------------------------------------------------ CPU build handling
def test_cpu_build_failure_falls_back(monkeypatch, tmp_path):
    """No compiler: available() is False, build_error() says why, the primitives still answer."""
    monkeypatch.setattr(cpu_ops, "_tried", False)
    monkeypatch.setattr(cpu_ops, "_lib", None)
    monkeypatch.setattr(cpu_ops, "_error", None)
    monkeypatch.setenv("SROT_FAST_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.delenv("SROT_FAST_NO_COMPILE", raising=False)
    assert not cpu_ops.available()
    assert "FileNotFoundError" in cpu_ops.build_error()
    x, y, h, scale = _problem(2, torch.float64, 1)
    _close(cpu_ops.softmin(x, y, h, 0.1, 1), ref.softmin(x, y, h, 0.1, 1), torch.float64, scale)


def test_cpu_rejects_bad_arguments():
    x = torch.randn(4, 2)
    with pytest.raises(ValueError, match="p must be 1 or 2"):
        cpu_ops.softmin(x, x, torch.zeros(4), 0.1, 3)
    with pytest.raises(ValueError, match=r"h \(M,\)"):
        cpu_ops.softmin(x, x, torch.zeros(5), 0.1, 1)
    with pytest.raises(ValueError, match="phi"):
        cpu_ops.weighted_mean(x, x, torch.zeros(4), 0.1, 1, phi="z")


def test_cpu_other_dtypes_use_fallback():
    x, y, h, _ = _problem(2, torch.float64, 2)
    out = cpu_ops.softmin(x.bfloat16(), y.bfloat16(), h.bfloat16(), 1.0, 2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref.softmin(x, y, h, 1.0, 2), atol=0.1, rtol=0.02)


# ------------------------------------------------------------------------------------------ memory
_MEM_SCRIPT = textwrap.dedent(
    """
    import resource, sys, torch
    from srot_fast.kernels import cpu_ops, tensorized

    def peak_kib():  # high-water RSS: VmHWM (resettable), else ru_maxrss (never reset)
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))

    def reset_peak():
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        except OSError:
            pass

    fn, n = {"compiled": (cpu_ops.softmin, 20000), "blocked": (cpu_ops.torch_softmin, 8000),
             "dense": (tensorized.softmin, 4000)}[sys.argv[1]]
    if sys.argv[1] == "compiled" and not cpu_ops.available():
        fn = cpu_ops.torch_softmin
    x, y, h = torch.randn(n, 2), torch.randn(n, 2), torch.zeros(n)
    fn(x[:64], y[:64], h[:64], 0.1, 1)  # build / warm-up outside the measurement
    reset_peak()
    before = peak_kib()
    assert torch.isfinite(fn(x, y, h, 0.1, 1)).all()
    print((peak_kib() - before) * 1024)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss units are Linux-specific")
def test_cpu_memory_is_bounded():
    """Peak RSS growth (one fresh process per case) far below one N x M float32 buffer; the probe itself
    is checked on the dense reference (positive control), which must show its N x M buffer."""
    procs = {
        mode: subprocess.Popen(
            [sys.executable, "-c", _MEM_SCRIPT, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for mode in ("compiled", "blocked", "dense")
    }
    grow = {}
    for mode, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        grow[mode] = int(out)
    assert grow["compiled"] < 20000 * 20000 * 4 / 16, grow  # < 100 MB; an N x M buffer is 1.6 GB
    # blocked torch: a few live temporaries of 2**22 floats (16.8 MB each): 33 MB usually, 85 MB seen under
    # load; an N x M buffer is 256 MB
    assert grow["blocked"] < 8000 * 8000 * 4 / 2, grow
    assert grow["dense"] >= 4000 * 4000 * 4, grow  # the dense reference shows its 64 MB: the probe works


@pytest.mark.parametrize(
    "module",
    ["cpu_ops", pytest.param("keops_ops", marks=KEOPS), pytest.param("triton_softmin", marks=TRITON)],
)
def test_all_names_resolve(module):
    if module == "triton_softmin":
        pytest.importorskip("triton")
    mod = __import__(f"srot_fast.kernels.{module}", fromlist=["__all__"])
    for name in ("softmin", "weighted_mean", "plan_argmax", "max_cost"):
        assert name in mod.__all__
    assert all(callable(getattr(mod, name)) for name in mod.__all__)


@pytest.mark.parametrize("module", ["tensorized", "cpu_ops", "blocksparse"])
def test_operands_of_a_wrong_dtype_are_named(module):
    """Integer, complex or mixed-dtype points gave torch-internal errors ("cdist only supports floating-point
    dtypes", "expected scalar type Float but found Double") or, on the tensorized pass, a silent complex result;
    every pass now raises a TypeError naming the argument."""
    import importlib

    ops = importlib.import_module(f"srot_fast.kernels.{module}")
    x, y, h = torch.zeros(3, 2), torch.ones(4, 2), torch.zeros(4)
    for bad, match in [((x.long(), y.long(), h), "x must be a real floating"),
                       ((x.to(torch.complex64), y.to(torch.complex64), h), "x must be a real floating"),
                       ((x, y.double(), h), "x and y must have one dtype"),
                       ((x, y, h.long()), "h must be a real floating")]:
        with pytest.raises(TypeError, match=match):
            ops.softmin(*bad, 0.5, 2)
