#!/usr/bin/env bash
# Builds bench binaries of an older commit (in a throwaway worktree) and of this tree, and puts
# them side by side in target/ab/before and target/ab/after, for the A/B scripts
# (bench-cpu-ab.sh, bench-vm-ab.sh) to run in turn.
#   scripts/build-before.sh <commit> <bin>...     e.g. scripts/build-before.sh fd1eaf9 bench
set -euo pipefail
cd "$(dirname "$0")/.."
before=${1:?usage: scripts/build-before.sh <commit> <bin>...}
shift
(($#)) || { echo "build-before: name at least one binary of rdmastream-bench" >&2; exit 2; }
bins=()
for b; do bins+=(--bin "$b"); done
wt=$(mktemp -d /tmp/rdmastream-before.XXXXXX)
trap 'git worktree remove --force "$wt" >/dev/null 2>&1 || true' EXIT
git worktree add -q --detach "$wt" "$before"
# Its own target directory, kept between runs (a second run of the same commit builds nothing).
before_target=${TMPDIR:-/tmp}/rdmastream-before-target
(cd "$wt" && CARGO_TARGET_DIR="$before_target" cargo build --release --quiet -p rdmastream-bench "${bins[@]}")
cargo build --release --quiet -p rdmastream-bench "${bins[@]}"
mkdir -p target/ab/before target/ab/after
for b; do
  cp "$before_target/release/$b" target/ab/before/
  cp "target/release/$b" target/ab/after/
done
