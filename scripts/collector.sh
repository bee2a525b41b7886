#!/usr/bin/env bash
# spanguard's OpenTelemetry Collector (otlp receiver -> batch -> kafka exporter), built from
# deploy/collector/builder-config.yaml with the OpenTelemetry Collector Builder (ocb).
#
# No Docker and no release download: ocb and every component come from the Go module proxy.
# The binary is built once into a cache outside the repo, in a directory named after the
# manifest's core version and a fingerprint of the manifest, so changing a pin rebuilds:
#   ${XDG_CACHE_HOME:-$HOME/.cache}/spanguard/otelcol-<version>-<fingerprint>/otelcol-spanguard
#
# Usage: scripts/collector.sh COMMAND [ARGS]
#   build            build the binary unless the cache has it (needs go)
#   path             print the binary's path (building it first if needed)
#   validate [CONF...]  run the binary's `validate --config CONF...` (default
#                    deploy/collector/config.yaml; later files merge over earlier ones, e.g.
#                    config.yaml kafka-tls.yaml kafka-sasl.yaml for SASL_SSL)
#   up [CONF...]     start the Collector in the background with CONF... and wait until its
#                    OTLP/HTTP port accepts connections (idempotent: exits 0 if already running)
#   down             stop it (SIGTERM, SIGKILL after COLLECTOR_STOP_TIMEOUT s); idempotent
#   status           print state; exit 0 if running and its HTTP port answers, 1 otherwise
#
# Environment (passed through to the Collector; see deploy/collector/config.yaml):
#   OTLP_GRPC_ENDPOINT     OTLP/gRPC listen address (default 0.0.0.0:4317)
#   OTLP_HTTP_ENDPOINT     OTLP/HTTP listen address (default 0.0.0.0:4318); `up` waits on its port
#   KAFKA_BROKERS          bootstrap broker (default 127.0.0.1:$KAFKA_PORT, KAFKA_PORT default 9092)
#   SPANGUARD_INPUT_TOPIC  topic the spans go to (default otlp_spans)
#   OTELCOL_METRICS_PORT   the Collector's own metrics port (default 8888);
#   OTELCOL_METRICS_LEVEL  "none" turns those metrics off
#   COLLECTOR_STATE_DIR    pid and log files (default <cache>/collector-run-<http port>)
#   COLLECTOR_START_TIMEOUT seconds `up` waits for the port (default 60)
#   COLLECTOR_STOP_TIMEOUT  seconds `down` waits before SIGKILL (default 15)
#   GOPATH, GOCACHE, GOFLAGS, GOPROXY  the go command's own settings, used as they are
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MANIFEST="$ROOT/deploy/collector/builder-config.yaml"
# The spanguard_pack exporter's Go module, built in from this checkout (the manifest's `path`).
PACK_MODULE="$ROOT/deploy/collector/packexporter"
DEFAULT_CONFIG="$ROOT/deploy/collector/config.yaml"
BINARY_NAME=otelcol-spanguard
CACHE_ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/spanguard"

