import json, sys
A, B = sys.argv[1], sys.argv[2]
tot = [0, 0]
for cfg in ("d2", "d64", "n4000"):
    ra = json.load(open(f"{A}_{cfg}.json"))["rows"]; rb = json.load(open(f"{B}_{cfg}.json"))["rows"]
    for x, y in zip(ra, rb):
        k = (x["p"], x["penalty"], x["d"], x["ratio"], x["n"], x["offsets"])
        assert k == tuple(y[c] for c in ("p", "penalty", "d", "ratio", "n", "offsets"))
        tot[0] += x["n_iter"]; tot[1] += y["n_iter"]
        if x["n_iter"] != y["n_iter"]:
            print(cfg, k, x["n_iter"], "->", y["n_iter"], "conv", y["converged"], f"dvalue {abs(x['value']-y['value'])/abs(x['value']):.1e}")
print("total", tot)
