#!/usr/bin/env bash
# Benchmark over real RDMA verbs on Soft-RoCE in a throwaway VM (a command that prints figures,
# not a test): our data path for block sizes 64 B .. 8 MiB next to ib_write_bw, and our sync
# (status READ) latency for N = 3..64 status bytes next to ib_read_lat, on the same rxe device
# in the same run, with the ratios.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/vm.sh prepare
cargo build --release --quiet -p rdmastream-bench
# `scripts/bench-vm.sh` runs both tables in one VM boot; `scripts/bench-vm.sh verbs-sync --rounds 7`
# only the sync latency, with more rounds.
#
# The sync latency is measured with the process (ours and perftest alike) pinned to one vCPU:
# unpinned, a thread that moves between the VM's two TCG vCPUs costs tens of microseconds, and
# whole 1000-READ runs come out at 70-100 us instead of 40 us, for ours and ib_read_lat both.
if [ $# -eq 0 ]; then
  scripts/vm.sh run --timeout "${RDMASTREAM_VM_TIMEOUT:-1800}" -- bash -c \
    'target/release/bench verbs --seconds "$1" && taskset -c 1 target/release/bench verbs-sync --rounds 3' \
    _ "${SECONDS_PER_POINT:-1}"
else
  scripts/vm.sh run --timeout "${RDMASTREAM_VM_TIMEOUT:-1800}" -- taskset -c 1 target/release/bench "$@"
fi
