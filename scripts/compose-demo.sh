#!/usr/bin/env bash
# The compose demo, run and checked: docker-compose.yml (receiver, edge-1 with 12 cameras and 2
# radars, edge-2 with the images source and a 1280x720 camera, the processor) for DURATION
# seconds (first argument, default 20), then `down`, then checks that
#   - every sender's every device arrived, ended its stream and verified against its reference
#     pattern (the receiver's --verify summary), and every container exited 0;
#   - the processor left a playable MP4 per camera (gst-discoverer-1.0: H.264, a duration) and a
#     mosaic.png that decodes, and nothing half-written (no .part file, no temporary frame file);
#   - the receiver's status page, /metrics, /healthz and /readyz answered on 127.0.0.1:8080
#     (RDMASTREAM_STATUS_PORT; another free port when 8080 is taken),
#     when the binaries have --metrics (older ones do not; this says so and skips that check).
# Exits non-zero with a message naming what failed.
#
# With a working Docker engine it uses `docker compose`; otherwise (this project's machines) it
# installs Podman and podman-compose (a venv in target/deploy-venv) and configures Podman as
# shared/CONTAINERS.md says (deploy/compose/containers.conf). No image can be pulled there, so it
# makes the debian:bookworm base image with debootstrap once and keeps it. Re-runs reuse the
# base image, the image layers and the venv.
#
# Output: out/compose/ (RDMASTREAM_OUT): frames/ (the receiver's), processed/ (MP4s, mosaic.png,
# index.json), logs/ (each container's log and exit code).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
DURATION="${1:-${DURATION:-20}}"
export RDMASTREAM_OUT="${RDMASTREAM_OUT:-$root/out/compose}"
t0=$SECONDS
fail() {
  echo "compose-demo: FAILED: $*" >&2
  exit 1
}
step() { echo "== [$((SECONDS - t0))s] $*"; }

# Build tools, GStreamer, python3-venv, curl (quick when they are there).
scripts/setup.sh
# --- container engine ---------------------------------------------------------------------------
if [ -z "${RDMASTREAM_ENGINE:-}" ] && command -v docker >/dev/null && docker info >/dev/null 2>&1 \
  && docker compose version >/dev/null 2>&1; then
  RDMASTREAM_ENGINE=docker
fi
engine="${RDMASTREAM_ENGINE:-podman}"
if [ "$engine" = podman ]; then
  packages=(podman runc uidmap slirp4netns fuse-overlayfs netavark aardvark-dns
    containernetworking-plugins catatonit debootstrap)
  missing=()
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    [ "$(id -u)" = 0 ] || fail "please install (as root): apt-get install ${missing[*]}"
    step "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  # runc (crun refuses hybrid cgroups) and a nofile default under the hard limit.
  export CONTAINERS_CONF="$root/deploy/compose/containers.conf"
  venv="$root/target/deploy-venv"
  if ! "$venv/bin/podman-compose" version >/dev/null 2>&1; then
    step "installing podman-compose in $venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q podman-compose==1.6.0
  fi
  compose=("$venv/bin/podman-compose")
  # The base image, made locally: nothing can be pulled here.
  if ! podman image exists docker.io/library/debian:bookworm; then
    # The machine's own Debian mirror (deb822 sources, or a classic sources.list line).
    mirror="${DEBIAN_MIRROR:-$( (sed -n 's/^URIs: *\([^ ]*debian\)\/* *$/\1/p' /etc/apt/sources.list.d/*.sources
      sed -n 's/^deb \(\[[^]]*\] \)\?\([^ ]*debian\)\/* bookworm main.*/\2/p' /etc/apt/sources.list) 2>/dev/null | head -1 || true)}"
    [ -n "$mirror" ] || fail "no Debian mirror found in /etc/apt/sources.list*; set DEBIAN_MIRROR"
    rootfs="$(mktemp -d /var/tmp/rdmastream-rootfs.XXXXXX)"
    trap 'rm -rf "$rootfs"' EXIT
    step "making the debian:bookworm base image with debootstrap from $mirror (once, about a minute)"
    debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >/dev/null
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - localhost/debian-base:bookworm >/dev/null
    podman tag localhost/debian-base:bookworm docker.io/library/debian:bookworm
    rm -rf "$rootfs"
    trap - EXIT
  fi
