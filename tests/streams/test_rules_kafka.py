"""The rules through the real broker, the worker on its shipped defaults (no policy file): a
cycle is killed at the call that completes its third round, the empty-index agent is flagged,
and healthy agents that go round their tools get nothing at all."""

from __future__ import annotations

import time

import pytest

from spanguard.detection.guard import Guard
from spanguard.schemas.decision import KillSignal, canonical_json, read_signal, validate
from tests.detection.test_cycle import call, round_of
from tests.streams.test_worker_kafka import DEADLINE, kills_for
from tests.support.spans import AgentRecorder, one_request_per_span, span_id_of
from tests.support.worker import running_worker, send_spans

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    with running_worker(
        tmp_path_factory.mktemp("worker"),
        collect=("kills", "detections", "dead_letters", "repartition"),
    ) as running:
        yield running.process, running.collector


def healthy_agents() -> list[AgentRecorder]:
    rounds = AgentRecorder("researcher", "research")  # round its tools, something new each time
    for topic in range(20):
        call(rounds, "search_web", {"q": f"topic {topic}"}, f"{topic} hits")
        call(rounds, "fetch", {"url": f"https://example.org/{topic}"}, f"page {topic}")
        call(rounds, "summarize", {"page": topic}, f"summary {topic}")
    improving = AgentRecorder("coder-healthy", "coder")  # tests re-run, failures going down
    for failing in (6, 5, 4, 3, 2, 1, 0):
        call(improving, "edit_file", {"patch": f"fix {failing}"}, '{"ok": true}')
        call(improving, "run_tests", {"suite": "unit"}, f"{failing} failed")
    edits = AgentRecorder("editor", "editor")  # different edits, one same acknowledgement
    for step in range(12):
        call(edits, "edit_file", {"patch": f"change {step}"}, '{"ok": true}')
    return [rounds, improving, edits]


def test_a_cycle_is_killed_at_the_call_completing_its_third_round(worker):
    process, collector = worker
    topics = process.topics
    agent = AgentRecorder("coder", "coder")
    # Rounds of 5: with rounds of 4 or fewer, the first call of round 3 is the 3rd identical
    # call within tool_loop's window of 10 (the default threshold is 3), which kills it first.
    spans = [call(agent, *step) for _ in range(5) for step in round_of(5)]
    send_spans(topics.input, agent)
    collector.wait(
        lambda m: m["topic"] == topics.kills and m["key"] == agent.trace_id.encode(),
        timeout=DEADLINE,
    )
    process.wait_for("spanguard_tool_calls_observed_total", 25)
    time.sleep(1.0)  # time for a second signal to show up, were there one
    (signal_record,) = kills_for(collector, topics, agent.trace_id)
    validate(signal_record, "kill-signal")
    assert (signal_record["rule"], signal_record["kind"]) == ("cycle", "kill")
    assert signal_record["evidence"]["span_id"] == span_id_of(spans[14])
    assert (
        "a sequence of 5 calls (list_dir -> read_file -> grep -> run_tests -> list_dir)"
        in (signal_record["reason"])
    )
    [detection] = collector.json_from(topics.detections, agent.trace_id)
    validate(detection, "detection")
    assert (detection["period"], detection["hits"]) == (5, 3)
    assert [c["tool_name"] for c in detection["calls"][-5:]] == [t for t, _, _ in round_of(5)]
    metric = 'spanguard_decisions_total{action="kill",rule="cycle",service="coder"}'
    process.wait_for(metric, 1)


def test_the_empty_index_agent_is_flagged_and_healthy_agents_get_nothing(worker):
    process, collector = worker
    topics = process.topics
    empty = AgentRecorder("support-bot", "support")
    for query in ("refund", "refunds", "refund policy", "returns", "money back"):
        call(empty, "search_docs", {"query": query}, "[]")
    healthy = healthy_agents()
    for agent in (empty, *healthy):
        send_spans(topics.input, agent)
    collector.wait(
        lambda m: m["topic"] == topics.detections and m["key"] == empty.trace_id.encode(),
        timeout=DEADLINE,
    )
    total = sum(len(agent.finished()) for agent in (empty, *healthy))
    process.wait_for("spanguard_spans_total", total)
    time.sleep(1.0)
    [flag] = collector.json_from(topics.detections, empty.trace_id)
    assert (flag["rule"], flag["action"], flag["hits"]) == ("no_progress", "flag", 4)
    assert kills_for(collector, topics, empty.trace_id) == []  # a flag sends no signal
    for agent in healthy:
        assert collector.json_from(topics.detections, agent.trace_id) == [], agent.trace_id
        assert kills_for(collector, topics, agent.trace_id) == []


def test_an_agent_reads_a_cycle_kill():
    """The agents' reader (the killswitch's read_signal) accepts a signal of the new rule."""
    agent = AgentRecorder("coder", "coder")
    for _ in range(3):
        for step in round_of(5):  # rounds of 5: shorter ones are tool_loop's at the default 3
            call(agent, *step)
    guard = Guard()
    [decision] = [d for r in one_request_per_span(agent.finished()) for d in guard.process(r)]
    signal = KillSignal.from_decision(decision)
    read = read_signal(canonical_json(signal.to_dict()), None)
    assert (read.rule, read.kind) == ("cycle", "kill")
