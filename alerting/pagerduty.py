"""Page the on-call through PagerDuty's Events API v2 when an autonomous agent loops.

Faust-free and synchronous: the worker calls `Pager.page` off its event loop (an executor), so a
slow or failing PagerDuty delays pages, never detection or kill signals.

    settings = PagerSettings.from_env()          # routing key, URL, trace link, TLS trust
    pager = Pager(settings)
    if should_page(detection):                   # detection: one spanguard-detections record
        result = pager.page(detection)           # PageResult(status="accepted" | "rejected" | "failed")

The event goes out with the real `pagerduty` client (`EventsApiV2Client`, built on httpx2), with
its own retries switched off so that the retry policy here is the only one in force: 408, 429,
5xx and network errors are retried up to `max_attempts`, waiting as `spanguard.retry` says
(capped, jittered exponential backoff, or the server's Retry-After, capped); any other 4xx
(a 400 "invalid event") is final after one attempt. The judge retries by the same rules. The dedup key
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
from typing import Any, Literal

import httpx2
import pagerduty

from spanguard.errors import PagerConfigError
from spanguard.retry import Backoff, is_retryable_status, retry_after_seconds
from spanguard.schemas.decision import EVIDENCE_FIELDS, PAUSE_FIELDS, pause_instructions
from spanguard.settings import DEFAULT_EVENTS_URL, SEVERITIES, PagerSettings

__all__ = [
    "DEFAULT_EVENTS_URL",
    "SEVERITIES",
    "PageResult",
    "Pager",
    "PagerConfigError",
    "PagerSettings",
    "build_event",
    "dedup_key",
    "should_page",
]

log = logging.getLogger(__name__)

SUMMARY_LIMIT = 1024  # PagerDuty truncates payload.summary beyond this


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
)

Status = Literal["accepted", "rejected", "failed"]


# --- the event -------------------------------------------------------------------------------


def should_page(detection: Mapping[str, Any]) -> bool:
    """Only detections on autonomous agents (policy `autonomous: true`) page the on-call."""
    return detection.get("autonomous") is True


def dedup_key(detection: Mapping[str, Any]) -> str:
    """`spanguard:<trace_id>:<rule>`: one incident per looping trace and rule."""
    return f"spanguard:{detection['trace_id']}:{detection['rule']}"


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
    component, class, custom_details}, "client", ["client_url", "links"]}.
    """
    service, name = _agent(detection)
    who = f"{name} ({service})" if name and name != service else service
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
        "source": service,
        "severity": severity_of(detection, settings.default_severity),
        "component": name or service,
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
    link = trace_url(detection, settings)
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


class _Retry(Exception):
    def __init__(
        self, error: str, http_status: int | None = None, retry_after: float | None = None
    ):
        super().__init__(error)
        self.error = error
        self.http_status = http_status
        self.retry_after = retry_after


