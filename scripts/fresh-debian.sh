#!/usr/bin/env bash
# scripts/fresh-debian.sh [COMMAND] - tries the README's first command as a newcomer would: on a
# fresh Debian 12 that has nothing but the Rust toolchain. A clean clone of this checkout's HEAD
# runs in a debian:bookworm container (made with debootstrap by scripts/compose-demo.sh's step
# when it is missing; nothing can be pulled here) that sees only the Rust 1.95 toolchain of this
# machine, read-only, and the network (Debian's mirror and crates.io). COMMAND (default
# scripts/demo.sh) runs there as root, so every package it needs must be installed by the
# project's own scripts. The container's build is from scratch: about 4 minutes in all here.
# Exits with COMMAND's status; after a failure (or with RDMASTREAM_FRESH_KEEP=1) the clone and
# its output stay in the directory it prints. scripts/test.sh runs it with a 5 s demo.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd -P)"
cmd="${1:-scripts/demo.sh}"
engine="$(command -v podman || command -v docker || true)"
[ -n "$engine" ] || { echo "fresh-debian: podman or docker is needed" >&2; exit 1; }
# As for the compose demo: runc, and a nofile default under this machine's hard limit.
export CONTAINERS_CONF="$root/deploy/compose/containers.conf"
toolchain="$(rustc --print sysroot)"
[ -x "$toolchain/bin/cargo" ] || { echo "fresh-debian: no cargo next to rustc in $toolchain" >&2; exit 1; }
if ! "$engine" image exists docker.io/library/debian:bookworm 2>/dev/null; then
  echo "fresh-debian: no debian:bookworm image; scripts/compose-demo.sh makes one (debootstrap)" >&2
  exit 1
fi
work="$(mktemp -d /tmp/rdmastream-fresh.XXXXXX)"
git clone -q "$root" "$work/src"
echo "== fresh Debian 12 container, clone of $(git rev-parse --short HEAD) in $work/src: $cmd"
start=$SECONDS
rc=0
# This machine's certificate authorities ride along (read-only, beside the container's own):
# where the way out goes through a proxy with its own CA, cargo needs it to reach crates.io.
ca=()
bundle="${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}"
if [ -f "$bundle" ]; then
  ca=(-v "$bundle:/opt/host-ca.crt:ro" -e CARGO_HTTP_CAINFO=/opt/host-ca.crt)
fi
"$engine" run --rm --network host "${ca[@]}" \
  -v "$toolchain:/opt/rust:ro" -v "$work/src:/src" -w /src \
  -e PATH=/opt/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  -e CARGO_HOME=/root/.cargo docker.io/library/debian:bookworm \
  bash -c "$cmd" || rc=$?
if [ "$rc" = 0 ] && [ -z "${RDMASTREAM_FRESH_KEEP:-}" ]; then
  # Its build (about 1.5 GB) is of no further use; RDMASTREAM_FRESH_KEEP=1 keeps it.
  rm -rf "$work"
  echo "== $cmd in the fresh container: exit 0 after $((SECONDS - start)) s"
else
  echo "== $cmd in the fresh container: exit $rc after $((SECONDS - start)) s (clone and output: $work/src)"
fi
exit "$rc"
