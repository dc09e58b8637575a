"""Update counts of two grid_tree.py JSON files: every unbalanced / partial case and every changed one, then
summaries over the unbalanced / partial cases.

    python changed.py OLD.json NEW.json
"""
import json
import statistics
import sys


def load(path):
    rows = json.load(open(path))["rows"]
    return {(r["p"], r["penalty"], r["d"], r["ratio"], r["n"], r["offsets"]): r for r in rows}


def main(old_path, new_path):
    old, new = load(old_path), load(new_path)
    ratios = []
    for key in sorted(set(old) & set(new), key=str):
        o, n = old[key], new[key]
        if o["n_iter"] != n["n_iter"] or o["penalty"] != "balanced":
            dv = abs(o["value"] - n["value"]) / abs(o["value"])
            print(key, o["n_iter"], "->", n["n_iter"], "conv", n["converged"], f"dv {dv:.1e}")
        if key[1] != "balanced":
            ratios.append(o["n_iter"] / n["n_iter"])
    print("unbalanced cases", len(ratios), "median old/new", statistics.median(ratios), "min", min(ratios),
          "max", max(ratios))
    unbalanced = [k for k in set(old) & set(new) if k[1] != "balanced"]
    print("sum old", sum(old[k]["n_iter"] for k in unbalanced), "sum new", sum(new[k]["n_iter"] for k in unbalanced))


if __name__ == "__main__":
    main(*sys.argv[1:3])