else
  compose=(docker compose)
fi

# --- build ----------------------------------------------------------------------------------------
command -v cargo >/dev/null || fail "cargo (Rust 1.95) is required to build the binaries"
step "building the binaries and the plugin (cargo build --release)"
cargo build --release -q -p rdmastream-sender -p rdmastream-receiver -p gst-plugin-rdma
deploy/compose/keygen.sh
step "building the image localhost/rdmastream:latest ($engine)"
image=localhost/rdmastream:latest
previous="$("$engine" image inspect -f '{{.Id}}' "$image" 2>/dev/null || true)"
"$engine" build -q -t "$image" . >/dev/null
# The image this build replaced would stay behind untagged (655 MB each run); removed unless a
# container still uses it.
if [ -n "$previous" ] && [ "$previous" != "$("$engine" image inspect -f '{{.Id}}' "$image")" ]; then
  "$engine" rmi "$previous" >/dev/null 2>&1 || true
fi

# --- run ------------------------------------------------------------------------------------------
project=rdmastream
# Bounded: podman-compose waits for each dependency to run, and would wait forever on one that
# cannot start.
dc() { timeout 300 "${compose[@]}" -p "$project" -f "$root/docker-compose.yml" "$@"; }
# Leftovers of an interrupted run would hold the port and the output.
dc down >/dev/null 2>&1 || true
rm -rf "$RDMASTREAM_OUT"
mkdir -p "$RDMASTREAM_OUT/logs"
logs="$RDMASTREAM_OUT/logs"
services=(receiver edge-1 edge-2 processor)
cleanup() { dc down >/dev/null 2>&1 || true; }
trap cleanup EXIT
# The status page's port on the host (127.0.0.1 only): 8080, or a free one when 8080 is taken
# and RDMASTREAM_STATUS_PORT does not say which to use.
port_free() { python3 -c 'import socket,sys; s=socket.socket(); s.bind(("127.0.0.1", int(sys.argv[1])))' "$1" 2>/dev/null; }
if [ -z "${RDMASTREAM_STATUS_PORT:-}" ]; then
  RDMASTREAM_STATUS_PORT=8080
  if ! port_free 8080; then
    RDMASTREAM_STATUS_PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    echo "compose-demo: 127.0.0.1:8080 is in use; publishing the status page on 127.0.0.1:$RDMASTREAM_STATUS_PORT"
  fi
fi
export RDMASTREAM_STATUS_PORT
port_free "$RDMASTREAM_STATUS_PORT" || fail "127.0.0.1:$RDMASTREAM_STATUS_PORT (RDMASTREAM_STATUS_PORT) is in use"
step "compose up (${DURATION}s)"
dc up -d >"$logs/up.log" 2>&1 || { cat "$logs/up.log" >&2; fail "compose up (log: $logs/up.log)"; }
container() {
  "$engine" ps -a -q --filter "label=com.docker.compose.project=$project" \
    --filter "label=com.docker.compose.service=$1" | head -1
}
declare -A cid
waiters=()
for s in "${services[@]}"; do
  cid[$s]="$(container "$s")"
  [ -n "${cid[$s]}" ] || fail "no container for service $s (see $logs/up.log)"
  # Each container's whole log and its exit code, kept after `down` removes it.
  "$engine" logs -f "${cid[$s]}" >"$logs/$s.log" 2>&1 &
  waiters+=($!)
  ("$engine" wait "${cid[$s]}" >"$logs/$s.exit" 2>/dev/null || true) &
  waiters+=($!)
done

metrics=no
# Captured first: with pipefail, `grep -q` closing the pipe early would fail the pipeline.
help="$("$engine" run --rm --entrypoint receiver "$image" --help 2>/dev/null || true)"
if grep -q -- '--metrics' <<<"$help"; then
  metrics=yes
