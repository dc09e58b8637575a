"""Every Anderson step of the seed 1 partial problem with offsets, as given: (error, best error before the step,
dual objective, its best before the step, history entries after the step). ``python trace.py OUT.json``."""
import json
import sys

import torch
from problems import safeguard_problem, solve

import srot_fast._anderson as anderson

torch.set_num_threads(1)
log = []
real_step = anderson.Anderson.step


def step(self, g, g_hat, err, done, value=None):
    best, top = float(self.best[0]), float(self.top[0])
    out = real_step(self, g, g_hat, err, done, value)
    log.append((float(err[0]), best, None if value is None else float(value[0]), top, int(self.valid[0].sum())))
    return out


anderson.Anderson.step = step
res = solve(*safeguard_problem(1), "partial")
print("updates", int(res.n_iter), "steps logged", len(log))
with open(sys.argv[1], "w") as f:
    json.dump(log, f)
