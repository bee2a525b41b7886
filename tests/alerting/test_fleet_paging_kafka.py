"""One page per cause, through the real worker, the real broker, the real `pagerduty` client
against the local Events API v2 server, and the local webhook receiver: a fleet incident pages
once and posts once, its recovery resolves the page and posts once more, and the per-trace pages
of traces decided on its tool are folded into it while it is open (and not after), across a
SIGKILL of the worker too.

The first test runs the whole way: the worker's tool scope sees 30 traces fail on one tool and
decides the incident, and 3 traces answered again recover it. The others put the incident's
records on the detections topic as the tool scope writes them
(spanguard.detection.fleet.incident_decision, keyed by the incident's trace id), for exact
figures and a kill at a chosen moment. The per-trace decisions are the worker's own, from
looping agents' spans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from spanguard.detection.fleet import TOOL_FAILING, FleetIncident, incident_decision
from spanguard.schemas.decision import Decision
from spanguard.schemas.policy import FleetPolicy
from tests.support.kafka_harness import (
    CLUSTER,
    Collector,
    Topics,
    WorkerProcess,
    ensure_broker,
    producer,
)
from tests.support.pagerduty_server import EventsApiServer
from tests.support.spans import AgentRecorder
from tests.support.waiting import wait_until
from tests.support.webhook_server import WebhookServer
from tests.support.worker import send_spans

pytestmark = pytest.mark.kafka

ROUTING_KEY = "R0UT1NGKEY0123456789abcdefABCDEF"
HOOK_PATH = "/hooks/fleet"
TOOL = "search_docs"
POLICY = """
agents:
  - match: {service.name: autopilot}
    autonomous: true
"""
FLEET_POLICY = POLICY + "fleet: {enabled: true}\n"
OPENED_NS = 1_780_000_000 * 10**9


def incident(traces: int = 30, step: int = 1) -> FleetIncident:
    return FleetIncident(
        rule=TOOL_FAILING,
        tool=TOOL,
        server="docs.internal:443",
        opened_at_ns=OPENED_NS + step * 30 * 10**9,
        opened_step=step,
        figures={"calls": traces * 2, "traces": traces, "failing_traces": traces, "agents": 7},
        traces=[f"{n:032x}" for n in range(1, min(traces, 20) + 1)],
        agents=[f"autopilot/agent-{n}" for n in range(7)],
    )


def send_record(topic: str, decision: Decision) -> None:
    out = producer()
    out.produce(topic, key=decision.trace_id.encode(), value=decision.to_json().encode())
    assert out.flush(10) == 0


def open_and_recovered(found: FleetIncident) -> tuple[Decision, Decision]:
    opened = incident_decision(found, FleetPolicy(enabled=True))
    found.recovered_at_ns = found.opened_at_ns + 120 * 10**9
    found.recovering = ["a" * 32, "b" * 32, "c" * 32]
    return opened, incident_decision(found, FleetPolicy(enabled=True))


def loops(topic: str, count: int, failing: bool = False) -> list[AgentRecorder]:
    """`count` autonomous agents each looping on the tool: a tool_loop decision apiece. Not
    `failing`, their calls are answers to the tool scope (enough of them recover its incident)."""
    agents = []
    for _ in range(count):
        agent = AgentRecorder("autopilot", "autopilot-agent")
        for step in range(4):
            attributes = {
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": TOOL,
                "gen_ai.tool.call.arguments": json.dumps({"query": "refund", "nonce": step}),
            }
            if failing:
                attributes["error.type"] = "401"
            agent.tool(TOOL, attributes=attributes)
        send_spans(topic, agent)
        agents.append(agent)
    return agents


def calls(topic: str, count: int, failing: bool) -> list[AgentRecorder]:
    """`count` traces of six agents, each calling the tool once: failing (`error.type`, as a
    401 from its server would be recorded) or answered. One call: no trace-level rule trips."""
    agents = []
    for n in range(count):
        agent = AgentRecorder("autopilot", f"autopilot-agent-{n % 6}")
        attributes = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": TOOL,
            "gen_ai.tool.call.arguments": json.dumps({"query": f"question {n}"}),
        }
        if failing:
            attributes["error.type"] = "401"
        else:
            attributes["gen_ai.tool.call.result"] = "3 documents found"
        agent.tool(TOOL, attributes=attributes)
        send_spans(topic, agent)
        agents.append(agent)
    return agents


def fleet_pages(server: EventsApiServer, action: str = "trigger") -> list:
    return [
        r
        for r in server.enqueue_requests
        if ":tool_failing" in str(r.body.get("dedup_key")) and r.body.get("event_action") == action
    ]


def triggers(server: EventsApiServer, trace_id: str, action: str = "trigger") -> list:
    return [
        r
        for r in server.enqueue_requests
        if trace_id in str(r.body.get("dedup_key")) and r.body.get("event_action") == action
    ]


def hook_posts(hooks: WebhookServer, trace_id: str) -> list[dict]:
    posted = hooks.posted(HOOK_PATH)
    return [body for _, body in posted if body.get("detection", {}).get("trace_id") == trace_id]


def explain_tool(topics: Topics, *args: str) -> subprocess.CompletedProcess:
    """`spanguard explain --tool ...` on the test's detections topic."""
    return subprocess.run(
        [sys.executable, "-m", "spanguard.cli", "explain", *args, "--bootstrap",
         CLUSTER.bootstrap, "--detections-topic", topics.detections, "--timeout", "30"],
        capture_output=True, text=True, timeout=60, env={**os.environ, **CLUSTER.env()},
    )  # fmt: skip


