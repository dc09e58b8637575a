"""Markdown tables from pytest-benchmark JSON files of bench_primitives.py, bench_sinkhorn.py and
bench_memory.py (used to write benchmarks/README.md).

Run: ``python benchmarks/report.py prim.json sinkhorn.json memory.json`` (any subset, any order).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def _fmt(v) -> str:
    if isinstance(v, str):
        return v
    if v is None:
        return "-"
    return f"{v:.3g}"


def primitives(rows) -> str:
    """pairs/s per (n, d, p) and backend, with ratios to the fused C loop and to raw KeOps."""
    table = defaultdict(dict)
    backends = []
    for r in rows:
        key = (r["n"], r["d"], r["p"])
        table[key][r["backend"]] = r.get("pairs_per_s")
        if r["backend"] not in backends:
            backends.append(r["backend"])
    order = [b for b in ("cpu", "fused_c", "cpu_torch", "keops", "keops_raw", "tensorized", "triton") if b in backends]
    head = "| n = m | d | p | " + " | ".join(order) + " | cpu / fused_c | cpu / keops_raw |"
    lines = [head, "|" + "---|" * (len(order) + 5)]
    for key in sorted(table):
        vals = table[key]

        def ratio(a, b, vals=vals):
            x, y = vals.get(a), vals.get(b)
            return f"{x / y:.2f}" if isinstance(x, float) and isinstance(y, float) else "-"

        cells = [_fmt(vals.get(b)) for b in order]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells)
                     + f" | {ratio('cpu', 'fused_c')} | {ratio('cpu', 'keops_raw')} |")
    return "pairs / s (median), float32 softmin\n\n" + "\n".join(lines)


def sinkhorn(rows) -> str:
    """Seconds per loss + gradient per n and solver, ratios to GeomLoss online."""
    table = defaultdict(dict)
    cols = []
    overhead = defaultdict(dict)
    for r in rows:
        if "variant" in r:  # rows of an older layout of test_offsets_overhead
            continue
        if r.get("overhead"):
            overhead[r["n"]] = {k[len("seconds_"):]: v for k, v in r.items() if k.startswith("seconds_")}
            continue
        col = f"{r['solver']}:{r['backend']}"
        table[r["n"]][col] = r.get("seconds_median")
        if col not in cols:
            cols.append(col)
    lines = ["| n = m | " + " | ".join(cols) + " | geomloss online / srot cpu | geomloss online / srot keops |",
             "|" + "---|" * (len(cols) + 3)]
    for n in sorted(table):
        vals = table[n]

        def ratio(a, b, vals=vals):
            x, y = vals.get(a), vals.get(b)
            return f"{x / y:.2f}" if isinstance(x, float) and isinstance(y, float) else "-"

        gl = "geomloss:online"
        lines.append(f"| {n} | " + " | ".join(_fmt(vals.get(c)) for c in cols)
                     + f" | {ratio(gl, 'srot_fast:cpu')} | {ratio(gl, 'srot_fast:keops')} |")
    out = "seconds per loss + gradient (median; debias off)\n\n" + "\n".join(lines) if table else ""
    if overhead:
        out += "\n\nsoft-offset overhead, backend cpu (seconds; ratio to no offsets)\n\n"
        out += "| n = m | none | soft, gamma fixed | soft, gamma = max C |\n|---|---|---|---|\n"
        for n in sorted(overhead):
            v = overhead[n]
            base = v.get("none")
            cells = []
            for k in ("none", "soft_fixed_gamma", "soft_gamma_max_cost"):
                x = v.get(k)
                cells.append(f"{_fmt(x)} ({x / base:.3f})" if isinstance(x, float) and isinstance(base, float)
                             else _fmt(x))
            out += f"| {n} | " + " | ".join(cells) + " |\n"
    return out


def memory(rows) -> str:
    """Peak RSS before / after one loss + gradient per backend and n (rows of bench_memory.py)."""
    lines = ["| backend | n = m | seconds | RSS before (MiB) | RSS peak (MiB) | growth (MiB) | N x M float32 (MiB) |",
             "|---|---|---|---|---|---|---|"]
    mib = 2.0**20
    for r in rows:
        if "growth_bytes" not in r:
            continue
        lines.append(f"| {r['backend']} | {r['n']} | {r['seconds']:.1f} | {r['rss_before_bytes'] / mib:.0f} | "
                     f"{r['rss_peak_bytes'] / mib:.0f} | {r['growth_bytes'] / mib:.1f} | "
                     f"{r['dense_nm_float32_bytes'] / mib:.0f} |")
    return "peak RSS, SROTLoss soft KL p = 1 (debias off) loss + gradient\n\n" + "\n".join(lines)


def main(paths) -> None:
    """Rows of every file, grouped by kind (primitives / sinkhorn / memory); for the same case, a later file
    replaces an earlier one (re-runs of a subset)."""
    kinds = {"primitives": {}, "sinkhorn": {}, "memory": {}}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for b in data.get("benchmarks", []):
            row = dict(b.get("extra_info", {}))
            row.setdefault("seconds_median", b["stats"]["median"])
            kind = ("memory" if "growth_bytes" in row else
                    "primitives" if row.get("primitive") == "softmin" else "sinkhorn")
            kinds[kind][b["name"]] = row
    for kind, fn in (("primitives", primitives), ("sinkhorn", sinkhorn), ("memory", memory)):
        if kinds[kind]:
            print(fn(list(kinds[kind].values())))
            print()


if __name__ == "__main__":
    main(sys.argv[1:])
