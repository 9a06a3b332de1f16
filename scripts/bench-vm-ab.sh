#!/usr/bin/env bash
# Benchmark over verbs in the Soft-RoCE VM, before and after: builds the bench binaries of an
# older commit (in a throwaway worktree) beside this tree's, and runs both in one VM boot,
# interleaved, so the figures of the two can be compared row by row despite a noisy host.
#   scripts/bench-vm-ab.sh <commit>     e.g. scripts/bench-vm-ab.sh 09fa542
set -euo pipefail
cd "$(dirname "$0")/.."
before=${1:?usage: scripts/bench-vm-ab.sh <commit>}
scripts/setup.sh
scripts/vm.sh prepare
wt=$(mktemp -d /tmp/rdmastream-before.XXXXXX)
trap 'git worktree remove --force "$wt" >/dev/null 2>&1 || true' EXIT
git worktree add -q --detach "$wt" "$before"
# Its own target directory, kept between runs (a second run of the same commit builds nothing).
before_target=${TMPDIR:-/tmp}/rdmastream-before-target
(cd "$wt" && CARGO_TARGET_DIR="$before_target" cargo build --release --quiet -p rdmastream-bench --bins)
cargo build --release --quiet -p rdmastream-bench --bins
# The VM has its own /tmp: the binaries go where it sees them (the working tree is shared).
mkdir -p target/ab/before target/ab/after
cp "$before_target/release/"{bench,gst-bench} target/ab/before/
cp target/release/{bench,gst-bench} target/ab/after/
cat > target/ab/run.sh <<'INNER'
for v in before after before after; do
  echo "=== $v: bench verbs"
  target/ab/$v/bench verbs --seconds 1 2>&1 | grep -E '^ +[0-9]+ (B|KiB|MiB) +[0-9]'
done
for v in before after after before; do
  echo "=== $v: gst-bench --transport verbs"
  target/ab/$v/gst-bench --transport verbs --seconds 5 2>&1 | grep -E '^\||÷'
done
INNER
scripts/vm.sh run --timeout "${RDMASTREAM_VM_TIMEOUT:-2400}" -- bash target/ab/run.sh
