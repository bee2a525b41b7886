"""The goal verifier in the real worker: ended invocations judged by a local chat-completions
server, verdicts on the detections topic, and loop kills never waiting for the judge."""

from __future__ import annotations

import json
import time

import pytest

from spanguard.schemas.decision import validate
from tests.support.chat_server import ChatServer, Reply
from tests.support.kafka_harness import Collector, Topics
from tests.support.spans import AgentRecorder
from tests.support.worker import running_worker, send_spans

pytestmark = pytest.mark.kafka

POLICY = """
agents:
  - match: {service.name: helpdesk}
    goal: {enabled: true, min_confidence: 0.6}
  - match: {service.name: ops-autopilot}
    autonomous: true
    goal: {enabled: true}
"""


def content(request: str, answer: str) -> dict[str, str]:
    return {
        "gen_ai.input.messages": json.dumps(
            [{"role": "user", "parts": [{"type": "text", "content": request}]}]
        ),
        "gen_ai.output.messages": json.dumps(
            [
                {
                    "role": "assistant",
                    "parts": [{"type": "text", "content": answer}],
                    "finish_reason": "stop",
                }
            ]
        ),
    }


def run(topic: str, service: str, root_attributes: dict[str, str] | None = None, loops: int = 0):
    agent = AgentRecorder(service, "helper")
    agent.chat(200, 30)
    for _ in range(loops):
        agent.tool("search_docs", {"query": "refund policy"})
    agent.finish(**(root_attributes or {}))
    send_spans(topic, agent)
    return agent


@pytest.fixture(scope="module")
def goal_stack(tmp_path_factory):
    judge_env = {"SPANGUARD_JUDGE_MODEL": "judge-small"}
    with (
        ChatServer() as judge,
        running_worker(
            tmp_path_factory.mktemp("goal"),
            policy=POLICY,
            collect=("detections", "kills", "dead_letters"),
            env={**judge_env, "SPANGUARD_JUDGE_URL": judge.base_url},
        ) as running,
    ):
        yield judge, running.process, running.collector


def detections_for(collector: Collector, topics: Topics, trace_id: str) -> list[dict]:
    return collector.json_from(topics.detections, trace_id)


def test_a_bad_verdict_becomes_a_goal_unmet_flag(goal_stack):
    judge, worker, collector = goal_stack
    judge.script(Reply.verdict(False, 0.9, "It answered about shipping, not refunds."))
    agent = run(
        worker.topics.input, "helpdesk", content("What is the refund policy?", "We ship in 2 days.")
    )
    (message,) = collector.wait(
        lambda m: m["topic"] == worker.topics.detections and m["key"] == agent.trace_id.encode()
    )
    detection = json.loads(message["value"])
    validate(detection, "detection")
    assert (detection["rule"], detection["action"]) == ("goal_unmet", "flag")
    assert detection["confidence"] == 0.9 and "shipping, not refunds" in detection["reason"]
    assert detection["span_id"] == format(agent.root.get_span_context().span_id, "016x")
    # The judge saw the user's request and the answer.
    sent = json.dumps(judge.requests[-1].body)
    assert "What is the refund policy?" in sent and "We ship in 2 days." in sent
    assert collector.json_from(worker.topics.kills, agent.trace_id) == []  # flags are not kills


def test_a_good_verdict_and_a_low_confidence_one_are_not_flagged(goal_stack):
    judge, worker, collector = goal_stack
    judge.script(Reply.verdict(True, 0.95, "Correct."), Reply.verdict(False, 0.3, "Unsure."))
    good = run(worker.topics.input, "helpdesk", content("Refund policy?", "30 days."))
    worker.wait_for('spanguard_goal_checks_total{outcome="met"}', 1)
    unsure = run(worker.topics.input, "helpdesk", content("Refund policy?", "Maybe 30 days?"))
    worker.wait_for('spanguard_goal_checks_total{outcome="low_confidence"}', 1)
    time.sleep(0.5)
    assert detections_for(collector, worker.topics, good.trace_id) == []
    assert detections_for(collector, worker.topics, unsure.trace_id) == []


def test_content_not_recorded_is_counted_and_never_judged(goal_stack):
    judge, worker, collector = goal_stack
    before = len(judge.requests)
    agent = run(worker.topics.input, "helpdesk")
    worker.wait_for('spanguard_goal_checks_total{outcome="no_content"}', 1)
    time.sleep(0.5)
    assert len(judge.requests) == before
    assert detections_for(collector, worker.topics, agent.trace_id) == []


def test_garbage_from_the_judge_is_an_error_not_a_pass(goal_stack):
    judge, worker, collector = goal_stack
    judge.script(Reply.garbage(), Reply.garbage())
    agent = run(worker.topics.input, "helpdesk", content("Refund policy?", "Ask later."))
    (dead,) = collector.wait(
        lambda m: m["topic"] == worker.topics.dead_letters and m["key"] == agent.trace_id.encode()
    )
    assert b"goal check of trace" in dead["headers"]["spanguard.reason"]
    assert detections_for(collector, worker.topics, agent.trace_id) == []


def test_a_slow_judge_never_delays_loop_kills(goal_stack):
    judge, worker, collector = goal_stack
    judge.script(Reply.verdict(False, 0.9, "Wrong.", delay=6.0))
    run(worker.topics.input, "ops-autopilot", content("Restart billing", "Restarted search."))
    time.sleep(0.5)  # the judge is now busy with that run
    started = time.monotonic()
    looping = run(worker.topics.input, "support-bot", loops=4)
    collector.wait(
        lambda m: m["topic"] == worker.topics.kills and m["key"] == looping.trace_id.encode(),
        timeout=5.0,
    )
    assert time.monotonic() - started < 5.0
