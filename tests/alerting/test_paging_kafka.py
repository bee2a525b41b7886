"""Paging through the real worker, the real broker and the real `pagerduty` client, against a
local HTTPS server that speaks Events API v2 (tests/support/pagerduty_server.py, a throwaway CA)."""

from __future__ import annotations

import time

import pytest

from tests.support.https_receiver import Fault
from tests.support.pagerduty_server import EventsApiServer
from tests.support.spans import AgentRecorder
from tests.support.waiting import wait_until
from tests.support.worker import (
    assert_kill_not_delayed,
    dead_letter,
    notifying_worker,
    restart_mid_retry,
    send_calls,
)

pytestmark = pytest.mark.kafka

ROUTING_KEY = "R0UT1NGKEY0123456789abcdefABCDEF"  # 32 characters, as PagerDuty wants
POLICY = """
agents:
  - match: {service.name: autopilot}
    autonomous: true
    severity: critical
"""


def worker_env(server: EventsApiServer) -> dict[str, str]:
    return {
        "SPANGUARD_PAGERDUTY_ROUTING_KEY": ROUTING_KEY,
        "SPANGUARD_PAGERDUTY_URL": server.url,
        "SSL_CERT_FILE": server.ca_bundle,
        "SPANGUARD_TRACE_URL_TEMPLATE": "https://tempo.example/trace/{trace_id}",
    }


def loop(topic: str, service: str, calls: int = 4) -> AgentRecorder:
    agent = AgentRecorder(service, "autopilot-agent")
    return send_calls(topic, agent, "restart_service", {"name": "billing"}, calls)


def requests_for(server: EventsApiServer, trace_id: str) -> list:
    key = f"spanguard:{trace_id}:tool_loop"
    return [r for r in server.enqueue_requests if r.body.get("dedup_key") == key]


@pytest.fixture(scope="module")
def paging_stack(tmp_path_factory):
    data = tmp_path_factory.mktemp("paging")
    with (
        EventsApiServer() as server,
        notifying_worker(data, POLICY, worker_env(server), [ROUTING_KEY]) as running,
    ):
        yield server, running.process, running.collector


def test_one_incident_with_the_exact_payload_and_none_for_other_agents(paging_stack):
    server, worker, _ = paging_stack
    autonomous = loop(worker.topics.input, "autopilot", calls=9)  # the loop goes on
    ordinary = loop(worker.topics.input, "support-bot")
    wait_until(lambda: requests_for(server, autonomous.trace_id), what="a page")
    time.sleep(1.5)  # room for a duplicate, were there one
    (request,) = requests_for(server, autonomous.trace_id)
    assert requests_for(server, ordinary.trace_id) == []
    event = request.body
    assert event["routing_key"] == ROUTING_KEY and event["event_action"] == "trigger"
    assert event["dedup_key"] == f"spanguard:{autonomous.trace_id}:tool_loop"
    payload = event["payload"]
    assert payload["source"] == "autopilot"
    assert payload["severity"] == "critical"
    assert "autopilot" in payload["summary"] and "tool_loop" in payload["summary"]
    assert "restart_service called 3x in last 3 steps" in payload["summary"]
    details = payload["custom_details"]
    assert details["trace_id"] == autonomous.trace_id
    assert (details["tool_name"], details["hits"], details["window"]) == ("restart_service", 3, 10)
    assert len(details["args_hash"]) == 16
    assert event["links"] == [
        {"href": f"https://tempo.example/trace/{autonomous.trace_id}", "text": "trace"}
    ]
    metrics = worker.metrics()
    assert metrics['spanguard_pages_total{outcome="accepted"}'] >= 1


def test_503_then_202_is_one_incident(paging_stack):
    server, worker, _ = paging_stack
    server.script(503)
    agent = loop(worker.topics.input, "autopilot")
    wait_until(lambda: len(requests_for(server, agent.trace_id)) == 2, what="a retried page")
    time.sleep(1.0)
    statuses = [r.status for r in requests_for(server, agent.trace_id)]
    assert statuses == [503, 202]
    assert f"spanguard:{agent.trace_id}:tool_loop" in server.incidents


def test_400_is_a_dead_letter_and_no_retry_storm(paging_stack):
    server, worker, collector = paging_stack
    server.script(400)
    agent = loop(worker.topics.input, "autopilot")
    dead = dead_letter(worker, collector, agent)
    assert dead["headers"]["spanguard.reason"].startswith(b"page rejected")
    time.sleep(1.0)
    assert [r.status for r in requests_for(server, agent.trace_id)] == [400]


def test_a_slow_pagerduty_never_delays_kill_signals(paging_stack):
    server, worker, collector = paging_stack
    server.script(Fault(status=202, delay=6.0))
    paged = loop(worker.topics.input, "autopilot")
    wait_until(
        lambda: requests_for(server, paged.trace_id) or server.pending_script == 0, what="page sent"
    )
    assert_kill_not_delayed(worker, collector, lambda: loop(worker.topics.input, "support-bot"))


def test_a_restart_mid_retry_does_not_page_twice(tmp_path):
    with EventsApiServer() as server:
        server.script(503, 503, 503)
        agent = restart_mid_retry(
            tmp_path,
            POLICY,
            worker_env(server),
            lambda topics: loop(topics.input, "autopilot"),
            failed_twice=lambda agent: len(requests_for(server, agent.trace_id)) >= 2,
            delivered=lambda agent: any(
                r.status == 202 for r in requests_for(server, agent.trace_id)
            ),
        )
        accepted = [r for r in requests_for(server, agent.trace_id) if r.status == 202]
        assert len(accepted) == 1
        assert len([i for i in server.all_incidents if agent.trace_id in i.dedup_key]) == 1
