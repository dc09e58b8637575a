"""Seconds per soft-min pass against n (log-log), dense `cpu` and `blocksparse`, from bench_blocksparse.py's
``pass`` rows: ``python plot.py pass_p2.json pass_p1.json`` writes pass_vs_n.png beside this file, with the
O(n) and O(n^2) slopes drawn through the first block-sparse and the first dense point."""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(paths):
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    styles = {2: "-", 1: "--"}
    for path in paths:
        rows = [r for r in json.load(open(path))["rows"] if r["kind"] == "pass"]
        for p in sorted({r["p"] for r in rows}):
            rs = sorted((r for r in rows if r["p"] == p), key=lambda r: r["n"])
            dense = [(r["n"], r["dense_s"]) for r in rs if "dense_s" in r]
            sparse = [(r["n"], r["sparse_s"]) for r in rs]
            ax.plot(*zip(*dense), styles[p], marker="o", color="tab:red", label=f"dense cpu, p = {p}")
            ax.plot(*zip(*sparse), styles[p], marker="s", color="tab:blue", label=f"blocksparse, p = {p}")
            if p == 2:
                n0, t0 = sparse[0]
                n1 = sparse[-1][0]
                ax.plot([n0, n1], [t0, t0 * n1 / n0], ":", color="gray", label="O(n) from the first point")
                m0, s0 = dense[0]
                ax.plot([m0, n1], [s0, s0 * (n1 / m0) ** 2], "-.", color="gray", label="O(n^2) from the first point")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("n = m (points per cloud)")
    ax.set_ylabel("seconds per soft-min pass")
    ax.set_title("One pass, 2-D, blur = 0.01 x diameter, h = log b (2 CPU cores)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pass_vs_n.png")
    fig.savefig(out, dpi=120)
    print("wrote", out)


if __name__ == "__main__":
    main(sys.argv[1:])