fi
page_ok=0
deadline=$((SECONDS + DURATION))
while [ $SECONDS -lt "$deadline" ]; do
  for s in "${services[@]}"; do
    running="$("$engine" inspect -f '{{.State.Running}}' "${cid[$s]}" 2>/dev/null || echo false)"
    [ "$running" = true ] || { tail -20 "$logs/$s.log" >&2; fail "service $s stopped during the run (log: $logs/$s.log)"; }
  done
  if [ $metrics = yes ] && [ $page_ok = 0 ] && [ $SECONDS -gt $((deadline - DURATION / 2)) ]; then
    # Halfway through: every device is streaming by now.
    ok=1
    for path in / /metrics /healthz /readyz; do
      name="${path//\//_}"
      curl -fsS -m 5 "http://127.0.0.1:$RDMASTREAM_STATUS_PORT$path" -o "$logs/http$name.out" 2>"$logs/http$name.err" || ok=0
    done
    if [ $ok = 1 ] && [ -s "$logs/http_.out" ] && grep -q '^rdmastream_' "$logs/http_metrics.out" \
      && grep -q 'edge-1' "$logs/http_metrics.out" && grep -q 'edge-2' "$logs/http_metrics.out"; then
      page_ok=1
      step "status page, /metrics, /healthz and /readyz answered on 127.0.0.1:$RDMASTREAM_STATUS_PORT"
    fi
  fi
  sleep 1
done

step "compose down"
down_start=$SECONDS
dc down >"$logs/down.log" 2>&1 || { cat "$logs/down.log" >&2; fail "compose down"; }
trap - EXIT
down_secs=$((SECONDS - down_start))
wait "${waiters[@]}" 2>/dev/null || true

# --- checks ---------------------------------------------------------------------------------------
step "checking the outcome"
problems=()
for s in "${services[@]}"; do
  code="$(tr -d '[:space:]' <"$logs/$s.exit" 2>/dev/null)"
  [ "$code" = 0 ] || problems+=("$s exited ${code:-?} (log: $logs/$s.log)")
done
r="$logs/receiver.log"
expected=()
for d in $(seq -f '%03g' 0 11) 100 101; do expected+=("edge-1/d$d"); done
expected+=(edge-2/d000 edge-2/d001)
for stream in "${expected[@]}"; do
  line="$(grep -E "summary $stream: " "$r" | tail -1 || true)"
  frames="$(sed -n 's/.*: \([0-9]*\) frames received.*/\1/p' <<<"$line")"
  if [ -z "$line" ] || [ "${frames:-0}" -eq 0 ]; then
    problems+=("$stream: no frames arrived")
    continue
  fi
  grep -q "mismatched 0," <<<"$line" || problems+=("$stream: frames differ from the reference pattern: $line")
  grep -q "end of stream after frame index .* stream=$stream\$" "$r" || problems+=("$stream: its sender did not end the stream")
done
grep -q "verify: all [0-9]* synthetic frames match" "$r" || problems+=("the receiver's verify line is missing or reports mismatches (log: $r)")
for s in edge-1 edge-2; do
  grep -q "done after .* 0 blocks unsent" "$logs/$s.log" || problems+=("$s did not end cleanly (log: $logs/$s.log)")
done
leftovers="$(find "$RDMASTREAM_OUT/frames" "$RDMASTREAM_OUT/processed" -type f \
  ! -regex '.*/[0-9]+\.\(ppm\|raw\)' ! -name .session ! -name '*.mp4' ! -name mosaic.png ! -name index.json 2>/dev/null | head -5)"
[ -z "$leftovers" ] || problems+=("half-written files left: $leftovers")

p="$RDMASTREAM_OUT/processed"
if [ ! -s "$p/index.json" ]; then
  problems+=("the processor wrote no $p/index.json (log: $logs/processor.log)")
else
  python3 - "$p/index.json" >"$logs/index-check.out" 2>&1 <<'EOF' || problems+=("processor index: $(cat "$logs/index-check.out")")
