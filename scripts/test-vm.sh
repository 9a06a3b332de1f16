#!/usr/bin/env bash
# Runs the process-level integration tests over real RDMA verbs: Soft-RoCE (rdma_rxe) inside a
# throwaway qemu VM (scripts/vm.sh), with host-built binaries, fewer and smaller frames than on
# the host (the VM runs under software CPU emulation). Installs what it needs on a fresh
# Debian 12 machine (through scripts/vm.sh prepare).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/vm.sh prepare
cargo build --release --quiet -p rdmastream-sender -p rdmastream-receiver
# Build the test executable on the host (cargo cannot run inside the VM) and find it.
exe="$(cargo test --release -p rdmastream-integration --test processes --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "processes":
        print(m["executable"])')"
[ -x "$exe" ] || { echo "test-vm: could not build the integration test executable" >&2; exit 1; }
echo "== integration tests over verbs (Soft-RoCE rxe0 in a VM): $exe"
scripts/vm.sh run --timeout "${RDMASTREAM_VM_TIMEOUT:-1200}" -- \
  env RDMASTREAM_PREBUILT=1 RDMASTREAM_IT_TRANSPORT=verbs RDMASTREAM_IT_HOST=192.0.2.1 RUST_BACKTRACE=1 \
  "$exe" --test-threads=1
