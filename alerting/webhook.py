"""Detections of any agent to a webhook: a JSON body, or a Slack incoming webhook's shape.

Faust-free and synchronous, like the pager: the worker calls `Webhook.notify` off its event
loop (an executor), so a slow or failing receiver delays notifications, never kill signals.

    settings = WebhookSettings.from_sources({})     # URL (a secret), template, retry caps
    webhook = Webhook(settings)
    result = webhook.notify(detection)              # NotifyResult("delivered" | "rejected" | "failed")

Bodies:
- `json`: {"type": "spanguard.detection", "dedup_key", "summary", "detection": <the record>}
  (the record as on spanguard-detections: hashes and ids, never raw arguments unless the
  policy records them).
- `slack`: {"text", "blocks"} as Slack's incoming webhooks take it; `text` is the fallback
  shown in notifications.

429, 5xx and network errors are retried with capped, jittered exponential backoff (honouring
Retry-After up to the cap) up to `max_attempts`; any other status is final after one attempt.
With a signing key, `X-Spanguard-Signature: sha256=<hex>` is the HMAC-SHA256 of the body, so
a receiver can tell our posts from forgeries. The URL is a credential (a Slack webhook's path
is its token): logs and results name its host only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import random
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx2

from spanguard import __version__
from spanguard.alerting.incidents import delivery_mark
from spanguard.alerting.pagerduty import dedup_key, fleet_label, record_of
from spanguard.config.settings import WebhookSettings
from spanguard.connectors.outbound import (
    SUMMARY_LIMIT,
    Final,
    Retry,
    deliver,
    limit_responses,
    retry_or_final,
    tls_verify_failure,
)
from spanguard.outcomes import CountedOutcome, Tally
from spanguard.retry import Backoff
from spanguard.schemas.decision import Decision, pause_instructions

__all__ = [
    "NotifyResult",
    "Webhook",
    "WebhookOutcome",
    "WebhookService",
    "build_body",
    "json_body",
    "slack_body",
]

log = logging.getLogger("spanguard.alerting")

SIGNATURE_HEADER = "X-Spanguard-Signature"
# What a Slack message shows of the evidence, when present.
SLACK_FIELDS = (
    ("tool_name", "tool"),
    ("server", "server"),
    ("traces", "traces"),
    ("hits", "hits"),
    ("window", "window"),
    ("threshold", "threshold"),
    ("tokens", "tokens"),
    ("token_budget", "budget"),
    ("confidence", "confidence"),
    ("policy_entry", "policy"),
)

Status = Literal["delivered", "rejected", "failed"]


def summary_of(detection: Mapping[str, Any]) -> str:
    agent = detection.get("agent") or {}
    service = agent.get("service") or "unknown-service"
    name = agent.get("name")
    who = f"{name} ({service})" if name and name != service else service
    who = fleet_label(detection) or who  # a fleet incident: the tool across every agent
    text = (
        f"spanguard: {who} {detection.get('rule')} -> {detection.get('action')}:"
        f" {detection.get('reason')}"
    )
    waiting = pause_instructions(detection)
    if waiting is not None:  # before the cut: the answer is what the reader needs
        text = f"{text[: SUMMARY_LIMIT - len(waiting) - 5]}; {waiting}"
    return text if len(text) <= SUMMARY_LIMIT else text[: SUMMARY_LIMIT - 3] + "..."


def json_body(detection: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "type": "spanguard.detection",
        "dedup_key": dedup_key(detection),
        "summary": summary_of(detection),
        "detection": dict(detection),
    }


def _slack_escape(text: str) -> str:
    # Slack's mrkdwn control characters (its documented escaping).
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def slack_body(detection: Mapping[str, Any]) -> dict[str, Any]:
    agent = detection.get("agent") or {}
    fields = [
        {"type": "mrkdwn", "text": f"*agent*\n{_slack_escape(str(agent.get('service')))}"},
        {
            "type": "mrkdwn",
            "text": f"*rule*\n{detection.get('rule')} → {detection.get('action')}",
        },
    ]
    for key, label in SLACK_FIELDS:
        if detection.get(key) is not None:
            fields.append(
                {"type": "mrkdwn", "text": f"*{label}*\n{_slack_escape(str(detection[key]))}"}
            )
    summary = _slack_escape(summary_of(detection))
    return {
        "text": summary,
        "blocks": [
            {"type": "section", "text": {"type": "mrkdwn", "text": summary}},
            {"type": "section", "fields": fields[:10]},  # Slack takes at most 10 fields
            {
                "type": "context",
                "elements": [
                    {
                        "type": "mrkdwn",
                        "text": f"trace `{detection.get('trace_id')}` · span"
                        f" `{detection.get('span_id')}` · {detection.get('detected_at')}",
                    }
                ],
            },
        ],
    }


TEMPLATES: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    "json": json_body,
    "slack": slack_body,
}


def build_body(detection: Mapping[str, Any], template: str) -> bytes:
    return json.dumps(TEMPLATES[template](detection), separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class NotifyResult:
    """What became of one notification: "delivered" (2xx), "rejected" (a 4xx other than 429:
    retrying cannot help), "failed" (429, 5xx or network errors until `max_attempts`)."""

    status: Status
    attempts: int
    dedup_key: str
    error: str | None = None
    http_status: int | None = None

    @property
    def delivered(self) -> bool:
        return self.status == "delivered"


class _HideUrl(logging.Filter):
    """httpx2 logs every request's full URL at INFO: a webhook's path (and query) is its
    credential, so our URL is shown as its scheme and host only."""

    def __init__(self, url: str) -> None:
        super().__init__()
        parts = urlsplit(url)
        self.secret = parts.path + (f"?{parts.query}" if parts.query else "")
        self.shown = f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}/..."

    def filter(self, record: logging.LogRecord) -> bool:
        if self.secret.strip("/") and isinstance(record.args, tuple):
            record.args = tuple(
                self.shown if self.secret in str(arg) else arg for arg in record.args
            )
        if self.secret.strip("/") and self.secret in str(record.msg):
            record.msg = str(record.msg).replace(self.secret, "/...")
        return True


_HTTPX_LOG = logging.getLogger("httpx2")


class Webhook:
    """Posts detections to one URL; safe to share between threads. `sleep` and `jitter` are
    injectable so tests need not wait."""

    def __init__(
        self,
        settings: WebhookSettings,
        *,
        sleep: Callable[[float], None] = time.sleep,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.settings = settings
        self._sleep = sleep
        self._backoff = Backoff(settings.backoff_base, settings.backoff_cap, jitter)
        verify: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=settings.ca_file) if settings.ca_file else True
        )
        self._hide_url = _HideUrl(settings.url or "")
        _HTTPX_LOG.addFilter(self._hide_url)
        self._client = httpx2.Client(
            verify=verify,
            timeout=httpx2.Timeout(settings.timeout),
            follow_redirects=False,  # a redirect could carry the body somewhere unplanned
            # A new connection per attempt: the attempt's deadline watches its socket.
            limits=httpx2.Limits(max_keepalive_connections=0),
            headers={"User-Agent": f"spanguard/{__version__}"},
        )
        limit_responses(self._client)

    def __repr__(self) -> str:
        return f"Webhook(host={self.settings.host!r}, template={self.settings.template!r})"

    def close(self) -> None:
        self._client.close()
        _HTTPX_LOG.removeFilter(self._hide_url)

    def backoff(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds to wait after failed attempt number `attempt` (spanguard.retry.Backoff)."""
        return self._backoff.delay(attempt, retry_after)

    def notify(self, detection: Decision | Mapping[str, Any]) -> NotifyResult:
        """Post `detection`; never raises for delivery problems (they come back as a result)."""
        detection = record_of(detection)
        body = build_body(detection, self.settings.template)
        headers = {"Content-Type": "application/json"}
        if self.settings.signing_key:
            digest = hmac.new(self.settings.signing_key.encode(), body, hashlib.sha256)
            headers[SIGNATURE_HEADER] = f"sha256={digest.hexdigest()}"
        key = dedup_key(detection)
        context = {"dedup_key": key, "host": self.settings.host}
        outcome = deliver(
            lambda: self._post(body, headers),
            max_attempts=self.settings.max_attempts,
            backoff=self._backoff,
            timeout=self.settings.timeout,
            what="webhook",
            sleep=self._sleep,
            log=log,
            context=context,
        )
        failure = outcome.failure
        if failure is None:
            return NotifyResult("delivered", outcome.attempts, key, http_status=outcome.value)
        status: Status = failure.status if isinstance(failure, Final) else "failed"
        log.error(
            "webhook %s after %d attempt(s): %s",
            status,
            outcome.attempts,
            failure.error,
            extra={**context, "attempts": outcome.attempts},
        )
        return NotifyResult(status, outcome.attempts, key, failure.error, failure.http_status)

    def _post(self, body: bytes, headers: dict[str, str]) -> int:
        """One attempt: the 2xx status, else Retry or Final. A 2xx body is never read."""
        assert self.settings.url is not None
        try:
            with self._client.stream(
                "POST", self.settings.url, content=body, headers=headers
            ) as response:
                status = response.status_code
                if 200 <= status < 300:
                    return status
                retry_or_final(status, response.headers, f"HTTP {status} from {self.settings.host}")
        except httpx2.HTTPError as exc:
            if tls_verify_failure(exc):
                raise Final(
                    f"TLS certificate verification failed for {self.settings.host}"
                    " (SPANGUARD_WEBHOOK_CA_FILE names the CA bundle to trust)",
                    status="failed",
                ) from None
            # str(exc) may hold the URL, whose path is a credential: the type and host only.
            raise Retry(f"network error: {type(exc).__name__} ({self.settings.host})") from None
        raise AssertionError("unreachable")  # pragma: no cover


