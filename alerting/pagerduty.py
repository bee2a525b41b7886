"""Page the on-call through PagerDuty's Events API v2 when an autonomous agent loops.

Faust-free and synchronous: the worker calls `Pager.page` off its event loop (an executor), so a
slow or failing PagerDuty delays pages, never detection or kill signals.

    settings = PagerSettings.from_env()          # routing key, URL, trace link, TLS trust
    pager = Pager(settings)
    if should_page(detection):                   # detection: one spanguard-detections record
        result = pager.page(detection)           # PageResult(status="accepted" | "rejected" | "failed")

The event goes out with the real `pagerduty` client (`EventsApiV2Client`, built on httpx2), with
its own retries switched off so that the delivery loop every outbound call shares
(connectors/outbound.py) is the only one in force: 408, 429, 5xx and network errors are retried
up to `max_attempts`, waiting as `spanguard.retry` says (capped, jittered exponential backoff,
or the server's Retry-After, capped); any other 4xx (a 400 "invalid event") is final after one
attempt; each attempt as a whole within `timeout`, its answer read within the body cap. The dedup key
`spanguard:<trace_id>:<rule>` makes a retried or repeated trigger land on the same incident.

The routing key is a credential: it is kept out of `repr`, logs and `PageResult.error`.
"""

from __future__ import annotations

import logging
import random
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

import httpx2
import pagerduty

from spanguard.config.settings import SEVERITIES, PagerSettings
from spanguard.connectors.outbound import (
    SUMMARY_LIMIT,
    Final,
    Retry,
    deliver,
    limit_responses,
    retry_or_final,
    scrub,
    tls_reason,
    tls_verify_failure,
)
from spanguard.retry import Backoff
from spanguard.schemas.decision import (
    EVIDENCE_FIELDS,
    PAUSE_FIELDS,
    SCOPE_FIELDS,
    Decision,
    pause_instructions,
)

__all__ = [
    "PageResult",
    "Pager",
    "build_event",
    "dedup_key",
    "record_of",
    "should_page",
]

log = logging.getLogger(__name__)


# Evidence copied from a detection into payload.custom_details, when present.
DETAIL_FIELDS = (
    "rule",
    "action",
    "reason",
    *EVIDENCE_FIELDS,
    "trace_id",
    "span_id",
    "decision_id",
    "detected_at",
    *PAUSE_FIELDS,
    *SCOPE_FIELDS,  # a conversation's decision: which conversation, over how many traces
    # The agents a decision names (a fleet incident's callers, a handoff cycle's agents), and
    # the multi-agent rules' figures: in the record's evidence, not in a kill signal's.
    "agents",
    "depth",
    "sub_agents",
)

Status = Literal["accepted", "rejected", "failed"]


# --- the event -------------------------------------------------------------------------------


def record_of(detection: Decision | Mapping[str, Any]) -> Mapping[str, Any]:
    """A detection as its record on the topic: what a page's and a webhook's payload carry."""
    return detection.to_dict() if isinstance(detection, Decision) else detection


def should_page(detection: Decision | Mapping[str, Any]) -> bool:
    """Detections on autonomous agents (policy `autonomous: true`) page the on-call, and so do
    fleet incidents (scope "tool": one tool failing across every agent)."""
    if isinstance(detection, Decision):
        return detection.policy.autonomous is True or detection.scope_kind == "tool"
    return detection.get("autonomous") is True or detection.get("scope") == "tool"


def dedup_key(detection: Mapping[str, Any]) -> str:
    """`spanguard:<trace_id>:<rule>`: one incident per looping trace and rule."""
    return f"spanguard:{detection['trace_id']}:{detection['rule']}"


def fleet_label(detection: Mapping[str, Any]) -> str | None:
    """A fleet incident's subject, `tool NAME[ at SERVER]`; None for any other detection."""
    if detection.get("scope") != "tool":
        return None
    server = detection.get("server")
    return f"tool {detection.get('tool')}" + (f" at {server}" if server else "")


