"""Compare two small.py outputs: python cmp.py ACCELERATED.json PLAIN.json"""
import json
import sys

A = json.load(open(sys.argv[1]))
P = json.load(open(sys.argv[2]))
for k in A:
    a, p = A[k], P[k]
    unc = sum(not c for _, c in a)
    unc_pc = sum((not ca) and cp for (_, ca), (_, cp) in zip(a, p))
    slow = sum(ca and cp and na > 3 * np_ for (na, ca), (np_, cp) in zip(a, p))
    print(f"{k}: updates {sum(n for n, _ in a)} (plain {sum(n for n, _ in p)}), unconverged {unc} "
          f"(plain {sum(not c for _, c in p)}), unconv where plain conv {unc_pc}, >3x plain {slow}")
