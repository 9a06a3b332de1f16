#!/usr/bin/env bash
# Installs what building rdmastream needs on a fresh Debian 12 machine (idempotent, quiet).
# The Rust toolchain itself (rustc/cargo 1.95) is expected to be installed already.
set -euo pipefail
need=()
command -v cc >/dev/null 2>&1 || need+=(build-essential)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
if ((${#need[@]})); then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "setup: please install: ${need[*]}" >&2
    exit 1
  fi
fi
command -v cargo >/dev/null 2>&1 || { echo "setup: cargo (Rust 1.95) is required" >&2; exit 1; }
