"""Agents taking the other path, end to end (issue 44): a fleet of real LangGraph agents whose
shared tool breaks is one incident, its contain reaches every agent, each agent's next call of
the tool is refused as a tool error its model reads, the model calls the other tool and the run
finishes; after `spanguard release --tool` the tool is called again, answers, and the incident
recovers.

The stack is the real one: the agents (tests/support/fleet_agents.py: OpenInference's LangChain
instrumentation, the SDK's default BatchSpanProcessor and OTLP exporter, spanguard's LangChain
adapter over a KillSwitch each) export to the Collector built from deploy/collector, which
writes to Kafka; `spanguard worker` runs the fleet rules with the action `contain`, at the
shipped thresholds (FleetPolicy's defaults): AGENTS is above `min_traces`, so one wave of
failing runs crosses it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from spanguard.schemas.policy import FleetPolicy
from tests.support.fleet_agents import (
    FALLBACK,
    FALLBACK_ANSWER,
    GAVE_UP,
    PRIMARY,
    PRIMARY_ANSWER,
)
from tests.support.kafka_harness import (
    BOOTSTRAP,
    ROOT,
    SIGNING_KEY,
    Collector,
    Topics,
    WorkerProcess,
    collector_env,
    ensure_broker,
)
from tests.support.waiting import wait_until
from tests.support.worker import operator_cli

pytestmark = pytest.mark.kafka

AGENTS = 12
POLICY = {"fleet": {"enabled": True, "action": "contain"}}  # the shipped thresholds


class Fleet:
    """The agents' process (tests/support/fleet_agents.py), one command a line."""

    def __init__(self, endpoint: str, topics: Topics, log: Path) -> None:
        env = {
            **os.environ,
            "SPANGUARD_SIGNING_KEY": SIGNING_KEY,
            "PYTHONPATH": str(ROOT),
            "PYTHONWARNINGS": "ignore::DeprecationWarning",  # LangGraph's create_react_agent
        }
        self.log = log
        self._log = log.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.support.fleet_agents", "--endpoint", endpoint,
             "--kill-topic", topics.kills, "--agents", str(AGENTS)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            cwd=ROOT, env=env,
        )  # fmt: skip
        assert self.answer() == {"ready": True}

    def answer(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line, f"the fleet's process ended ({self.process.poll()}):\n{self.log_tail()}"
        return json.loads(line)

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def ask(self, **command: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self.answer()

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        self._log.close()


@pytest.fixture
def fleet_stack(tmp_path: Path):
    """The worker (fleet rules, action contain), the Collector in front of it, a consumer of
    the detections and kill topics, and the agents' process."""
    ensure_broker()
    topics = Topics()
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump(POLICY))
    worker = WorkerProcess(topics, tmp_path / "worker", policy=policy).start()
    collector_environment, http_port = collector_env(
        BOOTSTRAP, topics.input, tmp_path / "collector", OTELCOL_METRICS_LEVEL="none"
    )
    collector = [str(ROOT / "scripts" / "collector.sh")]
    records = Collector(topics.detections, topics.kills)
    fleet = None
    try:
        subprocess.run([*collector, "up"], env=collector_environment, check=True, timeout=900)
        fleet = Fleet(f"http://127.0.0.1:{http_port}", topics, tmp_path / "agents.log")
        yield topics, records, fleet, worker
    finally:
        if fleet is not None:
            fleet.close()
        subprocess.run([*collector, "down"], env=collector_environment, timeout=60)
        records.close()
        worker.stop()
        topics.delete()


def tool_records(records: Collector, topic: str) -> list[tuple[float, dict]]:
    found = []
    for message in records.where(lambda m: m["topic"] == topic):
        record = json.loads(message["value"])
        if record.get("scope") == "tool":
            found.append((message["received"], record))
    return found


def test_a_fleet_whose_tool_breaks_takes_the_other_tool_until_the_release(fleet_stack):
    topics, records, fleet, worker = fleet_stack
    assert FleetPolicy().min_traces < AGENTS

    # 1. The tool breaks for everyone: each agent calls it once, fails, gives up.
    failing = fleet.ask(run="failing")["runs"]
    assert [(run["ran"], run["answer"], run["error"]) for run in failing] == [
        ([PRIMARY], GAVE_UP, None)
    ] * AGENTS
    failure_start = min(run["started"] for run in failing)

    # 2. One incident, with the contain on the kill topic.
    incidents = wait_until(
        lambda: tool_records(records, topics.detections),
        60,
        lambda: f"the fleet incident; worker:\n{worker.log_tail()}",
    )
    incident_at, incident = incidents[0]
    assert (incident["rule"], incident["tool"], incident["action"]) == (
        "tool_failing",
        PRIMARY,
        "contain",
    )
    assert incident["hits"] >= FleetPolicy().min_traces
    [(_, contain)] = wait_until(lambda: tool_records(records, topics.kills), 30, "the contain")
    assert contain["kind"] == "kill" and contain["signature"]

    # 3. Every agent's switch refuses the tool; the next runs take the other tool and finish.
    seen = fleet.ask(**{"await": "contained", "timeout": 30})["seen"]
    assert None not in seen, seen
    contained = fleet.ask(run="healthy")["runs"]
    for run, contain_seen in zip(contained, seen, strict=True):
        assert run["error"] is None, run  # no agent killed: each run finishes
        # The model read the refusal as the tool's error (its script keys on CONTAINED).
        assert run["refused"] == [PRIMARY] and run["ran"] == [FALLBACK], run
        assert run["answer"] == FALLBACK_ANSWER, run
        assert run["fallback_at"] > contain_seen

    # 4. Released by hand: the tool is called again and answers; the incident recovers.
    released_at = time.time()
    done = operator_cli("release", topics, "--tool", PRIMARY)
    assert done.returncode == 0, done.stderr
    lifted = fleet.ask(**{"await": "released", "timeout": 30})["seen"]
    assert None not in lifted, lifted
    healthy = fleet.ask(run="healthy")["runs"]
    assert [(run["ran"], run["answer"], run["error"]) for run in healthy] == [
        ([PRIMARY], PRIMARY_ANSWER, None)
    ] * AGENTS
    recovered = wait_until(
        lambda: [
            r for r in tool_records(records, topics.detections) if r[1]["action"] == "recovered"
        ],
        60,
        "the incident's recovery",
    )

    time.sleep(2.0)  # time for a second incident to show up, were there one
    decided = tool_records(records, topics.detections)
    opened = {r["decision_id"] for _, r in decided if r["action"] == "contain"}
    assert len(opened) == 1 and len(recovered) == 1, [
        (r["action"], r["reason"]) for _, r in decided
    ]
    kills = [json.loads(m["value"]) for m in records.where(lambda m: m["topic"] == topics.kills)]
    assert all(k.get("scope") == "tool" for k in kills), kills  # no trace, agent killed
    first_fallback = min(run["fallback_at"] for run in contained)
    print(
        f"\nfleet of {AGENTS} LangGraph agents: failure start 0.0 s,"
        f" incident record {incident_at - failure_start:.1f} s"
        f" ({incident['hits']} of {incident['traces']} traces),"
        f" contain in every agent's switch {max(seen) - failure_start:.1f} s,"
        f" first fallback call {first_fallback - failure_start:.1f} s,"
        f" release {released_at - failure_start:.1f} s (lifted in every switch"
        f" {max(lifted) - failure_start:.1f} s), recovered record"
        f" {recovered[0][0] - failure_start:.1f} s"
    )
