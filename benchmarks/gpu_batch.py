import time, torch, json, os
from srot_fast import SROTLoss
torch.backends.cuda.matmul.allow_tf32 = False
dev = "cuda"
g = torch.Generator().manual_seed(0)
X = torch.randn(64, 256, 2, generator=g).to(dev); Y = (torch.randn(64, 256, 2, generator=g) + 0.5).to(dev)
out = {}
for name, fn in (("batched", lambda L, X: L(X, Y)), ("loop", lambda L, X: torch.stack([L(X[k], Y[k]) for k in range(64)]))):
    L = SROTLoss(debias=False)
    for rep in range(3):
        Xg = X.clone().requires_grad_(); torch.cuda.synchronize(); t = time.perf_counter()
        v = fn(L, Xg); v.sum().backward(); torch.cuda.synchronize(); dt = time.perf_counter() - t
    out[name] = dict(seconds=dt, passes=L.last_result.passes, syncs=L.last_result.syncs, value0=float(v[0]))
try:
    import geomloss
    Lg = geomloss.SamplesLoss(debias=False, backend="tensorized")
    for rep in range(3):
        Xg = X.clone().requires_grad_(); torch.cuda.synchronize(); t = time.perf_counter()
        v = Lg(Xg, Y); v.sum().backward(); torch.cuda.synchronize(); dt = time.perf_counter() - t
    out["geomloss_tensorized"] = dict(seconds=dt, value0=float(v[0]))
except Exception as e:
    out["geomloss_tensorized"] = repr(e)[:200]
print(json.dumps(out))
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "batch.json"), "w"))
