"""Batched kernel primitives on every installed backend: x (B, N, D), y (B, M, D), h (B, M) with one eps give,
per problem, the unbatched torch reference (``kernels.tensorized`` in float64 on the same inputs): relative
1e-12 (float64) / 1e-5 (float32) of the problem's cost or coordinate scale. Also: B = 0, a problem whose
columns are all masked, shape errors, one Triton launch per primitive for the whole batch, Triton's 64-bit
element offsets, and float16 / bfloat16 inputs (computed in float32, compared with the float64 reference on
the same half-rounded inputs at the float32 tolerance; Triton loads them without a float32 copy).

Backends: those of ``srot_fast.backends.available_backends()``; Triton runs under ``TRITON_INTERPRET=1`` on
CPU (marker ``triton``, few small cases: the interpreter is slow), KeOps (marker ``keops``) on float64 at
D = 3 only (each new formula is a CPU compile of tens of seconds, cached afterwards).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from reference import assert_argmax, optional_backend
from srot_fast.kernels import tensorized as ref

from srot_fast.backends import available_backends

INF = float("inf")
KEOPS = pytest.mark.keops
TRITON = pytest.mark.triton
RTOL = {torch.float64: 1e-12, torch.float32: 1e-5}  # relative to the problem's scale (cost or coordinates)
HALF = (torch.float16, torch.bfloat16)
N, M = 37, 21


# ------------------------------------------------------------------------------------------ helpers


def _module(name: str):
    if name == "tensorized":
        return ref
    if name == "cpu":
        from srot_fast.kernels import cpu_ops

        return cpu_ops
    return optional_backend(name)


def _marks(name):
    return {"keops": [KEOPS], "triton": [TRITON]}.get(name, [])


BACKENDS = [pytest.param(b, marks=_marks(b)) for b in available_backends()]


def _batch(nb, d, dtype, p, *, n=N, m=M, seed=0):
    """B problems of odd size with coincident pairs (the p = 1 kink), -inf columns (first, middle, last) and,
    from the third problem on, the last 5 columns masked as padding of a ragged batch."""
    g = torch.Generator().manual_seed(seed + 100 * d + 10 * nb + p)
    x = torch.randn(nb, n, d, generator=g, dtype=torch.float64)
    y = torch.randn(nb, m, d, generator=g, dtype=torch.float64) + 0.3
    y[:, 5] = x[:, 3]
    y[:, 11] = x[:, 0]
    h = torch.randn(nb, m, generator=g, dtype=torch.float64) - math.log(m)
    h[:, [0, m // 2, m - 1]] = -INF
    h[2:, -5:] = -INF
    return x.to(dtype), y.to(dtype), h.to(dtype)


def _close(out, want, dtype, scale):
    tol = RTOL[dtype] * max(scale, 1.0)
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=RTOL[dtype])


def _check_all(mod, x, y, h, p, dtype):
    """Every primitive, batched, against the float64 reference of each problem. float16 / bfloat16 inputs:
    float32 results within the float32 tolerance of the reference on the same (rounded) inputs."""
    half = dtype in HALF
    dtype = torch.float32 if half else dtype  # the compute dtype: results and tolerances
    nb, n, d = x.shape
    # half points on the tl.dot path are not centred: |x|^2 + |y|^2 - 2 x.y cancels more than in the centred
    # float32 path (an H100 measured 8.7e-5 against 7.1e-5 on the weighted mean at D = 129): 4x the tolerance
    widen = 4.0 if half and d >= 32 else 1.0
    eps = 0.1 * (1.0 if p == 1 else 2.0) * math.sqrt(d)
    x64, y64, h64 = x.double(), y.double(), h.double()
    out = mod.softmin(x, y, h, eps, p)
    assert out.shape == (nb, n) and out.dtype == dtype
    for b in range(nb):
        scale = ref.max_cost(x64[b], y64[b], p).item()
        _close(out[b], ref.softmin(x64[b], y64[b], h64[b], eps, p), dtype, scale * widen)
    for phi in ("y", "grad"):
        out = mod.weighted_mean(x, y, h, eps, p, phi)
        assert out.shape == (nb, n, d) and out.dtype == dtype
        for b in range(nb):
            scale = x64[b].abs().max().item() + y64[b].abs().max().item()
            _close(out[b], ref.weighted_mean(x64[b], y64[b], h64[b], eps, p, phi), dtype, scale * widen)
    out = mod.plan_argmax(x, y, h, eps, p)
    assert out.shape == (nb, n) and out.dtype == torch.int64
    for b in range(nb):
        assert_argmax(out[b], h64[b][None, :] - ref.cost_matrix(x64[b], y64[b], p) / eps, RTOL[dtype])
    out = mod.max_cost(x, y, p)
    assert out.shape == (nb,) and out.dtype == dtype
    for b in range(nb):
        want = ref.max_cost(x64[b], y64[b], p)
        _close(out[b], want, dtype, want.item())


# ------------------------------------------------------------------------------------------ cases
_FULL = [(dt, nb, d, p) for dt in (torch.float32, torch.float64) for nb in (0, 1, 3) for d in (1, 2, 3, 64)
         for p in (1, 2)]
_FEW = {  # the interpreter and the KeOps compiler are slow: a selection
    "triton": [(torch.float32, 3, 1, 1), (torch.float64, 3, 3, 2), (torch.float64, 1, 2, 1),
               (torch.float32, 0, 3, 2), (torch.float32, 3, 64, 1), (torch.float32, 3, 64, 2),
               # half points, loaded as such: small-d path, tl.dot path with the one-pass mean, two-pass mean
               (torch.bfloat16, 3, 3, 1), (torch.float16, 2, 3, 2), (torch.bfloat16, 3, 64, 2),
               (torch.float16, 2, 64, 1), (torch.bfloat16, 1, 129, 1), (torch.float16, 1, 129, 2)],
    "keops": [(torch.float64, nb, 3, p) for nb in (0, 1, 3) for p in (1, 2)],
}
_CASES = [pytest.param(b.values[0], *c, marks=b.marks) for b in BACKENDS for c in _FEW.get(b.values[0], _FULL)]


@pytest.mark.parametrize("backend,dtype,nb,d,p", _CASES)
def test_batched_primitives_match_reference(backend, dtype, nb, d, p):
    """softmin, weighted_mean (both phi), plan_argmax and max_cost of a batch, per problem against the
    float64 reference (Triton: D = 64 in float32 and half takes the tl.dot path and the one-pass tl.dot mean,
    D = 129 the two-pass mean)."""
    x, y, h = _batch(nb, d, dtype, p)
    _check_all(_module(backend), x, y, h, p, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_softmin_masked_problem(backend):
    """A problem whose columns are all -inf gives +inf on its rows; the other problems are unaffected."""
    mod = _module(backend)
    x, y, h = _batch(3, 3, torch.float64, 1)
    h[1] = -INF
    out = mod.softmin(x, y, h, 0.2, 1)
    assert torch.isposinf(out[1]).all()
    for b in (0, 2):
        _close(out[b], ref.softmin(x[b], y[b], h[b], 0.2, 1), torch.float64, 10.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_shape_errors(backend):
    """Mixing batched and unbatched operands, or shapes that disagree, is a ValueError naming the arguments."""
    mod = _module(backend)
    x, y, h = _batch(2, 2, torch.float64, 1, n=5, m=13)
    bad = [
        ((x, y[0], h), "all unbatched|expected"),
        ((x[0], y[0], h), "all unbatched|expected"),
        ((x, y, h[0]), "all unbatched|expected"),
        ((x, y[:1], h[:1]), r"x \(B, N, D\)"),
        ((x, y, h[:, :3]), r"h \(B, M\)"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            mod.softmin(*args, 0.1, 1)
    with pytest.raises(ValueError, match="p must be 1 or 2"):
        mod.plan_argmax(x, y, h, 0.1, 3)
    with pytest.raises(ValueError, match="all unbatched|expected"):
        mod.max_cost(x, y[0], 1)


# ------------------------------------------------------------------------------------ Triton paths
class _LaunchCounter:
    """Stands in for a @triton.jit kernel: counts launches, then launches the real kernel."""

    def __init__(self, kernel, name, seen):
        self.kernel, self.name, self.seen = kernel, name, seen

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.seen.append(self.name)
            return self.kernel[grid](*args, **kw)

        return launch


_TRITON_KERNELS = ("_softmin_fwd_kernel", "_softmin_small_kernel", "_weighted_mean_fwd_kernel",
                   "_weighted_mean_soa_kernel", "_weighted_mean_dot_kernel", "_weighted_sum_dot_kernel",
                   "_plan_argmax_fwd_kernel", "_max_sq_fwd_kernel")


@pytest.mark.triton
@pytest.mark.parametrize("path", ["small", "dot"])
@pytest.mark.parametrize("passes", [1, 2])
def test_triton_batched_every_kernel_one_launch(monkeypatch, path, passes):
    """Every Triton kernel (small-d in both tile orientations, tl.dot, one- and two-pass weighted means, the
    thread-per-row one-pass weighted mean, argmax, max) on a batch whose problems span several row and column
    blocks (16 x 16 blocks, N = 37, M = 21), float32 at D = 3: one launch per kernel for the whole batch and
    per-problem reference results.
    The two-pass weighted mean is forced at D = 3 by lowering the one-pass D limits."""
    mod = _module("triton")
    if torch.cuda.is_available():
        pytest.skip("launch counting patches module attributes: interpreter only")
    from srot_fast.kernels.triton import launchers  # the module whose globals the launchers read

    seen = []
    for name in _TRITON_KERNELS:
        monkeypatch.setattr(launchers, name, _LaunchCounter(getattr(launchers, name), name, seen))
    if passes == 2:
        monkeypatch.setattr(launchers, "_MAX_D_WMEAN", 2)
        monkeypatch.setattr(launchers, "_MAX_D_WMEAN_DOT", 2)
    dt = torch.float32
    x, y, h = _batch(3, 3, dt, 1)
    x64, y64, h64 = x.double(), y.double(), h.double()
    blocks = dict(path=path, block_n=16, block_m=16, block_k=16)
    for p in (1, 2):
        eps = 0.3 * p
        for trans in ((False, True) if path == "small" else (None,)):
            seen.clear()
            out = mod.softmin_fwd(x, y, h, eps, p, trans=trans, **blocks)
            assert seen == ["_softmin_small_kernel" if path == "small" else "_softmin_fwd_kernel"]
            for b in range(3):
                _close(out[b], ref.softmin(x64[b], y64[b], h64[b], eps, p), dt, 10.0)
        for phi in ("y", "grad"):
            seen.clear()
            # path='small' refuses D above the one-pass limit: 'auto' (float32, D < 32) is the small-d path
            wm_path = "auto" if passes == 2 and path == "small" else path
            out = mod.weighted_mean_fwd(x, y, h, eps, p, phi, **dict(blocks, path=wm_path))
            if passes == 2:
                want = ["_softmin_small_kernel" if path == "small" else "_softmin_fwd_kernel",
                        "_weighted_sum_dot_kernel"]
            else:
                want = ["_weighted_mean_fwd_kernel" if path == "small" else "_weighted_mean_dot_kernel"]
            assert seen == want
            for b in range(3):
                _close(out[b], ref.weighted_mean(x64[b], y64[b], h64[b], eps, p, phi), dt, 10.0)
            if path == "small" and passes == 1:
                seen.clear()
                out = mod.weighted_mean_fwd(x, y, h, eps, p, phi, trans=True, **blocks)
                assert seen == ["_weighted_mean_soa_kernel"]
                for b in range(3):
                    _close(out[b], ref.weighted_mean(x64[b], y64[b], h64[b], eps, p, phi), dt, 10.0)
        seen.clear()
        arg = mod.plan_argmax_fwd(x, y, h, eps, p, **blocks)
        mx = mod.max_sq_fwd(x, y, **blocks)
        assert seen == ["_plan_argmax_fwd_kernel", "_max_sq_fwd_kernel"]
        for b in range(3):
            assert_argmax(arg[b], h64[b][None, :] - ref.cost_matrix(x64[b], y64[b], p) / eps, RTOL[dt])
            _close(mx[b], (ref.cost_matrix(x64[b], y64[b], 2) * 2).amax(1), dt, 10.0)


# The kernels read points through strided views when their coordinates (row-major kernels) or rows
# (coordinate-major softmin) are contiguous, so a view of a sparse memory-mapped file (8 GiB of address space,
# a few pages written) places points 2^31 elements and more past the start without allocating them.
_OFFSETS_SCRIPT = textwrap.dedent(
    """
    import math, sys, torch
    from srot_fast.kernels import tensorized as ref, triton_softmin as T
    from srot_fast.kernels.triton import launchers as L  # the module whose globals the launchers read

    R = 1 << 29  # 4 R = 2^31 elements
    store = torch.from_file(sys.argv[1], shared=True, size=4 * R + 64, dtype=torch.float32)
    layouts = {  # (x (size, stride, offset), y (size, stride, offset)): last element offset >= 2^31
        "rows": (((2, 5, 3), (8, R, 1), 0), ((2, 4, 3), (8, 4 * R // 3 + 1, 1), 32)),  # row 4, column 3 at >= 4R
        "batch": (((3, 5, 3), (2 * R, 3, 1), 0), ((3, 4, 3), (2 * R, 3, 1), 20)),  # problem 2 at 4R
        "coords": (((2, 5, 3), (5, 1, 2 * R), 0), ((2, 4, 3), (4, 1, 2 * R), 16)),  # coordinate 2 at 4R
    }

    def operands(x, y, dot):  # the launcher's operands without the centring copy (it would hide the strides)
        x, y = L._rows(x), L._rows(y)
        if not dot:
            return x, y, x, x, 0.0, None
        return x, y, (x * x).sum(-1), (y * y).sum(-1), 2.0 * math.sqrt(x.shape[-1]) * 1.2e-7, None

    L._operands = operands
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for name, ((xs, xst, xo), (ys, yst, yo)) in layouts.items():
        x = store.as_strided(xs, xst, xo)
        y = store.as_strided(ys, yst, yo)
        x.copy_(torch.randn(xs, generator=g))
        y.copy_(torch.randn(ys, generator=g))
        x64, y64 = x.double(), y.double()
        assert x64.abs().max() > 0 and y64.abs().max() > 0
        h = torch.randn(ys[:2], generator=g)
        h[:, 1] = -math.inf
        nb = xs[0]
        for path in ("small", "dot"):
            for p in (1, 2):
                want = [ref.softmin(x64[b], y64[b], h[b].double(), 0.5, p) for b in range(nb)]
                got = T.softmin_fwd(x, y, h, 0.5, p, path=path, block_n=16, block_m=16, block_k=16)
                worst = max([worst] + [(got[b] - want[b]).abs().max().item() for b in range(nb)])
                for phi in ("y", "grad"):
                    for limits in ((64, 128), (2, 2)):  # one pass, then two passes
                        L._MAX_D_WMEAN, L._MAX_D_WMEAN_DOT = limits
                        wm_path = "auto" if path == "small" else path  # 'small' refuses D > its limit
                        got = T.weighted_mean_fwd(x, y, h, 0.5, p, phi, path=wm_path, block_n=16, block_m=16,
                                                  block_k=16)
                        want = [ref.weighted_mean(x64[b], y64[b], h[b].double(), 0.5, p, phi) for b in range(nb)]
                        worst = max([worst] + [(got[b] - want[b]).abs().max().item() for b in range(nb)])
                got = T.plan_argmax_fwd(x, y, h, 0.5, p, path=path, block_n=16, block_m=16, block_k=16)
                for b in range(nb):  # how far the chosen logit falls below the row maximum (near-ties may swap)
                    logits = h[b].double()[None, :] - ref.cost_matrix(x64[b], y64[b], p) / 0.5
                    chosen = logits.gather(1, got[b][:, None])[:, 0]  # an index out of range raises
                    worst = max(worst, (logits.max(1).values - chosen).max().item())
            got = T.max_sq_fwd(x, y, path=path, block_n=16, block_m=16, block_k=16)
            want = [(ref.cost_matrix(x64[b], y64[b], 2) * 2).amax(1) for b in range(nb)]
            worst = max([worst] + [(got[b] - want[b]).abs().max().item() for b in range(nb)])
    print("worst", worst)
    """
)


@pytest.mark.triton
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sparse memory-mapped file: Linux only")
def test_triton_offsets_are_64_bit(tmp_path):
    """Points 2^31 and more elements past the start of their tensor (a row stride, a batch stride, and a
    coordinate stride of the coordinate-major softmin), through every kernel and path (small-d, tl.dot,
    one- and two-pass means, argmax, max), under the interpreter: results match the reference (values to 1e-4;
    the argmax's chosen logit within 1e-4 of the row maximum: near-ties may swap). With 32-bit
    offset arithmetic the loads wrap to the wrong address (wrong numbers or a crash, hence the child
    process). It does not cover the outputs' offsets (they are allocated contiguous here; the GPU test
    below does), nor a compiled kernel (the interpreter evaluates the same offset arithmetic with numpy)."""
    if torch.cuda.is_available():
        pytest.skip("interpreter check (TRITON_INTERPRET=1); the GPU test below allocates the sizes")
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", _OFFSETS_SCRIPT, str(tmp_path / "store.bin")], capture_output=True,
                         text=True, timeout=600, env=env)
    assert res.returncode == 0, (res.returncode, res.stderr[-3000:])
    worst = float(res.stdout.split("worst")[-1])
    assert worst < 1e-4, res.stdout


@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_offsets_beyond_2_31_on_gpu(monkeypatch):
    """Real tensors of more than 2^31 elements on a GPU (about 40 GB): rows past element 2^31 of x (N x D
    row-major and the coordinate-major copy) and of the (N, D) mean, on the small-d path (D = 4) and the
    tl.dot path (D = 64); the last rows are compared with the float64 reference."""
    free, _ = torch.cuda.mem_get_info()
    if free < 48 * 2**30:
        pytest.skip("needs about 48 GB of free GPU memory")
    from srot_fast.kernels import triton_softmin as T

    monkeypatch.setenv("SROT_TRITON_AUTOTUNE", "0")  # fixed blocks: tuning would compile every candidate
    g = torch.Generator(device="cuda").manual_seed(0)
    for d in (4, 64):
        n = (1 << 31) // d + 1000
        x = torch.rand(n, d, device="cuda", generator=g)
        y = torch.rand(9, d, device="cuda", generator=g)
        h = torch.zeros(9, device="cuda")
        h[4] = -INF
        eps = 0.05 * d
        tail = slice(n - 700, n)
        xt, y64, h64 = x[tail].double().cpu(), y.double().cpu(), h.double().cpu()
        for p in (1, 2):
            got = T.softmin(x, y, h, eps, p)[tail].cpu()
            _close(got, ref.softmin(xt, y64, h64, eps, p), torch.float32, 1e2)
            del got
            got = T.weighted_mean(x, y, h, eps, p, "y")[tail].cpu()
            torch.testing.assert_close(got.double(), ref.weighted_mean(xt, y64, h64, eps, p, "y"), atol=1e-4,
                                       rtol=1e-4)
            del got
            got = T.plan_argmax(x, y, h, eps, p)[tail].cpu()
            assert_argmax(got, h64[None, :] - ref.cost_matrix(xt, y64, p) / eps, RTOL[torch.float32])
        got = T.max_sq_fwd(x, y)[tail].cpu().double()
        torch.testing.assert_close(got, (ref.cost_matrix(xt, y64, 2) * 2).amax(1), atol=1e-4, rtol=1e-4)
        del x, got
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ half precision
_HALF = [pytest.param(b, marks=_marks(b)) for b in ("tensorized", "keops", "triton") if b in available_backends()]


@pytest.mark.parametrize("backend", _HALF)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_are_computed_in_float32(backend, dtype):
    """float16 / bfloat16 inputs: float32 results, within float32 accuracy of the float64 reference on the
    same (rounded) inputs (KeOps: D = 2, the float32 formula of tests/test_kernels.py)."""
    mod = _module(backend)
    d = 2
    x, y, h = (t[0].to(dtype) for t in _batch(1, d, torch.float64, 2))
    x64, y64, h64 = x.double(), y.double(), h.double()
    eps = 0.3
    out = mod.softmin(x, y, h, eps, 2)
    assert out.dtype == torch.float32
    _close(out, ref.softmin(x64, y64, h64, eps, 2), torch.float32, ref.max_cost(x64, y64, 2).item())
    if backend != "keops":  # keeps the KeOps formulas to the one of tests/test_kernels.py
        out = mod.weighted_mean(x, y, h, eps, 2, "grad")
        assert out.dtype == torch.float32
        _close(out, ref.weighted_mean(x64, y64, h64, eps, 2, "grad"), torch.float32, 10.0)
        assert mod.max_cost(x, y, 2).dtype == torch.float32
        assert mod.plan_argmax(x, y, h, eps, 2).dtype == torch.int64


class _DtypeRecorder:
    """Stands in for a @triton.jit kernel: records the dtypes and addresses of the tensor arguments of each
    launch, then launches the real kernel."""

    def __init__(self, kernel, name, seen):
        self.kernel, self.name, self.seen = kernel, name, seen

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.seen.append((self.name, [(a.dtype, a.data_ptr()) for a in args if torch.is_tensor(a)]))
            return self.kernel[grid](*args, **kw)

        return launch


@pytest.mark.triton
@pytest.mark.parametrize("dtype", HALF)
def test_triton_half_points_reach_the_kernels_without_a_float32_copy(monkeypatch, dtype):
    """float16 / bfloat16 points go to every Triton kernel in their own dtype (the kernels upcast each tile in
    registers); on the tl.dot path (row-major, not centred) the very tensors given are read in place. ``h``,
    ``prm`` and the outputs are float32."""
    triton_mod = _module("triton")
    from srot_fast.kernels.triton import launchers

    names = ("_softmin_fwd_kernel", "_softmin_small_kernel", "_weighted_mean_dot_kernel", "_weighted_mean_fwd_kernel",
             "_weighted_sum_dot_kernel", "_plan_argmax_fwd_kernel", "_max_sq_fwd_kernel")
    seen = []
    for name in names:
        monkeypatch.setattr(launchers, name, _DtypeRecorder(getattr(launchers, name), name, seen))
    for d in (3, 64, 129):
        dev = "cuda" if torch.cuda.is_available() else "cpu"  # the CUDA wrapper would copy CPU tensors
        x, y, h = (t.to(dev) for t in _batch(2, d, dtype, 2, n=13, m=12))
        h = h.float()
        for p in (1, 2):
            triton_mod.softmin(x, y, h, 1.0, p)
            triton_mod.weighted_mean(x, y, h, 1.0, p, "grad")
            triton_mod.plan_argmax(x, y, h, 1.0, p)
        triton_mod.max_cost(x, y, 2)
        for name, tensors in seen:
            assert tensors[0][0] == dtype and tensors[1][0] == dtype, (name, tensors)
            assert all(dt in (dtype, torch.float32, torch.int64) for dt, _ in tensors), (name, tensors)
            if d > 3:  # dot path: x and y themselves
                assert tensors[0][1] == x.data_ptr() and tensors[1][1] == y.data_ptr(), name
        del seen[:]
