"""The webhook sink through the real worker and the real broker, against a local HTTPS server
(tests/support/webhook_server.py, a throwaway CA): every agent's detections, once per trace and
rule, retried, dead-lettered when undeliverable, and never twice across a restart."""

from __future__ import annotations

import hashlib
import hmac
import json
import time

import pytest

from spanguard.schemas.decision import validate
from tests.support.https_receiver import Fault
from tests.support.spans import AgentRecorder
from tests.support.waiting import wait_until
from tests.support.webhook_server import WebhookServer, slack_errors
from tests.support.worker import (
    assert_kill_not_delayed,
    dead_letter,
    notifying_worker,
    restart_mid_retry,
    send_calls,
)

pytestmark = pytest.mark.kafka

HOOK_PATH = "/hooks/T0/B0/s3cretT0ken"
SIGNING_KEY = "webhook-signing-key"
POLICY = """
agents:
  - match: {service.name: support-downgrade}
    action: downgrade
"""


def worker_env(server: WebhookServer, path: str = HOOK_PATH, **env: str) -> dict[str, str]:
    return {
        "SPANGUARD_WEBHOOK_URL": server.url + path,
        "SPANGUARD_WEBHOOK_CA_FILE": server.ca_bundle,
        "SPANGUARD_WEBHOOK_SIGNING_KEY": SIGNING_KEY,
        **env,
    }


def loop(topic: str, service: str, calls: int = 4) -> AgentRecorder:
    agent = AgentRecorder(service, "agent")
    return send_calls(topic, agent, "search_docs", {"query": "refund policy"}, calls)


def posts_for(server: WebhookServer, trace_id: str, path: str = HOOK_PATH) -> list:
    return [request for request, body in server.posted(path) if trace_id in json.dumps(body)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    data = tmp_path_factory.mktemp("webhook")
    secrets = ["s3cretT0ken", SIGNING_KEY]
    with (
        WebhookServer() as server,
        notifying_worker(data, POLICY, worker_env(server), secrets) as running,
    ):
        yield server, running.process, running.collector


def test_every_agent_is_notified_once_per_trace_and_rule_with_a_signed_json_body(stack):
    server, worker, _ = stack
    agent = loop(worker.topics.input, "support-bot", calls=9)  # not autonomous; loops on
    downgraded = loop(worker.topics.input, "support-downgrade", calls=8)  # downgrade, then kill
    wait_until(lambda: posts_for(server, agent.trace_id), what="a notification")
    wait_until(lambda: posts_for(server, downgraded.trace_id), what="a second notification")
    time.sleep(1.5)  # room for a duplicate, were there one
    (request,) = posts_for(server, agent.trace_id)
    body = request.body
    assert body["type"] == "spanguard.detection"
    assert body["dedup_key"] == f"spanguard:{agent.trace_id}:tool_loop"
    assert "support-bot tool_loop -> kill: search_docs called 3x in last 3 steps" in body["summary"]
    validate(body["detection"], "detection")
    assert body["detection"]["trace_id"] == agent.trace_id
    expected = hmac.new(SIGNING_KEY.encode(), request.raw, hashlib.sha256).hexdigest()
    assert request.headers["X-Spanguard-Signature"] == f"sha256={expected}"
    # One per trace and rule: the downgrade is sent, the kill after it on the same rule is not.
    (request,) = posts_for(server, downgraded.trace_id)
    assert request.body["detection"]["action"] == "downgrade"
    metrics = worker.metrics() or {}
    assert metrics['spanguard_webhooks_total{outcome="delivered"}'] >= 2
    assert metrics['spanguard_webhooks_total{outcome="already_sent"}'] >= 1


def test_503_then_200_is_one_delivery(stack):
    server, worker, _ = stack
    server.script(503, Fault(status=429, headers={"Retry-After": "0.2"}))
    agent = loop(worker.topics.input, "support-bot")
    wait_until(lambda: len(posts_for(server, agent.trace_id)) == 3, what="a retried notification")
    time.sleep(1.0)
    assert [r.status for r in posts_for(server, agent.trace_id)] == [503, 429, 200]


def test_a_rejected_notification_is_a_dead_letter_and_not_retried(stack):
    server, worker, collector = stack
    server.script(403)
    agent = loop(worker.topics.input, "support-bot")
    dead = dead_letter(worker, collector, agent)
    reason = dead["headers"]["spanguard.reason"].decode()
    assert reason.startswith("webhook rejected: HTTP 403 from 127.0.0.1:")
    assert "s3cretT0ken" not in reason
    time.sleep(1.0)
    assert [r.status for r in posts_for(server, agent.trace_id)] == [403]


def test_a_slow_receiver_never_delays_kill_signals(stack):
    server, worker, collector = stack
    server.script(Fault(status=200, delay=6.0))
    slow = loop(worker.topics.input, "support-bot")
    wait_until(lambda: posts_for(server, slow.trace_id), what="notification sent")
    assert_kill_not_delayed(worker, collector, lambda: loop(worker.topics.input, "support-bot"))


def test_slack_template_and_no_second_notification_after_a_restart(tmp_path):
    slack_path = "/services/T000/B000/XXXXXXXX"
    with WebhookServer() as server:
        server.script(503, 503, 503)
        agent = restart_mid_retry(
            tmp_path,
            POLICY,
            worker_env(server, slack_path, SPANGUARD_WEBHOOK_TEMPLATE="slack"),
            lambda topics: loop(topics.input, "support-bot"),
            failed_twice=lambda agent: len(posts_for(server, agent.trace_id, slack_path)) >= 2,
            delivered=lambda agent: any(
                r.status == 200 for r in posts_for(server, agent.trace_id, slack_path)
            ),
        )
        posts = posts_for(server, agent.trace_id, slack_path)
        delivered = [r for r in posts if r.status == 200]
        assert len(delivered) == 1
        assert slack_errors(delivered[0].raw) is None  # what Slack's webhooks accept
        body = delivered[0].body
        assert body["text"].startswith("spanguard: support-bot tool_loop -&gt; kill")
        assert agent.trace_id in body["blocks"][-1]["elements"][0]["text"]