die() { echo "collector.sh: $*" >&2; exit 1; }
say() { echo "collector.sh: $*" >&2; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

[[ $# -gt 0 ]] || { usage >&2; exit 2; }
case $1 in -h|--help|help) usage; exit 0 ;; esac
CMD=$1; shift

[[ -f $MANIFEST ]] || die "missing $MANIFEST"

# The core release the manifest pins (the builder must be of the same release).
CORE_VERSION=$(grep -oE 'go\.opentelemetry\.io/collector/service v[0-9]+\.[0-9]+\.[0-9]+' "$MANIFEST" |
  head -n1 | awk '{print $2}')
[[ -n $CORE_VERSION ]] || die "cannot find the go.opentelemetry.io/collector/service pin in $MANIFEST"

sha256() { if command -v sha256sum >/dev/null 2>&1; then sha256sum; else shasum -a 256; fi | cut -c1-12; }
# The manifest's bytes, the exporter's sources, the builder's release and the platform: any
# change means a new build.
pack_sources() { (cd "$PACK_MODULE" && find . -type f \( -name '*.go' -o -name 'go.mod' -o -name 'go.sum' \) | LC_ALL=C sort | xargs cat); }
FINGERPRINT=$({ cat "$MANIFEST"; pack_sources; echo "builder=$CORE_VERSION $(uname -s)-$(uname -m)"; } | sha256)
BUILD_DIR="$CACHE_ROOT/otelcol-${CORE_VERSION#v}-$FINGERPRINT"
BINARY="$BUILD_DIR/$BINARY_NAME"
BUILDER_DIR="$CACHE_ROOT/ocb-${CORE_VERSION#v}"
BUILDER="$BUILDER_DIR/builder"

# ---------------------------------------------------------------- build
need_go() {
  command -v go >/dev/null 2>&1 ||
    die "go not found: the Collector is built from Go modules; install Go >= 1.26 (https://go.dev/dl/ or your distribution's golang package) and retry"
}

build() {
  [[ -x $BINARY ]] && return 0
  need_go
  mkdir -p "$CACHE_ROOT"
  # One build at a time (parallel test runs, make -j): the others wait, then reuse it. The lock
  # is held in a subshell so that its fd is not inherited by a Collector that `up` starts.
  if command -v flock >/dev/null 2>&1; then
    (
      flock 9
      if [[ ! -x $BINARY ]]; then build_locked; fi
    ) 9>"$CACHE_ROOT/otelcol-build.lock"
  else
    (build_locked)
  fi
}

build_locked() {
  local started=$SECONDS
  if [[ ! -x $BUILDER ]]; then
    say "installing ocb (go.opentelemetry.io/collector/cmd/builder@$CORE_VERSION) into $BUILDER_DIR"
    mkdir -p "$BUILDER_DIR"
    GOBIN="$BUILDER_DIR" go install -trimpath -ldflags="-s -w" \
      "go.opentelemetry.io/collector/cmd/builder@$CORE_VERSION" ||
      die "could not install the builder from the Go module proxy (GOPROXY=$(go env GOPROXY))"
  fi
  local work
  work=$(mktemp -d "$CACHE_ROOT/otelcol-build.XXXXXX")
  # shellcheck disable=SC2064
  trap "rm -rf '$work'" EXIT
  say "building $BINARY_NAME $CORE_VERSION (manifest fingerprint $FINGERPRINT); the first build takes a few minutes"
  # ocb resolves the manifest's relative dist.output_path (./_build) and the exporter's path
  # (./packexporter) against its working directory: run it in the scratch directory, with a
  # copy of the module, so nothing is written into the repo. It compiles with -trimpath and
  # -ldflags="-s -w".
  cp -R "$PACK_MODULE" "$work/packexporter"
  (cd "$work" && "$BUILDER" --config="$MANIFEST" --ldflags="-s -w") >"$work/build.log" 2>&1 || {
    tail -n 40 "$work/build.log" >&2
    die "ocb failed (full log above, last 40 lines)"
  }
  [[ -x $work/_build/$BINARY_NAME ]] || die "ocb finished but $work/_build/$BINARY_NAME is missing"
  mkdir -p "$BUILD_DIR"
  cp "$work/build.log" "$BUILD_DIR/build.log"
  cp "$MANIFEST" "$BUILD_DIR/builder-config.yaml"
  mv "$work/_build/$BINARY_NAME" "$BUILD_DIR/.$BINARY_NAME.tmp"
  mv "$BUILD_DIR/.$BINARY_NAME.tmp" "$BINARY"  # atomic: a reader sees no half-written binary
  rm -rf "$work"
  trap - EXIT
  say "built $BINARY in $((SECONDS - started))s"
}

# ---------------------------------------------------------------- run
HTTP_ENDPOINT=${OTLP_HTTP_ENDPOINT:-0.0.0.0:4318}
HTTP_PORT=${HTTP_ENDPOINT##*:}
HTTP_HOST=${HTTP_ENDPOINT%:*}
HTTP_HOST=${HTTP_HOST#[}; HTTP_HOST=${HTTP_HOST%]}
case $HTTP_HOST in ""|0.0.0.0|::) HTTP_HOST=127.0.0.1 ;; esac
[[ $HTTP_PORT =~ ^[0-9]+$ ]] || die "OTLP_HTTP_ENDPOINT must end in :PORT (got '$HTTP_ENDPOINT')"
STATE_DIR=${COLLECTOR_STATE_DIR:-$CACHE_ROOT/collector-run-$HTTP_PORT}
PID_FILE="$STATE_DIR/collector.pid"
LOG_FILE="$STATE_DIR/collector.log"
export KAFKA_BROKERS=${KAFKA_BROKERS:-127.0.0.1:${KAFKA_PORT:-9092}}

port_open() { (exec 3<>"/dev/tcp/$HTTP_HOST/$HTTP_PORT") 2>/dev/null; }

# The pid in the pid file, if that process is alive and is a Collector.
running_pid() {
  [[ -f $PID_FILE ]] || return 1
  local pid
  pid=$(<"$PID_FILE")
  [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || return 1
  if [[ -r /proc/$pid/cmdline ]]; then
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "$BINARY_NAME" || return 1
  fi
  echo "$pid"
}

config_arg() {
  local config=${1:-$DEFAULT_CONFIG}
  [[ -f $config ]] || die "no such config: $config"
  (cd "$(dirname "$config")" && echo "$(pwd)/$(basename "$config")")
}

# CONFIGS=(--config FILE ...) for every argument (default: the one config.yaml).
config_args() {
  local c
  CONFIGS=()
  [[ $# -gt 0 ]] || set -- "$DEFAULT_CONFIG"
  for c in "$@"; do CONFIGS+=(--config "$(config_arg "$c")"); done
}

up() {
  local pid config
  config_args "$@"
  config="${CONFIGS[*]}"
  if pid=$(running_pid) && port_open; then
    say "already running (pid $pid, OTLP/HTTP $HTTP_HOST:$HTTP_PORT, log $LOG_FILE)"
    return 0
  fi
  if pid=$(running_pid); then
    say "pid $pid is running but port $HTTP_PORT is not answering yet; waiting for it"
  else
    port_open && die "port $HTTP_PORT is already taken by another process (set OTLP_HTTP_ENDPOINT)"
    build
    mkdir -p "$STATE_DIR"
    "$BINARY" validate "${CONFIGS[@]}" >"$STATE_DIR/validate.log" 2>&1 || {
      cat "$STATE_DIR/validate.log" >&2
      die "config $config does not validate"
    }
    echo "--- $(date -u +%FT%TZ) up $config (KAFKA_BROKERS=$KAFKA_BROKERS)" >>"$LOG_FILE"
    if command -v setsid >/dev/null 2>&1; then
      setsid "$BINARY" "${CONFIGS[@]}" </dev/null >>"$LOG_FILE" 2>&1 &
    else
      nohup "$BINARY" "${CONFIGS[@]}" </dev/null >>"$LOG_FILE" 2>&1 &
    fi
    pid=$!
    echo "$pid" >"$PID_FILE"
    echo "$config" >"$STATE_DIR/config"
  fi
  local deadline=$((SECONDS + ${COLLECTOR_START_TIMEOUT:-60}))
  until port_open; do
    if ! kill -0 "$pid" 2>/dev/null; then
      rm -f "$PID_FILE"
      tail -n 30 "$LOG_FILE" >&2
      die "the Collector exited during startup (log: $LOG_FILE)"
    fi
    ((SECONDS < deadline)) || {
      tail -n 30 "$LOG_FILE" >&2
      die "OTLP/HTTP port $HTTP_PORT not open after ${COLLECTOR_START_TIMEOUT:-60}s (pid $pid left running; log: $LOG_FILE)"
    }
    sleep 0.1
  done
  say "up (pid $pid, OTLP/HTTP $HTTP_HOST:$HTTP_PORT, gRPC ${OTLP_GRPC_ENDPOINT:-0.0.0.0:4317}, Kafka $KAFKA_BROKERS, log $LOG_FILE)"
}

down() {
  local pid
  if ! pid=$(running_pid); then
    rm -f "$PID_FILE"
    say "not running"
    return 0
  fi
  kill -TERM "$pid" 2>/dev/null || true
  local deadline=$((SECONDS + ${COLLECTOR_STOP_TIMEOUT:-15}))
  while kill -0 "$pid" 2>/dev/null; do
    if ((SECONDS >= deadline)); then
      say "pid $pid still running after ${COLLECTOR_STOP_TIMEOUT:-15}s: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      break
    fi
    sleep 0.1
  done
  rm -f "$PID_FILE"
  say "stopped (pid $pid)"
}

status() {
  local pid
  echo "binary:  $BINARY ($([[ -x $BINARY ]] && echo built || echo "not built"))"
  echo "state:   $STATE_DIR"
  if pid=$(running_pid); then
    echo "config:  $(cat "$STATE_DIR/config" 2>/dev/null || echo '?')"
    if port_open; then
      echo "running: pid $pid, OTLP/HTTP $HTTP_HOST:$HTTP_PORT answering"
      return 0
    fi
    echo "running: pid $pid, but OTLP/HTTP $HTTP_HOST:$HTTP_PORT is not answering"
    return 1
  fi
  echo "stopped"
  return 1
}

case $CMD in
  build) build ;;
  path) build; echo "$BINARY" ;;
  validate)
    config_args "$@"
    build
    "$BINARY" validate "${CONFIGS[@]}"
    ;;
  up) up "$@" ;;
  down) down ;;
  status) status ;;
  *) usage >&2; die "unknown command '$CMD'" ;;
esac
