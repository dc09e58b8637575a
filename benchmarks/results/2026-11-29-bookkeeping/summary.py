"""Per size and revision: the range of SROTLoss()'s time over the runs, GeomLoss's, their ratio, updates and value:
python summary.py ab.jsonl"""
import json
import sys
from collections import defaultdict

rows = defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    rows[(str(r.get("reach") or "-"), r["n"], r["d"], r["label"])].append(r)
print("| reach | n, d | revision | SROTLoss() ms | SamplesLoss() ms | ratio | updates | value |")
print("|---|---|---|---|---|---|---|---|")
for (reach, n, d, label), rs in sorted(rows.items(), key=lambda kv: (*kv[0][:3], kv[0][3] == "new")):
    s = sorted(r["srot_ms"] for r in rs)
    g = sorted(r["geomloss_ms"] or 0.0 for r in rs)
    q = sorted(r["srot_ms"] / r["geomloss_ms"] if r["geomloss_ms"] else 0.0 for r in rs)
    upd = sorted({r["updates"] for r in rs})
    val = sorted({f"{r['value']:.8g}" for r in rs})
    peer, ratio = (f"{g[0]:.1f}-{g[-1]:.1f}", f"{q[0]:.2f}-{q[-1]:.2f}x") if g[0] else ("-", "-")
    print(f"| {reach} | {n}, {d} | {label} | {s[0]:.1f}-{s[-1]:.1f} | {peer} | {ratio} | {','.join(map(str, upd))} | "
          f"{','.join(val)} |")
