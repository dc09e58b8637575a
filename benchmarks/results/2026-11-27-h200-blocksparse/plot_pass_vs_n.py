"""pass_vs_n.png from call2_pass_vs_n.json (this folder): time of one soft-min pass against n = m, 2-D."""
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

here = os.path.dirname(os.path.abspath(__file__))
rows = [r for r in json.load(open(os.path.join(here, "call2_pass_vs_n.json")))["rows"]
        if r.get("d") == 2 and "dense_pass_s" in r]
n = [r["n"] for r in rows]
fig, ax = plt.subplots(figsize=(5, 3.6))
ax.loglog(n, [r["dense_pass_s"] for r in rows], "o-", label="dense Triton pass")
ax.loglog(n, [r["sparse_pass_s"] for r in rows], "s-", label="block-sparse pass (pruning reused)")
ax.loglog(n, [r["pruning_s"] for r in rows], "^--", label="one pruning")
ax.loglog(n, [r["dense_pass_s"] * 1e4 ** 2 / (n[0] * r["n"]) * n[0] / 1e4 for r in rows], ":", color="gray",
          label="O(n^2) through the first point")
ax.set_xlabel("n = m (2-D, blur = 0.01 x diameter, p = 2)")
ax.set_ylabel("seconds")
ax.set_title("One soft-min pass, NVIDIA H200, float32")
ax.legend(fontsize=7)
fig.tight_layout()
fig.savefig(os.path.join(here, "pass_vs_n.png"), dpi=110)
