#!/usr/bin/env bash
# The B = 64 batch (bench_convergence.py --batch, two threads) of BASE_REV and of the working tree, alternated:
# bash run_batch.sh BASE_REV OUT_PREFIX [ROUNDS] -> OUT_PREFIX_{BASE_REV,new}_{k}.json
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(git -C "$here" rev-parse --show-toplevel)
base=$(mktemp -d)
git -C "$root" worktree add -q --detach "$base/tree" "$1"
mkdir "$base/pkg" "$base/new"
cp -r "$base/tree/srot_fast" "$base/pkg/srot_fast"
ln -s "$base/tree/kernels" "$base/pkg/srot_fast/kernels"
cp -r "$root/srot_fast" "$base/new/srot_fast"
ln -s "$root/kernels" "$base/new/srot_fast/kernels"
for k in $(seq "${3:-2}"); do
  (cd "$base" && PYTHONPATH="$base/pkg" OMP_NUM_THREADS=2 python "$root/benchmarks/bench_convergence.py" --batch \
    --out "$2_$1_$k.json")
  (cd "$base" && PYTHONPATH="$base/new" OMP_NUM_THREADS=2 python "$root/benchmarks/bench_convergence.py" --batch \
    --out "$2_new_$k.json")
done
git -C "$root" worktree remove --force "$base/tree"
rm -rf "$base"
