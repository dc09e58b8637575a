"""Per size and revision: the range of SROTLoss()'s time over the runs, GeomLoss's, their ratio, updates and value:
python summary.py ab.jsonl"""
import json
import sys
from collections import defaultdict

rows = defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    rows[(r.get("reach") or 0, r["n"], r["d"], r["label"])].append(r)
print("| reach | n, d | revision | SROTLoss() ms | SamplesLoss() ms | ratio | updates | value |")
print("|---|---|---|---|---|---|---|---|")
for (reach, n, d, label), rs in sorted(rows.items(), key=lambda kv: (*kv[0][:3], kv[0][3] == "new")):
    s = sorted(r["srot_ms"] for r in rs)
    g = sorted(r["geomloss_ms"] for r in rs)
    q = sorted(r["srot_ms"] / r["geomloss_ms"] for r in rs)
    upd = sorted({r["updates"] for r in rs})
    val = sorted({f"{r['value']:.8g}" for r in rs})
    print(f"| {reach or '-'} | {n}, {d} | {label} | {s[0]:.1f}-{s[-1]:.1f} | {g[0]:.1f}-{g[-1]:.1f} | "
          f"{q[0]:.2f}-{q[-1]:.2f}x | {','.join(map(str, upd))} | {','.join(val)} |")
