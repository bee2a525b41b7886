"""`spanguard explain TRACE_ID` against the detections topic a real worker wrote."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from spanguard.schemas.decision import validate
from tests.support.kafka_harness import (
    BOOTSTRAP,
    Topics,
    ensure_broker,
    producer,
)
from tests.support.spans import AgentRecorder, encode, span_id_of
from tests.support.worker import running_worker

pytestmark = pytest.mark.kafka

POLICY = """
agents:
  - match: {service.name: nightly-reconciler}
    autonomous: true
  - match: {service.name: support-bot}
    loop: {window: 6, threshold: 3}
"""


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    with running_worker(
        tmp_path_factory.mktemp("explain"), policy=POLICY, collect=("detections",)
    ) as running:
        yield running.process, running.collector


def explain(topics: Topics, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spanguard.cli", "explain", *args,
         "--bootstrap", BOOTSTRAP, "--detections-topic", topics.detections, "--timeout", "30"],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip


def test_explain_prints_the_window_the_policy_entry_and_the_threshold(worker) -> None:
    process, collector = worker
    topics = process.topics
    agent = AgentRecorder("support-bot", "support")
    calls = []
    for step in range(3):
        calls.append(agent.tool("search_docs", {"query": "refund policy"}))
        if step < 2:
            # The same page re-read: different pages read between the searches would be new
            # work, and the searches no loop.
            calls.append(agent.tool("read_page", {"url": "kb/0"}))
    out = producer()
    for span in agent.finished():
        out.produce(
            topics.input, key=agent.trace_id.encode(), value=encode([span]).SerializeToString()
        )
    assert out.flush(10) == 0
    collector.wait(lambda m: m["key"] == agent.trace_id.encode(), timeout=30)

    result = explain(topics, agent.trace_id)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert text.startswith(f"trace {agent.trace_id}: 1 decision\n")
    assert "decision 1 of 1: tool_loop -> kill" in text
    assert "reason: search_docs called 3x in last 5 steps" in text
    assert (
        "policy: agents.1 (match service.name=support-bot): window 6, threshold 3, action kill"
        in text
    )
    assert f"tripped by span {span_id_of(calls[-1])} (search_docs, args " in text
    assert "window when it tripped (5 of 6 calls, oldest first;" in text
    # One line per call of the window, in order, with its hash prefix and span id.
    (record,) = json.loads("[" + explain(topics, agent.trace_id, "--json").stdout.strip() + "]")
    validate(record, "detection")
    rows = [line for line in text.splitlines() if re.match(r"^    [> ][* ] *\d+  ", line)]
    assert len(rows) == 5
    for number, (row, call, evidence) in enumerate(zip(rows, calls, record["calls"], strict=True)):
        tool = call.name.removeprefix("execute_tool ")
        assert row.rstrip().endswith(span_id_of(call))
        assert f"  {tool} " in row and f"  {evidence['args_hash'][:8]}  " in row
        assert evidence["ended_at"][11:26] in row  # HH:MM:SS.ffffff
        assert row[5] == ("*" if tool == "search_docs" else " ")  # the repeated call
        assert row[4] == (">" if number == 4 else " ")  # the span that tripped it
    assert "signal: kill sent to the agent" in text
    assert "refund policy" not in text  # hashes, never arguments


def test_explain_says_when_there_is_nothing(worker) -> None:
    process, _ = worker
    result = explain(process.topics, "0" * 32)
    assert result.returncode == 1
    assert f"no decision for trace {'0' * 32} in {process.topics.detections}" in result.stderr


def test_explain_names_a_missing_topic() -> None:
    ensure_broker()
    result = explain(Topics(), "0" * 32)
    assert result.returncode == 2
    assert "does not exist (is --detections-topic right?)" in result.stderr
