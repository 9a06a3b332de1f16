#!/usr/bin/env bash
# Runs every check and test: formatting, clippy with warnings as errors, and the whole test suite
# (unit, simulator, in-process engine, and the real sender/receiver processes over tcp).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --release -- -D warnings
cargo test --workspace --release