import json, sys
index = json.load(open(sys.argv[1]))
assert index["complete"], "the processor did not finish (complete = false)"
cams = {k.rsplit("-", 2)[0]: v for k, v in index["devices"].items()}
want = [f"edge-1/device-{d:03}" for d in range(12)] + ["edge-2/device-000", "edge-2/device-001"]
missing = [w for w in want if w not in cams or not cams[w]["frames"]]
assert not missing, f"no MP4 frames for {missing}"
errors = {k: v["error"] for k, v in index["devices"].items() if v["error"]}
assert not errors, f"pipeline errors {errors}"
radar = [m for m in index["mosaic"] if m.endswith(("device-100", "device-101"))]
assert len(index["mosaic"]) == 16 and len(radar) == 2, f"mosaic has {index['mosaic']}"
EOF
fi
# Open every output in the image's own GStreamer. Each MP4 must demux to the end as H.264 (an
# MP4 that mp4mux did not finish has no index and does not demux) with as many samples, and
# the size, as the processor says it encoded (index.json); the mosaic must decode as a PNG.
mp4s=$(cd "$p" 2>/dev/null && find . -name '*.mp4' | sort | sed 's#^\./##' || true)
[ "$(wc -w <<<"$mp4s")" -ge 14 ] || problems+=("expected 14 MP4 files in $p, found $(wc -w <<<"$mp4s")")
if [ -n "$mp4s" ] && [ -s "$p/mosaic.png" ]; then
  "$engine" run --rm --entrypoint bash -v "$p:/p:ro" -w /p "$image" -c '
    for f in '"$(tr '\n' ' ' <<<"$mp4s")"'; do
      out=$(gst-launch-1.0 -v filesrc location="$f" ! qtdemux ! fakesink silent=false 2>&1) || { echo "BAD $f"; continue; }
      caps=$(grep -m1 "caps = video/x-h264" <<<"$out")
      w=$(sed -n "s/.*width=(int)\([0-9]*\).*/\1/p" <<<"$caps"); h=$(sed -n "s/.*height=(int)\([0-9]*\).*/\1/p" <<<"$caps")
      echo "$f ${w:-0} ${h:-0} $(grep -c "last-message = chain" <<<"$out")"
    done
    gst-launch-1.0 -q filesrc location=mosaic.png ! pngdec ! fakesink || echo "BAD mosaic.png"' \
    >"$logs/outputs-check.out" 2>&1 || true
  python3 - "$p/index.json" "$logs/outputs-check.out" >"$logs/outputs-check.err" 2>&1 <<'PY' \
    || problems+=("processor outputs do not open: $(head -3 "$logs/outputs-check.err")")
import json, sys
devices = json.load(open(sys.argv[1]))["devices"]
bad = []
for line in open(sys.argv[2]):
    parts = line.split()
    if not parts:
        continue
    if parts[0] == "BAD" or len(parts) != 4:
        bad.append(line.strip())
        continue
    f, w, h, samples = parts[0], *map(int, parts[1:])
    d = devices.get(f)
    if d is None or (w, h, samples) != (d["width"], d["height"], d["frames"]) or samples == 0:
        bad.append(f"{f}: {w}x{h}, {samples} H.264 samples; the processor encoded {d}")
if bad:
    print("\n".join(bad))
    sys.exit(1)
PY
else
  problems+=("no mosaic.png in $p")
fi
if [ $metrics = yes ] && [ $page_ok = 0 ]; then
  problems+=("the status page or /metrics, /healthz, /readyz did not answer on 127.0.0.1:$RDMASTREAM_STATUS_PORT ($logs/http_*)")
fi

if ((${#problems[@]})); then
  printf 'compose-demo: FAILED: %s\n' "${problems[@]}" >&2
  exit 1
fi
verified="$(sed -n 's/.*verify: all \([0-9]*\) synthetic frames match.*/\1/p' "$r")"
echo
echo "compose-demo: OK in $((SECONDS - t0))s (run ${DURATION}s, down ${down_secs}s): 16 devices from 2 senders arrived and ended cleanly, $verified synthetic frames verified"
echo "  MP4s:   $(wc -w <<<"$mp4s") in $p/<sender>/, each demuxed in full (file, width, height, H.264 samples):"
sed 's/^/          /' "$logs/outputs-check.out"
echo "  mosaic: $p/mosaic.png"
if [ $metrics = yes ]; then
  echo "  status page and metrics answered on http://127.0.0.1:$RDMASTREAM_STATUS_PORT/"
else
  echo "  status page: not checked: this receiver binary has no --metrics flag yet"
fi
