#!/usr/bin/env bash
# The whole local stack in the background, for trying spanguard by hand and for `make demo`:
# Kafka (scripts/kafka.sh), the topics, the Collector on 4317/4318 (scripts/collector.sh) and
# `spanguard worker` (with SPANGUARD_POLICY and the other SPANGUARD_* settings if set).
#
# Usage: scripts/stack.sh up | down | status | key-file
#   up        start what is not running yet (idempotent), wait until each part answers
#   down      stop the worker, the Collector and Kafka
#   status    exit 0 when all of them run
#   key-file  print the file holding the stack's signing key (made on first use)
# Environment: SPANGUARD_STACK_DIR (worker pid/log, default ~/.cache/spanguard/stack),
#   KAFKA_PORT (9092), SPANGUARD_METRICS_PORT (9464), and any SPANGUARD_* worker setting.
#   Kill signals are signed: with neither SPANGUARD_SIGNING_KEY nor SPANGUARD_SIGNING_KEY_FILE
#   set, the worker gets a random key kept in $SPANGUARD_STACK_DIR/signing-key (mode 600),
#   which agents of this stack read through SPANGUARD_SIGNING_KEY_FILE (see key-file).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN="$ROOT/.venv/bin"
STATE="${SPANGUARD_STACK_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/spanguard/stack}"
PIDFILE="$STATE/worker.pid"
LOG="$STATE/worker.log"
METRICS_PORT="${SPANGUARD_METRICS_PORT:-9464}"
export SPANGUARD_BOOTSTRAP="${SPANGUARD_BOOTSTRAP:-127.0.0.1:${KAFKA_PORT:-9092}}"
# The shipped defaults (the RocksDB store among them), state under the stack's directory.
export SPANGUARD_DATA_DIR="${SPANGUARD_DATA_DIR:-$STATE/data}"

KEY_FILE="$STATE/signing-key"

say() { echo "stack.sh: $*" >&2; }

# The worker refuses to start without a signing key: give it this stack's own, made once.
use_stack_key() {
  if [ -n "${SPANGUARD_SIGNING_KEY:-}" ] || [ -n "${SPANGUARD_SIGNING_KEY_FILE:-}" ]; then
    return 0
  fi
  if [ ! -s "$KEY_FILE" ]; then
    mkdir -p "$STATE"
    (umask 077 && "$BIN/python" -c 'import secrets; print(secrets.token_hex(32))' >"$KEY_FILE.tmp" \
      && mv -f "$KEY_FILE.tmp" "$KEY_FILE")
  fi
  export SPANGUARD_SIGNING_KEY_FILE="$KEY_FILE"
}

worker_running() { [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }

metrics_answer() { curl -fsS -o /dev/null "http://127.0.0.1:$METRICS_PORT/metrics" 2>/dev/null; }

up() {
  [ -x "$BIN/spanguard" ] || { say "run 'make install' first"; exit 1; }
  mkdir -p "$STATE"
  "$ROOT/scripts/kafka.sh" up
  "$BIN/spanguard" topics create >/dev/null
  "$ROOT/scripts/collector.sh" up
  use_stack_key
  if worker_running; then
    say "worker already running (pid $(cat "$PIDFILE"))"
  else
    say "starting the worker (log: $LOG)"
    [ -f "$LOG" ] && mv -f "$LOG" "$LOG.1"
    nohup "$BIN/spanguard" worker --metrics-host 127.0.0.1 --metrics-port "$METRICS_PORT" \
      >>"$LOG" 2>&1 </dev/null &
    echo $! >"$PIDFILE"
  fi
  # Ready once /metrics answers and Faust has its partitions.
  for _ in $(seq 1 300); do
    if ! worker_running; then say "the worker exited:"; tail -n 30 "$LOG" >&2; exit 1; fi
    if metrics_answer && grep -q "Worker ready" "$LOG"; then say "worker ready"; return 0; fi
    sleep 0.2
  done
  say "the worker is not ready after 60s:"; tail -n 30 "$LOG" >&2; exit 1
}

down() {
  if worker_running; then
    pid=$(cat "$PIDFILE")
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null || true
    say "worker stopped"
  fi
  rm -f "$PIDFILE"
  "$ROOT/scripts/collector.sh" down || true
  "$ROOT/scripts/kafka.sh" down || true
}

status() {
  local ok=0
  "$ROOT/scripts/kafka.sh" status >/dev/null 2>&1 || { say "kafka: not running"; ok=1; }
  "$ROOT/scripts/collector.sh" status >/dev/null 2>&1 || { say "collector: not running"; ok=1; }
  if worker_running && metrics_answer; then say "worker: running"; else say "worker: not running"; ok=1; fi
  return $ok
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  key-file) use_stack_key; echo "${SPANGUARD_SIGNING_KEY_FILE:-}" ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2 ;;
esac
