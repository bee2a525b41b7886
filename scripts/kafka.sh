#!/usr/bin/env bash
# Single-node Apache Kafka (KRaft, combined broker+controller) for local dev and CI.
#
# No Docker and no tarball download: the broker's jars come from Maven Central via
# `mvn dependency:copy-dependencies` into a cache outside the repo, and the broker
# runs as a plain `java -cp 'libs/*' kafka.Kafka server.properties`.
#
# Usage: scripts/kafka.sh [--port N] [--controller-port N] [--data-dir DIR]
#                         [--sasl-ssl-port N] [--ssl-port N] [--tls-dir DIR] COMMAND [ARGS]
#   up              fetch jars if needed, format storage once, start broker, wait until it
#                   answers the Kafka protocol (idempotent: exits 0 if already running)
#   down [--purge]  stop broker (SIGTERM, SIGKILL after KAFKA_STOP_TIMEOUT s); --purge
#                   (or KAFKA_PURGE=1) also deletes the data dir
#   status          print state; exit 0 if running and answering, 1 otherwise
#   fetch           only fetch the jars into the cache
#   topics ARGS     run org.apache.kafka.tools.TopicCommand with the cached classpath
#                   (--bootstrap-server 127.0.0.1:$KAFKA_PORT is added if not given)
#   cluster ARGS    scripts/kafka-cluster.sh ARGS (a KRaft cluster of several nodes, for fault
#                   tests; its own --help), kept here for the callers of `kafka.sh cluster`
#
# The release, the jar fetch, the probes and the start, wait and stop of a broker are shared
# with scripts/kafka-cluster.sh in scripts/lib/kafka-common.sh.
#
# Environment:
#   KAFKA_PORT             client listener port (default 9092)
#   KAFKA_CONTROLLER_PORT  KRaft controller port (default 9093)
#   KAFKA_DATA_DIR         default ${XDG_CACHE_HOME:-$HOME/.cache}/spanguard/kafka-data-$KAFKA_PORT
#                          (holds server.properties, kafka.pid, kafka.log and logs/)
#   KAFKA_HEAP_OPTS        broker heap flags (default -Xmx512m)
#   KAFKA_JVM_OPTS         extra broker JVM flags (default none)
#   KAFKA_START_TIMEOUT    seconds `up` waits for the broker (default 60)
#   KAFKA_STOP_TIMEOUT     seconds `down` waits before SIGKILL (default 30)
#   KAFKA_PURGE=1          same as `down --purge`
#
# Secured listeners (off unless a port is given), beside the PLAINTEXT one:
#   KAFKA_SASL_SSL_PORT    a SASL_SSL listener (SCRAM-SHA-256 and SCRAM-SHA-512) on this port
#   KAFKA_SSL_PORT         an SSL listener that requires a client certificate (mutual TLS)
#   KAFKA_TLS_DIR          holds broker.pem (the broker's PKCS#8 private key, unencrypted, then
#                          its certificate chain; its names must include 127.0.0.1) and ca.pem
#                          (the CA that client certificates must chain to); Kafka reads both as
#                          PEM stores (ssl.keystore.type=PEM, ssl.truststore.type=PEM)
#   KAFKA_SCRAM_USERS      space-separated USER:PASSWORD pairs, created for both SCRAM mechanisms
#                          when the storage is formatted (kafka-storage format --add-scram), so
#                          only on the first `up` of a data dir
set -euo pipefail

KAFKA_SCRIPT=kafka.sh
# shellcheck source=scripts/lib/kafka-common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/kafka-common.sh"

# ---------------------------------------------------------------- options
while [[ $# -gt 0 ]]; do
  case $1 in
    --port) KAFKA_PORT=${2:?--port needs a value}; shift 2 ;;
    --controller-port) KAFKA_CONTROLLER_PORT=${2:?--controller-port needs a value}; shift 2 ;;
    --data-dir) KAFKA_DATA_DIR=${2:?--data-dir needs a value}; shift 2 ;;
    --sasl-ssl-port) KAFKA_SASL_SSL_PORT=${2:?--sasl-ssl-port needs a value}; shift 2 ;;
    --ssl-port) KAFKA_SSL_PORT=${2:?--ssl-port needs a value}; shift 2 ;;
    --tls-dir) KAFKA_TLS_DIR=${2:?--tls-dir needs a value}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) break ;;
  esac
