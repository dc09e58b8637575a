"""Top-level tensor operations of one ``sinkhorn`` solve at n = 256, d = 2 (p = 2, eps 0.0025, tol 1e-3,
value_tol 1e-4; one thread), counted by torch.profiler, and their CPU time."""
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from srot_fast import sinkhorn

torch.set_num_threads(1)
gen = torch.Generator().manual_seed(0)
x, y = torch.randn(256, 2, generator=gen), torch.randn(256, 2, generator=gen)
y[:, 0] += 0.5
kw = dict(p=2, eps=0.0025, tol=1e-3, value_tol=1e-4)
sinkhorn(x, y, **kw)
with profile(activities=[ProfilerActivity.CPU]) as prof:
    r = sinkhorn(x, y, **kw)
tops = [ev for ev in prof.events() if ev.cpu_parent is None]
total = collections.Counter()
for ev in tops:
    total[ev.name] += ev.cpu_time_total
print(f"{len(tops)} top-level operations, {int(r.n_iter)} updates, {r.passes} passes, "
      f"{len(tops) / int(r.n_iter):.0f} per update, {sum(total.values()) / 1e3:.1f} ms in them")
print(collections.Counter(ev.name for ev in tops).most_common(12))
