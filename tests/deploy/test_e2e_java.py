"""End to end in Java: a real LangChain4j agent -> OTLP -> the real Collector -> Kafka -> the
default worker -> clients/java's KillSwitch, through LangChain4jGuard before each tool call.

The agent (tests/support/java_agents, built by `make java-agents`) is a LangChain4j AI service
whose scripted model asks for the same search again and again, thinking STEP_DELAY a turn; its
spans come from LangChain4jTracing (LangChain4j makes none itself) and leave through the
OpenTelemetry Java SDK's OTLP/HTTP exporter. The default policy trips at the 3rd identical call,
so, as the Python agents' rows at the same step time (tests/killswitch/test_agents_e2e.py), the
kill must stop it before its 4th call, or its 5th on a loaded machine; the kill latency (the end
of the 3rd call to the kill in the agent's book) is printed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.deploy.test_e2e import SIGNING_KEY, stack, stack_of_module  # noqa: F401 - fixtures
from tests.support.cli import result_of
from tests.support.instrumented_agents import java_command, java_ready
from tests.support.kafka_harness import BOOTSTRAP, ROOT, Topics

pytestmark = pytest.mark.kafka

STEP_DELAY = 0.3  # seconds the scripted model thinks a turn
TRIPS_AT = 3  # the default policy's tool_loop threshold


@pytest.fixture
def java_agent() -> None:
    why_not = java_ready()
    if why_not is not None:
        pytest.fail(f"the Java agent is not built: {why_not}")


def run_agent(topics: Topics, http_port: int, signing_key: str, *extra: str) -> dict:
    command = java_command(
        "e2e", "--endpoint", f"http://127.0.0.1:{http_port}", "--bootstrap", BOOTSTRAP,
        "--kill-topic", topics.kills, "--ack-topic", topics.acks,
        "--step-delay", str(STEP_DELAY), *extra,
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPANGUARD_SIGNING_KEY")}
    return result_of(command, signing_key, ROOT, env)


def test_a_langchain4j_agent_is_killed_through_the_java_killswitch(stack, java_agent):  # noqa: F811
    topics, http_port = stack
    result = run_agent(topics, http_port, SIGNING_KEY)
    assert result["status"] == "killed", result
    assert TRIPS_AT <= result["calls"] <= TRIPS_AT + 1, result
    assert result["reason"].startswith("search_docs called 3x"), result
    # What the agent's code sees: AgentKilled itself, out of the AI service's method.
    assert result["exception"] == ["AgentKilled"], result
    assert result["stop_event"] == "kill", result  # the trace itself says why it ended
    assert result["kill_latency_s"] is not None, result
    print(
        f"\nJava (LangChain4j) agent: killed after {result['calls']} calls,"
        f" kill latency {float(result['kill_latency_s']):.3f} s"
    )
    # The Java agent acknowledged the kill on the ack topic, signed: Python's explain checks it.
    explained = subprocess.run(
        [sys.executable, "-m", "spanguard.cli", "explain", result["trace_id"],
         "--bootstrap", BOOTSTRAP, "--detections-topic", topics.detections,
         "--ack-topic", topics.acks, "--timeout", "20"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
        env={**os.environ, "SPANGUARD_SIGNING_KEY": SIGNING_KEY},
    ).stdout  # fmt: skip
    assert "tool_loop" in explained and "  obeyed: by " in explained, explained
    assert "not checked" not in explained, explained


def test_a_kill_signed_with_another_key_stops_nothing(stack, java_agent):  # noqa: F811
    """The worker signs with its key; an agent holding another one refuses every kill."""
    topics, http_port = stack
    result = run_agent(topics, http_port, "not-the-worker-key-0123", "--max-calls", "8")
    assert result["status"] == "gave_up" and result["calls"] == 8, result
    assert result["stop_event"] is None, result