class _Final(Exception):
    def __init__(
        self,
        result_status: Status,
        error: str,
        http_status: int | None = None,
        errors: tuple[str, ...] = (),
    ):
        super().__init__(error)
        self.result_status = result_status
        self.error = error
        self.http_status = http_status
        self.errors = errors


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
            settings.routing_key, base_url=settings.events_url, verify=verify
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
        client.timeout = settings.timeout
        # With that, the client's only log line is an ERROR per 429 claiming it "exceeded maximum
        # number of attempts (-1)": misleading, and we log every outcome ourselves. Drop just that
        # line, on a logger of our own (the library's global logger is left alone).
        client.log = _client_log
        return client

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> Pager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def should_page(self, detection: Mapping[str, Any]) -> bool:
        return should_page(detection)

    def backoff(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based): `Backoff.delay`
        from `backoff_base` up to `backoff_cap`."""
        return self._backoff.delay(attempt, retry_after)

    def page(self, detection: Mapping[str, Any]) -> PageResult:
        """Trigger an incident for `detection` (does not check `should_page`); never raises for
        delivery problems, which come back as a "rejected" or "failed" PageResult."""
        event = build_event(detection, self.settings)
        key = event["dedup_key"]
        max_attempts = self.settings.max_attempts
        context = {"dedup_key": key, "decision_id": detection.get("decision_id")}
        for attempt in range(1, max_attempts + 1):
            try:
                http_status = self._send(event)
            except _Final as final:
                log.error(
                    "page %s after %d attempt(s): %s",
                    final.result_status,
                    attempt,
                    final.error,
                    extra={**context, "attempts": attempt, "http_status": final.http_status},
                )
                return PageResult(
                    final.result_status, attempt, key, final.error, final.errors, final.http_status
                )
            except _Retry as retry:
                if attempt == max_attempts:
                    log.error(
                        "page failed after %d attempt(s): %s",
                        attempt,
                        retry.error,
                        extra={**context, "attempts": attempt, "http_status": retry.http_status},
                    )
                    return PageResult("failed", attempt, key, retry.error, (), retry.http_status)
                delay = self.backoff(attempt, retry.retry_after)
                log.warning(
                    "page attempt %d/%d: %s; retrying in %.2fs",
                    attempt,
                    max_attempts,
                    retry.error,
                    delay,
                    extra={**context, "attempts": attempt, "http_status": retry.http_status},
                )
                self._sleep(delay)
            else:
                log.info(
                    "paged on-call",
                    extra={
                        **context,
                        "attempts": attempt,
                        "severity": event["payload"]["severity"],
                    },
                )
                return PageResult("accepted", attempt, key, http_status=http_status)
        raise AssertionError("unreachable")  # pragma: no cover

    def _send(self, event: dict[str, Any]) -> int:
        """One HTTP attempt: the HTTP status when PagerDuty accepted the event, else _Retry or
        _Final. (The client returns only the dedup_key on success, and the Events API's success
        status is 202.)"""
        properties = {k: v for k, v in event.items() if k not in ("event_action", "dedup_key")}
        try:
            self._client.send_event(
                event["event_action"], dedup_key=event["dedup_key"], **properties
            )
        except pagerduty.HttpError as exc:
            response = exc.response
            status = response.status_code
            if response.is_success:
                # 2xx with a body the client did not expect: PagerDuty took the event.
                log.warning(
                    "PagerDuty accepted the event with an unexpected body (HTTP %d)", status
                )
                return status
            message, errors = _describe(response)
            error = f"HTTP {status} from PagerDuty: {message}"
            if is_retryable_status(status):
                retry_after = retry_after_seconds(response.headers.get("Retry-After"))
                raise _Retry(error, status, retry_after) from None
            raise _Final("rejected", error, status, errors) from None
        except pagerduty.Error as exc:
            # Network-level failure (the client raises Error from the httpx2 TransportError).
            cause = exc.__cause__
            if _tls_verify_failure(cause):
                raise _Final(
                    "failed",
                    f"TLS certificate verification failed for {self.settings.events_url}: "
                    f"{_tls_reason(cause)} (SSL_CERT_FILE names the CA bundle to trust)",
                ) from None
            raise _Retry(f"network error: {_describe_exception(cause or exc)}") from None
        except httpx2.HTTPError as exc:
            raise _Retry(f"network error: {_describe_exception(exc)}") from None
        return 202


def _describe(response: httpx2.Response) -> tuple[str, tuple[str, ...]]:
    """The server's message and errors list, from an Events API error body."""
    try:
        body = response.json()
    except ValueError:
        text = response.text.strip()
        return (text[:200] or response.reason_phrase or "no body"), ()
    if not isinstance(body, dict):
        return str(body)[:200], ()
    message = str(body.get("message") or body.get("status") or response.reason_phrase)
    raw = body.get("errors") or []
    errors = tuple(str(e) for e in (raw if isinstance(raw, list) else [raw]))
    if errors:
        message = f"{message}: {'; '.join(errors)}"
    return message, errors


def _chain(exc: BaseException | None):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _tls_verify_failure(exc: BaseException | None) -> bool:
    return any(isinstance(e, ssl.SSLCertVerificationError) for e in _chain(exc)) or (
        exc is not None and "CERTIFICATE_VERIFY_FAILED" in str(exc)
    )


def _tls_reason(exc: BaseException | None) -> str:
    for e in _chain(exc):
        if isinstance(e, ssl.SSLCertVerificationError):
            return e.verify_message or str(e)
    return str(exc)


def _describe_exception(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
