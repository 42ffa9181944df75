#!/usr/bin/env bash
# Builds the test control plane (etcd, kube-apiserver, kube-controller-manager, kubectl) from
# the Go module proxy with the ordinary `go` client, at the versions pinned in tools/k8s/go.mod,
# into .cache/k8s/bin/. Idempotent: does nothing when every binary exists and the stamp (a hash
# of tools/k8s/go.mod, go.sum, this script and the Go version) matches. Used by `make k8s` (and `make test`).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MOD="$ROOT/tools/k8s"
BIN="${K8S_BIN_DIR:-$ROOT/.cache/k8s/bin}"
STAMP="$BIN/.stamp"
BINARIES=(etcd kube-apiserver kube-controller-manager kubectl)

if ! command -v go >/dev/null; then
  echo "build_k8s.sh: the Go toolchain (go) is not on PATH; install Go >= 1.24" >&2
  exit 1
fi

EPP_MOD="$ROOT/tools/epp"
EPP_MISSING="$BIN/epp.unavailable"
want="$(cat "$MOD/go.mod" "$MOD/go.sum" "$EPP_MOD/go.mod" "$EPP_MOD/go.sum" "$EPP_MOD/pick/main.go" "${BASH_SOURCE[0]}" \
  <(go version) | sha256sum | cut -d' ' -f1)"
have_all=1
for b in "${BINARIES[@]}"; do [ -x "$BIN/$b" ] || have_all=0; done
{ [ -x "$BIN/epp" ] || [ -f "$EPP_MISSING" ]; } || have_all=0
if [ "$have_all" = 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  echo "build_k8s.sh: $BIN is up to date"
  exit 0
fi

mkdir -p "$BIN"
rm -f "$STAMP"
export CGO_ENABLED=0 GOFLAGS=-buildvcs=false
# The version the binaries report (helm checks a chart's kubeVersion against it): the pinned one.
version="$(awk '$1 == "k8s.io/kubernetes" {print $2}' "$MOD/go.mod")"
[[ "$version" =~ ^v([0-9]+)\.([0-9]+)\. ]] || { echo "build_k8s.sh: no k8s.io/kubernetes version in $MOD/go.mod" >&2; exit 1; }
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$version -X $pkg.gitMajor=${BASH_REMATCH[1]} -X $pkg.gitMinor=${BASH_REMATCH[2]}"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
flags=(-trimpath "-ldflags=$ldflags")
start=$(date +%s)
cd "$MOD"
echo "build_k8s.sh: building ${BINARIES[*]} into $BIN (takes a while on a fresh machine)"
nice -n 10 go build "${flags[@]}" -o "$BIN/etcd" go.etcd.io/etcd/server/v3
nice -n 10 go build "${flags[@]}" -o "$BIN/" \
  k8s.io/kubernetes/cmd/kube-apiserver \
  k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kubectl
for b in "${BINARIES[@]}"; do
  [ -x "$BIN/$b" ] || { echo "build_k8s.sh: $BIN/$b was not built" >&2; exit 1; }
done

# The Inference Extension's endpoint picker, its CRDs (InferencePool, InferenceObjective ...) and our ext-proc client
# (tools/epp) are optional: when they cannot be built, the reason goes to epp.unavailable and
# tests/cluster/test_picker.py skips with it; the control plane above is never optional.
rm -f "$EPP_MISSING"
cd "$EPP_MOD"
if ! log="$( {
  nice -n 10 go build -trimpath "-ldflags=-s -w" -o "$BIN/epp" sigs.k8s.io/gateway-api-inference-extension/cmd/epp &&
    nice -n 10 go build -trimpath "-ldflags=-s -w" -o "$BIN/epp-pick" ./pick &&
    dir="$(go list -m -f '{{.Dir}}' sigs.k8s.io/gateway-api-inference-extension)" &&
    rm -rf "$BIN/epp-crds" && mkdir "$BIN/epp-crds" && cp "$dir"/config/crd/bases/*.yaml "$BIN/epp-crds/" &&
    chmod 644 "$BIN"/epp-crds/*.yaml
} 2>&1 )"; then
  rm -rf "$BIN/epp" "$BIN/epp-pick" "$BIN/epp-crds"
  printf 'the endpoint picker (tools/epp) did not build:\n%s\n' "$log" | tail -20 >"$EPP_MISSING"
  echo "build_k8s.sh: the endpoint picker did not build (see $EPP_MISSING); going on without it" >&2
fi
echo "$want" >"$STAMP"
echo "build_k8s.sh: built in $(( $(date +%s) - start )) s"
