"""How every spanguard client connects to Kafka: TLS, mTLS and SASL, in one settings object.

The worker (Faust over aiokafka), `spanguard topics create` and the killswitch (confluent-kafka)
all take their connection security from one `KafkaSecurity`, so they can never disagree. Its
fields carry librdkafka's property names (`security.protocol`, `sasl.mechanism`,
`ssl.ca.location`, ...); each is a flag `--kafka-<name>` and a variable `SPANGUARD_KAFKA_<NAME>`
(dots become dashes or underscores). Passwords come only from the environment or from a file
(`SPANGUARD_KAFKA_SASL_PASSWORD_FILE`, `--kafka-sasl-password-file`), never from a flag that
`ps` would show, and never appear in `repr()` or logs.

    security = KafkaSecurity.from_env()
    Consumer({"bootstrap.servers": ..., **security.confluent_config()})   # confluent-kafka
    AIOKafkaClient(bootstrap_servers=..., **security.aiokafka_kwargs())    # aiokafka
    faust.App(..., broker_credentials=security.faust_credentials())       # Faust

Settings that cannot work together (a SASL mechanism over PLAINTEXT, a client certificate
without its key, a file that is not there) raise `KafkaSecurityError` when the object is made,
before any connection.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from spanguard.secrets import SecretError, read_secret

__all__ = [
    "ENV_PREFIX",
    "MECHANISMS",
    "PROTOCOLS",
    "KafkaConnectError",
    "KafkaSecurity",
    "KafkaSecurityError",
    "LibrdkafkaLog",
    "add_flags",
    "check_aiokafka",
    "wait_for_metadata",
]

ENV_PREFIX = "SPANGUARD_KAFKA_"
FLAG_PREFIX = "kafka_"
PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
_SSL_PROTOCOLS = ("SSL", "SASL_SSL")
_SASL_PROTOCOLS = ("SASL_PLAINTEXT", "SASL_SSL")
# Secrets: read from $NAME or the file named by $NAME_FILE (or --kafka-<name>-file).
_SECRETS = ("ssl_key_password", "sasl_password")


class KafkaSecurityError(ValueError):
    """Settings that cannot be used together; the message names them by their Kafka names."""


class KafkaConnectError(RuntimeError):
    """The broker could not be reached, refused the credentials or was not trusted."""


def _kafka_name(attribute: str) -> str:
    """security_protocol -> security.protocol (librdkafka's property name)."""
    for prefix in ("security_", "ssl_", "sasl_"):
        if attribute.startswith(prefix):
            return prefix[:-1] + "." + attribute[len(prefix) :].replace("_", ".")
    return attribute.replace("_", ".")


@dataclass(frozen=True)
class KafkaSecurity:
    security_protocol: str = field(
        default="PLAINTEXT", metadata={"help": "PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL"}
    )
    ssl_ca_location: str | None = field(
        default=None, metadata={"help": "CA bundle (PEM) to trust; default the system's"}
    )
    ssl_certificate_location: str | None = field(
        default=None, metadata={"help": "client certificate (PEM) for mutual TLS"}
    )
    ssl_key_location: str | None = field(
        default=None, metadata={"help": "the client certificate's private key (PEM)"}
    )
    ssl_key_password: str | None = field(
        default=None, repr=False, metadata={"help": "password of an encrypted private key"}
    )
    ssl_endpoint_identification_algorithm: str = field(
        default="https",
        metadata={"help": "https (check the broker's name in its certificate) or none"},
    )
    sasl_mechanism: str | None = field(
        default=None, metadata={"help": "PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512"}
    )
    sasl_username: str | None = field(default=None, metadata={"help": "SASL user name"})
    sasl_password: str | None = field(default=None, repr=False, metadata={"help": "SASL password"})

    def __post_init__(self) -> None:
        # Accept any case, store the canonical spelling the libraries expect.
        object.__setattr__(self, "security_protocol", self.security_protocol.strip().upper())
        if self.sasl_mechanism is not None:
            object.__setattr__(self, "sasl_mechanism", self.sasl_mechanism.strip().upper())
        self._check()

    # ------------------------------------------------------------------ validation

    def _check(self) -> None:
        protocol = self.security_protocol
        if protocol not in PROTOCOLS:
            raise KafkaSecurityError(
                f"security.protocol must be one of {', '.join(PROTOCOLS)}, not {protocol!r}"
            )
        sasl = {
            name: getattr(self, name)
            for name in ("sasl_mechanism", "sasl_username", "sasl_password")
        }
        if protocol in _SASL_PROTOCOLS:
            if self.sasl_mechanism not in MECHANISMS:
                raise KafkaSecurityError(
                    f"security.protocol {protocol} needs sasl.mechanism, one of"
                    f" {', '.join(MECHANISMS)} (got {self.sasl_mechanism!r})"
                )
            for name in ("sasl_username", "sasl_password"):
                if not getattr(self, name):
                    raise KafkaSecurityError(
                        f"security.protocol {protocol} needs {_kafka_name(name)}"
                    )
        else:
            for name, value in sasl.items():
                if value:
                    raise KafkaSecurityError(
                        f"{_kafka_name(name)} is set but security.protocol is {protocol}:"
                        " use SASL_SSL (or SASL_PLAINTEXT)"
                    )
        tls = ("ssl_ca_location", "ssl_certificate_location", "ssl_key_location")
        if protocol not in _SSL_PROTOCOLS:
            for name in (*tls, "ssl_key_password"):
                if getattr(self, name):
                    raise KafkaSecurityError(
                        f"{_kafka_name(name)} is set but security.protocol is {protocol}:"
                        " use SSL or SASL_SSL"
                    )
        if bool(self.ssl_certificate_location) != bool(self.ssl_key_location):
            raise KafkaSecurityError(
                "ssl.certificate.location and ssl.key.location go together (mutual TLS):"
                " set both or neither"
            )
        if self.ssl_key_password and not self.ssl_key_location:
            raise KafkaSecurityError("ssl.key.password is set without ssl.key.location")
        if self.ssl_endpoint_identification_algorithm not in ("https", "none"):
            raise KafkaSecurityError(
                "ssl.endpoint.identification.algorithm must be https or none, not"
                f" {self.ssl_endpoint_identification_algorithm!r}"
            )
        for name in tls:
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise KafkaSecurityError(f"{_kafka_name(name)}: no such file {path!r}")
        if protocol in _SSL_PROTOCOLS:
            self.ssl_context()  # unreadable PEM or a wrong key password: refused now

    # ------------------------------------------------------------------ sources

    @classmethod
    def from_sources(
        cls, flags: Mapping[str, Any], environ: Mapping[str, str] | None = None
    ) -> KafkaSecurity:
        """`--kafka-<name>` flags (keys `kafka_<name>`, None when unset) win over
        SPANGUARD_KAFKA_<NAME> variables; secrets from $..._PASSWORD or $..._PASSWORD_FILE."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for spec in fields(cls):
            env_name = ENV_PREFIX + spec.name.upper()
            if spec.name in _SECRETS:
                file_flag = flags.get(FLAG_PREFIX + spec.name + "_file")
                sources = {
                    env_name: environ.get(env_name, ""),
                    env_name + "_FILE": file_flag or environ.get(env_name + "_FILE", ""),
                }
                try:
                    secret = read_secret(sources, env_name, env_name + "_FILE")
                except SecretError as exc:
                    raise KafkaSecurityError(str(exc)) from None
                if secret is not None:
                    values[spec.name] = secret
                continue
            flag = flags.get(FLAG_PREFIX + spec.name)
            raw = flag if flag is not None else (environ.get(env_name) or "").strip()
            if raw:
                values[spec.name] = raw
        return cls(**values)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KafkaSecurity:
        return cls.from_sources({}, environ)

    # ------------------------------------------------------------------ what is safe to show

    def describe(self) -> dict[str, str]:
        """The settings by their Kafka names, for logs: never a password."""
        shown = {
            _kafka_name(spec.name): getattr(self, spec.name)
            for spec in fields(self)
            if spec.name not in _SECRETS and getattr(self, spec.name) is not None
        }
        if self.security_protocol not in _SSL_PROTOCOLS:
            del shown["ssl.endpoint.identification.algorithm"]
        return shown

    def to_env(self) -> dict[str, str]:
        """The SPANGUARD_KAFKA_* variables that make this object again (passwords included: for
        a child process's environment, never for a log)."""
        return {
            ENV_PREFIX + spec.name.upper(): str(getattr(self, spec.name))
            for spec in fields(self)
            if getattr(self, spec.name) is not None and getattr(self, spec.name) != spec.default
        }

    @property
    def uses_tls(self) -> bool:
        return self.security_protocol in _SSL_PROTOCOLS

    @property
    def uses_sasl(self) -> bool:
        return self.security_protocol in _SASL_PROTOCOLS

    # ------------------------------------------------------------------ per library

    def ssl_context(self) -> ssl.SSLContext | None:
        """A client TLS context (aiokafka and Faust take one): the CA bundle, or the system's
        trust store, the client certificate for mutual TLS, and host name checking."""
        if not self.uses_tls:
            return None
        try:
            context = ssl.create_default_context(
                ssl.Purpose.SERVER_AUTH, cafile=self.ssl_ca_location
            )
        except (OSError, ssl.SSLError) as exc:
            raise KafkaSecurityError(
                f"ssl.ca.location: cannot load {self.ssl_ca_location!r}: {exc}"
            ) from None
        context.check_hostname = self.ssl_endpoint_identification_algorithm == "https"
        if self.ssl_certificate_location:
            try:
                context.load_cert_chain(
                    self.ssl_certificate_location,
                    self.ssl_key_location,
                    password=self.ssl_key_password,
                )
            except (OSError, ssl.SSLError) as exc:
                raise KafkaSecurityError(
                    "ssl.certificate.location / ssl.key.location: cannot load the client"
                    f" certificate and key (wrong ssl.key.password?): {exc}"
                ) from None
        return context

    def confluent_config(self) -> dict[str, str]:
        """librdkafka properties for confluent-kafka's Producer, Consumer and AdminClient."""
        config = {"security.protocol": self.security_protocol}
        if self.uses_tls:
            # "probe": librdkafka looks for the system's CA bundle, as Python's ssl does.
            config["ssl.ca.location"] = self.ssl_ca_location or "probe"
            config["ssl.endpoint.identification.algorithm"] = (
                self.ssl_endpoint_identification_algorithm
            )
            if self.ssl_certificate_location and self.ssl_key_location:
                config["ssl.certificate.location"] = self.ssl_certificate_location
                config["ssl.key.location"] = self.ssl_key_location
            if self.ssl_key_password:
                config["ssl.key.password"] = self.ssl_key_password
        if self.uses_sasl:
            assert self.sasl_mechanism and self.sasl_username and self.sasl_password
            config["sasl.mechanism"] = self.sasl_mechanism
            config["sasl.username"] = self.sasl_username
            config["sasl.password"] = self.sasl_password
        return config

    def aiokafka_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of aiokafka's clients (AIOKafkaProducer, AIOKafkaConsumer, ...)."""
        kwargs: dict[str, Any] = {"security_protocol": self.security_protocol}
        if self.uses_tls:
            kwargs["ssl_context"] = self.ssl_context()
        if self.uses_sasl:
            kwargs["sasl_mechanism"] = self.sasl_mechanism
            # aiokafka's names; they carry the SCRAM credentials too.
            kwargs["sasl_plain_username"] = self.sasl_username
            kwargs["sasl_plain_password"] = self.sasl_password
        return kwargs

    def faust_credentials(self) -> Any:
        """Faust's `broker_credentials`: SASLCredentials (with the TLS context for SASL_SSL),
        SSLCredentials, or None for PLAINTEXT."""
        if self.security_protocol == "PLAINTEXT":
            return None
        from faust.auth import SASLCredentials, SSLCredentials

        if self.uses_sasl:
            # An ssl_context makes Faust's protocol SASL_SSL; without one, SASL_PLAINTEXT.
            return SASLCredentials(
                username=self.sasl_username,
                password=self.sasl_password,
                mechanism=self.sasl_mechanism,
                ssl_context=self.ssl_context(),
            )
        return SSLCredentials(self.ssl_context())


# ---------------------------------------------------------------------- flags


def add_flags(parser: argparse.ArgumentParser) -> None:
    """`--kafka-<name>` for every setting; secrets only as `--kafka-<name>-file`."""
    group = parser.add_argument_group(
        "Kafka connection security",
        "librdkafka's names; each flag falls back to SPANGUARD_KAFKA_<NAME>",
    )
    for spec in fields(KafkaSecurity):
        env = ENV_PREFIX + spec.name.upper()
        dashed = "--kafka-" + spec.name.replace("_", "-")
        name = _kafka_name(spec.name)
        if spec.name in _SECRETS:
            group.add_argument(
                dashed + "-file",
                dest=FLAG_PREFIX + spec.name + "_file",
                metavar="FILE",
                help=f"file holding {name} (${env}_FILE; or ${env})",
            )
            continue
        choices = None
        if spec.name == "security_protocol":
            choices = PROTOCOLS
        elif spec.name == "sasl_mechanism":
            choices = MECHANISMS
        elif spec.name == "ssl_endpoint_identification_algorithm":
            choices = ("https", "none")
        group.add_argument(
            dashed,
            dest=FLAG_PREFIX + spec.name,
            metavar="FILE" if spec.name.endswith("_location") else name.split(".")[-1].upper(),
            choices=choices,
            help=f"{name}: {spec.metadata['help']} (${env}; default {spec.default})",
        )


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

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
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

    _TIMING = re.compile(r" \(after \d+ms in state [A-Z_]+\)")

    def __init__(self, logger: logging.Logger, every: float = 60.0) -> None:
        self.logger = logger
        self.every = every
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def log(self, level: int, msg: str, *args: Any) -> None:
        line = msg % args if args else msg
        key = self._TIMING.sub("", line)
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
        except Exception as exc:  # KafkaException: _TRANSPORT / _TIMED_OUT while connecting
            last = str(exc)
        # list_topics does not serve callbacks: poll() runs the error_cb for what happened.
        client.poll(0)
        if errors.refused is not None:
            raise errors.refused
        if time.monotonic() >= deadline:
            raise KafkaConnectError(
                f"Kafka at {errors.bootstrap} did not answer in {timeout:.0f}s:"
                f" {errors.unreachable or last}"
            )


async def check_aiokafka(bootstrap: str, security: KafkaSecurity, timeout: float = 15.0) -> None:
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
