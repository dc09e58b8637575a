"""Compare two grid_tree.py outputs case by case: python cmpgrid.py BEFORE.json AFTER.json"""
import json
import sys


def load(path):
    d = json.load(open(path))
    rows = d["rows"] if isinstance(d, dict) else d
    return {(r["p"], r["penalty"], r["d"], r["ratio"], r["n"], r["offsets"]): r for r in rows}


A, B = load(sys.argv[1]), load(sys.argv[2])
ta = tb = 0
for k in A:
    a, b = A[k]["n_iter"], B[k]["n_iter"]
    ta, tb = ta + a, tb + b
    if a != b:
        print(k, a, "->", b, "conv", B[k]["converged"])
print("total", ta, "->", tb, "unconverged", sum(not r["converged"] for r in B.values()))
