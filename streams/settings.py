"""Worker settings: flags, else SPANGUARD_* environment variables, else these defaults."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from spanguard.secrets import SecretError, read_secret

__all__ = ["ENV_PREFIX", "SettingsError", "WorkerSettings"]

ENV_PREFIX = "SPANGUARD_"


class SettingsError(ValueError):
    """A setting with a value that cannot be used; the message names it."""


@dataclass(frozen=True)
class WorkerSettings:
    bootstrap: str = field(default="127.0.0.1:9092", metadata={"help": "Kafka bootstrap HOST:PORT"})
    app_id: str = field(
        default="spanguard",
        metadata={"help": "Faust app id: consumer group and prefix of its internal topics"},
    )
    policy: str | None = field(default=None, metadata={"help": "policy YAML file"})
    input_topic: str = field(
        default="otlp_spans", metadata={"help": "OTLP spans from the Collector"}
    )
    kill_topic: str = field(
        default="agent-kill-signals", metadata={"help": "kill/downgrade signals"}
    )
    detections_topic: str = field(
        default="spanguard-detections", metadata={"help": "audit of every decision"}
    )
    dead_letter_topic: str = field(
        default="spanguard-dead-letters", metadata={"help": "messages that could not be processed"}
    )
    repartition_topic: str = field(
        default="spanguard-otlp-repartition",
        metadata={"help": "re-keyed single-trace messages (unkeyed or mixed input)"},
    )
    goal_topic: str = field(
        default="spanguard-goal-checks",
        metadata={"help": "ended agent invocations waiting for the goal verifier"},
    )
    partitions: int = field(
        default=8, metadata={"help": "partitions of the topics `topics create` makes"}
    )
    replication_factor: int = field(default=1, metadata={"help": "replication of created topics"})
    store: str = field(default="rocksdb", metadata={"help": "table store: rocksdb or memory"})
    data_dir: str = field(default="./spanguard-data", metadata={"help": "RocksDB and worker state"})
    state_ttl: float = field(
        default=3600.0, metadata={"help": "seconds after which an idle trace's state is evicted"}
    )
    metrics_port: int = field(
        default=9464, metadata={"help": "port of the Prometheus /metrics endpoint"}
    )
    metrics_host: str = field(default="0.0.0.0", metadata={"help": "address /metrics listens on"})
    recovery_delay: float = field(
        default=0.0, metadata={"help": "seconds to wait after a rebalance before table recovery"}
    )
    session_timeout: float = field(
        default=30.0,
        metadata={"help": "seconds before a silent worker's partitions move to another worker"},
    )
    batch_size: int = field(
        default=500,
        metadata={
            "help": "messages processed together; each trace's state is written once per batch"
        },
    )
    fetch_max_wait: int = field(
        default=20,
        metadata={"help": "milliseconds a Kafka fetch may wait for data (Faust's own: 1500)"},
    )
    commit_interval: float = field(default=1.0, metadata={"help": "seconds between offset commits"})
    dead_after: float = field(
        default=60.0,
        metadata={
            "help": "seconds the span agent may stay crashed, or stuck with records waiting,"
            " before /livez fails"
        },
    )
    signing_key: str | None = field(
        default=None,
        repr=False,
        metadata={"help": "HMAC key that signs kill signals (environment only)", "flag": False},
    )
    signing_key_file: str | None = field(
        default=None, metadata={"help": "file holding the signing key (a mounted Secret)"}
    )
    log_level: str = field(default="INFO", metadata={"help": "DEBUG, INFO, WARNING, ERROR"})

    def __post_init__(self) -> None:
        if self.store not in ("rocksdb", "memory"):
            raise SettingsError(f"store must be rocksdb or memory, not {self.store!r}")
        host, _, port = self.bootstrap.rpartition(":")
        if not host or not port.isdigit():
            raise SettingsError(f"bootstrap must be HOST:PORT, not {self.bootstrap!r}")
        for name in ("partitions", "replication_factor"):
            if getattr(self, name) < 1:
                raise SettingsError(f"{name} must be at least 1")
        if self.session_timeout < 6:
            raise SettingsError("session_timeout must be at least 6 seconds (the broker's minimum)")
        if self.batch_size < 1:
            raise SettingsError("batch_size must be at least 1")
        if not 1 <= self.fetch_max_wait <= 1500:
            raise SettingsError("fetch_max_wait must be between 1 and 1500 milliseconds")
        if self.dead_after <= 0:
            raise SettingsError("dead_after must be a positive number of seconds")
        if self.state_ttl <= 0:
            raise SettingsError("state_ttl must be a positive number of seconds")

    def signing_key_bytes(self) -> bytes | None:
        """The signing key, from SPANGUARD_SIGNING_KEY or the key file; None = unsigned."""
        values = {"key": self.signing_key or "", "file": self.signing_key_file or ""}
        try:
            key = read_secret(values, "key", "file")
        except SecretError as exc:
            message = str(exc).replace("key", "signing_key", 1).replace("file", "signing_key_file")
            raise SettingsError(message) from None
        return key.encode() if key is not None else None

    @property
    def table_name(self) -> str:
        return "trace-state"

    @property
    def changelog_topic(self) -> str:
        """What Faust names the state table's changelog topic."""
        return f"{self.app_id}-{self.table_name}-changelog"

    @property
    def store_url(self) -> str:
        return "rocksdb://" if self.store == "rocksdb" else "memory://"

    @classmethod
    def from_sources(
        cls, flags: Mapping[str, Any], environ: Mapping[str, str] | None = None
    ) -> WorkerSettings:
        """Flags that are not None win over SPANGUARD_<NAME> variables, which win over defaults."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for spec in fields(cls):
            flag = flags.get(spec.name)
            if flag is not None:
                values[spec.name] = flag
                continue
            raw = environ.get(ENV_PREFIX + spec.name.upper())
            if raw is None or raw == "":
                continue
            kind = type(spec.default) if spec.default is not None else str
            try:
                values[spec.name] = kind(raw)
            except ValueError:
                raise SettingsError(
                    f"{ENV_PREFIX}{spec.name.upper()}={raw!r} is not a valid {kind.__name__}"
                ) from None
        return cls(**values)
