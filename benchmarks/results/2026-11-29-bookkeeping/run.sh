#!/usr/bin/env bash
# A/B of two revisions, alternated: bash run.sh BASE_REV OUT.jsonl [ROUNDS]. The working tree is the "new" side.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(git -C "$here" rev-parse --show-toplevel)
base=$(mktemp -d)
git -C "$root" worktree add -q --detach "$base/tree" "$1"
mkdir "$base/pkg"
cp -r "$base/tree/srot_fast" "$base/pkg/srot_fast"
ln -s "$base/tree/kernels" "$base/pkg/srot_fast/kernels"
mkdir "$base/new"
cp -r "$root/srot_fast" "$base/new/srot_fast"
ln -s "$root/kernels" "$base/new/srot_fast/kernels"
for _ in $(seq "${3:-2}"); do
  (cd "$base" && PYTHONPATH="$base/pkg" OMP_NUM_THREADS=1 python "$here/ab.py" "$1") | grep "^{" >> "$2"
  (cd "$base" && PYTHONPATH="$base/new" OMP_NUM_THREADS=1 python "$here/ab.py" new) | grep "^{" >> "$2"
done
git -C "$root" worktree remove --force "$base/tree"
rm -rf "$base"
