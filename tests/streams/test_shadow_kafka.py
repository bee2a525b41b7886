"""Shadow mode through the real broker: a flag is recorded and counted, never sent to the agent.

Both workers run the shipped defaults (RocksDB store, signed signals); the first takes a policy
with one agent in shadow mode (`action: flag`), the second the same policy under `--mode
observe`, which flags for every agent.
"""

from __future__ import annotations

import time

import pytest

from spanguard.schemas.decision import validate
from tests.support.kafka_harness import Collector, WorkerProcess
from tests.support.spans import AgentRecorder
from tests.support.worker import running_worker, send_spans

pytestmark = pytest.mark.kafka

DEADLINE = 20.0
POLICY = """
defaults:
  token_budget: 1000
agents:
  - match: {deployment.environment: canary}
    action: flag
"""


def looping_agent(environment: str) -> AgentRecorder:
    """The same agent, deployed to `environment`: it loops on one search and overspends."""
    agent = AgentRecorder("support-bot", "support", **{"deployment.environment": environment})
    for _ in range(12):
        agent.tool("search_docs", {"query": "refund policy"})
        agent.chat(200, 20)
    return agent


def run(process: WorkerProcess, collector: Collector, agent: AgentRecorder) -> tuple[list, list]:
    """Send the agent's spans; wait until the worker has read all of them; (kills, detections)."""
    topics = process.topics
    before = (process.metrics() or {}).get("spanguard_spans_total", 0)
    send_spans(topics.input, agent)
    process.wait_for("spanguard_spans_total", before + len(agent.finished()), timeout=DEADLINE)
    time.sleep(1.0)  # time for a signal to show up, were there one
    return (
        collector.json_from(topics.kills, agent.trace_id),
        collector.json_from(topics.detections, agent.trace_id),
    )


def test_flagged_agent_keeps_going_then_killed_where_the_policy_says_kill(tmp_path):
    with running_worker(tmp_path, policy=POLICY, collect=("kills", "detections")) as worker:
        process, collector = worker.process, worker.collector
        kills, detections = run(process, collector, looping_agent("canary"))
        assert kills == []  # nothing reaches the agent: it finishes its run
        for record in detections:
            validate(record, "detection")
        assert sorted((d["rule"], d["action"]) for d in detections) == [
            ("token_budget", "flag"),
            ("tool_loop", "flag"),
        ]
        assert all(d["policy_entry"] == "agents.0" for d in detections)
        metrics = process.metrics() or {}
        flagged = {k: v for k, v in metrics.items() if "spanguard_decisions" in k and "flag" in k}
        assert flagged, metrics  # counted, by rule and action

        kills, detections = run(process, collector, looping_agent("production"))
        assert sorted((k["rule"], k["kind"]) for k in kills) == [
            ("token_budget", "kill"),
            ("tool_loop", "kill"),
        ]
        assert {d["action"] for d in detections} == {"kill"}


def test_observe_mode_kills_nothing(tmp_path):
    observe = ["--mode", "observe"]
    with running_worker(
        tmp_path, policy=POLICY, collect=("kills", "detections"), extra=observe
    ) as worker:
        process, collector = worker.process, worker.collector
        for environment in ("canary", "production"):
            kills, detections = run(process, collector, looping_agent(environment))
            assert kills == []
            assert {d["action"] for d in detections} == {"flag"}
            assert {d["rule"] for d in detections} == {"tool_loop", "token_budget"}
        assert "observe mode" in process.log_text()