def start_worker(
    topics: Topics,
    data: Path,
    pager: EventsApiServer,
    hooks: WebhookServer,
    policy_text: str = POLICY,
) -> WorkerProcess:
    data.mkdir(parents=True, exist_ok=True)
    policy = data / "policy.yaml"
    policy.write_text(policy_text)
    env = {
        "SPANGUARD_PAGERDUTY_ROUTING_KEY": ROUTING_KEY,
        "SPANGUARD_PAGERDUTY_URL": pager.url,
        "SSL_CERT_FILE": pager.ca_bundle,
        "SPANGUARD_WEBHOOK_URL": hooks.url + HOOK_PATH,
        "SPANGUARD_WEBHOOK_CA_FILE": hooks.ca_bundle,
    }
    return WorkerProcess(topics, data, policy=policy, env=env).start()


@contextmanager
def fleet_stack(data: Path) -> Iterator[tuple[EventsApiServer, WebhookServer, Topics, Collector]]:
    ensure_broker()
    with EventsApiServer() as pager, WebhookServer() as hooks:
        topics = Topics()
        collector = Collector(topics.detections)
        try:
            yield pager, hooks, topics, collector
        finally:
            collector.close()
            topics.delete()


@contextmanager
def fleet_worker(
    data: Path, policy_text: str = POLICY
) -> Iterator[tuple[EventsApiServer, WebhookServer, Topics, Collector, WorkerProcess]]:
    """The fleet stack and one worker on it, which must exit 0 once the test is done."""
    with fleet_stack(data) as (pager, hooks, topics, collector):
        worker = start_worker(topics, data / "worker", pager, hooks, policy_text)
        try:
            yield pager, hooks, topics, collector, worker
        finally:
            assert worker.stop() == 0, worker.log_tail()


def folded(worker: WorkerProcess) -> float:
    return (worker.metrics() or {}).get('spanguard_pages_total{outcome="folded"}', 0.0)


def decided(collector: Collector, topics: Topics, agents: list[AgentRecorder]) -> bool:
    return all(collector.json_from(topics.detections, a.trace_id) for a in agents)