def _agent(detection: Mapping[str, Any]) -> tuple[str, str | None]:
    agent = detection.get("agent") or {}
    service = agent.get("service") or "unknown-service"
    return service, agent.get("name") or None


def _link_fields(detection: Mapping[str, Any]) -> dict[str, str]:
    service, name = _agent(detection)
    return {
        "trace_id": str(detection.get("trace_id", "")),
        "span_id": str(detection.get("span_id") or ""),
        "service": service,
        "agent": name or service,
    }


def trace_url(detection: Mapping[str, Any], settings: PagerSettings) -> str | None:
    if not settings.trace_url_template:
        return None
    return settings.trace_url_template.format_map(_link_fields(detection))


def severity_of(detection: Mapping[str, Any], default: str = "error") -> str:
    """The detection's `severity` (from the policy) when valid, else `default`."""
    value = detection.get("severity")
    if isinstance(value, str) and value.lower() in SEVERITIES:
        return value.lower()
    if value is not None:
        log.warning(
            "detection severity %r is not one of %s; paging with %r",
            value,
            ", ".join(SEVERITIES),
            default,
            extra={"decision_id": detection.get("decision_id")},
        )
    return default


def build_event(detection: Mapping[str, Any], settings: PagerSettings) -> dict[str, Any]:
    """The Events API v2 trigger for one detection, without the routing key (the client adds it).

    Shape: {"event_action", "dedup_key", "payload": {summary, source, severity, timestamp,
    component, class, custom_details}, "client", ["client_url", "links"]}. A fleet incident's
    `recovered` record is the resolve of its trigger: {"event_action": "resolve", "dedup_key"}.
    """
    if detection.get("action") == "recovered":
        return {"event_action": "resolve", "dedup_key": dedup_key(detection)}
    service, name = _agent(detection)
    who = f"{name} ({service})" if name and name != service else service
    fleet = fleet_label(detection)
    if fleet is not None:  # many agents: the tool is the subject (`agents` lists them)
        who = fleet
    rule = detection["rule"]
    reason = detection.get("reason")
    summary = f"spanguard: {who} {rule}: {reason}" if reason else f"spanguard: {who} {rule}"
    waiting = pause_instructions(detection)
    if waiting is not None:  # kept whole: the answer is what on-call needs
        summary = f"{summary[: SUMMARY_LIMIT - len(waiting) - 5]}; {waiting}"
    if len(summary) > SUMMARY_LIMIT:
        summary = summary[: SUMMARY_LIMIT - 3] + "..."

    details: dict[str, Any] = {
        key: detection[key] for key in DETAIL_FIELDS if detection.get(key) is not None
    }
    details["agent"] = {"service": service, "name": name}
    if "autonomous" in detection:
        details["autonomous"] = detection["autonomous"]

    payload: dict[str, Any] = {
        "summary": summary,
        "source": fleet or service,
        "severity": severity_of(detection, settings.default_severity),
        "component": fleet or name or service,
        "class": rule,
        "custom_details": details,
    }
    if detection.get("detected_at"):
        payload["timestamp"] = detection["detected_at"]

    event: dict[str, Any] = {
        "event_action": "trigger",
        "dedup_key": dedup_key(detection),
        "payload": payload,
        "client": "spanguard",
    }
    link = None if fleet else trace_url(detection, settings)  # an incident's id is no trace
    if link:
        details["trace_url"] = link
        event["client_url"] = link
        event["links"] = [{"href": link, "text": "trace"}]
    return event


# --- sending ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PageResult:
    """What became of one page.

    status: "accepted" (PagerDuty took the event; the incident is open or was deduplicated),
    "rejected" (a 4xx other than 408 and 429: retrying cannot help; `errors` holds the server's
    reasons), "failed" (408/429/5xx/network errors until `max_attempts`, or TLS trust failure).
    """

    status: Status
    attempts: int
    dedup_key: str
    error: str | None = None
    errors: tuple[str, ...] = ()
    http_status: int | None = None

    @property
    def delivered(self) -> bool:
        return self.status == "accepted"


