"""CUDA-only checks (marker ``gpu``; skipped without a CUDA device, run by benchmarks/gpu_suite.py).

- Sinkhorn / SROTLoss on the Triton backend with CUDA tensors against 'tensorized' on the same device,
  float32 (TF32 off) and float64, small d and the large-d ``tl.dot`` path, values and gradients;
- autotuned launches (n = m = 8192) against float64, float32 and half points;
- float16 / bfloat16 points on the Triton backend: float32 potentials against float64 on the same rounded
  points (that the kernels receive the given half tensors is checked in tests/test_batched_kernels.py),
  value and gradients in the input dtype; SROTLoss under ``torch.autocast("cuda", dtype=torch.bfloat16)``;
- 'auto' picks Triton on CUDA; results stay on the input device;
- no n x m buffer: CUDA allocator peak of a Triton solve at n = m = 20k far below 4 n m bytes;
- the block-sparse backend's coarse-to-fine start on CUDA tensors (cells on the device, Triton passes)
  against the dense Triton solve;
- the VAT detector trains on CUDA (points and images, fused and fd power steps), finds the toy's type-II
  outliers there, and a CUDA-fitted detector saves and loads onto the CPU.
"""
import pytest
import torch

from srot_fast import SROTLoss, sinkhorn
from srot_fast.datasets import make_toy_2d
from srot_fast.detector import OutlierDetector

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.filterwarnings("ignore:Sinkhorn stopped at max_iter"),
]


