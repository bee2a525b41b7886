#!/usr/bin/env bash
# A KRaft cluster of several Apache Kafka nodes on this machine, for fault tests (the single
# broker of local dev and CI is scripts/kafka.sh; both share scripts/lib/kafka-common.sh: the
# release, its jars from Maven Central, the probes, a broker's start, wait and stop).
#
# Usage: scripts/kafka-cluster.sh [--data-dir DIR] COMMAND [ARGS]
#        (scripts/kafka.sh cluster [--data-dir DIR] COMMAND [ARGS] runs this too)
#
# Each node is a combined broker+controller, and all of them are the static quorum. Topics
# default to replication factor 3 (fewer nodes: all of them) and min.insync.replicas 2, the
# internal topics too. Ports are free ones picked at the first
# `up` and kept in DIR/cluster.env; every node has its own data dir DIR/node-N.
#   up [--brokers N]   start every node that is not running (N, default 3, is fixed at the
#                   first up) and wait until each answers; prints `bootstrap=HOST:PORT,...` last
#   down [--purge]     stop every node (SIGTERM), --purge deletes DIR
#   status             one line per node; exit 0 if all answer
#   bootstrap          print the bootstrap list
#   proxied-bootstrap  the PROXIED listener's advertised addresses
#                   (PROXY_PORT_n in cluster.env): a client bootstrapped there talks to node n
#                   only through whatever forwards PROXY_PORT_n to PROXIED_PORT_n (a test's TCP
#                   proxy, to cut a client off the cluster and heal it)
#   kill NODE          SIGKILL one node (no clean shutdown)
#   stop NODE          SIGTERM one node and wait until it is gone
#   start NODE         (re)start one node from its data dir, wait for it
#   pid NODE           print a running node's pid
#
# Default DIR: $KAFKA_DATA_DIR, else ${XDG_CACHE_HOME:-$HOME/.cache}/spanguard/kafka-cluster.
# scripts/kafka.sh's single-broker options (--port ...) do not apply; its environment's heap
# (default -Xmx384m per node here), JVM flags and timeouts do (KAFKA_START_TIMEOUT defaults to
# 180 s per node here).
set -euo pipefail

KAFKA_SCRIPT=kafka-cluster.sh
# shellcheck source=scripts/lib/kafka-common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/kafka-common.sh"
# The single broker's secured listeners are not the cluster's (wait_ready reads them).
KAFKA_SASL_SSL_PORT=""
KAFKA_SSL_PORT=""

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

# per_broker VARIABLE [voters]: 127.0.0.1:$VARIABLE_i of each broker i, comma-separated; with
# `voters`, as i@127.0.0.1:... (KRaft's controller.quorum.voters).
per_broker() {
  local variable=$1 voters=${2:-} i id out=()
  for ((i = 1; i <= BROKERS; i++)); do
    local v="${variable}_$i"
    id=""
    [[ -n $voters ]] && id="$i@"
    out+=("${id}127.0.0.1:${!v}")
  done
  (IFS=,; echo "${out[*]}")
}

cluster_bootstrap() { per_broker PORT; }
cluster_proxied_bootstrap() { per_broker PROXY_PORT; }
cluster_voters() { per_broker CONTROLLER_PORT voters; }

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
    die "node $NODE: storage format failed (to start over: $0 down --purge)"
}

node_launch() {  # start node $NODE's JVM in the background (no waiting)
  write_node_properties
  node_format_once
  launch_broker -Xmx384m
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
  while [[ $# -gt 0 && $1 == -* ]]; do
    case $1 in
      --data-dir) CLUSTER_DIR=${2:?--data-dir needs a value}; shift 2 ;;
      -h|--help) usage; return 0 ;;
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

cluster_cmd "$@"
