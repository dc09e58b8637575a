"""grid_tree.py (../2026-11-27-before/) with the loop's SCALE_TOL and SCALE_CAP overridden, on this repository.

    OMP_NUM_THREADS=1 python grid_scale.py TOL CAP OUT.json [grid_tree.py's options]
"""
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.join(HERE, "..", "..", "..")
sys.path.insert(0, REPO)
import srot_fast._loop as loop  # noqa: E402

loop.SCALE_TOL, loop.SCALE_CAP = float(sys.argv[1]), int(sys.argv[2])
sys.argv = ["grid_tree.py", REPO, sys.argv[3], *sys.argv[4:]]
runpy.run_path(os.path.join(HERE, "..", "2026-11-27-before", "grid_tree.py"), run_name="__main__")
