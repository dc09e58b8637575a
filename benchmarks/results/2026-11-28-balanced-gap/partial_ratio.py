"""Updates of partial OT (mass 0.5) over those of balanced OT on the same data without offsets, per grid case.

    python partial_ratio.py base gap
"""
import json
import sys

for tag in sys.argv[1:]:
    out = []
    for cfg in ("d2", "d64", "n4000"):
        rows = json.load(open(f"{tag}_{cfg}.json"))["rows"]
        idx = {(r["p"], r["penalty"], r["d"], r["ratio"], r["n"], r["offsets"]): r["n_iter"] for r in rows}
        for (p, pen, d, ratio, n, off), it in idx.items():
            if pen == "partial":
                bal = idx[(p, "balanced", d, ratio, n, False)]
                out.append((it / bal, p, d, ratio, n, off, it, bal))
    out.sort(reverse=True)
    print(tag, "over 2x:", [(f"{o[0]:.2f}", *o[1:]) for o in out if o[0] > 2])
    print(tag, "max without offsets:", max(o[0] for o in out if not o[5]))
