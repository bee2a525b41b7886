"""One page per cause, without a broker: a fleet incident's page and its resolve through the real
`pagerduty` client against the local Events API v2 server, the paging service folding the
per-trace pages of its tool while it is open, the webhook's body, and `explain --tool`'s text."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import pytest

from spanguard.alerting.incident_reader import IncidentReader, IncidentSkip
from spanguard.alerting.incidents import OpenIncidents, delivery_mark
from spanguard.alerting.pagerduty import build_event, should_page
from spanguard.alerting.service import PageOutcome, PagingService
from spanguard.alerting.webhook import json_body, slack_body
from spanguard.config.settings import WorkerSettings
from spanguard.detection.explain import explain_tool_incidents
from spanguard.detection.fleet import TOOL_FAILING, FleetIncident, incident_decision
from spanguard.schemas.decision import AgentIdentity, Decision, Evidence, PolicyInForce
from spanguard.schemas.policy import FleetPolicy
from tests.alerting.test_pagerduty import (  # noqa: F401  (fixtures)
    env,
    make_pager,
    server,
    sleeps,
)

POLICY = FleetPolicy(enabled=True)
TOOL = "search_docs"


def incident(step: int = 4, server_name: str = "docs.internal:443") -> FleetIncident:
    return FleetIncident(
        rule=TOOL_FAILING,
        tool=TOOL,
        server=server_name,
        opened_at_ns=1_780_000_000 * 10**9 + step * 30 * 10**9,
        opened_step=step,
        figures={"calls": 80, "traces": 40, "failing_traces": 30, "agents": 9},
        traces=[f"{n:032x}" for n in range(1, 21)],
        agents=[f"svc/agent-{n}" for n in range(9)],
    )


def records(found: FleetIncident) -> tuple[Decision, Decision]:
    opened = incident_decision(found, POLICY)
    found.recovered_at_ns = found.opened_at_ns + 90 * 10**9
    found.recovering = ["a" * 32, "b" * 32, "c" * 32]
    return opened, incident_decision(found, POLICY)


def per_trace(trace: int, tool: str = TOOL, autonomous: bool = True) -> Decision:
    return Decision(
        trace_id=f"{trace:032x}",
        span_id="00f067aa0ba902b7",
        rule="tool_loop",
        action="kill",
        reason=f"{tool} called 3x in last 3 steps",
        agent=AgentIdentity("autopilot", "autopilot-agent"),
        detected_at="2026-06-01T12:00:00.000+00:00",
        evidence=Evidence(tool_name=tool, args_hash="9f86d081884c7d65", hits=3, window=10),
        policy=PolicyInForce(autonomous=autonomous),
    )


def test_an_incident_pages_whatever_autonomous_says_names_the_tool_and_its_recovery_resolves():
    opened, recovered = records(incident())
    assert should_page(opened) and should_page(opened.to_dict())
    assert delivery_mark(opened) == TOOL_FAILING
    assert delivery_mark(recovered) == f"{TOOL_FAILING}:recovered"
    from spanguard.config.settings import PagerSettings

    settings = PagerSettings(routing_key="R" * 32, trace_url_template="https://t/{trace_id}")
    event = build_event(opened.to_dict(), settings)
    assert event["dedup_key"] == f"spanguard:{opened.trace_id}:{TOOL_FAILING}"
    payload = event["payload"]
    assert payload["source"] == payload["component"] == "tool search_docs at docs.internal:443"
    assert payload["summary"].startswith("spanguard: tool search_docs at docs.internal:443")
    assert "30 of 40 traces calling search_docs" in payload["summary"]
    details = payload["custom_details"]
    assert (details["tool"], details["traces"], details["hits"]) == (TOOL, 40, 30)
    assert len(details["trace_ids"]) == 20 and len(details["agents"]) == 9
    assert "links" not in event  # the incident's id is no trace to link to
    assert build_event(recovered.to_dict(), settings) == {
        "event_action": "resolve",
        "dedup_key": event["dedup_key"],
    }


def test_the_real_client_triggers_then_resolves_one_incident(server, make_pager):  # noqa: F811
    opened, recovered = records(incident())
    pager = make_pager()
    assert pager.page(opened).delivered
    key = f"spanguard:{opened.trace_id}:{TOOL_FAILING}"
    assert key in server.incidents
    assert pager.page(recovered).delivered
    assert key not in server.incidents
    assert [i.status for i in server.all_incidents] == ["resolved"]
    assert [r.body["event_action"] for r in server.enqueue_requests] == ["trigger", "resolve"]


def test_pages_of_traces_on_the_tool_fold_while_the_incident_is_open_and_not_after():
    table: dict = {}
    service = PagingService(None, OpenIncidents(table))
    opened, recovered = records(incident())
    service.detection_to_page(opened.to_json().encode(), set())
    assert service.incidents.failing_traces() == {TOOL: 30, "(other)": 0}
    for trace in range(1, 31):
        assert service.detection_to_page(per_trace(trace).to_json().encode(), set()) is None
    assert service.outcomes.count(PageOutcome.FOLDED) == 30
    other = per_trace(99, tool="send_email").to_json().encode()
    service.detection_to_page(other, set())  # another tool: not folded (no pager: not paged)
    assert service.outcomes.count(PageOutcome.FOLDED) == 30
    stored = json.loads(table[TOOL.encode()])
    assert stored[opened.trace_id]["folded"] == 30

    # The recovery is delivered (it resolves), apart from the opening record already paged.
    assert service.detection_to_page(recovered.to_json().encode(), {TOOL_FAILING}) is None
    assert table == {} and service.incidents.failing_traces() == {"(other)": 0}
    service.detection_to_page(per_trace(31).to_json().encode(), set())
    assert service.outcomes.count(PageOutcome.FOLDED) == 30  # closed: paged as before


def test_a_service_over_the_same_table_still_folds():
    """The worker's table outlives a restart: a new service over it folds as the first did."""
    table: dict = {}
    opened, _ = records(incident())
    PagingService(None, OpenIncidents(table)).detection_to_page(opened.to_json().encode(), set())
    restarted = PagingService(None, OpenIncidents(table))
    restarted.detection_to_page(per_trace(7).to_json().encode(), set())
    assert restarted.outcomes.count(PageOutcome.FOLDED) == 1


