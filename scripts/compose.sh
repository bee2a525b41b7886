#!/usr/bin/env bash
# Docker Compose v2 for checking docker-compose.yml where the docker CLI has no compose plugin,
# built from the Go module proxy like scripts/helm.sh builds helm.
#
# `go install github.com/docker/compose/v2/cmd@VERSION` refuses the module (its go.mod has
# exclude directives), so its source is fetched with `go mod download` and built as the main
# module, once, into a cache outside the repo; every later call reuses that binary:
#   ${XDG_CACHE_HOME:-$HOME/.cache}/spanguard/compose-<version>/docker-compose
# `config` needs no Docker engine; `up` and friends do.
#
# Usage: scripts/compose.sh path | COMPOSE-ARGS...
#   path           print the binary's path (building it first if needed)
#   COMPOSE-ARGS   run docker-compose with them, e.g. scripts/compose.sh config --quiet
#
# Environment:
#   GOPATH, GOCACHE, GOFLAGS, GOPROXY  the go command's own settings, used as they are
set -euo pipefail

COMPOSE_VERSION=v2.40.3
MODULE=github.com/docker/compose/v2
# shellcheck source=scripts/lib/go-tool.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/go-tool.sh"
COMPOSE_DIR="$CACHE_ROOT/compose-$COMPOSE_VERSION"
COMPOSE="$COMPOSE_DIR/docker-compose"

# The module's source, fetched with `go mod download`, copied into the scratch directory $1 and
# built there as the main module.
build_compose() {
  local work=$1 src
  src=$(cd "$work" && go mod download -json "$MODULE@$COMPOSE_VERSION" |
        sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p') ||
    die "could not download $MODULE@$COMPOSE_VERSION from the Go module proxy (GOPROXY=$(go env GOPROXY))"
  [[ -n $src && -d $src ]] || die "go mod download gave no source directory for $MODULE@$COMPOSE_VERSION"
  # The module cache is read-only: build a writable copy as the main module.
  cp -R "$src" "$work/src"
  chmod -R u+w "$work/src"
  (cd "$work/src" && go build -trimpath \
      -ldflags="-s -w -X $MODULE/internal.Version=$COMPOSE_VERSION" -o "$work/docker-compose" ./cmd) ||
    die "go build of $MODULE@$COMPOSE_VERSION failed"
}

ensure_compose() {
  build_tool "$COMPOSE" compose Go \
    "building docker compose $COMPOSE_VERSION ($MODULE) into $COMPOSE_DIR" build_compose
}

case ${1:-} in
  ""|-h|--help|help) usage; [[ -n ${1:-} ]] || exit 2 ;;
  path) ensure_compose; echo "$COMPOSE" ;;
  *) ensure_compose; exec "$COMPOSE" "$@" ;;
esac
