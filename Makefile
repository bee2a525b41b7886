# spanguard: everything a developer or CI runs goes through these targets.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-failover test-faults soak test-unit lint bench bench-eviction bench-stall bench-pipeline kafka-up kafka-down topics worker \
	collector helm compose constraints up down demo clean fixtures

install: $(STAMP)

# Re-install when the dependency list changes; a fresh clone gets everything from PyPI, at the
# versions of constraints.txt (the tested set; `make constraints` rewrites it from .venv).
$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "spanguard needs Python >= 3.11 ($(PYTHON) is older)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip setuptools wheel
	$(BIN)/pip install --quiet -c constraints.txt -e ".[dev,worker,demo,instrumentation-tests]"
	@touch $(STAMP)

# The tests need the real broker (started here, idempotent, and left running for the next run;
# `make kafka-down` stops it), the Collector binary and helm; all three are fetched or built
# once into ~/.cache/spanguard, outside the repo, so the long first builds show up here;
# `compose` checks docker-compose.yml with Compose v2 (built from Go modules if the plugin is missing).
test: install kafka-up collector helm compose
	$(BIN)/ruff check .
	$(BIN)/pytest -q

# Two workers across a SIGKILL of a broker of the test's own and its restart from its data
# directory, with its figures (about a minute, so not in `make test`; the shared broker is not
# touched).
test-failover: install
	$(BIN)/pytest -q -s -m broker_failover tests/streams/test_failover_kafka.py

# Faults of a three-broker cluster of their own (scripts/kafka.sh cluster, free ports) under two
# workers on their shipped defaults: partition leaders SIGKILLed, a rolling restart, a frozen
# worker, the Collector SIGKILLed (with and without its queue on disk), a worker cut off from
# the brokers. Each prints kills expected/sent/doubled/lost and its recovery time (10-17 min
# here). The Collector one with its queue on disk also runs in `make test`.
test-faults: install collector
	$(BIN)/pytest -q -s -m "kafka or faults" tests/streams/test_faults_brokers.py \
		tests/streams/test_faults_collector.py tests/streams/test_faults_workers.py

# 20-30 minutes of mixed traffic at 2,000 spans/s through the real Collector into two workers on
# a three-broker cluster, a worker or a broker SIGKILLed every few minutes; prints kills
# expected/sent/doubled/lost, RSS, the longest lag and its drain, detection latency p50/p99.
soak: install collector
	$(BIN)/python -m bench.soak

kafka-up:
	scripts/kafka.sh up

# The OpenTelemetry Collector (otlp -> batch -> kafka), built with the Collector Builder from
# the Go module proxy once into ~/.cache/spanguard (first build ~5-6 min on 2 cores, then reused
# until the manifest changes), and its config checked with the binary's `validate`.
collector:
	scripts/collector.sh build
	scripts/collector.sh validate

# Helm from the Go module proxy (built once into ~/.cache/spanguard), then lint and render the chart.
helm:
	scripts/helm.sh lint --strict helm/spanguard
	scripts/helm.sh template spanguard helm/spanguard >/dev/null

# docker-compose.yml checked by Compose v2 itself (`config` needs no Docker engine); where the
# docker CLI has no compose plugin, scripts/compose.sh builds one from its Go module, once.
compose:
	@if docker compose version >/dev/null 2>&1; then docker compose -f docker-compose.yml config --quiet; \
	else scripts/compose.sh -f docker-compose.yml config --quiet; fi

# The whole local stack in the background: Kafka, topics, Collector (4317/4318), worker.
up: install
	scripts/stack.sh up

down:
	scripts/stack.sh down

# The README's main command: both demo agents against the real stack, from nothing.
demo: install
	$(BIN)/python -m spanguard.demo run

kafka-down:
	scripts/kafka.sh down

constraints: install
	$(BIN)/python scripts/constraints.py > constraints.txt

topics: install kafka-up
	$(BIN)/spanguard topics create

worker: install kafka-up topics
	$(BIN)/spanguard worker

test-unit: install
	$(BIN)/pytest -q -m "not kafka"

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Span fixtures from the real instrumentation libraries (tests/fixtures/instrumentation).
# Google ADK and strands get virtualenvs of their own (their OTel pins exclude the SDK's).
fixtures: install
	$(BIN)/python -m tests.support.instrumented_agents --venv google-adk
	$(BIN)/python -m tests.support.instrumented_agents --venv strands
	$(BIN)/python -m tests.support.instrumented_agents

bench: install
	$(BIN)/python -m bench.bench_core

# The longest per-batch eviction pause with a million idle traces, against a full scan.
bench-eviction: install
	$(BIN)/python -m bench.bench_eviction

# The longest event-loop stall with a million idle traces in a real RocksDB table while
# eviction runs per batch, against a full scan (about a minute; no broker).
bench-stall: install
	$(BIN)/python -m bench.bench_stall

# One worker (RocksDB, signed) against the core, detection latency at 2,000 spans/s, two workers
# against one, and a bare Faust agent on the same topic, in one run (about 2-3 minutes).
bench-pipeline: install kafka-up
	$(BIN)/python -m bench.bench_pipeline

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
