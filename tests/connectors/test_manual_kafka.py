"""`spanguard kill` and `spanguard release` through the real broker, obeyed by the KillSwitch,
beside a running worker whose own detections keep working after a release."""

from __future__ import annotations

import pytest

from spanguard.detection.explain import explain_records
from spanguard.killswitch.client import KillSwitch
from spanguard.killswitch.signals import AgentKilled
from spanguard.schemas.decision import signature_valid, validate
from tests.support.kafka_harness import (
    CLUSTER,
    SIGNING_KEY,
)
from tests.support.spans import AgentRecorder
from tests.support.waiting import raises, wait_until
from tests.support.worker import run_cli, running_worker, send_spans

pytestmark = pytest.mark.kafka

POLICY = "defaults: {token_budget: 1000}\n"


def killed(switch: KillSwitch, trace_id: str) -> bool:
    return raises(lambda: switch.check(trace_id), AgentKilled)


@pytest.fixture
def running(tmp_path):
    with running_worker(tmp_path, policy=POLICY, collect=("kills", "detections")) as worker:
        switch = KillSwitch(CLUSTER.bootstrap, worker.topics.kills, signing_key=SIGNING_KEY)
        yield worker.topics, worker.collector, switch, worker.process
        switch.close()


def test_release_lifts_a_detected_kill_and_a_later_detection_kills_again(running):
    topics, collector, switch, _ = running
    agent = AgentRecorder("support-bot", "support")
    for _ in range(4):
        agent.tool("search_docs", {"query": "refund policy"})
    assert switch.check(agent.trace_id) is None
    send_spans(topics.input, agent)
    wait_until(lambda: killed(switch, agent.trace_id))  # the worker's tool_loop kill

    released = run_cli("release", agent.trace_id, topics, "--operator", "alice")
    assert released.returncode == 0, released.stderr
    wait_until(lambda: not killed(switch, agent.trace_id))
    assert switch.check(agent.trace_id) is None  # the agent may call tools again

    before = len(agent.finished())
    for _ in range(6):
        agent.chat(200, 20)  # over the budget of 1000 on the fifth
    send_spans(topics.input, agent, agent.finished()[before:])
    wait_until(lambda: killed(switch, agent.trace_id))  # a later detection kills it again
    with pytest.raises(AgentKilled, match="over the budget"):
        switch.check(agent.trace_id)

    signals = collector.json_from(topics.kills, agent.trace_id)
    assert [(s["rule"], s["kind"]) for s in signals] == [
        ("tool_loop", "kill"),
        ("manual", "release"),
        ("token_budget", "kill"),
    ]
    for record in signals:
        validate(record, "kill-signal")
        assert signature_valid(record, SIGNING_KEY.encode())
    audit = collector.json_from(topics.detections, agent.trace_id)
    (manual,) = [r for r in audit if r["rule"] == "manual"]
    validate(manual, "detection")
    assert (manual["action"], manual["operator"]) == ("release", "alice")
    assert manual["decision_id"] == signals[1]["signal_id"]


def test_after_a_release_the_same_loop_repeated_kills_again(running):
    """The worker reads the release too: the loop rule that killed the trace is re-armed, and
    the same loop repeated trips it again with a new signal id."""
    topics, collector, switch, process = running
    agent = AgentRecorder("support-bot", "support")
    for _ in range(4):
        agent.tool("search_docs", {"query": "refund policy"})
    send_spans(topics.input, agent)
    wait_until(lambda: killed(switch, agent.trace_id))

    released = run_cli("release", agent.trace_id, topics, "--operator", "alice")
    assert released.returncode == 0, released.stderr
    wait_until(lambda: not killed(switch, agent.trace_id))
    process.wait_for("spanguard_releases_read_total", 1)  # the worker has read it too

    before = len(agent.finished())
    for _ in range(2):  # a fresh window: two calls after the release are not a loop
        agent.tool("search_docs", {"query": "refund policy"})
    send_spans(topics.input, agent, agent.finished()[before:])
    process.wait_for("spanguard_releases_applied_total", 1)
    assert not killed(switch, agent.trace_id)
    agent.tool("search_docs", {"query": "refund policy"})  # the third
    send_spans(topics.input, agent, agent.finished()[-1:])
    wait_until(lambda: killed(switch, agent.trace_id))

    signals = collector.json_from(topics.kills, agent.trace_id)
    assert [(s["rule"], s["kind"]) for s in signals] == [
        ("tool_loop", "kill"),
        ("manual", "release"),
        ("tool_loop", "kill"),
    ]
    assert len({s["signal_id"] for s in signals}) == 3  # the second kill is no duplicate
    for record in signals:
        assert signature_valid(record, SIGNING_KEY.encode())


def test_manual_kill_release_and_kill_again(running):
    topics, collector, switch, _ = running
    trace_id = AgentRecorder("batch-bot").trace_id
    assert switch.check(trace_id) is None
    for step, (command, args) in enumerate([
        ("kill", ("--reason", "runaway spend", "--operator", "bob")),
        ("release", ("--operator", "bob")),
        ("kill", ("--reason", "still looping", "--operator", "carol")),
    ]):  # fmt: skip
        result = run_cli(command, trace_id, topics, *args)
        assert result.returncode == 0, result.stderr
        wait_until(lambda n=step: switch.received >= n + 1)
        assert killed(switch, trace_id) == (command == "kill")
    with pytest.raises(AgentKilled, match="still looping"):
        switch.check(trace_id)
    signals = collector.json_from(topics.kills, trace_id)
    assert [(s["kind"], s["operator"]) for s in signals] == [
        ("kill", "bob"),
        ("release", "bob"),
        ("kill", "carol"),
    ]
    assert len({s["signal_id"] for s in signals}) == 3  # a new id per issue: never a duplicate
    audit = collector.json_from(topics.detections, trace_id)
    assert [(r["action"], r["operator"], r["reason"]) for r in audit] == [
        ("kill", "bob", "runaway spend"),
        ("release", "bob", "released by bob"),
        ("kill", "carol", "still looping"),
    ]
    for record in audit:
        validate(record, "detection")
    text = explain_records(trace_id, audit)
    assert "manual -> release" in text and "by operator carol" in text


def test_kill_needs_a_reason_and_a_trace_id(running):
    topics, *_ = running
    assert run_cli("kill", "0" * 32, topics).returncode == 2  # --reason is required
    bad = run_cli("kill", "not-a-trace", topics, "--reason", "x")
    assert bad.returncode == 2 and "not a trace id" in bad.stderr
