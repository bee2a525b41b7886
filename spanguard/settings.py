"""Worker settings: flags, else SPANGUARD_* environment variables, else these defaults."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Final
from urllib.parse import urlsplit

from spanguard.errors import SettingsError
from spanguard.secrets import SecretError, read_secret

__all__ = ["ENV_PREFIX", "GoalSettings", "SettingsError", "WorkerSettings", "redact_url"]

ENV_PREFIX = "SPANGUARD_"


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


ENV_JUDGE_URL: Final = "SPANGUARD_JUDGE_URL"
ENV_JUDGE_MODEL: Final = "SPANGUARD_JUDGE_MODEL"
ENV_JUDGE_API_KEY: Final = "SPANGUARD_JUDGE_API_KEY"
ENV_JUDGE_API_KEY_FILE: Final = "SPANGUARD_JUDGE_API_KEY_FILE"
ENV_JUDGE_TIMEOUT: Final = "SPANGUARD_JUDGE_TIMEOUT"
ENV_JUDGE_MAX_ATTEMPTS: Final = "SPANGUARD_JUDGE_MAX_ATTEMPTS"
ENV_JUDGE_MAX_CONCURRENCY: Final = "SPANGUARD_JUDGE_MAX_CONCURRENCY"


@dataclass(frozen=True)
class GoalSettings:
    """Where the judge is. base_url is the OpenAI-style base, with its /v1: the judge POSTs to
    `{base_url}/chat/completions` (vLLM http://host:8000/v1, Ollama http://host:11434/v1,
    llama.cpp server http://host:8080/v1, https://api.openai.com/v1)."""

    base_url: str | None = None
    model: str | None = None
    api_key: str | None = field(default=None, repr=False)
    timeout: float = 10.0  # seconds per attempt
    max_attempts: int = 3
    max_concurrency: int = 4

    def __post_init__(self) -> None:
        if self.base_url is not None:
            url = self.base_url.strip().rstrip("/")
            if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).netloc:
                raise SettingsError(
                    f"{ENV_JUDGE_URL} must be an http(s) URL, got {redact_url(url)!r}"
                )
            object.__setattr__(self, "base_url", url)
        if not (math.isfinite(self.timeout) and self.timeout > 0):
            raise SettingsError(f"{ENV_JUDGE_TIMEOUT} must be a positive number of seconds")
        if self.max_attempts < 1:
            raise SettingsError(f"{ENV_JUDGE_MAX_ATTEMPTS} must be at least 1")
        if self.max_concurrency < 1:
            raise SettingsError(f"{ENV_JUDGE_MAX_CONCURRENCY} must be at least 1")

    @property
    def enabled(self) -> bool:
        """A judge is configured: a URL and a model."""
        return bool(self.base_url and self.model)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> GoalSettings:
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {
            "base_url": env.get(ENV_JUDGE_URL, "").strip() or None,
            "model": env.get(ENV_JUDGE_MODEL, "").strip() or None,
            "api_key": _judge_api_key(env),
        }
        for name, key, kind in (
            ("timeout", ENV_JUDGE_TIMEOUT, float),
            ("max_attempts", ENV_JUDGE_MAX_ATTEMPTS, int),
            ("max_concurrency", ENV_JUDGE_MAX_CONCURRENCY, int),
        ):
            raw = env.get(key, "").strip()
            if raw:
                try:
                    values[name] = kind(raw)
                except ValueError:
                    raise SettingsError(f"{key}={raw!r} is not a valid {kind.__name__}") from None
        return cls(**values)


def _judge_api_key(env: Mapping[str, str]) -> str | None:
    # Local servers (Ollama, llama.cpp, vLLM) need none.
    try:
        return read_secret(env, ENV_JUDGE_API_KEY, ENV_JUDGE_API_KEY_FILE)
    except SecretError as exc:
        raise SettingsError(str(exc)) from None


def redact_url(url: str) -> str:
    """scheme://host[:port]/path: no credentials, query or fragment."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return f"{parts.scheme}://{host}{parts.path}"
