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
#
# A KRaft cluster of several nodes (each a combined broker+controller, a static quorum of all
# of them), for fault tests: topics default to replication factor 3 (fewer nodes: all of them)
# and min.insync.replicas 2, the internal topics too. Ports are free ones picked at the first
# `up` and kept in DIR/cluster.env; every node has its own data dir DIR/node-N.
#   cluster [--data-dir DIR] up [--brokers N]   start every node that is not running (N, default
#                   3, is fixed at the first up) and wait until each answers; prints
#                   `bootstrap=HOST:PORT,...` last
#   cluster [--data-dir DIR] down [--purge]     stop every node (SIGTERM), --purge deletes DIR
#   cluster [--data-dir DIR] status             one line per node; exit 0 if all answer
#   cluster [--data-dir DIR] bootstrap          print the bootstrap list
#   cluster [--data-dir DIR] proxied-bootstrap  the PROXIED listener's advertised addresses
#                   (PROXY_PORT_n in cluster.env): a client bootstrapped there talks to node n
#                   only through whatever forwards PROXY_PORT_n to PROXIED_PORT_n (a test's TCP
#                   proxy, to cut a client off the cluster and heal it)
#   cluster [--data-dir DIR] kill NODE          SIGKILL one node (no clean shutdown)
#   cluster [--data-dir DIR] stop NODE          SIGTERM one node and wait until it is gone
#   cluster [--data-dir DIR] start NODE         (re)start one node from its data dir, wait for it
#   cluster [--data-dir DIR] pid NODE           print a running node's pid
#   Default DIR: ${XDG_CACHE_HOME:-$HOME/.cache}/spanguard/kafka-cluster. The single broker's
#   options (--port ...) do not apply; the environment's heap (default -Xmx384m per node) and
#   timeout settings do (KAFKA_START_TIMEOUT defaults to 180 s per node here).
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

KAFKA_VERSION=4.4.0
SCALA_VERSION=2.13
# kafka-server already pulls log4j-core 2.25.5; Kafka pins slf4j-api 1.7.x, so the
# SLF4J *1.x* binding (log4j-slf4j-impl, not -slf4j2-impl) routes its logging to log4j2.
LOG4J_VERSION=2.25.5
DEP_PLUGIN_VERSION=3.8.1

CACHE_ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/spanguard"
KAFKA_HOME="$CACHE_ROOT/kafka-$KAFKA_VERSION"
LIBS="$KAFKA_HOME/libs"
MARKER="$KAFKA_HOME/.libs-complete"
# Changing any pin changes the fingerprint, which invalidates the cached libs.
FINGERPRINT="kafka_$SCALA_VERSION:$KAFKA_VERSION kafka-tools:$KAFKA_VERSION log4j-slf4j-impl:$LOG4J_VERSION dep-plugin:$DEP_PLUGIN_VERSION"
BROKER_LOG4J="$KAFKA_HOME/log4j2-broker.properties"
TOOLS_LOG4J="$KAFKA_HOME/log4j2-tools.properties"
PROPS_HEADER="# written by spanguard scripts/kafka.sh"

die() { echo "kafka.sh: $*" >&2; exit 1; }
say() { echo "kafka.sh: $*"; }

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

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

