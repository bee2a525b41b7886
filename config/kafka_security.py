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
    faust.App(..., broker_credentials=faust_credentials(security))        # kafka_clients.py

Settings that cannot work together (a SASL mechanism over PLAINTEXT, a client certificate
without its key, a file that is not there) raise `KafkaSecurityError` when the object is made,
before any connection.
"""

from __future__ import annotations

import argparse
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from spanguard.config.secrets import read_secret
from spanguard.errors import KafkaSecurityError, SecretError

__all__ = [
    "ENV_PREFIX",
    "MECHANISMS",
    "PROTOCOLS",
    "KafkaSecurity",
    "add_flags",
]

ENV_PREFIX = "SPANGUARD_KAFKA_"
FLAG_PREFIX = "kafka_"
PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
_SSL_PROTOCOLS = ("SSL", "SASL_SSL")
_SASL_PROTOCOLS = ("SASL_PLAINTEXT", "SASL_SSL")
# Secrets: read from $NAME or the file named by $NAME_FILE (or --kafka-<name>-file).
_SECRETS = ("ssl_key_password", "sasl_password")


def _kafka_name(attribute: str) -> str:
    """security_protocol -> security.protocol (librdkafka's property name)."""
    for prefix in ("security_", "ssl_", "sasl_"):
        if attribute.startswith(prefix):
            return prefix[:-1] + "." + attribute[len(prefix) :].replace("_", ".")
    return attribute.replace("_", ".")


@dataclass(frozen=True)
class KafkaSecurity:
    """How to connect to Kafka: SPANGUARD_KAFKA_<NAME>, flags --kafka-<name>."""

    ENV_GROUP: ClassVar[str] = "KAFKA_"

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
        default=None,
        repr=False,
        metadata={"help": "password of an encrypted private key", "secret": True},
    )
    ssl_endpoint_identification_algorithm: str = field(
        default="https",
        metadata={"help": "https (check the broker's name in its certificate) or none"},
    )
    sasl_mechanism: str | None = field(
        default=None, metadata={"help": "PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512"}
    )
    sasl_username: str | None = field(default=None, metadata={"help": "SASL user name"})
    sasl_password: str | None = field(
        default=None, repr=False, metadata={"help": "SASL password", "secret": True}
    )

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
        choices: tuple[str, ...] | None = None
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