@pytest.fixture(autouse=True)
def _no_tf32():
    """fp32 matmuls and convolutions on the GPU: cuDNN's TF32 default made the CUDA detector's image
    probabilities differ from the same weights on the CPU by up to 2e-5 (H200, 2026-11-26)."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _clouds(n, m, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, d, generator=g, dtype=torch.float64)
    y = torch.rand(m, d, generator=g, dtype=torch.float64) + 0.2
    s_x = torch.rand(n, generator=g, dtype=torch.float64) * 0.98 + 0.01
    s_y = torch.rand(m, generator=g, dtype=torch.float64) * 0.98 + 0.01
    return [t.to("cuda", dtype) for t in (x, y, s_x, s_y)]


@pytest.mark.parametrize("prim,d,p,precision,dtype", [
    ("softmin", 2, 1, None, torch.float32), ("softmin", 64, 2, "ieee", torch.float32),
    ("weighted_mean", 64, 2, "ieee", torch.float32), ("softmin", 64, 2, "tf32x3", torch.float32),
    ("weighted_mean", 64, 2, "tf32x3", torch.float32), ("softmin", 2, 2, None, torch.bfloat16),
    ("weighted_mean", 64, 2, None, torch.float16)])  # each tuned key compiles every candidate: few half cases
def test_autotuned_launches_match_float64(prim, d, p, precision, dtype, monkeypatch):
    """At n = m = 8192 (2^26 pairs, the tuning threshold) the launch is autotuned over the candidate blocks;
    the chosen kernel's rows match a float64 reference (256 rows against all columns), with the large-d
    path's tl.dot at each precision (set through SROT_TRITON_DOT_PRECISION, as a user would), and for half
    points (the reference on the same rounded points: float32 accuracy)."""
    from srot_fast.kernels import tensorized as ref
    from srot_fast.kernels import triton_softmin as tri

    if precision is not None:
        monkeypatch.setenv("SROT_TRITON_DOT_PRECISION", precision)
    n = 8192
    x, y, _, _ = _clouds(n, n, d, dtype)
    h = torch.full((n,), -torch.log(torch.tensor(float(n))).item(), device="cuda")
    eps = 0.05 * float(ref.max_cost(x[:256].double(), y[:256].double(), p))
    before = sum(len(v) for v in tri.tuned_configs().values())
    if prim == "softmin":
        out = tri.softmin(x, y, h, eps, p)[:256].double()
        want = ref.softmin(x[:256].double(), y.double(), h.double(), eps, p)
        tol = 1e-5 * float(want.abs().max()) + 1e-4 * eps
    else:
        out = tri.weighted_mean(x, y, h, eps, p, "grad")[:256].double()
        want = ref.weighted_mean(x[:256].double(), y.double(), h.double(), eps, p, "grad")
        tol = 2e-5
    assert sum(len(v) for v in tri.tuned_configs().values()) == before + 1  # one new tuned launch
    assert float((out - want).abs().max()) < tol


@pytest.mark.parametrize("d,dtype,p,precision", [(2, torch.float32, 1, None), (2, torch.float32, 2, None),
                                                 (2, torch.float64, 1, None), (64, torch.float32, 2, "ieee"),
                                                 (3072, torch.float32, 2, "ieee"), (64, torch.float32, 1, "tf32x3"),
                                                 (3072, torch.float32, 2, "tf32x3")])
def test_srotloss_triton_matches_tensorized_on_cuda(d, dtype, p, precision, monkeypatch):
    """Soft SROT, KL, 40 updates, 'triton' in ``dtype`` against 'tensorized' in float64 on the same CUDA
    points: value within 1e-5 (float32) / 1e-10 (float64) relative, gradients within 4e-4 sqrt(max(1, d/64))
    (float32: the large-d path's |x|^2 + |y|^2 - 2 x.y rounding grows like sqrt(d), and 40 unconverged
    accelerated updates in float32 and float64 take slightly different Anderson steps: 2.7e-4 measured on an
    H100 at d = 64) / 1e-9 of their max.
    Under the CPU interpreter the same comparison measured 6e-8 (value) and 3e-5 / 1e-4 (gradients, d = 64
    / 300) in float32."""
    if precision is not None:  # the large-d path's tl.dot precision
        monkeypatch.setenv("SROT_TRITON_DOT_PRECISION", precision)
    n, m = (700, 900) if d < 1000 else (300, 260)
    x0, y0, s_x, s_y = _clouds(n, m, d, torch.float64)
    # costs O(1) at every d: unscaled, d = 3072 gives C ~ 300 >> reach 1, nothing is transported and the
    # gradients are ~1e-106 in float64 and exactly 0 in float32 (an ill-posed comparison, failed on an H200)
    x0, y0 = x0 / (d / 2) ** 0.5, y0 / (d / 2) ** 0.5
    rtol = 1e-5 if dtype == torch.float32 else 1e-10
    gtol = 4e-4 * max(1.0, (d / 64) ** 0.5) if dtype == torch.float32 else 1e-9
    out = {}
    for be, dt in (("tensorized", torch.float64), ("triton", dtype)):
        x, y = x0.to(dt).requires_grad_(), y0.to(dt).requires_grad_()
        loss = SROTLoss(p=p, blur=0.1, reach=1.0, strategy="soft", backend=be, tol=1e-30, max_iter=40,
                        debias=False)
        value = loss(x, y, scores=(s_x.to(dt), s_y.to(dt)))
        gx, gy = torch.autograd.grad(value, (x, y))
        assert loss.last_result.backend == be and value.device.type == "cuda"
        out[be] = value.detach().double(), gx.double(), gy.double()
    (v0, gx0, gy0), (v1, gx1, gy1) = out["tensorized"], out["triton"]
    assert torch.isfinite(v1) and abs(float(v1 - v0)) <= rtol * abs(float(v0))
    for got, want in ((gx1, gx0), (gy1, gy0)):
        assert float((got - want).abs().max()) <= gtol * float(want.abs().max())


def test_auto_picks_triton_on_cuda_and_plan_helpers():
    x, y, _, _ = _clouds(5000, 4000, 2, torch.float32)
    res = sinkhorn(x, y, p=2, eps=0.01, penalty="kl", tau=1.0, backend="auto")
    assert res.backend == "triton" and res.f.device.type == "cuda"
    ref = sinkhorn(x[:800], y[:700], p=2, eps=0.01, penalty="kl", tau=1.0, backend="tensorized")
    tri = sinkhorn(x[:800], y[:700], p=2, eps=0.01, penalty="kl", tau=1.0, backend="triton")
    torch.testing.assert_close(tri.barycentric_projection(), ref.barycentric_projection(), atol=1e-4, rtol=1e-4)
    agree = (tri.plan_argmax() == ref.plan_argmax()).float().mean()
    assert agree > 0.99  # float32 ties may break differently


def test_triton_solve_allocates_no_nm_buffer():
    """n = m = 20k, d = 2, float32: an n x m buffer is 1.6 GB; the solve's allocator peak stays < 64 MiB."""
    n = 20_000
    x, y, _, _ = _clouds(n, n, 2, torch.float32)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    res = sinkhorn(x, y, p=1, eps=0.01, penalty="kl", tau=1.0, backend="triton", max_iter=20)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert torch.isfinite(res.value)
    assert peak < 64 * 2**20, f"peak {peak / 2**20:.1f} MiB"


