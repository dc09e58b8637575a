import math, time, sys, torch
from srot_fast import sinkhorn
from srot_fast.kernels import blocksparse as bs
from srot_fast.geometry import bbox_diameter
torch.manual_seed(0)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
p = int(sys.argv[2]) if len(sys.argv) > 2 else 2
bs.REUSE_SLACK = float(sys.argv[3]) if len(sys.argv) > 3 else bs.REUSE_SLACK
spans = len(sys.argv) > 4
calls = []
_real_prune = bs._prune
def _timed(*a):
    t0 = time.perf_counter(); out = _real_prune(*a); calls.append(time.perf_counter() - t0); return out
bs._prune = _timed
x = torch.rand(n, 2); y = torch.rand(n, 2); y[:, 0] += 0.1
eps = (0.01 * bbox_diameter(x, y)) ** p
t = time.perf_counter()
r = sinkhorn(x, y, p=p, eps=eps, tol=1e-3, backend="blocksparse")
print("slack", bs.REUSE_SLACK, "solve", round(time.perf_counter() - t, 2), "updates", int(r.n_iter), "passes", r.passes, "prunings", len(calls), "pruning s", round(sum(calls), 2), "value", float(r.value))
h = (-math.log(n) + r.g / eps).float()
bs.softmin(x, y, h, eps, p)
for _ in range(2):
    t = time.perf_counter(); bs.softmin(x, y, h, eps, p); full = time.perf_counter() - t
    xb, yb, hb = x[None], y[None], h[None]
    t = time.perf_counter(); st = bs._sparse_setup(xb, yb, hb, eps, p); setup = time.perf_counter() - t
    print(f"pass {full:.3f} s, setup (pruning) {setup:.3f} s ({100*setup/full:.0f} %), kept {bs.last_kept_fraction():.4f}")
# drift of h between consecutive updates near the end of a solve
r2 = sinkhorn(x, y, p=p, eps=eps, tol=1e-300, max_iter=int(r.n_iter) + 1, backend="blocksparse", init=(r.f, r.g)) if False else None
if not spans: sys.exit()
log = []
real = bs.softmin
def spy(x_, y_, h_, eps_, p_, **kw):
    log.append((x_.data_ptr(), float(eps_), h_.detach().double().clone()))
    return real(x_, y_, h_, eps_, p_, **kw)
import srot_fast.geometry as G
bs.softmin = spy
t = time.perf_counter()
r = sinkhorn(x, y, p=p, eps=eps, tol=1e-3, backend="blocksparse")
print("spied solve", time.perf_counter() - t, int(r.n_iter))
bs.softmin = real
last = {}
rows = []
for ptr, e, hh in log:
    k = (ptr, e)
    if k in last:
        d = (hh - last[k]); fin = torch.isfinite(d)
        rows.append((e == eps, float(d[fin].max() - d[fin].min())))
    last[k] = hh
fin_rows = [s for f, s in rows if f]
print("final-eps consecutive spans (nats):", [round(s, 3) for s in fin_rows])