class _DropRetryExhausted(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Non-transient HTTP error: exceeded maximum number of attempts" not in str(
            record.msg
        )


_client_log = logging.getLogger(f"{__name__}.client")
_client_log.addFilter(_DropRetryExhausted())


class Pager:
    """Sends triggers for detections to PagerDuty; safe to share between threads.

    `sleep` (default time.sleep) and `jitter` (default random.random, in [0, 1)) are injectable
    so tests need not wait.
    """

    def __init__(
        self,
        settings: PagerSettings,
        *,
        sleep: Callable[[float], None] = time.sleep,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.settings = settings
        self._sleep = sleep
        self._backoff = Backoff(settings.backoff_base, settings.backoff_cap, jitter)
        self._client = self._make_client(settings)

    def __repr__(self) -> str:
        return (
            f"Pager(events_url={self.settings.events_url!r},"
            f" max_attempts={self.settings.max_attempts})"
        )

    @staticmethod
    def _make_client(settings: PagerSettings) -> pagerduty.EventsApiV2Client:
        # httpx2 reads SSL_CERT_FILE once, when a client is built, and only when trust_env holds;
        # an explicit context makes the trust we were configured with the one in force.
        verify: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=settings.ca_file) if settings.ca_file else True
        )
        client = pagerduty.EventsApiV2Client(
            # PagerSettings.__post_init__ sets the key or refuses the settings.
            cast(str, settings.routing_key),
            base_url=settings.events_url,
            verify=verify,
            # A new connection per attempt: the attempt's deadline watches its socket.
            limits=httpx2.Limits(max_keepalive_connections=0),
        )
        # Our retry loop is the only one. The library's own defaults would otherwise:
        # - retry 429 without limit (status absent from `retry` => unlimited) and 500/502/503/504
        #   2-6 times each with its own un-injectable time.sleep (EventsApiV2Client.__init__);
        # - retry network errors `max_network_attempts` (3) times, sleeping 3s, 6s, 12s.
        # A `retry` entry n > 0 retries until n retries of that status OR until the total exceeds
        # `max_http_attempts` (a strict `>`: 0 still allows one retry). So: 429 gets an entry
        # (which stops "unlimited") and max_http_attempts = -1 makes the first 429 final; the 5xx
        # entries are dropped (status not in `retry` and not 429 => response returned as is).
        client.retry = {429: 1}
        client.max_http_attempts = -1
        client.max_network_attempts = 0  # first TransportError raises pagerduty.Error
        client.timeout = settings.timeout  # type: ignore[assignment]  # httpx2 takes a float; pagerduty's default is an int
        # With that, the client's only log line is an ERROR per 429 claiming it "exceeded maximum
        # number of attempts (-1)": misleading, and we log every outcome ourselves. Drop just that
        # line, on a logger of our own (the library's global logger is left alone).
        client.log = _client_log
        # Bodies uncompressed, within the cap and the attempt's deadline (connectors/outbound.py).
        limit_responses(client)
        return client

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> Pager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def should_page(self, detection: Decision | Mapping[str, Any]) -> bool:
        return should_page(detection)

    def backoff(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based): `Backoff.delay`
        from `backoff_base` up to `backoff_cap`."""
        return self._backoff.delay(attempt, retry_after)

    def page(self, detection: Decision | Mapping[str, Any]) -> PageResult:
        """Trigger an incident for `detection` (does not check `should_page`); never raises for
        delivery problems, which come back as a "rejected" or "failed" PageResult."""
        detection = record_of(detection)
        event = build_event(detection, self.settings)
        key = event["dedup_key"]
        context = {"dedup_key": key, "decision_id": detection.get("decision_id")}
        outcome = deliver(
            lambda: self._send(event),
            max_attempts=self.settings.max_attempts,
            backoff=self._backoff,
            timeout=self.settings.timeout,
            what="page",
            sleep=self._sleep,
            log=log,
            context=context,
        )
        failure = outcome.failure
        if failure is None:
            log.info(
                "paged on-call",
                extra={
                    **context,
                    "attempts": outcome.attempts,
                    "event_action": event["event_action"],
                    "severity": event.get("payload", {}).get("severity"),
                },
            )
            return PageResult("accepted", outcome.attempts, key, http_status=outcome.value)
        status: Status = failure.status if isinstance(failure, Final) else "failed"
        errors = failure.errors if isinstance(failure, Final) else ()
        log.error(
            "page %s after %d attempt(s): %s",
            status,
            outcome.attempts,
            failure.error,
            extra={**context, "attempts": outcome.attempts, "http_status": failure.http_status},
        )
        return PageResult(status, outcome.attempts, key, failure.error, errors, failure.http_status)

    def _send(self, event: dict[str, Any]) -> int:
        """One HTTP attempt: the HTTP status when PagerDuty accepted the event, else Retry or
        Final. (The client returns only the dedup_key on success, and the Events API's success
        status is 202.)"""
        properties = {k: v for k, v in event.items() if k not in ("event_action", "dedup_key")}
        secrets = (self.settings.routing_key,)
        try:
            self._client.send_event(
                event["event_action"], dedup_key=event["dedup_key"], **properties
            )
        except pagerduty.HttpError as exc:
            # HttpError always carries its response; its base class types it Optional.
            response: httpx2.Response = exc.response  # type: ignore[assignment]
            status = response.status_code
            if response.is_success:
                # 2xx with a body the client did not expect: PagerDuty took the event.
                log.warning(
                    "PagerDuty accepted the event with an unexpected body (HTTP %d)", status
                )
                return status
            message, errors = _describe(response)
            error = scrub(f"HTTP {status} from PagerDuty: {message}", secrets)
            retry_or_final(status, response.headers, error, errors)
        except pagerduty.Error as exc:
            # Network-level failure (the client raises Error from the httpx2 TransportError).
            cause = exc.__cause__
            if tls_verify_failure(cause):
                raise Final(
                    f"TLS certificate verification failed for {self.settings.events_url}: "
                    f"{tls_reason(cause)} (SSL_CERT_FILE names the CA bundle to trust)",
                    status="failed",
                ) from None
            raise Retry(
                scrub(f"network error: {_describe_exception(cause or exc)}", secrets)
            ) from None
        except httpx2.HTTPError as exc:
            raise Retry(scrub(f"network error: {_describe_exception(exc)}", secrets)) from None
        return 202


# At most this many of the server's error reasons are kept (a 400 may list thousands).
MAX_ERRORS = 10


def _describe(response: httpx2.Response) -> tuple[str, tuple[str, ...]]:
    """The server's message and errors list, from an Events API error body (read within the
    body cap: a body over it is described by its status alone)."""
    try:
        body = response.json()
    except ValueError:
        text = response.text.strip()
        return (text[:200] or response.reason_phrase or "no body"), ()
    except httpx2.HTTPError:
        return response.reason_phrase or "an unreadable body", ()
    if not isinstance(body, dict):
        return str(body)[:200], ()
    message = str(body.get("message") or body.get("status") or response.reason_phrase)[:200]
    raw = body.get("errors") or []
    listed = raw if isinstance(raw, list) else [raw]
    errors = tuple(scrub(str(e), limit=200) for e in listed[:MAX_ERRORS])
    if len(listed) > MAX_ERRORS:
        errors += (f"... and {len(listed) - MAX_ERRORS} more",)
    if errors:
        message = f"{message}: {'; '.join(errors)}"
    return message, errors


def _describe_exception(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
