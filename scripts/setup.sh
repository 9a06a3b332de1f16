#!/usr/bin/env bash
# Installs what building and running rdmastream needs on a fresh Debian 12 machine (idempotent,
# quiet; only missing Debian packages are installed). The Rust toolchain itself (rustc/cargo
# 1.95) is expected to be installed already.
set -euo pipefail
packages=(
  build-essential pkg-config
  # ibverbs-sys: bindgen (libclang) and the vendored rdma-core build (cmake, libnl); it compiles
  # against the system's libibverbs headers and links libibverbs at run time; ibverbs-providers
  # holds the rxe (Soft-RoCE) and hardware providers.
  cmake clang libclang-dev libibverbs-dev libnl-3-dev libnl-route-3-dev libibverbs1 ibverbs-providers
  # gst-plugin (rdmasink/rdmasrc): gstreamer-rs builds against the -dev packages (gst-check
  # included); gst-launch-1.0 and the elements its tests and gst-bench use: videotestsrc,
  # videoconvert, tcp (base), jpegenc, multifilesink (good), gdppay, shmsink (bad).
  libgstreamer1.0-dev libgstreamer-plugins-base1.0-dev gstreamer1.0-tools
  gstreamer1.0-plugins-base gstreamer1.0-plugins-good gstreamer1.0-plugins-bad
  # integration/tests/netfaults.rs: network namespaces (ip) and packet loss (nft).
  iproute2 nftables
  # scripts/k8s-validate.sh and scripts/compose-demo.sh: PyPI tools (kubernetes-validate,
  # yamllint, podman-compose) in a venv; curl for the compose demo's status-page check.
  python3-venv curl
  # integration/tests/status_page.rs: the receiver's status page in headless Chromium.
  chromium
  # bench plot (scripts/paper.sh): the font of the figures' labels.
  fonts-dejavu-core
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [ "$(id -u)" = 0 ]; then
    echo "setup: installing ${missing[*]}" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "setup: please install (as root): apt-get install ${missing[*]}" >&2
    exit 1
  fi
fi
# A stale font cache is rebuilt by Chromium's first start, inside the browser test (one first
# start there took minutes; the cache is a likely cause). Build it here. Fast when up to date.
if command -v fc-cache >/dev/null 2>&1; then fc-cache >/dev/null 2>&1 || true; fi
command -v cargo >/dev/null 2>&1 || { echo "setup: cargo (Rust 1.95) is required" >&2; exit 1; }
