"""The batched solve (bench_convergence.py's ``batch_case``) with the current Anderson step or an older one.

    git show eef5a37:srot_fast/_anderson.py > /tmp/anderson_eef5a37.py
    for v in old new old new old new; do python batch_ab.py $v /tmp/anderson_eef5a37.py >> batch_ab.jsonl; done

``old`` swaps the loop's Anderson class for the one in the given file (the step before its Gram matrix was kept
up to date); ``new`` runs the code as it is. One JSON line per run: bench_convergence.py's batch fields.
"""
import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
from bench_convergence import batch_case  # noqa: E402

import srot_fast._loop as loop  # noqa: E402

if sys.argv[1] == "old":
    spec = importlib.util.spec_from_file_location("anderson_old", sys.argv[2])
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    loop.Anderson = old.Anderson
row = batch_case()
print(json.dumps(dict(anderson=sys.argv[1], **row)), flush=True)
