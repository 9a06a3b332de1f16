#!/usr/bin/env bash
# The paper's evaluation (section 4, Figures 10-19; a command that prints figures, not a test):
# `bench paper` runs every experiment for each mechanism in the same run, over tcp on this host
# and over verbs on Soft-RoCE in a throwaway VM (with perftest on the same rxe device as the
# ceiling), and writes a CSV per figure and summary.csv; `bench plot` draws the PNGs.
#
#   scripts/paper.sh [OUT]        # default docs/evaluation: OUT/tcp and OUT/verbs
#   PAPER_QUICK=1 scripts/paper.sh /tmp/paper   # every experiment briefly (what CI runs)
#   PAPER_ONLY=tcp|verbs scripts/paper.sh       # one of the two
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
out="${1:-docs/evaluation}"
quick=()
[ -n "${PAPER_QUICK:-}" ] && quick=(--quick)
cargo build --release --quiet -p rdmastream-bench
mkdir -p "$out"
if [ "${PAPER_ONLY:-tcp}" = tcp ] || [ -z "${PAPER_ONLY:-}" ]; then
  target/release/bench paper "${quick[@]}" --transport tcp --out "$out/tcp"
  target/release/bench plot "$out/tcp"
fi
if [ "${PAPER_ONLY:-verbs}" = verbs ] || [ -z "${PAPER_ONLY:-}" ]; then
  scripts/vm.sh prepare
  # The VM writes into target/ (shared writable); the results are copied out after.
  vm_out=target/paper-vm
  rm -rf "$vm_out"
  scripts/vm.sh run --timeout "${RDMASTREAM_VM_TIMEOUT:-3600}" -- \
    target/release/bench paper "${quick[@]}" --transport verbs --out "$vm_out"
  rm -rf "$out/verbs"
  cp -r "$vm_out" "$out/verbs"
  target/release/bench plot "$out/verbs"
fi
