"""Paging through the real `pagerduty` client against a local HTTPS Events API v2 server.

No mocks on the wire: every page goes out through pagerduty.EventsApiV2Client (httpx2) over TLS
to tests/support/pagerduty_server.py, whose certificate comes from a throwaway trustme CA that the
client trusts through SSL_CERT_FILE.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict

import certifi
import pagerduty
import pytest

from spanguard.alerting.pagerduty import Pager, build_event, record_of, should_page
from spanguard.alerting.service import PageOutcome, PagingService
from spanguard.config.settings import PagerSettings
from spanguard.errors import PagerConfigError
from spanguard.logs import JsonFormatter
from spanguard.schemas.decision import AgentIdentity, Decision, validate
from tests.support.https_receiver import Fault
from tests.support.pagerduty_server import EventsApiServer

ROUTING_KEY = "R0uT1nGk3yS3cR3tV4lu3F0rT3sts42x"  # 32 characters, like PagerDuty's
assert len(ROUTING_KEY) == 32
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN_ID = "00f067aa0ba902b7"
TEMPLATE = "https://tempo.example/trace/{trace_id}"
DEDUP_KEY = f"spanguard:{TRACE_ID}:tool_loop"


def detection(autonomous: bool = True, **changes) -> dict:
    """A real spanguard-detections record (the Decision type, checked against its schema)."""
    values = {
        "trace_id": TRACE_ID,
        "span_id": SPAN_ID,
        "rule": "tool_loop",
        "action": "kill",
        "reason": "search_docs called 4x in last 4 steps",
        "agent": AgentIdentity(service="support-agent", name="support-bot"),
        "detected_at": "2026-03-01T12:00:00+00:00",
        "tool_name": "search_docs",
        "args_hash": "9f86d081884c7d65",
        "hits": 4,
        "window": 10,
        "steps": 4,
        "autonomous": autonomous,
    }
    values.update(changes)
    values["agent"] = asdict(values["agent"])  # as the record has it
    record = Decision.from_dict(values).to_dict()
    validate(record, "detection")
    return record


@pytest.fixture
def server():
    with EventsApiServer() as running:
        yield running


@pytest.fixture
def env(server, monkeypatch):
    """The worker's environment: key, URL, trace link, and trust in the test CA."""
    for name in list(os.environ):
        if name.startswith("SPANGUARD_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("SPANGUARD_PAGERDUTY_ROUTING_KEY", ROUTING_KEY)
    monkeypatch.setenv("SPANGUARD_PAGERDUTY_URL", server.url)
    monkeypatch.setenv("SPANGUARD_TRACE_URL_TEMPLATE", TEMPLATE)
    monkeypatch.setenv("SSL_CERT_FILE", server.ca_bundle)
    return os.environ


@pytest.fixture
def sleeps():
    return []


@pytest.fixture
def make_pager(env, sleeps):
    pagers = []

    def make(**overrides) -> Pager:
        pager = Pager(PagerSettings.from_env(env, **overrides), sleep=sleeps.append)
        pagers.append(pager)
        return pager

    yield make
    for pager in pagers:
        pager.close()


@pytest.fixture
def pager(make_pager):
    return make_pager()


# --- the event ---------------------------------------------------------------------------------


def test_the_exact_event_pagerduty_receives(server, pager):
    result = pager.page(detection())

    assert result.status == "accepted"
    assert result.attempts == 1
    assert result.dedup_key == DEDUP_KEY
    [request] = server.requests
    assert request.method == "POST"
    assert request.path == "/v2/enqueue"
    assert request.headers["Content-Type"] == "application/json"
    assert request.headers["User-Agent"].startswith("python-pagerduty/7.")
    trace_url = f"https://tempo.example/trace/{TRACE_ID}"
    assert request.body == {
        "routing_key": ROUTING_KEY,
        "event_action": "trigger",
        "dedup_key": DEDUP_KEY,
        "payload": {
            "summary": (
                "spanguard: support-bot (support-agent) tool_loop:"
                " search_docs called 4x in last 4 steps"
            ),
            "source": "support-agent",
            "severity": "error",
            "timestamp": "2026-03-01T12:00:00+00:00",
            "component": "support-bot",
            "class": "tool_loop",
            "custom_details": {
                "rule": "tool_loop",
                "action": "kill",
                "reason": "search_docs called 4x in last 4 steps",
                "tool_name": "search_docs",
                "args_hash": "9f86d081884c7d65",
                "hits": 4,
                "window": 10,
                "steps": 4,
                "trace_id": TRACE_ID,
                "span_id": SPAN_ID,
                "decision_id": detection()["decision_id"],
                "detected_at": "2026-03-01T12:00:00+00:00",
                "agent": {"service": "support-agent", "name": "support-bot"},
                "autonomous": True,
                "trace_url": trace_url,
            },
        },
        "client": "spanguard",
        "client_url": trace_url,
        "links": [{"href": trace_url, "text": "trace"}],
    }
    assert list(server.incidents) == [DEDUP_KEY]


def test_token_budget_evidence_and_no_link_without_a_template(env):
    env_without_link = {k: v for k, v in env.items() if k != "SPANGUARD_TRACE_URL_TEMPLATE"}
    settings = PagerSettings.from_env(env_without_link)
    record = detection(
        rule="token_budget",
        action="kill",
        reason="52000 tokens used, over the budget of 50000",
        agent=AgentIdentity(service="batch-summariser"),
        tool_name=None,
        args_hash=None,
        hits=None,
        window=None,
        steps=None,
        tokens=52000,
        token_budget=50000,
    )
    event = build_event(record, settings)
    assert event["dedup_key"] == f"spanguard:{TRACE_ID}:token_budget"
    assert event["payload"]["summary"] == (
        "spanguard: batch-summariser token_budget: 52000 tokens used, over the budget of 50000"
    )
    assert event["payload"]["source"] == "batch-summariser"
    details = event["payload"]["custom_details"]
    assert details["tokens"] == 52000 and details["token_budget"] == 50000
    assert not {"tool_name", "args_hash", "hits", "window", "steps", "trace_url"} & set(details)
    assert "links" not in event and "client_url" not in event
    assert "routing_key" not in event


@pytest.mark.parametrize(
    ("given", "default", "sent"),
    [
        (None, "error", "error"),
        ("critical", "error", "critical"),
        ("WARNING", "error", "warning"),
        ("urgent", "error", "error"),  # not a PagerDuty severity: the default, not a 400
        (None, "info", "info"),
    ],
)
def test_severity_from_the_detection_else_the_default(env, given, default, sent):
    record = detection()
    if given is not None:
        record["severity"] = given
    settings = PagerSettings.from_env(env, default_severity=default)
    assert build_event(record, settings)["payload"]["severity"] == sent


def test_trace_url_template_placeholders(env):
    settings = PagerSettings.from_env(
        env, trace_url_template="https://ui.example/{service}/{agent}/{trace_id}?span={span_id}"
    )
    [link] = build_event(detection(), settings)["links"]
    assert link == {
        "href": f"https://ui.example/support-agent/support-bot/{TRACE_ID}?span={SPAN_ID}",
        "text": "trace",
    }
    with pytest.raises(PagerConfigError, match="SPANGUARD_TRACE_URL_TEMPLATE"):
        PagerSettings.from_env(env, trace_url_template="https://ui.example/{trace}")


def test_only_autonomous_agents_are_paged(server, pager):
    records = [detection(autonomous=False), detection(autonomous=True, trace_id="1" * 32)]
    no_flag = detection()
    del no_flag["autonomous"]
    records.append(no_flag)

    assert [should_page(r) for r in records] == [False, True, False]
    assert should_page({"autonomous": "true"}) is False  # strictly the boolean
    for record in records:
        if pager.should_page(record):
            assert pager.page(record).delivered

    assert len(server.requests) == 1
    assert list(server.incidents) == [f"spanguard:{'1' * 32}:tool_loop"]


# --- faults ------------------------------------------------------------------------------------


def test_503_then_202_is_one_incident_after_two_attempts(server, pager, sleeps):
    server.script(503, 202)

    result = pager.page(detection())

    assert (result.status, result.attempts, result.http_status) == ("accepted", 2, 202)
    assert [r.status for r in server.requests] == [503, 202]
    assert len(server.incidents) == 1
    assert len(sleeps) == 1 and 0.25 <= sleeps[0] <= 0.5  # backoff_base 0.5, jittered


@pytest.mark.parametrize("status", [500, 502, 504])
def test_other_5xx_are_retried(server, pager, status):
    server.script(status, 202)
    result = pager.page(detection())
    assert (result.status, result.attempts) == ("accepted", 2)
    assert len(server.incidents) == 1


def test_429_then_202_is_retried_by_us_not_by_the_library(server, pager, sleeps, caplog):
    caplog.set_level(logging.DEBUG)
    server.script(429, 202)

    result = pager.page(detection())

    assert (result.status, result.attempts) == ("accepted", 2)
    assert [r.status for r in server.requests] == [429, 202]
    assert len(sleeps) == 1  # our backoff, not the library's time.sleep
    assert len(server.incidents) == 1
    # The client's misleading "exceeded maximum number of attempts (-1)" line is dropped.
    assert "Non-transient" not in caplog.text


def test_429_forever_stops_at_our_cap(server, make_pager, sleeps):
    # Left alone, the library retries 429 without limit; here it must give up with us.
    pager = make_pager(max_attempts=3)
    server.script(*[429] * 10)

    result = pager.page(detection())

    assert (result.status, result.attempts, result.http_status) == ("failed", 3, 429)
    assert len(server.requests) == 3
    assert server.pending_script == 7
    assert len(sleeps) == 2
    assert not server.incidents


def test_retry_after_is_honoured_up_to_the_cap(server, pager, sleeps):
    server.script(
        Fault(429, headers={"Retry-After": "7"}), Fault(429, headers={"Retry-After": "900"})
    )
    assert pager.page(detection()).attempts == 3
    assert sleeps == [7.0, 30.0]  # 900 s is capped at backoff_cap


def test_400_is_rejected_after_one_attempt(server, pager, sleeps):
    server.script(400)

    result = pager.page(detection())

    assert (result.status, result.attempts, result.http_status) == ("rejected", 1, 400)
    assert result.errors == ("Scripted rejection",)
    assert "Event object is invalid" in result.error
    assert len(server.requests) == 1 and not sleeps and not server.incidents


def test_an_invalid_event_is_rejected_with_the_servers_errors(server, make_pager, sleeps):
    pager = make_pager(routing_key="too-short")  # PagerDuty keys are 32 characters

    result = pager.page(detection())

    assert (result.status, result.attempts) == ("rejected", 1)
    assert result.errors == ("Length of 'routing_key' is incorrect (should be 32 characters)",)
    assert len(server.requests) == 1 and not sleeps


def test_all_503_stops_at_max_attempts(server, pager, sleeps):
    server.script(*[503] * 20)

    result = pager.page(detection())

    assert (result.status, result.attempts, result.http_status) == ("failed", 6, 503)
    assert result.dedup_key == DEDUP_KEY
    assert "503" in result.error
    assert len(server.requests) == 6 and server.pending_script == 14
    assert len(sleeps) == 5
    assert not server.incidents


def test_backoff_is_capped_exponential_with_jitter(env):
    settings = PagerSettings.from_env(env, backoff_base=1.0, backoff_cap=4.0)
    top = Pager(settings, jitter=lambda: 0.999999)
    bottom = Pager(settings, jitter=lambda: 0.0)
    try:
        assert [round(top.backoff(n), 3) for n in range(1, 7)] == [1, 2, 4, 4, 4, 4]
        assert [bottom.backoff(n) for n in range(1, 7)] == [0.5, 1, 2, 2, 2, 2]
    finally:
        top.close()
        bottom.close()


def test_a_dropped_connection_is_retried(server, pager):
    server.script(Fault(drop=True), 202)
    result = pager.page(detection())
    assert (result.status, result.attempts) == ("accepted", 2)
    assert len(server.incidents) == 1


def test_nothing_listening_is_a_failure_after_max_attempts(server, make_pager, sleeps):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    pager = make_pager(events_url=f"https://127.0.0.1:{port}", max_attempts=3)

    result = pager.page(detection())

    assert (result.status, result.attempts, result.http_status) == ("failed", 3, None)
    assert result.error.startswith("network error: ConnectError")
    assert len(sleeps) == 2


def test_a_timeout_is_retried_and_still_one_incident(server, make_pager):
    pager = make_pager(timeout=0.3)
    server.script(Fault(202, delay=1.0))  # answers (and records the trigger) too late

    result = pager.page(detection())

    assert (result.status, result.attempts) == ("accepted", 2)
    deadline = time.monotonic() + 5
    while len([r for r in server.requests if r.status]) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    [incident] = server.incidents.values()
    assert len(incident.events) == 2  # the late trigger and the retry: deduplicated


def test_paging_twice_for_one_trace_and_rule_is_one_incident(server, make_pager):
    # E.g. a worker restarted before it recorded the first page.
    first, second = make_pager(), make_pager()
    assert first.page(detection()).delivered
    assert second.page(detection()).delivered
    assert len(server.requests) == 2
    [incident] = server.incidents.values()
    assert incident.dedup_key == DEDUP_KEY and len(incident.events) == 2


def test_the_paging_service_reads_detections_as_decisions_and_pages_the_same_payload(
    server, make_pager
):
    service = PagingService(make_pager())
    record = detection()
    decision = service.detection_to_page(json.dumps(record).encode(), set())
    assert decision == Decision.from_dict(record)  # typed, not a dict read by key
    assert service.page(decision).delivered
    [incident] = server.incidents.values()
    assert incident.dedup_key == DEDUP_KEY
    assert incident.first["payload"]["custom_details"]["trace_id"] == TRACE_ID
    # The same record as a dict pages the same event (the record is the payload's source).
    assert build_event(record, make_pager().settings) == build_event(
        record_of(decision), make_pager().settings
    )
    assert service.outcomes == {PageOutcome.ACCEPTED: 1}


def test_records_that_are_not_decisions_are_counted_unreadable_and_never_paged(make_pager):
    service = PagingService(make_pager())
    for value in (b"not json", b"[1, 2]", b'{"rule": "tool_loop", "autonomous": true}', b""):
        assert service.detection_to_page(value, set()) is None
    assert service.outcomes == {PageOutcome.UNREADABLE: 4}
    not_autonomous = json.dumps(detection(autonomous=False)).encode()
    assert service.detection_to_page(not_autonomous, set()) is None
    paged_already = json.dumps(detection()).encode()
    assert service.detection_to_page(paged_already, {"tool_loop"}) is None
    assert service.outcomes == {PageOutcome.UNREADABLE: 4, PageOutcome.ALREADY_PAGED: 1}


# --- TLS, settings, secrecy --------------------------------------------------------------------


def test_a_server_outside_ssl_cert_file_is_refused_without_retries(
    server, env, monkeypatch, sleeps
):
    monkeypatch.setenv("SSL_CERT_FILE", certifi.where())  # public CAs only, not the test CA
    with Pager(PagerSettings.from_env(env), sleep=sleeps.append) as pager:
        result = pager.page(detection())

    assert (result.status, result.attempts) == ("failed", 1)
    assert "certificate verification failed" in result.error
    assert "SSL_CERT_FILE" in result.error
    assert not server.enqueue_requests and not sleeps


def test_plain_http_is_refused_with_a_clear_error(env, monkeypatch):
    monkeypatch.setenv("SPANGUARD_PAGERDUTY_URL", "http://events.example:8080")
    with pytest.raises(PagerConfigError) as raised:
        PagerSettings.from_env(env)
    message = str(raised.value)
    assert "SPANGUARD_PAGERDUTY_URL" in message and "https://" in message
    assert "http://events.example:8080" in message
    # The reason: the client library itself accepts https only.
    with pytest.raises(pagerduty.UrlError, match="https"):
        pagerduty.EventsApiV2Client(ROUTING_KEY, base_url="http://events.example:8080")


def test_events_url_default_and_full_enqueue_url(env, monkeypatch):
    monkeypatch.delenv("SPANGUARD_PAGERDUTY_URL")
    assert PagerSettings.from_env(env).events_url == "https://events.pagerduty.com"
    monkeypatch.setenv("SPANGUARD_PAGERDUTY_URL", "https://events.eu.pagerduty.com/v2/enqueue")
    assert PagerSettings.from_env(env).events_url == "https://events.eu.pagerduty.com"


def test_routing_key_from_a_secret_file(env, monkeypatch, tmp_path, server):
    secret = tmp_path / "routing-key"
    secret.write_text(ROUTING_KEY + "\n")
    monkeypatch.delenv("SPANGUARD_PAGERDUTY_ROUTING_KEY")
    monkeypatch.setenv("SPANGUARD_PAGERDUTY_ROUTING_KEY_FILE", str(secret))
    settings = PagerSettings.from_env(env)
    assert settings.routing_key == ROUTING_KEY
    with Pager(settings, sleep=lambda _: None) as pager:
        assert pager.page(detection()).delivered
    assert server.requests[0].body["routing_key"] == ROUTING_KEY

    monkeypatch.setenv("SPANGUARD_PAGERDUTY_ROUTING_KEY", ROUTING_KEY)
    with pytest.raises(PagerConfigError, match="not both"):
        PagerSettings.from_env(env)
    monkeypatch.delenv("SPANGUARD_PAGERDUTY_ROUTING_KEY")
    secret.write_text("\n")
    with pytest.raises(PagerConfigError, match="is empty"):
        PagerSettings.from_env(env)
    monkeypatch.setenv("SPANGUARD_PAGERDUTY_ROUTING_KEY_FILE", str(tmp_path / "missing"))
    with pytest.raises(PagerConfigError, match="cannot read"):
        PagerSettings.from_env(env)
    monkeypatch.delenv("SPANGUARD_PAGERDUTY_ROUTING_KEY_FILE")
    with pytest.raises(PagerConfigError, match="no PagerDuty routing key"):
        PagerSettings.from_env(env)


def test_the_routing_key_never_appears_in_logs_or_reprs(server, env, make_pager, caplog):
    caplog.set_level(logging.DEBUG)  # every logger, the client's and httpx2's included
    pager = make_pager(max_attempts=2)
    server.script(503, 202, 429, 429, 400, Fault(drop=True), Fault(drop=True), 401)
    results = [pager.page(detection(rule=rule)) for rule in ["tool_loop", "token_budget"]]
    results += [pager.page(detection()) for _ in range(3)]
    untrusted = PagerSettings.from_env(env, ca_file=certifi.where(), max_attempts=1)
    with Pager(untrusted) as untrusting:
        results.append(untrusting.page(detection()))
    assert [r.status for r in results] == [
        "accepted", "failed", "rejected", "failed", "rejected", "failed"
    ]  # fmt: skip

    assert caplog.records, "expected the pages to be logged"
    formatter = JsonFormatter()
    for record in caplog.records:
        assert ROUTING_KEY not in formatter.format(record)  # message and extra fields
    assert ROUTING_KEY not in caplog.text
    settings = pager.settings
    for text in [repr(settings), str(settings), repr(pager), *map(repr, results)]:
        assert ROUTING_KEY not in text
    assert "routing_key" not in repr(settings)
    for result in results:
        assert ROUTING_KEY[-8:] not in (result.error or "")


def test_the_server_binds_loopback_only_and_stops_cleanly():
    before = set(threading.enumerate())
    server = EventsApiServer().start()
    assert server._httpd.server_address[0] == "127.0.0.1"
    assert server.url.startswith("https://127.0.0.1:")
    with Pager(
        PagerSettings(routing_key=ROUTING_KEY, events_url=server.url, ca_file=server.ca_bundle)
    ) as pager:
        assert pager.page(detection()).delivered  # leaves a kept-alive connection open
        server.stop()
    assert set(threading.enumerate()) <= before
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", server.port), timeout=1):
        pass