def test_the_reader_notes_incidents_from_any_partition_and_skips_the_rest():
    """The incident reader takes every record of the detections topic: an incident's opens or
    closes it, a per-trace decision is passed over unparsed, a broken one is counted."""
    incidents = OpenIncidents()
    reader = IncidentReader(WorkerSettings(), incidents)
    opened, recovered = records(incident())
    assert reader.accept(opened.to_json().encode(), 1000.0)
    assert reader.accept(per_trace(3).to_json().encode(), 1000.0) is False
    assert reader.accept(b'{"scope": "tool", "trace_id": 7', 1000.0) is False
    assert reader.accept(None, 1000.0) is False
    assert reader.skipped.count(IncidentSkip.UNREADABLE) == 1
    service = PagingService(None, incidents)
    service.detection_to_page(per_trace(3).to_json().encode(), set())
    assert service.outcomes.count(PageOutcome.FOLDED) == 1
    assert reader.accept(recovered.to_json().encode(), 1001.0) and reader.read == 2
    assert incidents.table == {}


def test_an_incident_noted_twice_is_one_and_a_late_opening_record_does_not_reopen_it(caplog):
    """The paging agent and the reader both note the records of the paging agent's partition;
    a partition read late may bring the opening record after the recovery."""
    incidents = OpenIncidents()
    opened, recovered = records(incident())
    incidents.record(opened)
    incidents.record(opened)
    assert len(json.loads(incidents.table[TOOL.encode()])) == 1
    incidents.fold(per_trace(5))
    with caplog.at_level("INFO", logger="spanguard.alerting"):
        assert incidents.record(recovered) == 1
        assert incidents.record(recovered) == 0
    assert sum("fleet incident closed" in r.getMessage() for r in caplog.records) == 1
    incidents.record(opened)
    assert incidents.table == {} and incidents.fold(per_trace(6)) is None


