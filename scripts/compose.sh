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
CACHE_ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/spanguard"
COMPOSE_DIR="$CACHE_ROOT/compose-$COMPOSE_VERSION"
COMPOSE="$COMPOSE_DIR/docker-compose"

SCRIPT=compose.sh
# shellcheck source=scripts/lib/go-tool.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/go-tool.sh"

build_compose() {
  tool_ready "$COMPOSE" compose-build.lock \
    "go not found: compose is built from the Go module proxy; install Go (https://go.dev/dl/ or your distribution's golang package) and retry" &&
    return 0
  local started=$SECONDS work src
  say "building docker compose $COMPOSE_VERSION ($MODULE) into $COMPOSE_DIR; the first build takes a few minutes"
  work=$(mktemp -d "$CACHE_ROOT/compose-build.XXXXXX")
  # shellcheck disable=SC2064
  trap "chmod -R u+w '$work' 2>/dev/null; rm -rf '$work'" EXIT
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
  mkdir -p "$COMPOSE_DIR"
  mv "$work/docker-compose" "$COMPOSE_DIR/.docker-compose.tmp"
  mv "$COMPOSE_DIR/.docker-compose.tmp" "$COMPOSE"
  say "built $COMPOSE in $((SECONDS - started))s"
}

case ${1:-} in
  ""|-h|--help|help) usage; [[ -n ${1:-} ]] || exit 2 ;;
  path) build_compose; echo "$COMPOSE" ;;
  *) build_compose; exec "$COMPOSE" "$@" ;;
esac
