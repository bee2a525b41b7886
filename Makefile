# spanguard: everything a developer or CI runs goes through these targets.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test typecheck test-typescript test-go test-java java-agents ts-agents test-agents test-failover test-faults soak test-unit lint bench bench-eviction bench-stall bench-prompt-export bench-pipeline bench-backtest bench-gateway gateway-venv kafka-up kafka-down topics worker \
	collector helm compose constraints up down demo clean fixtures

install: $(STAMP)

# The LiteLLM proxy and spanguard's guardrail for it (spanguard[litellm]) in a virtualenv of
# their own: litellm's pins (httpx, openai, aiohttp) conflict with constraints.txt. This
# checkout is installed editable into it, at the versions of constraints-litellm.txt.
GATEWAY_VENV := .venv-litellm
GATEWAY_STAMP := $(GATEWAY_VENV)/.installed

gateway-venv: $(GATEWAY_STAMP)

$(GATEWAY_STAMP): pyproject.toml constraints-litellm.txt
	$(PYTHON) -m venv $(GATEWAY_VENV)
	$(GATEWAY_VENV)/bin/pip install --quiet --upgrade pip setuptools wheel
	PYTHONWARNINGS="ignore:Editable installation" \
		$(GATEWAY_VENV)/bin/pip install --quiet -c constraints-litellm.txt -e ".[litellm]"
	@touch $@

# Re-install when the dependency list changes; a fresh clone gets everything from PyPI, at the
# versions of constraints.txt (the tested set; `make constraints` rewrites it from .venv).
$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "spanguard needs Python >= 3.11 ($(PYTHON) is older)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip setuptools wheel
	@# setuptools tells every editable install of a package_dir layout that folders named like
	@# the package may shadow it: here those folders are the package, so the notice is silenced.
	PYTHONWARNINGS="ignore:Editable installation" \
		$(BIN)/pip install --quiet -c constraints.txt -e ".[dev,worker,demo,instrumentation-tests]"
	@touch $(STAMP)

# The tests need the real broker (started here, idempotent, and left running for the next run;
# `make kafka-down` stops it), the Collector binary and helm; all three are fetched or built
# once into ~/.cache/spanguard, outside the repo, so the long first builds show up here;
# `compose` checks docker-compose.yml with Compose v2 (built from Go modules if the plugin is missing).
test: install gateway-venv kafka-up collector helm compose test-typescript test-go test-java java-agents ts-agents
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python scripts/typecheck.py
	@# The slowest tests at the end of the log: where the CI budget goes.
	$(BIN)/pytest -q --durations=25

# mypy over the whole package, each folder under its import name, and bench/ and scripts/
# (scripts/typecheck.py; the settings are pyproject.toml's [tool.mypy]): strict for the schemas
# and the detection kernel, a baseline elsewhere. Its cache is .mypy_cache: about a minute from
# nothing, a second or two after.
typecheck: install
	$(BIN)/python scripts/typecheck.py

# The killswitch clients for TypeScript (node's test runner) and Go (go test), each on the shared
# kill-signal vectors and against the real broker; npm ci and the Go module proxy fetch their
# dependencies once (node >= 20 and go on PATH). The TypeScript client's `npm test` first runs
# tsc over its index.d.ts and a usage file compiled against it (npm run typecheck).
TS_CLIENT := clients/typescript
TS_AGENTS := tests/support/ts_agents

$(TS_CLIENT)/node_modules/.installed: $(TS_CLIENT)/package-lock.json
	cd $(TS_CLIENT) && npm ci --no-audit --no-fund
	@touch $@

# The TypeScript agents that make the span fixtures (the fixture tests re-run them when present).
$(TS_AGENTS)/node_modules/.installed: $(TS_AGENTS)/package-lock.json
	cd $(TS_AGENTS) && npm ci --no-audit --no-fund
	@touch $@

# VoltAgent's agent: a package of its own (it asks for the AI SDK 6 as `ai`, the others use 7).
$(TS_AGENTS)/voltagent/node_modules/.installed: $(TS_AGENTS)/voltagent/package-lock.json
	cd $(TS_AGENTS)/voltagent && npm ci --no-audit --no-fund
	@touch $@

ts-agents: $(TS_AGENTS)/node_modules/.installed $(TS_AGENTS)/voltagent/node_modules/.installed

test-typescript: kafka-up $(TS_CLIENT)/node_modules/.installed
	cd $(TS_CLIENT) && npm test

# The Collector's spanguard_pack exporter (deploy/collector/packexporter) is tested there too, on
# franz-go's in-process fake cluster.
test-go: kafka-up
	cd clients/go && go mod download && go vet ./... && go test -count=1 ./...
	cd deploy/collector/packexporter && go mod download && go vet ./... && go test -count=1 ./...

# The Java killswitch (JUnit, Maven Surefire) on the shared vectors and the real broker; Maven
# Central fills ~/.m2 once (a JDK >= 17 and mvn on PATH), later runs need no network.
test-java: kafka-up
	cd clients/java && mvn -q -B test

# The Java agents (LangChain4j over a scripted model) for the span fixtures and the end-to-end
# test: clients/java installed into ~/.m2, then the agents with their dependencies in target/lib.
java-agents:
	cd clients/java && mvn -q -B install -DskipTests
	cd tests/support/java_agents && mvn -q -B package -DskipTests

# Two workers across a SIGKILL of a broker of the test's own and its restart from its data
# directory, with its figures (about a minute, so not in `make test`; the shared broker is not
# touched).
test-failover: install
	$(BIN)/pytest -q -s -m broker_failover tests/streams/test_failover_kafka.py

