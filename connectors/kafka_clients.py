"""The Kafka client libraries' side of a connection: Faust's credentials, failing fast on a
refused password or certificate (every client would retry forever), librdkafka's logs.

Not part of the pure kernel: this is the one module of `spanguard/` that imports the Kafka
libraries, shared by the worker and the killswitch (which may not import each other). The
settings themselves are `config/kafka_security.py`.
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from spanguard.config.kafka_security import KafkaSecurity
from spanguard.errors import KafkaConnectError

__all__ = [
    "ClientErrors",
    "LibrdkafkaLog",
    "check_aiokafka",
    "client_config",
    "faust_credentials",
    "reading",
    "refusal",
    "throwaway_reader",
    "wait_for_metadata",
]


def client_config(
    bootstrap: str, security: KafkaSecurity, properties: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The config of every confluent-kafka client (Producer, Consumer, AdminClient) a spanguard
    command builds: the client's own `properties`, then the bootstrap servers and the connection
    security, last so that no property can turn them off (never a plaintext fallback)."""
    return {**(properties or {}), "bootstrap.servers": bootstrap, **security.confluent_config()}


def throwaway_reader(
    bootstrap: str,
    security: KafkaSecurity,
    errors: ClientErrors,
    purpose: str,
    logger: logging.Logger,
    properties: Mapping[str, Any] | None = None,
) -> Any:
    """A confluent-kafka Consumer that only reads what it is assigned: its group
    (`spanguard-<purpose>-<random>`, which the client wants) is never joined and nothing is
    committed, so reading moves no one's offsets and leaves no group on the cluster. Errors go
    to `errors`, librdkafka's log lines through `logger` (repeats dropped); `properties` add to
    that."""
    from confluent_kafka import Consumer

    return Consumer(
        client_config(
            bootstrap,
            security,
            {
                "group.id": f"spanguard-{purpose}-{uuid.uuid4().hex}",
                "enable.auto.commit": False,
                "enable.partition.eof": True,
                "error_cb": errors,
                "logger": LibrdkafkaLog(logger),
                **(properties or {}),
            },
        )
    )


@contextmanager
def reading(
    consumer: Any, topic: str, bootstrap: str, failure: Callable[[str], Exception]
) -> Iterator[None]:
    """Closes `consumer` at the end; a Kafka error while it reads `topic` becomes `failure`,
    saying what could not be read."""
    from confluent_kafka import KafkaException

    try:
        yield
    except KafkaException as exc:
        raise failure(f"cannot read {topic} from {bootstrap}: {exc}") from None
    finally:
        consumer.close()


def faust_credentials(security: KafkaSecurity) -> Any:
    """Faust's `broker_credentials`: SASLCredentials (with the TLS context for SASL_SSL),
    SSLCredentials, or None for PLAINTEXT."""
    if security.security_protocol == "PLAINTEXT":
        return None
    from faust.auth import SASLCredentials, SSLCredentials

    if security.uses_sasl:
        # An ssl_context makes Faust's protocol SASL_SSL; without one, SASL_PLAINTEXT.
        return SASLCredentials(
            username=security.sasl_username,
            password=security.sasl_password,
            mechanism=security.sasl_mechanism,
            ssl_context=security.ssl_context(),
        )
    return SSLCredentials(security.ssl_context())


# ---------------------------------------------------------------------- failing fast

# librdkafka's codes for "the broker refused us" (retrying cannot help) and "cannot connect".
_REFUSED_TLS = ("_SSL",)
_REFUSED_SASL = ("_AUTHENTICATION", "SASL_AUTHENTICATION_FAILED")
_UNREACHABLE = ("_TRANSPORT", "_ALL_BROKERS_DOWN", "_RESOLVE")
# A broker that rejects our client certificate closes the handshake with an alert; librdkafka
# reports it as a transport error.
_CERT_REJECTED = ("alert bad certificate", "alert certificate required", "alert unknown ca")


def refusal(bootstrap: str, cause: str, *, tls: bool) -> KafkaConnectError:
    """One line that says which setting to look at, then the library's own words."""
    lowered = cause.lower()
    if not tls:
        what = "the broker refused the credentials (sasl.mechanism, sasl.username, sasl.password)"
    elif any(alert in lowered for alert in _CERT_REJECTED):
        what = "the broker refused the client certificate (ssl.certificate.location)"
    elif "verify failed" in lowered or "could not be verified" in lowered:
        what = "the broker's certificate is not trusted (ssl.ca.location)"
    else:
        what = "TLS failed"
    return KafkaConnectError(f"Kafka at {bootstrap}: {what}: {cause}")


class ClientErrors:
    """confluent-kafka's `error_cb`: keeps the first refusal and the last transport error, so a
    bad password or an untrusted certificate ends a start-up wait at once, with its cause."""

    def __init__(self, bootstrap: str, security: KafkaSecurity | None = None) -> None:
        self.bootstrap = bootstrap
        # A plaintext client that no broker answers may be knocking on a TLS or SASL listener.
        self.plaintext = security is not None and security.security_protocol == "PLAINTEXT"
        self.refused: KafkaConnectError | None = None
        self.unreachable: str | None = None

    def __call__(self, error: Any) -> None:
        from confluent_kafka import KafkaError

        def named(names: tuple[str, ...]) -> bool:
            return any(error.code() == getattr(KafkaError, name, None) for name in names)

        text = error.str()
        if self.refused is not None:
            return
        if named(_REFUSED_SASL):
            self.refused = refusal(self.bootstrap, text, tls=False)
        elif named(_REFUSED_TLS) or (
            named(_UNREACHABLE) and any(alert in text.lower() for alert in _CERT_REJECTED)
        ):
            self.refused = refusal(self.bootstrap, text, tls=True)
        elif named(_UNREACHABLE):
            self.unreachable = text


