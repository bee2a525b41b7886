"""The one delivery loop of every outbound HTTP call: the pager, the webhook and the judge.

Each caller writes one attempt (build the request, send it, read the answer) and raises
`Retry` or `Final` when it failed; `deliver` (sync: the pager and the webhook, in executor
threads) and `deliver_async` (the judge) run the attempts under the one policy of
`spanguard.retry`: 408, 429, 5xx and network errors are tried again up to `max_attempts`, after
a capped, jittered backoff or the server's `Retry-After` (seconds or an HTTP date), capped too;
any other status, and a certificate we do not trust, is final at once.

What every attempt shares, whoever sends it:
- one deadline for the whole attempt, connect to last byte (`timeout` seconds): the HTTP
  client's own timeouts are per operation, so a server that drips a byte a second would never
  trip them; `limit_responses` makes a sync client's body reads check it and shuts the
  attempt's socket down at the deadline (its clients keep no connection alive);
- one body cap (`MAX_RESPONSE_BYTES`): a body is read as it streams in and cut there; bodies
  are asked uncompressed (`Accept-Encoding: identity`) and a compressed one is not read at all,
  so no gzip bomb is ever inflated;
- error texts cut to one short line, with the call's secrets scrubbed (`scrub`): a server that
  echoes our Authorization header back must not put the key into a log line or a dead letter.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import httpx2

from spanguard.retry import Backoff, is_retryable_status, retry_after_seconds

__all__ = [
    "MAX_ERROR_CHARS",
    "MAX_RESPONSE_BYTES",
    "SUMMARY_LIMIT",
    "Delivery",
    "Final",
    "ResponseRefused",
    "Retry",
    "deliver",
    "deliver_async",
    "limit_responses",
    "retry_or_final",
    "scrub",
    "tls_reason",
    "tls_verify_failure",
]

# What any of the three services answers fits in a few kB; more is cut there.
MAX_RESPONSE_BYTES = 64 * 1024
# An error text in a result, a log line or a dead letter.
MAX_ERROR_CHARS = 300
# A one-line summary of a detection: PagerDuty cuts payload.summary at 1024 characters, Slack a
# section's text at 3000.
SUMMARY_LIMIT = 1000

T = TypeVar("T")


class AttemptFailed(Exception):
    """What one attempt's failure says, whichever kind: the error, the HTTP status if a
    response came, and the exception that caused it."""

    def __init__(
        self, error: str, http_status: int | None = None, cause: Exception | None = None
    ) -> None:
        super().__init__(error)
        self.error = error
        self.http_status = http_status
        self.cause = cause


class Retry(AttemptFailed):
    """The attempt failed in a way another attempt may not (408, 429, 5xx, network, timeout)."""

    def __init__(
        self,
        error: str,
        http_status: int | None = None,
        retry_after: float | None = None,
        cause: Exception | None = None,
    ) -> None:
        super().__init__(error, http_status, cause)
        self.retry_after = retry_after


class Final(AttemptFailed):
    """Another attempt cannot help: "rejected" (the server said no: a 4xx other than 408 and
    429) or "failed" (e.g. a certificate we do not trust)."""

    def __init__(
        self,
        error: str,
        http_status: int | None = None,
        *,
        status: Literal["rejected", "failed"] = "rejected",
        errors: tuple[str, ...] = (),
        cause: Exception | None = None,
    ) -> None:
        super().__init__(error, http_status, cause)
        self.status = status
        self.errors = errors


class ResponseRefused(httpx2.HTTPError):
    """A response body still arriving at the attempt's deadline. An httpx2 error, so the HTTP
    client (and the pagerduty client over it) treat it as a failed request."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class Delivery(Generic[T]):
    """What the attempts came to: the last attempt's value, or why they failed."""

    value: T | None
    attempts: int
    failure: Retry | Final | None = None


def retry_or_final(status: int, headers: Any, error: str, errors: tuple[str, ...] = ()) -> None:
    """Raise Retry for a status worth another attempt (with its Retry-After), else Final."""
    if is_retryable_status(status):
        raise Retry(error, status, retry_after_seconds(headers.get("retry-after")))
    raise Final(error, status, errors=errors)


def deliver(
    attempt: Callable[[], T],
    *,
    max_attempts: int,
    backoff: Backoff,
    timeout: float,
    what: str,
    sleep: Callable[[float], None] = time.sleep,
    log: logging.Logger,
    context: dict[str, Any] | None = None,
) -> Delivery[T]:
    """Run `attempt` (sync) until it returns, raises Final, or `max_attempts` are spent."""
    for number in range(1, max_attempts + 1):
        _deadline.at = time.monotonic() + timeout
        try:
            return Delivery(attempt(), number)
        except Final as final:
            return Delivery(None, number, final)
        except Retry as retry:
            if number == max_attempts:
                return Delivery(None, number, retry)
            delay = backoff.delay(number, retry.retry_after)
            _log_retry(log, what, number, max_attempts, retry, delay, context)
            sleep(delay)
        finally:
            _deadline.at = None
            for timer in _deadline.timers:  # the attempt is over: its watch too
                timer.cancel()
                timer.join()
            _deadline.timers.clear()
    raise ValueError("max_attempts must be at least 1")


