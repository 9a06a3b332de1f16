#!/usr/bin/env bash
# Makes the compose demo's sender keys, deploy/compose/keys/edge-1.key and edge-2.key (32 random
# bytes, hex), unless they exist. docker-compose.yml hands them to the receiver and to each
# sender as compose secrets (/run/secrets/edge-N-key): they are never part of the image.
# The directory is ignored by git.
set -euo pipefail
dir="$(cd "$(dirname "$0")" && pwd)/keys"
mkdir -p "$dir"
chmod 700 "$dir"
for name in edge-1 edge-2; do
  if [ ! -s "$dir/$name.key" ]; then
    (umask 077 && od -An -vtx1 -N32 /dev/urandom | tr -d ' \n' > "$dir/$name.key")
    echo "keygen: made $dir/$name.key"
  fi
done