def test_incidents_older_than_the_horizon_are_forgotten():
    incidents = OpenIncidents()
    opened, _ = records(incident())
    incidents.record(opened, noted_at=1000.0)
    assert incidents.prune(cutoff=1000.0) == 0
    assert incidents.prune(cutoff=1000.5) == 1 and incidents.table == {}


def test_the_gauge_names_at_most_twenty_tools_the_worst_first():
    incidents = OpenIncidents()
    for n in range(30):
        found = incident()
        found.tool = f"tool-{n:02d}"
        found.figures = {**found.figures, "failing_traces": 10 + n}
        incidents.record(incident_decision(found, POLICY))
    failing = incidents.failing_traces()
    assert len(failing) == 21
    assert list(failing)[:2] == ["tool-29", "tool-28"] and failing["tool-10"] == 20
    assert failing["(other)"] == sum(range(10, 20))  # the ten tools past the twenty


def test_the_webhook_body_names_the_tool_and_carries_the_whole_record():
    opened, recovered = records(incident())
    body = json_body(opened.to_dict())
    assert body["summary"].startswith("spanguard: tool search_docs at docs.internal:443")
    assert body["detection"]["trace_ids"] == opened.scope.trace_ids  # type: ignore[union-attr]
    assert json_body(recovered.to_dict())["detection"]["action"] == "recovered"
    texts = " ".join(f["text"] for f in slack_body(opened.to_dict())["blocks"][1]["fields"])
    assert "*traces*\n40" in texts and "*server*\ndocs.internal:443" in texts


@pytest.mark.parametrize("with_recovery", [False, True])
def test_explain_tool_prints_each_incident_with_its_figures_traces_and_agents(with_recovery):
    opened, recovered = records(incident())
    later, _ = records(incident(step=40))
    found = [opened.to_dict(), later.to_dict()]
    if with_recovery:
        found.append(recovered.to_dict())
    text = explain_tool_incidents(TOOL, found)
    assert text.startswith(f"{TOOL}: 2 fleet incident(s), {1 if with_recovery else 2} open")
    assert f"incident {opened.trace_id}: tool_failing on {TOOL} at docs.internal:443" in text
    assert "30 traces hit of 40 that called it, 80 calls, window 300 s" in text
    assert "(20 listed) " + " ".join(opened.scope.trace_ids or []) in text  # type: ignore[union-attr]
    assert "(9 listed) svc/agent-0, svc/agent-1" in text
    if with_recovery:
        first, second = text.index(later.trace_id), text.index(opened.trace_id)
        assert first < second  # open ones first
        assert "answered again for 3 traces" in text
    assert explain_tool_incidents("nothing", []) == (
        "no fleet incident on nothing in the detections topic\n"
    )


# Containment: the signals of an incident of action contain -----------------------------------


def test_a_containing_incident_sends_a_tool_signal_and_its_recovery_the_release():
    from spanguard.detection.fleet_signals import containment_signals
    from spanguard.schemas.decision import validate

    containing = FleetPolicy(enabled=True, action="contain")
    found = incident()
    opened = incident_decision(found, containing)
    assert opened.action == "contain"
    (contain,) = containment_signals(opened, containing)
    assert (contain.kind, contain.scope, contain.rule) == ("kill", "tool", TOOL_FAILING)
    assert (contain.tool.name, contain.tool.server) == (TOOL, "docs.internal:443")  # type: ignore[union-attr]
    assert contain.signal_id == opened.decision_id
    expires = datetime.fromisoformat(contain.expires_at)
    assert expires == datetime.fromisoformat(opened.detected_at) + timedelta(seconds=300)
    validate(contain.to_dict(), "kill-signal")
    _, recovered = records(found)
    (release,) = containment_signals(recovered, containing)
    assert release.kind == "release" and release.signal_id == recovered.decision_id
    validate(release.to_dict(), "kill-signal")
    # A flagging policy (or --mode observe, which makes contain a flag) sends nothing.
    assert containment_signals(incident_decision(incident(), POLICY), POLICY) == []
    assert containment_signals(recovered, POLICY) == []
    assert containment_signals(per_trace(1), containing) == []