async def deliver_async(
    attempt: Callable[[], Awaitable[T]],
    *,
    max_attempts: int,
    backoff: Backoff,
    # A per-attempt deadline of the delivery loop, not the whole call's.
    timeout: float | None,  # noqa: ASYNC109
    what: str,
    log: logging.Logger,
    context: dict[str, Any] | None = None,
) -> Delivery[T]:
    """`deliver` for a coroutine: each attempt as a whole within `timeout` (None: the attempt
    keeps its own deadline, e.g. one that starts once it holds a concurrency slot)."""
    for number in range(1, max_attempts + 1):
        try:
            async with asyncio.timeout(timeout):
                return Delivery(await attempt(), number)
        except TimeoutError as exc:
            failure: Retry | Final = Retry(f"no answer within {timeout:g}s", cause=exc)
        except Final as final:
            return Delivery(None, number, final)
        except Retry as retry:
            failure = retry
        if number == max_attempts:
            return Delivery(None, number, failure)
        assert isinstance(failure, Retry)
        delay = backoff.delay(number, failure.retry_after)
        _log_retry(log, what, number, max_attempts, failure, delay, context)
        await asyncio.sleep(delay)
    raise ValueError("max_attempts must be at least 1")


def _log_retry(
    log: logging.Logger,
    what: str,
    number: int,
    max_attempts: int,
    retry: Retry,
    delay: float,
    context: dict[str, Any] | None,
) -> None:
    log.warning(
        "%s attempt %d/%d: %s; retrying in %.2fs",
        what,
        number,
        max_attempts,
        retry.error,
        delay,
        extra={**(context or {}), "attempts": number, "http_status": retry.http_status},
    )


# -- what every response may cost -------------------------------------------------------------


class _Deadline(threading.local):
    def __init__(self) -> None:
        self.at: float | None = None
        self.timers: list[threading.Timer] = []  # the running attempt's socket watches


# The running sync attempt's deadline, per thread (each executor thread runs one attempt).
_deadline = _Deadline()


def limit_responses(client: httpx2.Client, max_bytes: int = MAX_RESPONSE_BYTES) -> None:
    """Make every response of `client` uncompressed, at most `max_bytes`, and read before the
    running attempt's deadline (a sync client: `deliver` sets the deadline)."""
    client.headers["Accept-Encoding"] = "identity"

    def bound(response: httpx2.Response) -> None:
        # The status stays readable whatever the body is: a body over the cap is cut there, and
        # a compressed one (sent though we asked for none) is not read at all, never inflated.
        encoding = response.headers.get("content-encoding", "").strip().lower()
        compressed = encoding not in ("", "identity")
        if compressed:
            del response.headers["content-encoding"]
        limit = 0 if compressed else max_bytes
        response.stream = _BoundedStream(response.stream, limit, _deadline.at)

    def watch(request: httpx2.Request) -> None:
        request.extensions["trace"] = _cut_at_deadline(_deadline.at)

    hooks = client.event_hooks
    hooks["request"] = [*hooks.get("request", []), watch]
    hooks["response"] = [*hooks.get("response", []), bound]
    client.event_hooks = hooks


_OPENED = frozenset({"connection.connect_tcp.complete", "connection.start_tls.complete"})


def _cut_at_deadline(deadline: float | None) -> Callable[[str, dict[str, Any]], None]:
    """An httpcore trace callback: once the attempt's connection is open, a timer shuts its
    socket down at the deadline, so a server that drips its status line and headers a byte at
    a time (each read within the client's per-read timeout) still ends the attempt. Works on
    new connections only: a client that uses it keeps none alive between attempts."""

    def trace(event: str, info: dict[str, Any]) -> None:
        # The TLS socket replaces the TCP one (which wrapping detaches): watch each as it opens.
        if deadline is None or event not in _OPENED:
            return
        stream = info.get("return_value")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if sock is None:
            return
        timer = threading.Timer(max(0.0, deadline - time.monotonic()), _shut, (sock,))
        timer.daemon = True
        timer.start()
        _deadline.timers.append(timer)

    return trace


def _shut(sock: Any) -> None:
    # SHUT_RDWR: a read blocked in another thread returns at once. OSError: the socket is
    # closed already (the attempt ended in time).
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class _BoundedStream(httpx2.SyncByteStream):
    """The first `limit` bytes of a body, read before `deadline` (time.monotonic())."""

    def __init__(self, stream: Any, limit: int, deadline: float | None) -> None:
        self._stream = stream
        self._limit = limit
        self._deadline = deadline

    def __iter__(self) -> Iterator[bytes]:
        room = self._limit
        if room <= 0:
            return
        for chunk in self._stream:
            if self._deadline is not None and time.monotonic() > self._deadline:
                raise ResponseRefused("the response was still arriving at the attempt's deadline")
            yield chunk[:room]
            room -= len(chunk)
            if room <= 0:
                return  # the rest is never read: the connection is closed, not reused

    def close(self) -> None:
        self._stream.close()


# -- error texts ------------------------------------------------------------------------------

_CREDENTIALS = re.compile(r"(?i)\b(bearer|basic|token|api[-_]?key)([\s:=\"']+)[^\s\"',;}]+")


def scrub(text: str, secrets: Iterable[str | None] = (), limit: int = MAX_ERROR_CHARS) -> str:
    """`text` on one line, each of `secrets` and anything shaped like a credential
    (`Bearer <token>`, `api_key=<value>`) replaced by ***, cut at `limit` characters."""
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    text = _CREDENTIALS.sub(lambda match: f"{match.group(1)}{match.group(2)}***", text)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def tls_verify_failure(exc: BaseException | None) -> bool:
    """Whether `exc` (or what caused it) is a certificate we do not trust."""
    return any(isinstance(e, ssl.SSLCertVerificationError) for e in _chain(exc)) or (
        exc is not None and "CERTIFICATE_VERIFY_FAILED" in str(exc)
    )


def tls_reason(exc: BaseException | None) -> str:
    for e in _chain(exc):
        if isinstance(e, ssl.SSLCertVerificationError):
            return e.verify_message or str(e)
    return str(exc)