@pytest.mark.parametrize("cfg", [dict(), dict(mass=0.6)])
def test_blocksparse_coarse_start_on_cuda(cfg, monkeypatch):
    """backend='blocksparse' on CUDA tensors: the coarse-to-fine start builds its cells on the device and runs on
    the Triton block-sparse passes; the value equals the dense Triton solve's (float64, tol 1e-7: 1e-7
    relative), the potentials stay on the device."""
    from srot_fast import _multiscale as ms

    devices = []
    real = ms._cells
    monkeypatch.setattr(ms, "_cells", lambda *args: devices.append(args[0].device.type) or real(*args))
    x, y, _, _ = _clouds(3000, 2500, 2, torch.float64, seed=3)
    kw = dict(p=2, eps=0.02**2, tol=1e-7, max_iter=5000, **cfg)
    sparse = sinkhorn(x, y, backend="blocksparse", **kw)
    dense = sinkhorn(x, y, backend="triton", **kw)
    assert devices and set(devices) == {"cuda"}
    assert sparse.converged and dense.converged and sparse.f.device.type == "cuda"
    assert abs(float(sparse.value - dense.value)) <= 1e-7 * abs(float(dense.value))


def test_detector_trains_on_cuda_points():
    d = make_toy_2d(seed=0)
    det = OutlierDetector(seed=0, progress=False, device="cuda").fit(d.x, d.y)
    assert next(det.model.parameters()).device.type == "cuda"
    ms, mt = det.outlier_masks(d.x, d.y)
    assert ms.device == d.x.device  # masks come back on the points' device
    found = int((ms & d.x_type2).sum() + (mt & d.y_type2).sum())
    n_out = int(d.x_type2.sum() + d.y_type2.sum())
    clean = ~(d.x_type1 | d.x_type2), ~(d.y_type1 | d.y_type2)
    flagged = int((ms & clean[0]).sum() + (mt & clean[1]).sum())
    assert found >= 0.9 * n_out and flagged <= 0.05 * int(clean[0].sum() + clean[1].sum())


