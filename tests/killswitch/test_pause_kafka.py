"""`action: pause` through the real broker: the worker pauses a looping agent, the agent's
KillSwitch waits; an operator's `spanguard release` lets it go on, and an unanswered pause
ends in the policy's fallback kill."""

from __future__ import annotations

import threading
import time

import pytest

from spanguard.killswitch.client import KillSwitch
from spanguard.killswitch.signals import AgentKilled, AgentPaused
from spanguard.schemas.decision import signature_valid, validate
from tests.support.kafka_harness import (
    CLUSTER,
    SIGNING_KEY,
)
from tests.support.spans import AgentRecorder
from tests.support.waiting import raises, wait_until
from tests.support.worker import run_cli, running_worker, send_spans

pytestmark = pytest.mark.kafka

POLICY = """
agents:
  - match: {service.name: patient-reconciler}
    action: pause
    pause: {timeout: 300, fallback: kill}
  - match: {service.name: hasty-reconciler}
    action: pause
    pause: {timeout: 4, fallback: kill}
"""


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    data = tmp_path_factory.mktemp("pause")
    with running_worker(data, policy=POLICY, collect=("kills", "detections")) as worker:
        switch = KillSwitch(CLUSTER.bootstrap, worker.topics.kills, signing_key=SIGNING_KEY)
        yield worker.topics, worker.collector, switch
        switch.close()


def paused(switch: KillSwitch, trace_id: str) -> bool:
    return raises(lambda: switch.check(trace_id), AgentPaused)


def loop(service: str) -> AgentRecorder:
    agent = AgentRecorder(service, "reconciler")
    for _ in range(4):
        agent.tool("search_docs", {"query": "refund policy"})
    return agent


def waiting(switch: KillSwitch, trace_id: str) -> tuple[threading.Thread, dict]:
    """The agent's thread, blocked in wait(); `outcome` says how it ended and when."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["returned"] = switch.wait(trace_id)
        except AgentKilled as exc:
            outcome["killed"] = exc
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def paused_and_waiting(running, service: str) -> tuple[AgentRecorder, threading.Thread, dict]:
    """A looping agent of `service`, paused by the worker, and its thread blocked in wait()."""
    topics, _, switch = running
    agent = loop(service)
    send_spans(topics.input, agent)
    wait_until(lambda: paused(switch, agent.trace_id), timeout=30)
    return agent, *waiting(switch, agent.trace_id)


def test_pause_then_release_and_the_agent_goes_on(running) -> None:
    topics, collector, switch = running
    agent, thread, outcome = paused_and_waiting(running, "patient-reconciler")
    time.sleep(1.0)
    assert thread.is_alive(), outcome  # the agent waits: no answer yet

    released = run_cli("release", agent.trace_id, topics, "--operator", "alice")
    assert released.returncode == 0, released.stderr
    thread.join(timeout=30)
    assert not thread.is_alive() and outcome.get("returned", "x") is None, outcome
    assert switch.check(agent.trace_id) is None  # it goes on

    [signal, release] = collector.json_from(topics.kills, agent.trace_id)
    assert (signal["kind"], signal["pause_fallback"]) == ("pause", "kill")
    validate(signal, "kill-signal")
    assert signature_valid(signal, SIGNING_KEY.encode()) and "key_id" in signal
    assert release["kind"] == "release"
    [detection] = [
        d for d in collector.json_from(topics.detections, agent.trace_id) if d["rule"] != "manual"
    ]
    validate(detection, "detection")
    assert detection["action"] == "pause" and detection["pause_until"] == signal["pause_until"]


def test_pause_unanswered_ends_in_the_fallback_kill(running) -> None:
    topics, collector, switch = running
    agent, thread, outcome = paused_and_waiting(running, "hasty-reconciler")
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert "fallback kills" in str(outcome["killed"]), outcome
    with pytest.raises(AgentKilled):
        switch.check(agent.trace_id)  # and it stays killed
    [signal] = collector.json_from(topics.kills, agent.trace_id)
    assert signal["kind"] == "pause"
