"""Cases whose update count differs between two sets of grid files (TAG_d2 / _d64 / _n4000.json), and totals.

    python compare.py base gap
"""
import json
import sys

KEYS = ("p", "penalty", "d", "ratio", "n", "offsets")
old, new = sys.argv[1], sys.argv[2]
total = [0, 0]
for cfg in ("d2", "d64", "n4000"):
    rows_a = json.load(open(f"{old}_{cfg}.json"))["rows"]
    rows_b = json.load(open(f"{new}_{cfg}.json"))["rows"]
    for x, y in zip(rows_a, rows_b):
        key = tuple(x[c] for c in KEYS)
        assert key == tuple(y[c] for c in KEYS)
        total[0] += x["n_iter"]
        total[1] += y["n_iter"]
        if x["n_iter"] != y["n_iter"]:
            rel = abs(x["value"] - y["value"]) / abs(x["value"])
            print(cfg, key, x["n_iter"], "->", y["n_iter"], "conv", y["converged"], f"dvalue {rel:.1e}")
print("total", total)
