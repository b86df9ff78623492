#!/usr/bin/env bash
# Prints the path of a helm binary, building it from the Go module proxy the
# first time and caching it (the chart tests in deploy/tests need it):
#
#   HELM=$(bash scripts/install_helm.sh)
#
# The cache (SLUICE_TOOLS_CACHE, default ~/.cache/sluice/tools) keeps only the
# binary; the Go toolchain and module downloads live in a temporary folder.
# Go: `go` on PATH or /usr/local/go; a Go >= 1.21 fetches the toolchain helm
# asks for by itself (GOTOOLCHAIN). An older Go (Debian bookworm's 1.19), or
# none (then Debian's golang-go is installed), downloads that toolchain as
# the Go module golang.org/toolchain and builds with it.
set -euo pipefail

HELM_VERSION="${SLUICE_HELM_VERSION:-v3.22.0}"
# helm v3.22's go.mod asks for go >= 1.26.0.
GO_TOOLCHAIN="${SLUICE_GO_TOOLCHAIN:-go1.26.8}"
CACHE="${SLUICE_TOOLS_CACHE:-$HOME/.cache/sluice/tools}"
HELM="$CACHE/helm-$HELM_VERSION/helm"

if [[ -x "$HELM" ]]; then
  echo "$HELM"
  exit 0
fi

say() { echo "install_helm.sh: $*" >&2; }

find_go() {
  local go
  for go in "$(command -v go || true)" /usr/local/go/bin/go /usr/lib/go/bin/go; do
    if [[ -n "$go" && -x "$go" ]]; then
      echo "$go"
      return 0
    fi
  done
  return 1
}

# 0 when `$1 version` is at least go1.21 (the first with toolchain switching).
go_switches_toolchains() {
  local v
  v=$("$1" env GOVERSION 2>/dev/null || "$1" version | awk '{print $3}')
  v=${v#go}
  local major=${v%%.*} rest=${v#*.}
  local minor=${rest%%[.a-z]*}
  [[ "$major" -gt 1 || ( "$major" -eq 1 && "$minor" -ge 21 ) ]]
}

WORK=$(mktemp -d)
cleanup() {
  chmod -R u+w "$WORK" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
export GOPATH="$WORK/gopath" GOMODCACHE="$WORK/gopath/pkg/mod" GOCACHE="$WORK/gocache"
export GOFLAGS=-modcacherw CGO_ENABLED=0

if ! GO=$(find_go); then
  say "no Go found: installing Debian's golang-go"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq golang-go >&2
  GO=$(find_go)
fi

if go_switches_toolchains "$GO"; then
  export GOTOOLCHAIN="$GO_TOOLCHAIN+auto"
else
  say "$("$GO" version) cannot switch toolchains: fetching golang.org/toolchain ($GO_TOOLCHAIN)"
  arch=$("$GO" env GOARCH)
  dir=$("$GO" mod download -json "golang.org/toolchain@v0.0.1-$GO_TOOLCHAIN.linux-$arch" |
    sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  cp -r "$dir" "$WORK/go"
  # Module zips keep no permission bits (the go command sets them the same way).
  chmod +x "$WORK"/go/bin/* "$WORK"/go/pkg/tool/*/*
  GO="$WORK/go/bin/go"
  export GOTOOLCHAIN=local
fi

say "building helm $HELM_VERSION with $("$GO" version) (a few minutes, once)"
# What helm's Makefile links in: its version, and the Kubernetes version of
# its client-go as the default for `helm template` / `helm lint` (v1.20
# otherwise, which a chart's kubeVersion may refuse).
src=$("$GO" mod download -json "helm.sh/helm/v3@$HELM_VERSION" |
  sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
k8s_minor=$(sed -n 's/^[[:space:]]*k8s\.io\/client-go v0\.\([0-9]*\)\..*/\1/p' "$src/go.mod")
ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
for pkg in chartutil lint/rules; do
  ldflags+=" -X helm.sh/helm/v3/pkg/$pkg.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/$pkg.k8sVersionMinor=$k8s_minor"
done
mkdir -p "$(dirname "$HELM")"
GOBIN="$WORK/bin" "$GO" install -trimpath -ldflags "$ldflags" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" >&2
mv "$WORK/bin/helm" "$HELM"
echo "$HELM"
