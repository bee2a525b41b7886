"""End to end: real agents -> OTLP -> the real Collector -> Kafka -> the worker -> KillSwitch.

The agents are `python -m spanguard.cli.demo agent ...` processes: OpenTelemetry SDK spans
exported over OTLP/HTTP to a Collector built from deploy/collector (scripts/collector.sh),
whose kafka exporter writes to the worker's input topic; each agent calls check() on a
KillSwitch before every tool call. Both Collectors the docs offer: the stock kafka exporter
(config.yaml: the worker splits each batch through its repartition topic) and spanguard_pack
(packed.yaml over it: batches packed by partition, decided where they land, no repartition).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.kafka_harness import (
    BOOTSTRAP,
    ROOT,
    Collector,
    Topics,
    WorkerProcess,
    collector_env,
    ensure_broker,
)

pytestmark = pytest.mark.kafka

STEP_DELAY = 0.3  # seconds each agent "thinks" between tool calls
# The pipeline (agent export 50 ms + Collector batch 20 ms + Kafka + worker) must deliver the
# kill before the support agent's 5th call: its 3rd identical call trips the rule, and the
# signal may take up to two think-times (0.6 s) to arrive.
MAX_CALLS_BEFORE_KILL = 4
SIGNING_KEY = "e2e-signing-key-0123456789"


CONFIGS = {
    "stock": [],
    "packed": [str(ROOT / "deploy" / "collector" / c) for c in ("config.yaml", "packed.yaml")],
}


# One stack per module and Collector: each test's agents have traces of their own, and the
# default policy decides trace by trace, so a test never sees another's decisions.
@pytest.fixture(scope="module", params=sorted(CONFIGS))
def stack_of_module(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest):
    ensure_broker()
    topics = Topics()
    data = tmp_path_factory.mktemp(f"stack-{request.param}")
    env, http_port = collector_env(
        BOOTSTRAP, topics.input, data / "collector", OTELCOL_METRICS_LEVEL="none"
    )
    worker = WorkerProcess(topics, data, env={"SPANGUARD_SIGNING_KEY": SIGNING_KEY}).start()
    subprocess.run(
        [str(ROOT / "scripts" / "collector.sh"), "up", *CONFIGS[request.param]],
        env=env, check=True, timeout=900,
    )  # fmt: skip
    repartitioned = Collector(topics.repartition)
    yield topics, http_port, repartitioned, request.param
    repartitioned.close()
    subprocess.run([str(ROOT / "scripts" / "collector.sh"), "down"], env=env, timeout=60)
    assert worker.stop() == 0
    topics.delete()


@pytest.fixture
def stack(stack_of_module):
    topics, http_port, repartitioned, config = stack_of_module
    before = len(repartitioned.where(lambda m: True))
    yield topics, http_port
    # The stock Collector's batches take the worker's repartition hop; packed, every batch
    # was decided where it landed: each test's own traffic shows it.
    assert (len(repartitioned.where(lambda m: True)) > before) == (config == "stock")


def run_agent(kind: str, topics: Topics, http_port: int, signing_key: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "spanguard.cli.demo", "agent", kind, "--step-delay", str(STEP_DELAY),
         "--otlp-endpoint", f"http://127.0.0.1:{http_port}", "--bootstrap", BOOTSTRAP,
         "--kill-topic", topics.kills],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "SPANGUARD_SIGNING_KEY": signing_key},
    )  # fmt: skip


def result_of(process: subprocess.Popen) -> dict:
    out, _ = process.communicate(timeout=180)
    assert process.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])


def test_looping_agent_is_killed_and_research_agent_finishes(stack):
    topics, http_port = stack
    support = run_agent("support", topics, http_port, SIGNING_KEY)
    research = run_agent("research", topics, http_port, SIGNING_KEY)
    support_result, research_result = result_of(support), result_of(research)

    assert support_result["status"] == "killed", support_result
    assert 3 <= support_result["calls"] <= MAX_CALLS_BEFORE_KILL, support_result
    assert support_result["reason"] == "search_docs called 3x in last 3 steps"
    assert support_result["kill_latency_s"] is not None
    print(f"kill latency seen by the agent: {support_result['kill_latency_s'] * 1000:.0f} ms")

    assert research_result["status"] == "finished", research_result
    assert research_result["calls"] == 80


def test_a_forged_signal_does_not_kill(stack):
    topics, http_port = stack
    # The agent trusts another key than the worker's: the worker's signals look forged.
    support = run_agent("support", topics, http_port, "not-the-worker-key")
    support_result = result_of(support)
    assert support_result["status"] == "gave_up", support_result
