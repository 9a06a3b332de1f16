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
# The VM has its own /tmp: the binaries go to target/ab/, where it sees them (the working tree
# is shared).
scripts/build-before.sh "$before" bench gst-bench
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
