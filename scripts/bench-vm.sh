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
scripts/vm.sh run --timeout "${RDMASTREAM_VM_TIMEOUT:-1800}" -- target/release/bench verbs --seconds "${SECONDS_PER_POINT:-1}"