class WebhookOutcome(CountedOutcome):
    """What became of a detection the webhook agent read."""

    DELIVERED = "delivered"  # NotifyResult's statuses, then ours
    REJECTED = "rejected"
    FAILED = "failed"
    ALREADY_SENT = "already_sent"  # this trace and rule sent before
    UNREADABLE = "unreadable"  # not JSON, or no rule in it


class WebhookService:
    """Which detections notify, and what became of each notification (the agent's Faust-free
    half): every detection, once per trace and rule (streams/agents/notify_webhook.py keeps
    what was sent in a changelog-backed table)."""

    def __init__(self, webhook: Webhook | None) -> None:
        self.webhook = webhook
        self.outcomes = Tally()

    def detection_to_send(self, value: bytes | None, sent_rules: set[str]) -> Decision | None:
        """The detection in `value` if it must be sent now, else None (and why is counted)."""
        if self.webhook is None:
            return None
        try:
            decision = Decision.from_json(value or b"")
        except ValueError:
            self.outcomes.add(WebhookOutcome.UNREADABLE)
            return None
        if delivery_mark(decision) in sent_rules:
            self.outcomes.add(WebhookOutcome.ALREADY_SENT)
            return None
        return decision

    def notify(self, decision: Decision) -> NotifyResult:
        """Blocking (retries with backoff): call it from an executor thread."""
        assert self.webhook is not None
        result = self.webhook.notify(decision)
        self.outcomes.add(WebhookOutcome(result.status))
        log.info(
            "webhook",
            extra={
                "dedup_key": result.dedup_key,
                "status": result.status,
                "attempts": result.attempts,
            },
        )
        return result