@pytest.mark.parametrize("power", ["fused", "fd"])
def test_detector_trains_on_cuda_images(power, tmp_path):
    g = torch.Generator().manual_seed(0)
    src, tgt = 0.1 * torch.rand(64, 3, 7, 10, generator=g), 0.1 * torch.rand(64, 3, 7, 10, generator=g)
    src[:, :, :3, :5] += 0.8
    tgt[:, :, 3:, 5:] += 0.8
    det = OutlierDetector(epochs=12, lr=3e-3, power=power, seed=0, progress=False).fit(src, tgt)  # images -> cuda
    assert next(det.model.parameters()).device.type == "cuda"
    ms, mt = det.outlier_masks(src, tgt)
    assert not ms.any() and not mt.any()
    det.save(tmp_path / "det.pt")
    back = OutlierDetector.load(tmp_path / "det.pt")
    torch.testing.assert_close(back.predict_proba(src), det.predict_proba(src), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("d,dtype,p", [(2, torch.bfloat16, 1), (2, torch.float16, 2), (64, torch.bfloat16, 2),
                                       (64, torch.float16, 1)])
def test_sinkhorn_triton_half_points_on_cuda(d, dtype, p):
    """Half points on the Triton backend (read as they are, computed in float32) against 'tensorized' in
    float64 on the same rounded points, KL, 60 updates: float32 potentials within 1e-4 of the cost scale,
    the value (in the input dtype) within its own rounding (unit roundoff 2^-8 / 2^-11 for bfloat16 /
    float16) plus 1e-5 relative, gradients in the input dtype within twice that of their largest entry."""
    n, m = 700, 900
    x0, y0, _, _ = _clouds(n, m, d, torch.float64)
    x0, y0 = x0 / (d / 2) ** 0.5, y0 / (d / 2) ** 0.5  # costs O(1) at every d
    rel = 2**-8 if dtype == torch.bfloat16 else 2**-11
    xh, yh = x0.to(dtype).requires_grad_(), y0.to(dtype)
    x64 = xh.detach().double().requires_grad_()
    kw = dict(p=p, eps=0.05, penalty="kl", tau=1.0, tol=1e-30, max_iter=60)
    out = sinkhorn(xh, yh, backend="triton", **kw)
    want = sinkhorn(x64, yh.double(), backend="tensorized", **kw)
    assert out.f.dtype == torch.float32 and out.value.dtype == dtype
    assert float((out.f.double() - want.f).abs().max()) <= 1e-4  # costs O(1)
    assert float((out.g.double() - want.g).abs().max()) <= 1e-4
    assert abs(float(out.value.detach()) - float(want.value.detach())) <= (rel + 1e-5) * abs(float(want.value))
    (gx,) = torch.autograd.grad(out.value, xh)
    (gx64,) = torch.autograd.grad(want.value, x64)
    assert gx.dtype == dtype
    assert float((gx.double() - gx64).abs().max()) <= 2 * rel * float(gx64.abs().max())


def test_srotloss_under_cuda_autocast_bfloat16():
    """The CUDA variant of tests/test_inputs.py's autocast test: features of a network under
    ``torch.autocast("cuda", dtype=torch.bfloat16)`` are bfloat16 and go to the Triton backend as they are;
    the bfloat16 value is within 2^-7 relative of the float64 computation on the same rounded features (its
    own rounding is up to 2^-8),
    within 2e-2 of the float32 network's value, and the gradients reach the network (within 5e-2 of the
    float32 ones relative to their largest entry)."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(600, 5, generator=gen).cuda(), (torch.randn(500, 5, generator=gen) + 0.5).cuda()
    torch.manual_seed(0)
    net = torch.nn.Linear(5, 3).cuda()
    loss = SROTLoss(p=2, blur=0.2, debias=False)
    v32 = loss(net(x), net(y))
    (g32,) = torch.autograd.grad(v32, net.weight)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fx, fy = net(x), net(y)
        value = loss(fx, fy)
    assert loss.last_result.backend == "triton"
    assert fx.dtype == torch.bfloat16 and value.dtype == torch.bfloat16 and torch.isfinite(value)
    (g16,) = torch.autograd.grad(value, net.weight)
    want = SROTLoss(p=2, blur=0.2, debias=False, backend="tensorized", tol=1e-8)(fx.detach().double(),
                                                                                fy.detach().double())
    value, v32 = float(value.detach()), float(v32.detach())
    assert abs(value - float(want)) <= 2**-7 * abs(float(want))
    assert abs(value - v32) <= 2e-2 * abs(v32)
    assert torch.isfinite(g16).all() and float((g16.float() - g32).abs().max()) <= 5e-2 * float(g32.abs().max())