done
[[ $# -gt 0 ]] || { usage >&2; exit 2; }
CMD=$1; shift

KAFKA_PORT=${KAFKA_PORT:-9092}
KAFKA_CONTROLLER_PORT=${KAFKA_CONTROLLER_PORT:-9093}
[[ $KAFKA_PORT =~ ^[0-9]+$ && $KAFKA_CONTROLLER_PORT =~ ^[0-9]+$ ]] || die "ports must be numbers"
[[ $KAFKA_PORT != "$KAFKA_CONTROLLER_PORT" ]] || die "KAFKA_PORT and KAFKA_CONTROLLER_PORT must differ"
KAFKA_SASL_SSL_PORT=${KAFKA_SASL_SSL_PORT:-}
KAFKA_SSL_PORT=${KAFKA_SSL_PORT:-}
KAFKA_SCRAM_USERS=${KAFKA_SCRAM_USERS:-}
for p in "$KAFKA_SASL_SSL_PORT" "$KAFKA_SSL_PORT"; do
  [[ -z $p || $p =~ ^[0-9]+$ ]] || die "ports must be numbers"
done
if [[ -n $KAFKA_SASL_SSL_PORT || -n $KAFKA_SSL_PORT ]]; then
  [[ -n ${KAFKA_TLS_DIR:-} ]] || die "a SASL_SSL or SSL listener needs KAFKA_TLS_DIR (broker.pem, ca.pem)"
  KAFKA_TLS_DIR=$(cd "$KAFKA_TLS_DIR" 2>/dev/null && pwd) || die "KAFKA_TLS_DIR: no such directory"
  for f in broker.pem ca.pem; do
    [[ -f $KAFKA_TLS_DIR/$f ]] || die "KAFKA_TLS_DIR has no $f"
  done
fi
DATA_DIR=${KAFKA_DATA_DIR:-$CACHE_ROOT/kafka-data-$KAFKA_PORT}
PROPS="$DATA_DIR/server.properties"
PID_FILE="$DATA_DIR/kafka.pid"
LOG_FILE="$DATA_DIR/kafka.log"
LOG_DIRS="$DATA_DIR/logs"


# ---------------------------------------------------------------- config / storage
write_server_properties() {
  mkdir -p "$DATA_DIR" "$LOG_DIRS"
  local listeners="PLAINTEXT://127.0.0.1:$KAFKA_PORT" protocols="PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"
  if [[ -n $KAFKA_SASL_SSL_PORT ]]; then
    listeners+=",SASL_SSL://127.0.0.1:$KAFKA_SASL_SSL_PORT"
    protocols+=",SASL_SSL:SASL_SSL"
  fi
  if [[ -n $KAFKA_SSL_PORT ]]; then
    listeners+=",SSL://127.0.0.1:$KAFKA_SSL_PORT"
    protocols+=",SSL:SSL"
  fi
  cat >"$PROPS.$$" <<EOF
$PROPS_HEADER on every 'up'; edits are overwritten.
process.roles=broker,controller
node.id=1
# Dynamic KRaft quorum (KIP-853), as Kafka 4.x's own config/server.properties does;
# the single voter is bootstrapped by 'kafka-storage format --standalone'.
controller.quorum.bootstrap.servers=127.0.0.1:$KAFKA_CONTROLLER_PORT
listeners=$listeners,CONTROLLER://127.0.0.1:$KAFKA_CONTROLLER_PORT
advertised.listeners=$listeners
listener.security.protocol.map=$protocols
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
log.dirs=$LOG_DIRS
num.partitions=1
auto.create.topics.enable=true
# Single node: every internal topic must fit on one replica.
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
# One partition instead of 50 for each internal topic: fewer files, faster restarts.
offsets.topic.num.partitions=1
transaction.state.log.num.partitions=1
share.coordinator.state.topic.num.partitions=1
# Dev/test: consumers join groups without the default 3 s wait.
group.initial.rebalance.delay.ms=0
EOF
  if [[ -n $KAFKA_SASL_SSL_PORT || -n $KAFKA_SSL_PORT ]]; then
    cat >>"$PROPS.$$" <<EOF
# TLS for the secured listeners from PEM files: no JKS or PKCS#12 store to make.
ssl.keystore.type=PEM
ssl.keystore.location=$KAFKA_TLS_DIR/broker.pem
ssl.truststore.type=PEM
ssl.truststore.location=$KAFKA_TLS_DIR/ca.pem
EOF
  fi
  if [[ -n $KAFKA_SASL_SSL_PORT ]]; then
    cat >>"$PROPS.$$" <<EOF
# SASL_SSL: the SCRAM users live in the KRaft metadata ('kafka-storage format --add-scram').
sasl.enabled.mechanisms=SCRAM-SHA-256,SCRAM-SHA-512
listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
EOF
  fi
  if [[ -n $KAFKA_SSL_PORT ]]; then
    echo "listener.name.ssl.ssl.client.auth=required" >>"$PROPS.$$"
  fi
  mv -f "$PROPS.$$" "$PROPS"
}


format_storage_once() {
  [[ -f "$LOG_DIRS/meta.properties" ]] && return 0
  say "formatting KRaft storage in $LOG_DIRS"
  local scram=() pair
  for pair in $KAFKA_SCRAM_USERS; do
    [[ $pair == ?*:?* ]] || die "KAFKA_SCRAM_USERS: expected USER:PASSWORD pairs"
    scram+=(--add-scram "SCRAM-SHA-256=[name=${pair%%:*},password=${pair#*:}]"
            --add-scram "SCRAM-SHA-512=[name=${pair%%:*},password=${pair#*:}]")
  done
  run_tool kafka.tools.StorageTool format --cluster-id="$(new_cluster_id)" \
      --config "$PROPS" --standalone "${scram[@]}" >/dev/null ||
    die "storage format failed (to start over: $0 down --purge)"
}


# ---------------------------------------------------------------- commands
cmd_up() {
  local pid t0=${EPOCHREALTIME:-}
  if pid=$(broker_pid); then
    if kafka_answers "$KAFKA_PORT"; then
      say "already running (pid $pid) on 127.0.0.1:$KAFKA_PORT"
      return 0
    fi
    say "broker (pid $pid) is starting; waiting"
    wait_ready "$pid"
    say "ready on 127.0.0.1:$KAFKA_PORT (pid $pid)"
    return 0
  fi
  rm -f "$PID_FILE"
  need_java
  local p
  if kafka_answers "$KAFKA_PORT"; then
    die "a Kafka broker not started from $DATA_DIR (or whose pid file is gone) already answers on 127.0.0.1:$KAFKA_PORT"
  fi
  for p in "$KAFKA_PORT" "$KAFKA_CONTROLLER_PORT" $KAFKA_SASL_SSL_PORT $KAFKA_SSL_PORT; do
    ! port_open "$p" || die "port $p on 127.0.0.1 is already in use by another process (set KAFKA_PORT / KAFKA_CONTROLLER_PORT)"
  done
  fetch_jars
  write_log4j_configs
  write_server_properties
  format_storage_once

  launch_broker -Xmx512m
  pid=$(<"$PID_FILE")
  wait_ready "$pid"
  local took=""
  [[ -n $t0 ]] && took=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN {printf " in %.1fs", b - a}')
  say "ready on 127.0.0.1:$KAFKA_PORT (pid $pid)$took; data $DATA_DIR, log $LOG_FILE"
}


cmd_down() {
  local purge=${KAFKA_PURGE:-0} pid
  while [[ $# -gt 0 ]]; do
    case $1 in
      --purge) purge=1 ;;
      *) die "down: unknown argument $1" ;;
    esac
    shift
  done
  if pid=$(broker_pid); then
    stop_pid "$pid"
    say "stopped (pid $pid)"
  else
    say "not running"
  fi
  rm -f "$PID_FILE"
  if [[ $purge == 1 && -d $DATA_DIR ]]; then
    # Only delete a directory this script set up, never an arbitrary KAFKA_DATA_DIR.
    if ! { [[ -f $PROPS ]] && head -n 1 "$PROPS" | grep -qF "$PROPS_HEADER"; }; then
      die "refusing to purge $DATA_DIR: no server.properties written by this script in it"
    fi
    rm -rf -- "$DATA_DIR"
    say "purged $DATA_DIR"
  fi
}

cmd_status() {
  local pid
  if pid=$(broker_pid); then
    if kafka_answers "$KAFKA_PORT"; then
      say "running (pid $pid) on 127.0.0.1:$KAFKA_PORT, data $DATA_DIR"
      return 0
    fi
    say "process up (pid $pid) but not answering on 127.0.0.1:$KAFKA_PORT (starting or hung; log $LOG_FILE)"
    return 1
  fi
  if kafka_answers "$KAFKA_PORT"; then
    say "not running from $DATA_DIR (but some other Kafka answers on 127.0.0.1:$KAFKA_PORT)"
  else
    say "not running"
  fi
  return 1
}

cmd_topics() {
  need_java
  fetch_jars
  write_log4j_configs
  local a
  for a in "$@"; do
    [[ $a == --bootstrap-server || $a == --bootstrap-server=* ]] &&
      exec java -Xmx256m -Dlog4j2.configurationFile="$TOOLS_LOG4J" -cp "$LIBS/*" org.apache.kafka.tools.TopicCommand "$@"
  done
  exec java -Xmx256m -Dlog4j2.configurationFile="$TOOLS_LOG4J" -cp "$LIBS/*" org.apache.kafka.tools.TopicCommand \
    --bootstrap-server "127.0.0.1:$KAFKA_PORT" "$@"
}

case $CMD in
  cluster)
    # --data-dir (or KAFKA_DATA_DIR) before `cluster` names the cluster's directory.
    [[ -z ${KAFKA_DATA_DIR:-} ]] || export KAFKA_DATA_DIR
    exec "$(dirname "${BASH_SOURCE[0]}")/kafka-cluster.sh" "$@" ;;
  up) [[ $# -eq 0 ]] || die "up takes no arguments"; cmd_up ;;
  down) cmd_down "$@" ;;
  status) cmd_status ;;
  fetch) need_java; fetch_jars; say "jars in $LIBS" ;;
  topics) cmd_topics "$@" ;;
  help) usage ;;
  *) usage >&2; exit 2 ;;
esac