def test_the_tool_scope_pages_thirty_failing_traces_once_folds_and_resolves(tmp_path):
    with fleet_worker(tmp_path, FLEET_POLICY) as (pager, hooks, topics, collector, worker):
        calls(topics.input, 30, failing=True)
        wait_until(lambda: fleet_pages(pager), what="the incident's page", timeout=60)
        # Decided on the tool while its incident is open (and failing too): folded.
        looping = loops(topics.input, 5, failing=True)
        wait_until(lambda: decided(collector, topics, looping), what="5 decisions", timeout=60)
        wait_until(lambda: folded(worker) >= 5, what="5 folded pages")
        time.sleep(1.5)  # room for a second page, were there one
        (page,) = fleet_pages(pager)
        assert [triggers(pager, a.trace_id) for a in looping] == [[]] * 5
        incident_id = page.body["dedup_key"].split(":")[1]
        details = page.body["payload"]["custom_details"]
        assert details["tool"] == TOOL and details["hits"] >= 8  # the policy's min_traces
        assert details["agents"] == ["autopilot"]  # the tool spans name the service only
        (post,) = hook_posts(hooks, incident_id)
        assert post["detection"]["scope"] == "tool"

        calls(topics.input, 3, failing=False)  # recover_after: 3 traces answered again
        wait_until(lambda: fleet_pages(pager, "resolve"), what="the resolve", timeout=60)
        assert page.body["dedup_key"] not in pager.incidents
        wait_until(lambda: len(hook_posts(hooks, incident_id)) == 2, what="recovery post")
        (after,) = loops(topics.input, 1)
        wait_until(lambda: triggers(pager, after.trace_id), what="a per-trace page")
        assert len(fleet_pages(pager)) == 1


def test_thirty_traces_failing_on_one_tool_page_once_and_the_recovery_resolves_it(tmp_path):
    with fleet_worker(tmp_path) as (pager, hooks, topics, collector, worker):
        opened, recovered = open_and_recovered(incident())
        send_record(topics.detections, opened)
        wait_until(lambda: triggers(pager, opened.trace_id), what="the incident's page")
        agents = loops(topics.input, 30)
        wait_until(lambda: decided(collector, topics, agents), what="30 decisions", timeout=60)
        wait_until(lambda: folded(worker) >= 30, what="30 folded pages")
        time.sleep(1.5)  # room for a stray page, were there one
        assert [triggers(pager, a.trace_id) for a in agents] == [[]] * 30
        (page,) = triggers(pager, opened.trace_id)
        payload = page.body["payload"]
        assert payload["source"] == "tool search_docs at docs.internal:443"
        assert "30 of 30 traces calling search_docs" in payload["summary"]
        details = payload["custom_details"]
        assert (details["tool"], details["traces"], details["hits"]) == (TOOL, 30, 30)
        assert len(details["trace_ids"]) == 20 and len(details["agents"]) == 7
        (post,) = hook_posts(hooks, opened.trace_id)
        assert post["detection"]["tool"] == TOOL and post["detection"]["action"] == "flag"

        send_record(topics.detections, recovered)
        wait_until(lambda: triggers(pager, opened.trace_id, "resolve"), what="the resolve")
        key = page.body["dedup_key"]
        assert key not in pager.incidents
        assert [i.status for i in pager.all_incidents if i.dedup_key == key] == ["resolved"]
        wait_until(lambda: len(hook_posts(hooks, opened.trace_id)) == 2, what="recovery post")
        assert hook_posts(hooks, opened.trace_id)[1]["detection"]["action"] == "recovered"
        assert "30 per-trace page(s) were folded" in worker.log_text()
        shown = explain_tool(topics, "--tool", TOOL, "--server", "docs.internal:443")
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.startswith(f"{TOOL}: 1 fleet incident(s), 0 open")
        assert "30 traces hit of 30 that called it, 60 calls, window 300 s" in shown.stdout
        assert "(7 listed) autopilot/agent-0" in shown.stdout
        none = explain_tool(topics, "--tool", "send_email")
        assert none.returncode == 0 and "no fleet incident on send_email" in none.stdout

        # Closed: a trace decided on the tool pages as it always did.
        (after,) = loops(topics.input, 1)
        wait_until(lambda: triggers(pager, after.trace_id), what="a per-trace page")
        time.sleep(1.0)
        assert len(triggers(pager, opened.trace_id)) == 1  # the incident paged once


