"""Markdown table of store_limit.py's JSON lines: python summary.py FILE [FILE ...]."""
import collections
import json
import sys

print("| threads | n | reach | limit | ms (per round) | updates | value |")
print("|---|---|---|---|---|---|---|")
for f in sys.argv[1:]:
    rows = collections.defaultdict(list)
    for line in open(f):
        r = json.loads(line)
        rows[(r["threads"], r["n"], str(r["reach"]), r["limit"])].append(r)
    for (t, n, reach, lim), rs in sorted(rows.items()):
        print(f"| {t} | {n} | {reach} | 2^{lim.bit_length() - 1} | {', '.join('%.1f' % r['ms'] for r in rs)} | "
              f"{rs[0]['updates']} | {rs[0]['value']:.9g} |")