# Every framework x instrumentation x adapter row against the real stack (Collector, default
# worker, KillSwitch): the looping agent stops at its 3rd call, its healthy twin finishes; each
# row prints its calls before the stop and the stop latency (`make test` runs one row).
# Google ADK and strands run in virtualenvs of their own (made or brought up to date here).
# The gateway rows (tests/killswitch/test_gateway_e2e.py) run the real LiteLLM proxy from
# gateway-venv.
test-agents: install gateway-venv kafka-up collector
	$(BIN)/python -m tests.support.instrumented_agents --venv google-adk
	$(BIN)/python -m tests.support.instrumented_agents --venv strands
	$(BIN)/pytest -q -s -m "agents or not agents" tests/killswitch/test_agents_e2e.py \
		tests/killswitch/test_agents_adapters.py tests/killswitch/test_gateway_e2e.py

# Faults of a three-broker cluster of their own (scripts/kafka-cluster.sh, free ports) under two
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
	$(BIN)/python -m spanguard.cli.demo run

kafka-down:
	scripts/kafka.sh down

constraints: install
	$(BIN)/python scripts/constraints.py > constraints.txt

topics: install kafka-up
	$(BIN)/spanguard topics create

worker: install kafka-up topics
	$(BIN)/spanguard worker

# The tests that need no broker and build nothing, in under two minutes, on the pure-Python core
# of the editable install, spread over the cores (pytest-xdist). `make test` runs the rest: the
# compiled core's test (it builds the mypyc wheel first: minutes on 2 cores), the re-runs of the
# instrumented agents, in every language, that made the span fixtures (minutes), the framework
# adapters' runs of real agents, tests/deploy (helm, which a new machine builds from Go), and
# the gateway's fail-open test (it waits out the Kafka client's own 15 s metadata wait).
UNIT_LEFT_OUT := --ignore=tests/deploy --ignore=tests/killswitch/test_agents_adapters.py \
	--deselect tests/detection/test_compiled_core.py::test_the_compiled_wheel_passes_the_cores_tests \
	--deselect tests/detection/test_instrumentation_fixtures.py::test_the_generator_reproduces_the_fixtures \
	--deselect tests/detection/test_multi_framework_fixtures.py::test_the_fixtures_are_what_the_libraries_emit_now \
	--deselect tests/detection/test_multi_agent_fixtures.py::test_the_fixtures_are_what_the_libraries_emit_now \
	--deselect tests/detection/test_language_fixtures.py::test_the_typescript_generator_reproduces_the_fixtures \
	--deselect tests/detection/test_language_fixtures.py::test_the_java_generator_reproduces_the_fixtures \
	--deselect tests/killswitch/test_gateway.py::test_an_unreachable_kill_topic_fails_open_by_default_and_says_so_once

test-unit: install
	$(BIN)/pytest -q -n auto -m "not kafka" $(UNIT_LEFT_OUT)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Span fixtures from the real instrumentation libraries (tests/fixtures/instrumentation).
# Google ADK and strands get virtualenvs of their own (their OTel pins exclude the SDK's); the
# TypeScript frameworks run under node from tests/support/ts_agents (its own lockfile).
fixtures: install ts-agents java-agents
	$(BIN)/python -m tests.support.instrumented_agents --venv google-adk
	$(BIN)/python -m tests.support.instrumented_agents --venv strands
	$(BIN)/python -m tests.support.instrumented_agents
	$(BIN)/python -m tests.support.instrumented_agents --typescript
	$(BIN)/python -m tests.support.instrumented_agents --go
	$(BIN)/python -m tests.support.instrumented_agents --java
	$(BIN)/python -m tests.support.multi_frameworks

# Both builds of the detection core: pure Python (a plain install) and compiled by mypyc (setup.py;
# the worker image), each against the same process's protobuf parse and attribute scan.
bench: install
	$(BIN)/python -m bench.bench_core
	$(BIN)/python scripts/compiled_core.py build
	$(BIN)/python scripts/compiled_core.py run -m bench.bench_core

# The longest per-batch eviction pause with a million idle traces, against a full scan.
bench-eviction: install
	$(BIN)/python -m bench.bench_eviction

# What the adapters' prompt export costs a healthy agent on the SDK's defaults: calls per second
# with and without it, in one process (about a minute and a half; no broker).
bench-prompt-export: install
	$(BIN)/python -m bench.bench_prompt_export

# The longest event-loop stall with a million idle traces in a real RocksDB table while
# eviction runs per batch, against a full scan (about a minute; no broker).
bench-stall: install
	$(BIN)/python -m bench.bench_stall

# One worker (RocksDB, signed) against the core; detection latency through the Collector at
# 2,000 and 10,000 spans/s; the packed path and where a span's time goes; two workers against
# one; the conversation, agent and tool scopes on against off (the worker image's compiled core,
# then pure Python); the fleet's incident decision time; the compiled worker against the
# compiled core; a bare Faust agent on the same topic: one run, its targets line last (about ten
# minutes on a quiet machine).
bench-pipeline: install kafka-up
	$(BIN)/python scripts/compiled_core.py build
	$(BIN)/python -m bench.bench_pipeline

# `spanguard backtest` over a topic of a million spans (six days of record times): records/s,
# peak RSS, and a bare consume loop over the same topic as the baseline (a few minutes).
bench-backtest: install kafka-up
	$(BIN)/python -m bench.bench_backtest

# What the gateway's guardrail adds to a model call through the real LiteLLM proxy: p50/p99 per
# call with and without it, in one run, and their ratio (about a minute; the shared broker).
bench-gateway: install gateway-venv kafka-up
	$(BIN)/python -m bench.bench_gateway

clean:
	rm -rf $(VENV) $(GATEWAY_VENV) .pytest_cache .ruff_cache build *.egg-info