def test_a_worker_killed_mid_incident_keeps_folding_after_its_restart(tmp_path):
    with fleet_stack(tmp_path) as (pager, hooks, topics, collector):
        worker = start_worker(topics, tmp_path / "worker", pager, hooks)
        try:
            opened, recovered = open_and_recovered(incident(traces=12, step=2))
            send_record(topics.detections, opened)
            wait_until(lambda: triggers(pager, opened.trace_id), what="the incident's page")
            worker.stop(signal.SIGKILL)
            worker = start_worker(topics, tmp_path / "worker", pager, hooks)
            agents = loops(topics.input, 5)
            wait_until(lambda: decided(collector, topics, agents), what="5 decisions", timeout=60)
            wait_until(lambda: folded(worker) >= 5, what="5 folded pages after the restart")
            time.sleep(1.5)
            assert [triggers(pager, a.trace_id) for a in agents] == [[]] * 5
            # A trigger taken again after the SIGKILL lands on the same incident (its dedup key).
            (page,) = [i for i in pager.all_incidents if opened.trace_id in i.dedup_key]
            assert page.status == "triggered"
            send_record(topics.detections, recovered)
            wait_until(lambda: triggers(pager, opened.trace_id, "resolve"), what="the resolve")
            (after,) = loops(topics.input, 1)
            wait_until(lambda: triggers(pager, after.trace_id), what="a per-trace page")
        finally:
            worker.stop()
        records = [json.loads(m["value"]) for m in collector.where(lambda m: True)]
        assert sum(r.get("rule") == "tool_loop" for r in records) == 6  # folded, still recorded


def test_a_containing_incident_sends_the_signed_tool_signal_and_its_recovery_the_release(
    tmp_path,
):
    from spanguard.schemas.decision import signature_valid
    from tests.support.kafka_harness import SIGNING_KEY

    with fleet_stack(tmp_path) as (pager, hooks, topics, collector):
        kills = Collector(topics.kills)
        policy = POLICY + "fleet: {enabled: true, action: contain}\n"
        worker = start_worker(topics, tmp_path / "worker", pager, hooks, policy)
        try:
            calls(topics.input, 30, failing=True)
            (contain,) = kills.wait(lambda m: json.loads(m["value"]).get("scope") == "tool", 1, 60)
            signal = json.loads(contain["value"])
            assert (signal["kind"], signal["rule"]) == ("kill", TOOL_FAILING)
            assert signal["tool"] == {"name": TOOL, "server": ""}
            assert signature_valid(signal, SIGNING_KEY)
            wait_until(lambda: fleet_pages(pager), what="the incident's page")
            (record,) = [
                r for r in collector.json_from(topics.detections) if r.get("scope") == "tool"
            ]
            assert record["action"] == "contain" and record["decision_id"] == signal["signal_id"]

            calls(topics.input, 3, failing=False)  # clients that did not honour it: answered
            released = kills.wait(lambda m: json.loads(m["value"])["kind"] == "release", 1, 60)
            release = json.loads(released[0]["value"])
            assert (release["scope"], release["tool"]["name"]) == ("tool", TOOL)
            assert signature_valid(release, SIGNING_KEY)
            wait_until(lambda: fleet_pages(pager, "resolve"), what="the resolve")
        finally:
            kills.close()
            assert worker.stop() == 0, worker.log_tail()


def test_two_workers_both_fold_into_an_incident_whichever_partition_its_record_came_on(tmp_path):
    """With two workers, the worker whose paging agent did not read the incident's record folds
    the pages of the traces on its own partitions too: its incident reader read it."""
    with fleet_stack(tmp_path) as (pager, hooks, topics, collector):
        first = start_worker(topics, tmp_path / "a", pager, hooks)
        second = start_worker(topics, tmp_path / "b", pager, hooks)
        try:
            opened, _ = open_and_recovered(incident(traces=20, step=3))
            send_record(topics.detections, opened)
            wait_until(lambda: triggers(pager, opened.trace_id), what="the incident's page")
            time.sleep(2.0)  # the record read by both workers' incident readers
            agents = loops(topics.input, 12)
            wait_until(lambda: decided(collector, topics, agents), what="12 decisions", timeout=60)
            wait_until(
                lambda: folded(first) + folded(second) >= 12,
                what=lambda: (
                    f"12 folded pages: {folded(first)} + {folded(second)}, paged"
                    f" {sum(bool(triggers(pager, a.trace_id)) for a in agents)}"
                ),
            )
            time.sleep(1.5)
            assert [triggers(pager, a.trace_id) for a in agents] == [[]] * 12
            print(f"\nfolded by each worker: {folded(first)}, {folded(second)}")
            assert folded(first) >= 1 and folded(second) >= 1
        finally:
            first.stop()
            second.stop()
