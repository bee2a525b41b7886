"""The webhook sender against a local HTTPS server (no broker): bodies, retries, trust, secrets."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging

import pytest

from spanguard.alerting.webhook import Webhook, WebhookOutcome, WebhookService, build_body
from spanguard.config.settings import WebhookSettings
from spanguard.errors import SettingsError
from spanguard.schemas.decision import Decision
from tests.support.https_receiver import Fault
from tests.support.webhook_server import WebhookServer, slack_errors

SECRET_PATH = "/services/T000/B000/XXXXsecretXXXX"
DETECTION = {
    "schema_version": 1,
    "decision_id": "6a19b10dab573a231a78e69ba7700f09",
    "trace_id": "092553d323c3f9ed3b2447fff505f70e",
    "span_id": "6ab3e875facdb098",
    "rule": "tool_loop",
    "action": "kill",
    "reason": "search_docs called 4x in last 4 steps",
    "agent": {"service": "support-bot", "name": "support <bot>"},
    "detected_at": "2026-12-03T07:14:26.502+00:00",
    "tool_name": "search_docs",
    "args_hash": "66b6ee03f42ce0b6",
    "hits": 4,
    "window": 10,
    "threshold": 4,
    "policy_entry": "defaults",
}


@pytest.fixture
def server():
    with WebhookServer() as running:
        yield running


def settings(server: WebhookServer, path: str = SECRET_PATH, **flags) -> WebhookSettings:
    environ = {"SPANGUARD_WEBHOOK_URL": server.url + path}
    return WebhookSettings.from_sources({"ca_file": server.ca_bundle, **flags}, environ)


def test_json_body_is_signed_and_carries_the_detection(server) -> None:
    hook = Webhook(
        settings(server, "/hooks/spanguard", signing_key_file=None), sleep=lambda s: None
    )
    environ = {"SPANGUARD_WEBHOOK_URL": server.url + "/hooks/spanguard"}
    signed = WebhookSettings.from_sources(
        {"ca_file": server.ca_bundle}, {**environ, "SPANGUARD_WEBHOOK_SIGNING_KEY": "k3y"}
    )
    result = Webhook(signed).notify(DETECTION)
    assert (result.status, result.attempts, result.http_status) == ("delivered", 1, 200)
    (request,) = server.received("/hooks/spanguard")
    body = request.body
    assert body["type"] == "spanguard.detection"
    assert body["dedup_key"] == f"spanguard:{DETECTION['trace_id']}:tool_loop"
    assert body["detection"] == DETECTION
    assert body["summary"] == (
        "spanguard: support <bot> (support-bot) tool_loop -> kill: search_docs called 4x in last 4 steps"
    )
    expected = hmac.new(b"k3y", request.raw, hashlib.sha256).hexdigest()
    assert request.headers["X-Spanguard-Signature"] == f"sha256={expected}"
    assert request.headers["Content-Type"] == "application/json"
    assert hook.notify(DETECTION).delivered
    assert "X-Spanguard-Signature" not in server.received("/hooks/spanguard")[1].headers


def test_slack_shape_is_what_an_incoming_webhook_accepts(server) -> None:
    result = Webhook(settings(server, template="slack")).notify(DETECTION)
    assert result.delivered
    (request,) = server.received(SECRET_PATH)
    assert slack_errors(request.raw) is None
    body = request.body
    assert body["text"].startswith("spanguard: support &lt;bot&gt; (support-bot) tool_loop")
    section, fields, context = body["blocks"]
    assert section["type"] == "section" and section["text"]["text"] == body["text"]
    texts = [field["text"] for field in fields["fields"]]
    assert "*tool*\nsearch_docs" in texts and "*threshold*\n4" in texts
    assert "*policy*\ndefaults" in texts
    assert DETECTION["trace_id"] in context["elements"][0]["text"]
    # And the server's Slack check is not vacuous: the JSON template is refused there.
    assert slack_errors(build_body(DETECTION, "json")) == "no_text"


def test_5xx_and_429_are_retried_with_backoff_up_to_the_cap(server) -> None:
    delays: list[float] = []
    server.script(503, Fault(status=429, headers={"Retry-After": "7"}), 502)
    hook = Webhook(settings(server, max_attempts=3), sleep=delays.append, jitter=lambda: 1.0)
    result = hook.notify(DETECTION)
    assert (result.status, result.attempts, result.http_status) == ("failed", 3, 502)
    assert [r.status for r in server.received(SECRET_PATH)] == [503, 429, 502]
    assert delays == [0.5, 7.0]  # backoff_base doubling, Retry-After honoured (under the cap)
    assert SECRET_PATH not in (result.error or "") and "127.0.0.1" in (result.error or "")
    # The next one goes through on its first try (the script is used up).
    assert hook.notify(DETECTION).attempts == 1


def test_a_4xx_is_final_after_one_attempt(server) -> None:
    server.script(404)
    service = WebhookService(Webhook(settings(server), sleep=lambda s: None))
    result = service.notify(DETECTION)
    assert (result.status, result.attempts, result.http_status) == ("rejected", 1, 404)
    assert len(server.received(SECRET_PATH)) == 1
    assert service.outcomes == {WebhookOutcome.REJECTED: 1}


def test_an_untrusted_certificate_fails_at_once_without_naming_the_path(server) -> None:
    environ = {"SPANGUARD_WEBHOOK_URL": server.url + SECRET_PATH}
    hook = Webhook(WebhookSettings.from_sources({}, environ), sleep=lambda s: None)
    result = hook.notify(DETECTION)
    assert (result.status, result.attempts) == ("failed", 1)  # retrying cannot help
    assert "TLS certificate verification failed" in (result.error or "")
    assert SECRET_PATH not in (result.error or "")
    assert server.received(SECRET_PATH) == []  # the handshake failed: nothing was posted


def test_a_timeout_is_retried(server) -> None:
    server.script(Fault(status=200, delay=2.0))
    hook = Webhook(
        settings(server, "/hooks/a", timeout="0.5", max_attempts="2"), sleep=lambda s: None
    )
    result = hook.notify(DETECTION)
    assert (result.status, result.attempts) == ("delivered", 2)  # a timeout, then through
    assert len(server.received("/hooks/a")) == 2


def test_the_url_is_a_secret_and_must_be_https(server, caplog) -> None:
    hook = Webhook(settings(server, template="slack"))
    with caplog.at_level(logging.DEBUG):
        assert hook.notify(DETECTION).delivered
    assert "HTTP Request: POST" in caplog.text  # httpx2's own line, with the URL hidden
    assert SECRET_PATH not in caplog.text and "XXXXsecretXXXX" not in caplog.text
    assert SECRET_PATH not in repr(hook) and SECRET_PATH not in repr(hook.settings)
    assert hook.settings.host == f"127.0.0.1:{server.port}"
    with pytest.raises(SettingsError, match="must be an https:// URL") as caught:
        WebhookSettings.from_sources(
            {}, {"SPANGUARD_WEBHOOK_URL": "http://hooks.example/T0/secret"}
        )
    assert "secret" not in str(caught.value)
    with pytest.raises(SettingsError, match="no webhook URL"):
        WebhookSettings.from_sources({}, {})
    assert not WebhookSettings.configured({}, {})
    assert WebhookSettings.configured({}, {"SPANGUARD_WEBHOOK_URL": "https://x.example/"})


def test_one_per_trace_and_rule_and_unreadable_records_are_counted(server) -> None:
    service = WebhookService(Webhook(settings(server)))
    value = json.dumps(DETECTION).encode()
    assert service.detection_to_send(value, set()) == Decision.from_dict(DETECTION)
    assert service.detection_to_send(value, {"tool_loop"}) is None
    assert service.detection_to_send(b"not json", set()) is None
    assert service.outcomes == {WebhookOutcome.ALREADY_SENT: 1, WebhookOutcome.UNREADABLE: 1}
    assert WebhookService(None).detection_to_send(value, set()) is None  # no URL: nothing
