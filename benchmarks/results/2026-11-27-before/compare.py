"""Markdown comparison of two grid_tree.py runs: updates to tol 1e-4 of the earlier loop against the current one.

    python compare.py BEFORE.json AFTER.json [BEFORE2.json AFTER2.json ...] > table.md
"""
import json
import statistics
import sys
from collections import defaultdict


def key(r):
    return (r["d"], r["n"], r["p"], r["penalty"], r["ratio"], r["offsets"])


def main(paths):
    pairs = []
    for i in range(0, len(paths), 2):
        before = {key(r): r for r in json.load(open(paths[i]))["rows"]}
        after = {key(r): r for r in json.load(open(paths[i + 1]))["rows"]}
        pairs += [(k, before[k], after[k]) for k in before if k in after]
    print("| d | n | p | penalty | blur/diam | offsets | before: updates | after: updates | before / after | "
          "value rel. diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    groups = defaultdict(list)
    for k, b, a in sorted(pairs):
        ib = b["n_iter"] if b["converged"] else None
        ia = a["n_iter"] if a["converged"] else None
        ratio = ib / ia if ib and ia else None
        vd = abs(b["value"] - a["value"]) / abs(a["value"]) if b["value"] is not None and a["value"] else None
        cap = lambda r: str(r["n_iter"]) if r["converged"] else f"{r['n_iter']} (not converged)"  # noqa: E731
        print(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {k[4]} | {'yes' if k[5] else 'no'} | {cap(b)} | {cap(a)} | "
              f"{'' if ratio is None else f'{ratio:.2f}'} | {'' if vd is None else f'{vd:.1e}'} |")
        # a capped 'before' run counts with its cap as a lower bound of its updates
        r = (b["n_iter"] / a["n_iter"]) if a["converged"] else None
        for g in ("all", f"d={k[0]}", f"blur/diam={k[4]}", f"penalty={k[3]}", f"p={k[2]}",
                  f"offsets={'yes' if k[5] else 'no'}"):
            if r is not None:
                groups[g].append(r)
    print()
    print("| group | cases | median before / after | min | max | cases after > before |")
    print("|---|---|---|---|---|---|")
    for g, rs in groups.items():
        print(f"| {g} | {len(rs)} | {statistics.median(rs):.2f} | {min(rs):.2f} | {max(rs):.2f} | "
              f"{sum(1 for r in rs if r < 1)} |")


if __name__ == "__main__":
    main(sys.argv[1:])
