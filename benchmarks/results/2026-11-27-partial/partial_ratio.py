"""Partial OT (mass 0.5) against balanced OT on the same data, from grid_tree.py runs: updates to tol 1e-4 per
case and the cases over 2x.

    python partial_ratio.py RUN.json [RUN2.json ...] > table.md
"""
import json
import sys


def main(paths):
    rows = {}
    for path in paths:
        for r in json.load(open(path))["rows"]:
            rows[(r["d"], r["n"], r["p"], r["penalty"], r["ratio"], r["offsets"])] = r["n_iter"]
    print("| d | n | p | blur/diam | offsets | balanced | partial | partial / balanced |")
    print("|---|---|---|---|---|---|---|---|")
    over = 0
    for k in sorted(rows):
        if k[3] != "partial":
            continue
        balanced, partial = rows[(*k[:3], "balanced", *k[4:])], rows[k]
        over += partial > 2 * balanced
        print(f"| {k[0]} | {k[1]} | {k[2]} | {k[4]:g} | {'yes' if k[5] else 'no'} | {balanced} | {partial} | "
              f"{partial / balanced:.2f} |")
    print(f"\nCases over 2x: {over}.")


if __name__ == "__main__":
    main(sys.argv[1:])
