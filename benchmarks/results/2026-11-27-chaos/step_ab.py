"""Time of one Anderson step, two versions of srot_fast/_anderson.py interleaved (one thread):
``python step_ab.py OLD_ANDERSON.py NEW_ANDERSON.py``; best of 6 x 50 steps on random potentials."""
import importlib.util
import sys
import time

import torch

torch.set_num_threads(1)


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


old, new = load(sys.argv[1], "a_old"), load(sys.argv[2], "a_new")
for B, M in [(1, 256), (1, 1000), (64, 256)]:
    res = {"old": [], "new": []}
    gen = torch.Generator().manual_seed(0)
    g0 = torch.randn(B, M, generator=gen)
    mask, done = torch.ones(B, M, dtype=torch.bool), torch.zeros(B, dtype=torch.bool)
    images = [g0 + 0.01 * torch.randn(B, M, generator=gen) for _ in range(50)]
    errors = [torch.rand(B, generator=gen) * 1e-3 for _ in range(50)]
    for _ in range(6):
        for name, mod in (("old", old), ("new", new)):
            state, g = mod.Anderson(B, g0, mask), g0
            for i in range(10):
                g = state.step(g, images[i], errors[i], done)
            t0 = time.perf_counter()
            for i in range(50):
                g = state.step(g, images[i], errors[i], done)
            res[name].append((time.perf_counter() - t0) / 50 * 1e6)
    print(f"B={B} M={M}: old {min(res['old']):.0f} us, new {min(res['new']):.0f} us per step (best of 6 x 50)")