class LibrdkafkaLog:
    """confluent-kafka's `logger`: librdkafka's lines through `logging`, each distinct line at
    most once per `every` seconds, so a client retrying a refused connection ten times a second
    does not fill the log."""

    # What differs between retries of one failure: its timing, and the count librdkafka adds
    # once it suppressed repeats itself (", 1 identical error(s) suppressed").
    _TIMING = re.compile(
        r" \(after \d+ms in state [A-Z_]+(?:, \d+ identical error\(s\) suppressed)?\)"
    )

    # A TLS failure names OpenSSL's error code; librdkafka's next try says it again in a
    # shorter form (without "SSL handshake failed:" and the hint): the same failure.
    _OPENSSL_ERROR = re.compile(r"error:[0-9A-F]{8}")

    def __init__(self, logger: logging.Logger, every: float = 60.0) -> None:
        self.logger = logger
        self.every = every
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def log(self, level: int, msg: str, *args: Any) -> None:
        line = msg % args if args else msg
        key = self._TIMING.sub("", line)
        code = self._OPENSSL_ERROR.search(key)
        if code is not None:  # the client and thread the line names, and the error's code
            key = key[: key.find("]: ") + 1] + code.group()
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, -self.every) < self.every:
                return
            if len(self._last) > 1000:  # bounded: a long-lived client sees many distinct lines
                self._last.clear()
            self._last[key] = now
        self.logger.log(level, line)


def wait_for_metadata(
    client: Any, errors: ClientErrors, topic: str | None = None, timeout: float = 15.0
) -> Any:
    """The cluster's metadata from a confluent-kafka client made with `error_cb=errors`;
    raises KafkaConnectError at the first refusal, or once `timeout` has passed."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.list_topics(topic, timeout=0.5)
        # KafkaException (_TRANSPORT / _TIMED_OUT while connecting) or whatever the client
        # given raises: said in the error once the deadline passes.
        except Exception as exc:  # noqa: BLE001
            last = str(exc)
        # list_topics does not serve callbacks: poll() runs the error_cb for what happened.
        client.poll(0)
        if errors.refused is not None:
            raise errors.refused
        if time.monotonic() >= deadline:
            hint = (
                " (a TLS or SASL listener? set SPANGUARD_KAFKA_SECURITY_PROTOCOL and its settings)"
                if errors.plaintext
                else ""
            )
            raise KafkaConnectError(
                f"Kafka at {errors.bootstrap} did not answer in {timeout:.0f}s:"
                f" {errors.unreachable or last}{hint}"
            )


# The deadline of a connection check, handed to aiokafka's own calls.
async def check_aiokafka(bootstrap: str, security: KafkaSecurity, timeout: float = 15.0) -> None:  # noqa: ASYNC109
    """Connect to a bootstrap broker the way Faust will (aiokafka, the same settings) and ask for
    metadata. Raises KafkaConnectError at once when TLS or SASL fail, or after `timeout` when no
    broker answers; Faust itself would retry both forever."""
    from aiokafka.conn import create_conn
    from aiokafka.errors import KafkaConnectionError, KafkaError
    from aiokafka.protocol.metadata import MetadataRequest

    hosts = [h.strip() for h in bootstrap.split(",") if h.strip()]
    kwargs = security.aiokafka_kwargs()
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        for host in hosts:
            name, _, port = host.rpartition(":")
            try:
                conn = await asyncio.wait_for(
                    create_conn(name, int(port), request_timeout_ms=5000, **kwargs), 5
                )
            except ssl.SSLError as exc:
                raise refusal(bootstrap, f"{type(exc).__name__}: {exc}", tls=True) from None
            except (TimeoutError, OSError, KafkaConnectionError) as exc:
                cause = exc.__cause__
                if isinstance(cause, ssl.SSLError):  # e.g. the broker's alert on our certificate
                    raise refusal(bootstrap, f"{type(cause).__name__}: {cause}", tls=True) from None
                last = f"{host}: {type(exc).__name__}: {exc}"
                continue
            except KafkaError as exc:  # SaslAuthenticationFailed and its kin: not retriable
                raise refusal(bootstrap, f"{type(exc).__name__}: {exc}", tls=False) from None
            try:
                await conn.send(MetadataRequest([]))
                return
            except (TimeoutError, KafkaError) as exc:
                last = f"{host}: {type(exc).__name__}: {exc}"
            finally:
                conn.close()
        if time.monotonic() >= deadline:
            raise KafkaConnectError(
                f"Kafka at {bootstrap} did not answer in {timeout:.0f}s: {last}"
            )
        await asyncio.sleep(0.5)
