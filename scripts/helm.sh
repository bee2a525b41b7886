#!/usr/bin/env bash
# Helm for spanguard's chart (helm/spanguard), built from the Go module proxy.
#
# No release download: `go install helm.sh/helm/v3/cmd/helm@$HELM_VERSION` compiles it once into
# a cache outside the repo, and every later call reuses that binary:
#   ${XDG_CACHE_HOME:-$HOME/.cache}/spanguard/helm-<version>/helm
#
# Usage: scripts/helm.sh path | HELM-ARGS...
#   path        print the binary's path (installing it first if needed)
#   HELM-ARGS   run helm with them (installing it first if needed), e.g.
#                 scripts/helm.sh lint --strict helm/spanguard
#                 scripts/helm.sh install spanguard helm/spanguard --set kafka.bootstrap=kafka:9092
#
# Environment:
#   GOPATH, GOCACHE, GOFLAGS, GOPROXY  the go command's own settings, used as they are
set -euo pipefail

HELM_VERSION=v3.22.0
# shellcheck source=scripts/lib/go-tool.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/go-tool.sh"
HELM_DIR="$CACHE_ROOT/helm-$HELM_VERSION"
HELM="$HELM_DIR/helm"

# helm, installed by `go install` into the scratch directory $1.
install_helm_into() {
  GOBIN="$1" go install -trimpath \
    -ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
    "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" ||
    die "could not install helm $HELM_VERSION from the Go module proxy (GOPROXY=$(go env GOPROXY))"
}

install_helm() {
  build_tool "$HELM" helm "Go >= 1.26, the go directive of helm $HELM_VERSION" \
    "installing helm $HELM_VERSION (helm.sh/helm/v3/cmd/helm) into $HELM_DIR" install_helm_into
}

case ${1:-} in
  "") usage >&2; exit 2 ;;
  path) install_helm; echo "$HELM" ;;
  *) install_helm; exec "$HELM" "$@" ;;
esac