# ---------------------------------------------------------------- checks
need_java() {
  command -v java >/dev/null 2>&1 ||
    die "java not found: install a JDK 17+ (e.g. apt-get install openjdk-17-jdk-headless)"
  local v
  v=$(java -version 2>&1 | awk -F'"' '/version/ {print $2; exit}')
  v=${v#1.}; v=${v%%[^0-9]*}   # "1.8.0_x" -> 8, "17.0.15" -> 17, "21-ea" -> 21
  [[ -n $v && $v -ge 17 ]] ||
    die "java ${v:-?} found but Kafka $KAFKA_VERSION needs 17+ (e.g. apt-get install openjdk-17-jdk-headless)"
}

need_mvn() {
  command -v mvn >/dev/null 2>&1 ||
    die "mvn not found: install Maven 3.8+ (e.g. apt-get install maven)"
}

# ---------------------------------------------------------------- jars
libs_complete() {
  [[ -f $MARKER && "$(<"$MARKER")" == "$FINGERPRINT" && -f "$LIBS/kafka_$SCALA_VERSION-$KAFKA_VERSION.jar" ]]
}

write_pom() {
  cat >"$KAFKA_HOME/pom.xml" <<EOF
<?xml version="1.0" encoding="UTF-8"?>
<!-- generated by spanguard scripts/kafka.sh: only used to resolve the broker's jars -->
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>local.spanguard</groupId>
  <artifactId>kafka-libs</artifactId>
  <version>$KAFKA_VERSION</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency><!-- broker: kafka.Kafka, kafka.tools.StorageTool -->
      <groupId>org.apache.kafka</groupId><artifactId>kafka_$SCALA_VERSION</artifactId><version>$KAFKA_VERSION</version>
    </dependency>
    <dependency><!-- CLI tools: org.apache.kafka.tools.TopicCommand & co. -->
      <groupId>org.apache.kafka</groupId><artifactId>kafka-tools</artifactId><version>$KAFKA_VERSION</version>
    </dependency>
    <dependency><!-- slf4j 1.x -> log4j2, else the broker logs nothing (NOP binder warning) -->
      <groupId>org.apache.logging.log4j</groupId><artifactId>log4j-slf4j-impl</artifactId><version>$LOG4J_VERSION</version>
    </dependency>
  </dependencies>
  <build>
    <plugins>
      <plugin><!-- pinned: Maven 3.8's default dependency plugin is 2.8 -->
        <groupId>org.apache.maven.plugins</groupId><artifactId>maven-dependency-plugin</artifactId><version>$DEP_PLUGIN_VERSION</version>
      </plugin>
    </plugins>
  </build>
</project>
EOF
}

fetch_jars() {
  libs_complete && return 0
  need_mvn
  mkdir -p "$KAFKA_HOME"
  # Serialize concurrent fetches (parallel CI jobs share the cache). The lock lives in a
  # subshell so the fd is never inherited by the long-running broker.
  (
    if command -v flock >/dev/null 2>&1; then
      exec 9>"$KAFKA_HOME/.fetch.lock"
      flock 9
    fi
    libs_complete && exit 0
    write_pom
    tmp="$KAFKA_HOME/libs.tmp.$$"
    rm -rf "$tmp"
    echo "kafka.sh: fetching Kafka $KAFKA_VERSION jars with mvn into $LIBS (one-time)..." >&2
    # Output goes to a file: Maven 3.8 prints stray ANSI resets even with -B -q, and on
    # failure the whole log is more useful than -q's summary anyway.
    if ! mvn -B -q -f "$KAFKA_HOME/pom.xml" dependency:copy-dependencies \
        -DincludeScope=runtime -DoutputDirectory="$tmp" >"$KAFKA_HOME/mvn.log" 2>&1; then
      rm -rf "$tmp"
      tail -n 40 "$KAFKA_HOME/mvn.log" >&2
      die "mvn could not fetch org.apache.kafka:kafka_$SCALA_VERSION:$KAFKA_VERSION (full log: $KAFKA_HOME/mvn.log)"
    fi
    [[ -f "$tmp/kafka_$SCALA_VERSION-$KAFKA_VERSION.jar" ]] || { rm -rf "$tmp"; die "mvn ran but kafka jar is missing"; }
    # Marker is written only after the libs dir is fully in place.
    rm -f "$MARKER"
    rm -rf "$LIBS"
    mv "$tmp" "$LIBS"
    printf '%s\n' "$FINGERPRINT" >"$MARKER"
  )
}

# Written on every run (cheap) so edits to this script take effect without a refetch.
write_log4j_configs() {
  mkdir -p "$KAFKA_HOME"
  # Broker: INFO to stdout (nohup sends it to $DATA_DIR/kafka.log); the multi-hundred-line
  # config dumps of every client/server config object are demoted to WARN.
  cat >"$BROKER_LOG4J.$$" <<'EOF'
status = warn
appender.out.type = Console
appender.out.name = STDOUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = info
rootLogger.appenderRef.out.ref = STDOUT
logger.configdump.name = org.apache.kafka.common.config.AbstractConfig
logger.configdump.level = warn
logger.request.name = kafka.request.logger
logger.request.level = warn
EOF
  mv -f "$BROKER_LOG4J.$$" "$BROKER_LOG4J"
  # Tools: warnings only, on stderr, so their stdout stays parseable.
  cat >"$TOOLS_LOG4J.$$" <<'EOF'
status = warn
appender.err.type = Console
appender.err.name = STDERR
appender.err.target = SYSTEM_ERR
appender.err.layout.type = PatternLayout
appender.err.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = warn
rootLogger.appenderRef.err.ref = STDERR
EOF
  mv -f "$TOOLS_LOG4J.$$" "$TOOLS_LOG4J"
}

run_tool() {  # run_tool MAIN_CLASS ARGS... (short-lived JVM with quiet logging)
  java -Xmx256m -Dlog4j2.configurationFile="$TOOLS_LOG4J" -cp "$LIBS/*" "$@"
}

# ---------------------------------------------------------------- process / probe
# Prints the pid of *our* broker (the one started on $PROPS) if it is alive.
broker_pid() {
  [[ -f $PID_FILE ]] || return 1
  local pid args
  pid=$(<"$PID_FILE")
  [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || return 1
  # Guard against pid reuse after a crash or reboot: the command line must be ours.
  if [[ -r /proc/$pid/cmdline ]]; then
    args=$(tr '\0' ' ' <"/proc/$pid/cmdline")
  else
    args=$(ps -o args= -p "$pid" 2>/dev/null || true)
  fi
  [[ $args == *kafka.Kafka*"$PROPS"* ]] || return 1
  echo "$pid"
}

port_open() {  # something accepts TCP connections on 127.0.0.1:$1
  # shellcheck disable=SC2016  # $1 is expanded by the inner bash, on purpose
  timeout 2 bash -c 'exec 3<>"/dev/tcp/127.0.0.1/$1"' _ "$1" 2>/dev/null
}

# Sends an ApiVersions v0 request (api_key 18, correlation id 42, client id "sg") and
# checks the reply echoes correlation id 42: proves a Kafka broker (not just any TCP
# listener) is serving requests, without paying for a JVM start per probe.
kafka_answers() {
  local reply
  # shellcheck disable=SC2016  # $1 is expanded by the inner bash, on purpose
  reply=$(timeout 3 bash -c '
      exec 3<>"/dev/tcp/127.0.0.1/$1" || exit 1
      printf "\x00\x00\x00\x0c\x00\x12\x00\x00\x00\x00\x00\x2a\x00\x02sg" >&3
      head -c 8 <&3 | od -An -v -tx1' _ "$1" 2>/dev/null | tr -d ' \n') || return 1
  [[ ${reply:8:8} == 0000002a ]]
}

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

new_cluster_id() {  # 16 random bytes, base64url without padding (Kafka's Uuid format)
  local id
  while :; do
    id=$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n')
    [[ $id != -* && ${#id} -eq 22 ]] && break   # a leading '-' looks like a CLI flag
  done
  echo "$id"
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

print_log_tail() {
  [[ -f $LOG_FILE ]] || return 0
  echo "---- last 40 lines of $LOG_FILE ----" >&2
  tail -n 40 "$LOG_FILE" >&2
  echo "----" >&2
}

# ---------------------------------------------------------------- commands
wait_ready() {  # wait_ready PID
  local pid=$1 deadline=$((SECONDS + ${KAFKA_START_TIMEOUT:-60}))
  while ((SECONDS < deadline)); do
    if ! kill -0 "$pid" 2>/dev/null; then
      rm -f "$PID_FILE"
      print_log_tail
      die "broker exited during startup"
    fi
    if kafka_answers "$KAFKA_PORT"; then
      local p open=1
      for p in $KAFKA_SASL_SSL_PORT $KAFKA_SSL_PORT; do port_open "$p" || open=0; done
      ((open)) && return 0
    fi
    sleep 0.2
  done
  print_log_tail
  # Don't leave a half-started broker behind for the next `up` to trip over.
  stop_pid "$pid"
  rm -f "$PID_FILE"
  die "broker did not answer on 127.0.0.1:$KAFKA_PORT within ${KAFKA_START_TIMEOUT:-60}s (stopped it)"
}

# SIGTERM first: after a SIGKILL the next start stalls ~10 s (DUPLICATE_BROKER_REGISTRATION
# until the old registration's broker.session.timeout.ms expires).
stop_pid() {  # stop_pid PID
  local pid=$1 deadline=$((SECONDS + ${KAFKA_STOP_TIMEOUT:-30}))
  kill -TERM "$pid" 2>/dev/null || return 0
  while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
  if kill -0 "$pid" 2>/dev/null; then
    say "broker (pid $pid) ignored SIGTERM for ${KAFKA_STOP_TIMEOUT:-30}s; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
  fi
}

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

  # Keep the previous run's log for post-mortems, start the new one clean.
  [[ -f $LOG_FILE ]] && mv -f "$LOG_FILE" "$LOG_FILE.1"
  local heap=() extra=()
  read -r -a heap <<<"${KAFKA_HEAP_OPTS:--Xmx512m}"
  read -r -a extra <<<"${KAFKA_JVM_OPTS:-}"
  # nohup + </dev/null: the broker must outlive this shell (and CI step) and never read a tty.
  nohup java "${heap[@]}" "${extra[@]}" \
      -Dlog4j2.configurationFile="$BROKER_LOG4J" -Dkafka.logs.dir="$DATA_DIR" \
      -cp "$LIBS/*" kafka.Kafka "$PROPS" >"$LOG_FILE" 2>&1 </dev/null &
  pid=$!
  echo "$pid" >"$PID_FILE"
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

# ---------------------------------------------------------------- cluster
# Several combined broker+controller nodes; all of them are controller voters (a static quorum,
# controller.quorum.voters), so any one may die and the other two keep a majority.
CLUSTER_DIR=""
CLUSTER_ENV=""

free_tcp_port() {  # a port nothing listens on now (the kernel's pick for an ephemeral bind)
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

cluster_load() {  # reads DIR/cluster.env: BROKERS, CLUSTER_ID, PORT_n, CONTROLLER_PORT_n
  [[ -f $CLUSTER_ENV ]] || return 1
  # shellcheck disable=SC1090  # written by cluster_init below, only numbers and an id
  source "$CLUSTER_ENV"
}

cluster_init() {  # cluster_init N: choose ports and a cluster id once, for good
  local n=$1 i ports=()
  [[ $n =~ ^[0-9]+$ && $n -ge 1 && $n -le 9 ]] || die "cluster: --brokers must be 1..9"
  mkdir -p "$CLUSTER_DIR"
  while ((${#ports[@]} < 4 * n)); do
    local p
    p=$(free_tcp_port)
    [[ " ${ports[*]} " == *" $p "* ]] || ports+=("$p")
  done
  {
    echo "$PROPS_HEADER (cluster layout: kept across restarts)"
    echo "BROKERS=$n"
    echo "CLUSTER_ID=$(new_cluster_id)"
    for ((i = 1; i <= n; i++)); do
      echo "PORT_$i=${ports[3 * i - 3]}"
      echo "CONTROLLER_PORT_$i=${ports[3 * i - 2]}"
      echo "PROXIED_PORT_$i=${ports[3 * i - 1]}"
      echo "PROXY_PORT_$i=${ports[3 * n + i - 1]}"
    done
  } >"$CLUSTER_ENV.$$"
  mv -f "$CLUSTER_ENV.$$" "$CLUSTER_ENV"
}

cluster_bootstrap() {
  local i out=()
  for ((i = 1; i <= BROKERS; i++)); do
    local v="PORT_$i"
    out+=("127.0.0.1:${!v}")
  done
  (IFS=,; echo "${out[*]}")
}

cluster_proxied_bootstrap() {
  local i out=()
  for ((i = 1; i <= BROKERS; i++)); do
    local v="PROXY_PORT_$i"
    out+=("127.0.0.1:${!v}")
  done
  (IFS=,; echo "${out[*]}")
}

cluster_voters() {
  local i out=()
  for ((i = 1; i <= BROKERS; i++)); do
    local v="CONTROLLER_PORT_$i"
    out+=("$i@127.0.0.1:${!v}")
  done
  (IFS=,; echo "${out[*]}")
}

use_node() {  # points the single-broker globals (DATA_DIR, PROPS, PID_FILE, ports) at node $1
  local i=$1 port="PORT_$1" controller="CONTROLLER_PORT_$1"
  [[ $i =~ ^[0-9]+$ && $i -ge 1 && $i -le $BROKERS ]] || die "cluster: no node $i (nodes 1..$BROKERS)"
  local proxied="PROXIED_PORT_$1" proxy="PROXY_PORT_$1"
  NODE=$i
  NODE_PROXIED_PORT=${!proxied}
  NODE_PROXY_PORT=${!proxy}
  KAFKA_PORT=${!port}
  KAFKA_CONTROLLER_PORT=${!controller}
  DATA_DIR="$CLUSTER_DIR/node-$i"
  PROPS="$DATA_DIR/server.properties"
  PID_FILE="$DATA_DIR/kafka.pid"
  LOG_FILE="$DATA_DIR/kafka.log"
  LOG_DIRS="$DATA_DIR/logs"
}

write_node_properties() {
  mkdir -p "$DATA_DIR" "$LOG_DIRS"
  local replicas=$((BROKERS < 3 ? BROKERS : 3))
  local min_isr=$((replicas > 1 ? replicas - 1 : 1))
  cat >"$PROPS.$$" <<EOF
$PROPS_HEADER on every 'cluster up' or 'cluster start'; edits are overwritten.
process.roles=broker,controller
node.id=$NODE
controller.quorum.voters=$(cluster_voters)
# PROXIED: a second client listener that advertises a port nothing listens on until a test
# runs a TCP proxy there (to PROXIED_PORT): clients bootstrapped through it reach every node
# only through the proxy, which can stall them (a network partition) and heal them.
listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$KAFKA_CONTROLLER_PORT,PROXIED://127.0.0.1:$NODE_PROXIED_PORT
advertised.listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT,PROXIED://127.0.0.1:$NODE_PROXY_PORT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,PROXIED:PLAINTEXT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
log.dirs=$LOG_DIRS
num.partitions=1
auto.create.topics.enable=true
# Every topic on $replicas nodes, and a write acknowledged (acks=all) once $min_isr have it: one
# node may be lost without losing an acknowledged write or refusing new ones.
default.replication.factor=$replicas
min.insync.replicas=$min_isr
unclean.leader.election.enable=false
offsets.topic.replication.factor=$replicas
transaction.state.log.replication.factor=$replicas
transaction.state.log.min.isr=$min_isr
share.coordinator.state.topic.replication.factor=$replicas
share.coordinator.state.topic.min.isr=$min_isr
# Few partitions per internal topic: fewer files and faster restarts on a test machine.
offsets.topic.num.partitions=3
transaction.state.log.num.partitions=3
share.coordinator.state.topic.num.partitions=1
group.initial.rebalance.delay.ms=0
# A SIGKILLed node is declared dead (and its partitions' leadership moved) after this long.
broker.session.timeout.ms=6000
broker.heartbeat.interval.ms=1000
EOF
  mv -f "$PROPS.$$" "$PROPS"
}

node_format_once() {
  [[ -f "$LOG_DIRS/meta.properties" ]] && return 0
  run_tool kafka.tools.StorageTool format --cluster-id="$CLUSTER_ID" --config "$PROPS" >/dev/null ||
    die "node $NODE: storage format failed (to start over: $0 cluster down --purge)"
}

node_launch() {  # start node $NODE's JVM in the background (no waiting)
  write_node_properties
  node_format_once
  [[ -f $LOG_FILE ]] && mv -f "$LOG_FILE" "$LOG_FILE.1"
  local heap=() extra=()
  read -r -a heap <<<"${KAFKA_HEAP_OPTS:--Xmx384m}"
  read -r -a extra <<<"${KAFKA_JVM_OPTS:-}"
  nohup java "${heap[@]}" "${extra[@]}" \
      -Dlog4j2.configurationFile="$BROKER_LOG4J" -Dkafka.logs.dir="$DATA_DIR" \
      -cp "$LIBS/*" kafka.Kafka "$PROPS" >"$LOG_FILE" 2>&1 </dev/null &
  echo "$!" >"$PID_FILE"
}

node_wait() {  # wait until node $NODE answers (a node answers once the quorum registered it)
  local pid
  # The pid file, not broker_pid: a node launched a moment ago may still be the shell's fork,
  # whose command line is not the broker's yet.
  pid=$(cat "$PID_FILE" 2>/dev/null) && [[ $pid =~ ^[0-9]+$ ]] || die "node $NODE is not running"
  wait_ready "$pid"
}

cluster_cmd() {
  CLUSTER_DIR=${KAFKA_DATA_DIR:-$CACHE_ROOT/kafka-cluster}
  # Three JVMs electing a quorum on a busy machine: more time than one broker gets.
  KAFKA_START_TIMEOUT=${KAFKA_START_TIMEOUT:-180}
  while [[ $# -gt 0 && $1 == --* ]]; do
    case $1 in
      --data-dir) CLUSTER_DIR=${2:?--data-dir needs a value}; shift 2 ;;
      *) die "cluster: unknown option $1" ;;
    esac
  done
  [[ $# -gt 0 ]] || die "cluster: which command? (up, down, status, bootstrap, kill, stop, start, pid)"
  mkdir -p "$CLUSTER_DIR"
  CLUSTER_DIR=$(cd "$CLUSTER_DIR" && pwd)
  CLUSTER_ENV="$CLUSTER_DIR/cluster.env"
  local sub=$1 i pid
  shift
  case $sub in
    up)
      local want=""
      while [[ $# -gt 0 ]]; do
        case $1 in
          --brokers) want=${2:?--brokers needs a value}; shift 2 ;;
          *) die "cluster up: unknown argument $1" ;;
        esac
      done
      if cluster_load; then
        [[ -z $want || $want == "$BROKERS" ]] ||
          die "cluster in $CLUSTER_DIR has $BROKERS nodes, not $want (cluster down --purge to start over)"
      else
        cluster_init "${want:-3}"
        cluster_load
      fi
      need_java
      fetch_jars
      write_log4j_configs
      local t0=$SECONDS started=()
      for ((i = 1; i <= BROKERS; i++)); do
        use_node "$i"
        broker_pid >/dev/null && continue
        for p in "$KAFKA_PORT" "$KAFKA_CONTROLLER_PORT" "$NODE_PROXIED_PORT"; do
          ! port_open "$p" || die "node $i: port $p on 127.0.0.1 is taken by another process"
        done
        started+=("$i")
      done
      # Format new nodes side by side (a JVM each), then launch them all.
      local formats=()
      for i in "${started[@]}"; do
        use_node "$i"
        (write_node_properties && node_format_once) &
        formats+=("$!")
      done
      for pid in "${formats[@]}"; do wait "$pid" || die "formatting a node's storage failed"; done
      for i in "${started[@]}"; do use_node "$i"; node_launch; done
      # All nodes first, then the wait: none answers before a majority of voters is up.
      for ((i = 1; i <= BROKERS; i++)); do use_node "$i"; node_wait; done
      say "cluster of $BROKERS in $CLUSTER_DIR ready in $((SECONDS - t0))s (started: ${started[*]:-none})"
      echo "bootstrap=$(cluster_bootstrap)"
      ;;
    down)
      local purge=${KAFKA_PURGE:-0}
      [[ ${1:-} == --purge ]] && purge=1
      if cluster_load; then
        # SIGTERM to all at once: a node stopping alone after the others waits for a quorum
        # that is gone (the full stop timeout) before it gives up.
        local pids=()
        for ((i = 1; i <= BROKERS; i++)); do
          use_node "$i"
          if pid=$(broker_pid); then kill -TERM "$pid" 2>/dev/null || true; pids+=("$pid"); fi
          rm -f "$PID_FILE"
        done
        for pid in "${pids[@]}"; do stop_pid "$pid"; done
        ((${#pids[@]} == 0)) || say "stopped ${#pids[@]} node(s) (pids ${pids[*]})"
      fi
      if [[ $purge == 1 ]]; then
        [[ ! -f $CLUSTER_ENV ]] || head -n 1 "$CLUSTER_ENV" | grep -qF "$PROPS_HEADER" ||
          die "refusing to purge $CLUSTER_DIR: its cluster.env was not written by this script"
        [[ -f $CLUSTER_ENV ]] || [[ -z $(ls -A "$CLUSTER_DIR") ]] ||
          die "refusing to purge $CLUSTER_DIR: no cluster.env in it"
        rm -rf -- "$CLUSTER_DIR"
        say "purged $CLUSTER_DIR"
      fi
      ;;
    status)
      cluster_load || { say "no cluster in $CLUSTER_DIR"; return 1; }
      local all=0
      for ((i = 1; i <= BROKERS; i++)); do
        use_node "$i"
        if pid=$(broker_pid) && kafka_answers "$KAFKA_PORT"; then
          say "node $i: running (pid $pid) on 127.0.0.1:$KAFKA_PORT"
        else
          say "node $i: not answering on 127.0.0.1:$KAFKA_PORT"
          all=1
        fi
      done
      echo "bootstrap=$(cluster_bootstrap)"
      return $all
      ;;
    bootstrap) cluster_load || die "no cluster in $CLUSTER_DIR"; cluster_bootstrap ;;
    proxied-bootstrap) cluster_load || die "no cluster in $CLUSTER_DIR"; cluster_proxied_bootstrap ;;
    kill|stop|start|pid)
      [[ $# -eq 1 ]] || die "cluster $sub: which node? (1..N)"
      cluster_load || die "no cluster in $CLUSTER_DIR"
      use_node "$1"
      case $sub in
        kill)
          pid=$(broker_pid) || die "node $NODE is not running"
          kill -KILL "$pid"
          while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
          say "node $NODE killed (pid $pid)"
          ;;
        stop)
          pid=$(broker_pid) || { say "node $NODE is not running"; return 0; }
          stop_pid "$pid"
          rm -f "$PID_FILE"
          say "node $NODE stopped (pid $pid)"
          ;;
        start)
          if ! broker_pid >/dev/null; then
            need_java
            write_log4j_configs
            node_launch
          fi
          node_wait
          say "node $NODE ready on 127.0.0.1:$KAFKA_PORT (pid $(broker_pid))"
          ;;
        pid) broker_pid || die "node $NODE is not running" ;;
      esac
      ;;
    *) die "cluster: unknown command $sub" ;;
  esac
}

case $CMD in
  cluster) cluster_cmd "$@" ;;
  up) [[ $# -eq 0 ]] || die "up takes no arguments"; cmd_up ;;
  down) cmd_down "$@" ;;
  status) cmd_status ;;
  fetch) need_java; fetch_jars; say "jars in $LIBS" ;;
  topics) cmd_topics "$@" ;;
  help) usage ;;
  *) usage >&2; exit 2 ;;
esac
