"""End to end in other languages: a TypeScript and a Go agent -> OTLP -> the real Collector ->
Kafka -> the worker -> their own killswitch, killed before their fourth identical call.

- TypeScript: tests/support/ts_agents/e2e_agent.mjs, a real AI SDK 6 agent (scripted model)
  whose spans are the AI SDK's own legacy `ai.*` telemetry, and clients/typescript's
  KillSwitch with guardTools;
- Go: tests/support/go_agent, OpenTelemetry Go SDK spans with the GenAI conventions, and
  clients/go's KillSwitch.

Each agent thinks STEP_DELAY between calls, so the signal has that long, from the end of the
3rd call's span, to reach it before the 4th: the measured latency is printed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy.test_e2e import SIGNING_KEY, stack, stack_of_module  # noqa: F401 - fixtures
from tests.support.cli import result_of
from tests.support.kafka_harness import BOOTSTRAP, ROOT, Topics

pytestmark = pytest.mark.kafka

STEP_DELAY = 1.5  # seconds; generous for a loaded machine (the latency is printed)
TS_AGENTS = ROOT / "tests" / "support" / "ts_agents"
TS_CLIENT = ROOT / "clients" / "typescript"
GO_AGENT = ROOT / "tests" / "support" / "go_agent"


def agent_flags(topics: Topics, http_port: int) -> list[str]:
    return [
        "--endpoint", f"http://127.0.0.1:{http_port}", "--bootstrap", BOOTSTRAP,
        "--kill-topic", topics.kills, "--step-delay",
    ]  # fmt: skip


def check_killed_before_the_fourth_call(result: dict, language: str) -> None:
    assert result["status"] == "killed", result
    assert result["calls"] == 3, result
    assert result["reason"].startswith("search_docs called 3x"), result
    assert result["kill_latency_s"] is not None
    print(
        f"\n{language} agent: killed after 3 calls, kill latency {result['kill_latency_s']:.3f} s"
    )


@pytest.fixture
def node_ready() -> None:
    if shutil.which("node") is None:
        pytest.skip("node is not on PATH: the TypeScript agent cannot run")
    for folder in (TS_AGENTS, TS_CLIENT):
        if not (folder / "node_modules").is_dir():
            pytest.fail(f"{folder}/node_modules is missing: run `make ts-agents test-typescript`")


@pytest.fixture
def go_agent(tmp_path: Path) -> Path:
    if shutil.which("go") is None:
        pytest.skip("go is not on PATH: the Go agent cannot run")
    binary = tmp_path / "go-agent"
    subprocess.run(["go", "build", "-o", str(binary), "."], cwd=GO_AGENT, check=True, timeout=600)
    return binary


def test_an_ai_sdk_agent_is_killed_through_the_typescript_killswitch(stack, node_ready):  # noqa: F811
    topics, http_port = stack
    command = ["node", "e2e_agent.mjs", *agent_flags(topics, http_port), str(STEP_DELAY)]
    check_killed_before_the_fourth_call(result_of(command, SIGNING_KEY, TS_AGENTS), "TypeScript")


def test_a_go_agent_is_killed_through_the_go_killswitch(stack, go_agent):  # noqa: F811
    topics, http_port = stack
    command = [str(go_agent), *agent_flags(topics, http_port), f"{STEP_DELAY}s"]
    check_killed_before_the_fourth_call(result_of(command, SIGNING_KEY, GO_AGENT), "Go")


def test_a_forged_signal_does_not_kill_the_typescript_agent(stack, node_ready):  # noqa: F811
    topics, http_port = stack
    command = ["node", "e2e_agent.mjs", *agent_flags(topics, http_port), "0.3", "--max-calls", "8"]
    result = result_of(command, "not-the-worker-key-0123", TS_AGENTS)
    assert result["status"] == "gave_up" and result["calls"] == 8, result
