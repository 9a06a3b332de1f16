#!/usr/bin/env bash
# Runs every check and test: formatting, clippy with warnings as errors, and the whole test suite
# (unit, simulator, in-process engine, and the real sender/receiver processes over tcp).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --release -- -D warnings
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
cargo test --workspace --release 2>&1 | tee "$log"
# One closing line over every test binary (cargo prints one per binary, doc-tests last).
awk '/^test result:/ { p += $4; f += $6 } END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
