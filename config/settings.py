"""Every setting spanguard reads, declared once: flags, else environment variables, else defaults.

A setting is a field of one of the settings classes in `SETTINGS_CLASSES`: `WorkerSettings`,
`KafkaSecurity`, `GoalSettings`, `PagerSettings` and `WebhookSettings`. Its type is the field's
annotation, its default the field's default, and its metadata give the help text and the
environment variable (`SPANGUARD_<GROUP><NAME>` unless it says otherwise). `REGISTRY` lists them
all. The worker's flags and `--help`, docs/settings.md (printed by `python -m
spanguard.config.settings`) and the helm chart's environment are generated from it or checked
against it (tests/config/test_settings.py). The flag of a setting is its variable without the
`SPANGUARD_` prefix, in lower case with dashes (`SPANGUARD_JUDGE_URL` is `--judge-url`).

Secrets (the signing key, the judge's API key, the PagerDuty routing key, the webhook URL and
its signing key, the Kafka passwords) have no flag, where `ps` would show them. They come from
their variable or from a file named by `<NAME>_FILE` (a mounted Secret), which has a flag. They
are kept out of reprs and error messages.
"""

from __future__ import annotations

import math
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any, Final, Literal
from urllib.parse import urlsplit

from spanguard.config.kafka_security import KafkaSecurity
from spanguard.config.secrets import read_secret
from spanguard.errors import PagerConfigError, SecretError, SettingsError
from spanguard.schemas.policy import Severity

__all__ = [
    "ENV_PREFIX",
    "MIN_SIGNING_KEY_BYTES",
    "REGISTRY",
    "GoalSettings",
    "PagerSettings",
    "Setting",
    "WebhookSettings",
    "WorkerSettings",
    "logger_levels",
    "redact_url",
    "settings_document",
    "settings_table",
]

ENV_PREFIX: Final = "SPANGUARD_"
# A shorter HMAC key can be guessed offline from one signal and its signature.
MIN_SIGNING_KEY_BYTES: Final = 16


def setting(
    default: Any,
    help: str,
    *,
    env: str | None = None,
    secret: bool = False,
    compare: bool = True,
    repr: bool = True,
) -> Any:
    """A settings field. `env` overrides the variable's name; `secret` keeps it out of reprs
    and off the command line."""
    metadata = {"help": help, "env": env, "secret": secret}
    return field(default=default, repr=repr and not secret, compare=compare, metadata=metadata)


def option(default: Any, help: str) -> Any:
    """A constructor argument that is not read from the environment (tests, embedding)."""
    return field(default=default, metadata={"help": help, "option": True})


@dataclass(frozen=True, slots=True)
class Setting:
    """One entry of the registry."""

    env: str
    flag: str | None  # None: a secret, environment only
    owner: str  # the settings class
    name: str  # the field
    kind: type  # int, float, str or bool
    choices: tuple[str, ...] | None
    default: Any
    help: str
    secret: bool


def _env_name(cls: type[Any], spec: Field[Any]) -> str:
    return spec.metadata.get("env") or ENV_PREFIX + cls.ENV_GROUP + spec.name.upper()


def _kind(annotation: Any) -> tuple[type, tuple[str, ...] | None]:
    """int, float, str or bool for an annotation (`X | None` unwrapped), and a Literal's
    choices."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is Literal:
        return str, tuple(typing.get_args(annotation))
    if annotation is bool or annotation in (int, float, str):  # bool first: it is an int
        return annotation, None
    raise TypeError(f"unsupported setting type {annotation!r}")


def settings_of(cls: type) -> tuple[Setting, ...]:
    hints = typing.get_type_hints(cls)
    entries = []
    for spec in fields(cls):
        if "help" not in spec.metadata or spec.metadata.get("option"):
            continue
        kind, choices = _kind(hints[spec.name])
        env = _env_name(cls, spec)
        secret = spec.metadata.get("secret", False)
        flag = None if secret else "--" + env.removeprefix(ENV_PREFIX).lower().replace("_", "-")
        entries.append(
            Setting(
                env=env,
                flag=flag,
                owner=cls.__name__,
                name=spec.name,
                kind=kind,
                choices=choices,
                default=None if spec.default is MISSING else spec.default,
                help=spec.metadata["help"],
                secret=secret,
            )
        )
    return tuple(entries)


# What a boolean variable may say; anything else is an error, not false.
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _convert(entry: Setting, raw: Any, source: str) -> Any:
    if not isinstance(raw, str):
        return raw  # already typed (a constructor argument, a boolean flag)
    text = raw.strip()
    if entry.kind is bool:
        if text.lower() in _TRUE | _FALSE:
            return text.lower() in _TRUE
        raise SettingsError(f"{source}={raw!r} is not a boolean (true or false)")
    try:
        value = entry.kind(text)
    except ValueError:
        raise SettingsError(f"{source}={raw!r} is not a valid {entry.kind.__name__}") from None
    if entry.kind is float and not math.isfinite(value):
        raise SettingsError(f"{source}={raw!r} is not a finite number")
    if entry.choices is not None and value not in entry.choices:
        raise SettingsError(f"{source}={raw!r}: expected one of {', '.join(entry.choices)}")
    return value


def _load(cls: type, flags: Mapping[str, Any], environ: Mapping[str, str] | None) -> Any:
    """Flags (by field name) that are not None win over variables, which win over defaults."""
    environ = os.environ if environ is None else environ
    options = {spec.name for spec in fields(cls) if spec.metadata.get("option")}
    values: dict[str, Any] = {k: v for k, v in flags.items() if k in options and v is not None}
    for spec in fields(cls):
        if spec.metadata.get("nested") is KafkaSecurity:  # --kafka-* flags, SPANGUARD_KAFKA_*
            values[spec.name] = KafkaSecurity.from_sources(flags, environ)
    for entry in settings_of(cls):
        flag = flags.get(entry.name)
        if flag is not None:
            values[entry.name] = _convert(entry, flag, entry.flag or entry.name)
            continue
        raw = environ.get(entry.env)
        if raw is not None and raw.strip() != "":
            values[entry.name] = _convert(entry, raw, entry.env)
    return cls(**values)


def _secret(
    value: str | None, file: str | None, env: str, error: type[SettingsError] = SettingsError
) -> str | None:
    """The secret itself, or the content of its file; the error names the variables."""
    try:
        return read_secret({env: value or "", env + "_FILE": file or ""}, env, env + "_FILE")
    except SecretError as exc:
        raise error(str(exc)) from None


def _secret_given(
    flags: Mapping[str, Any], environ: Mapping[str, str] | None, file_flag: str, env: str
) -> bool:
    """Whether a secret is given at all: its file flag, its variable or its _FILE variable."""
    environ = os.environ if environ is None else environ
    return bool(
        flags.get(file_flag)
        or (environ.get(env) or "").strip()
        or (environ.get(env + "_FILE") or "").strip()
    )


# -- the worker ---------------------------------------------------------------------------------

# A kill must outlive the time an agent takes to read it, and not be obeyed for weeks.
MIN_SIGNAL_TTL: Final = 10.0
MAX_SIGNAL_TTL: Final = 7 * 24 * 3600.0
# The worker's topics: each has one use.
TOPIC_SETTINGS: Final = (
    "input_topic",
    "kill_topic",
    "detections_topic",
    "dead_letter_topic",
    "repartition_topic",
    "goal_topic",
    "ack_topic",
    "conversation_topic",
    "agent_usage_topic",
    "tool_calls_topic",
)
# What Kafka accepts as a topic name (kafka.common.internals.Topic).
_TOPIC_NAME = re.compile(r"[a-zA-Z0-9._-]{1,249}")


def _is_port(text: str) -> bool:
    return text.isascii() and text.isdigit() and 1 <= int(text) <= 65535


def _check_topic(name: str, topic: str) -> None:
    if _TOPIC_NAME.fullmatch(topic) is None or topic in (".", ".."):
        raise SettingsError(
            f"{name} {topic!r} is not a Kafka topic name (1-249 of a-z A-Z 0-9 . _ -)"
        )


LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR")


def logger_levels(text: str) -> dict[str, str]:
    """`LOGGER=LEVEL,...` (SPANGUARD_LOG_LEVELS) as a mapping; a malformed pair is an error."""
    levels = {}
    for pair in filter(None, (part.strip() for part in text.split(","))):
        name, sep, level = (item.strip() for item in pair.partition("="))
        if not sep or not name or level.upper() not in LOG_LEVELS:
            raise SettingsError(
                f"log_levels: {pair!r} is not LOGGER=LEVEL with a level of {', '.join(LOG_LEVELS)}"
            )
        levels[name] = level.upper()
    return levels


@dataclass(frozen=True)
class WorkerSettings:
    """`spanguard worker` and `spanguard topics create`: SPANGUARD_<NAME>."""

    ENV_GROUP: typing.ClassVar[str] = ""

    bootstrap: str = setting("127.0.0.1:9092", "Kafka bootstrap HOST:PORT")
    app_id: str = setting(
        "spanguard", "Faust app id: consumer group and prefix of its internal topics"
    )
    policy: str | None = setting(None, "policy YAML file (default: the built-in defaults)")
    mode: Literal["enforce", "observe"] = setting(
        "enforce",
        "enforce: act as the policy says; observe: flag every decision, send no signal"
        " (a first rollout)",
    )
    input_topic: str = setting("otlp_spans", "OTLP spans from the Collector")
    kill_topic: str = setting("agent-kill-signals", "kill/downgrade signals")
    ack_topic: str = setting(
        "agent-kill-acks", "agents' signed acks of the signals they obeyed (`explain` reads them)"
    )
    detections_topic: str = setting("spanguard-detections", "audit of every decision")
    dead_letter_topic: str = setting(
        "spanguard-dead-letters", "messages that could not be processed"
    )
    repartition_topic: str = setting(
        "spanguard-otlp-repartition", "re-keyed single-trace messages (unkeyed or mixed input)"
    )
    goal_topic: str = setting(
        "spanguard-goal-checks", "ended agent invocations waiting for the goal verifier"
    )
    conversation_topic: str = setting(
        "spanguard-conversation-calls",
        "compact call and usage records of conversations, packed per partition of their id"
        " (the conversation scope)",
    )
    agent_usage_topic: str = setting(
        "spanguard-agent-usage",
        "compact usage records keyed by agent identity (agent budgets over a window)",
    )
    tool_calls_topic: str = setting(
        "spanguard-tool-calls",
        "compact call records keyed by tool (the tool scope: the policy's fleet rules)",
    )
    partitions: int = setting(8, "partitions of the topics `topics create` makes")
    scope_partitions: int = setting(
        2,
        "partitions of the conversation and agent usage topics and their tables' changelogs:"
        " their records are packed, a few percent of the spans' traffic, and each partition a"
        " worker holds is named in every one of its fetches (about 50 a second); the scope"
        " agents' work is shared by at most this many workers",
    )
    replication_factor: int = setting(
        0,
        "replication of created topics; 0: min(3, brokers found), min.insync.replicas one less",
    )
    store: Literal["rocksdb", "memory"] = setting("rocksdb", "table store: rocksdb or memory")
    data_dir: str = setting("./spanguard-data", "RocksDB and worker state")
    state_ttl: float = setting(3600.0, "seconds after which an idle trace's state is evicted")
    state_cache: int = setting(
        5000,
        "traces whose decoded state stays in memory between messages (about 13 kB each at"
        " most); 0: every message reads and decodes its trace's state from the store",
    )
    rocksdb_write_buffer_mb: int = setting(
        16,
        "RocksDB memtable size per table partition; up to 3 are held before a flush. Faust's"
        " own 64 (and its 2 GiB cache) let a worker's memory grow for hours (docs/operating.md)",
    )
    rocksdb_block_cache_mb: int = setting(
        64,
        "RocksDB block cache per table partition, filled as states are read back from disk",
    )
    metrics_port: int = setting(9464, "port of /metrics, /livez and /readyz")
    metrics_host: str = setting("0.0.0.0", "address /metrics, /livez and /readyz listen on")
    recovery_delay: float = setting(0.0, "seconds to wait after a rebalance before table recovery")
    standby_replicas: int = setting(
        0,
        "warm copies of each state partition kept by other workers (Faust's own default: 1);"
        " each costs every worker a share of its throughput, and saves a worker taking over"
        " a partition it never held the replay of its changelog",
    )
    session_timeout: float = setting(
        30.0, "seconds before a silent worker's partitions move to another worker"
    )
    batch_size: int = setting(
        500, "messages processed together; their signals are sent and acked per batch"
    )
    fetch_max_wait: int = setting(
        20, "milliseconds a Kafka fetch may wait for data (Faust's own: 1500)"
    )
    commit_interval: float = setting(
        1.0, "seconds between offset commits; a trace's state is written once per interval"
    )
    scope_hold: float = setting(
        0.2,
        "seconds the calls and usage bound for the conversation and agent scopes are held and"
        " sent together (at the latest with the next state write); 0 sends them with each batch",
    )
    processing_guarantee: Literal["at_least_once", "exactly_once"] = setting(
        "at_least_once",
        "at_least_once: redelivered records repeat decisions under the same id (agents obey an"
        " id once); exactly_once: Faust's Kafka transactions (slower, docs/design.md)",
    )
    dead_after: float = setting(
        60.0,
        "seconds the span agent may stay crashed, or stuck with records waiting, before /livez"
        " fails",
    )
    signing_key: str | None = setting(
        None, "HMAC key that signs kill signals (required, at least 16 bytes)", secret=True
    )
    signing_key_file: str | None = setting(None, "file holding the signing key (a mounted Secret)")
    allow_unsigned: bool = setting(
        False,
        "INSECURE: start without a signing key and send unsigned kill signals"
        " (anyone who can write the kill topic can then stop or steer agents)",
    )
    signal_ttl: float = setting(
        3600.0, "seconds after its detection during which a kill signal is obeyed"
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = setting(
        "INFO", "DEBUG, INFO, WARNING, ERROR"
    )
    log_levels: str = setting(
        "",
        "levels of single loggers over --log-level, LOGGER=LEVEL,... (e.g."
        " aiokafka.consumer.group_coordinator=DEBUG to see the consumer's group and offsets)",
    )
    # TLS and SASL, shared with every other Kafka client (config/kafka_security.py).
    kafka: KafkaSecurity = field(default_factory=KafkaSecurity, metadata={"nested": KafkaSecurity})

    def __post_init__(self) -> None:
        if self.store not in ("rocksdb", "memory"):
            raise SettingsError(f"store must be rocksdb or memory, not {self.store!r}")
        for address in self.bootstrap.split(","):
            host, _, port = address.strip().rpartition(":")
            if not host or not _is_port(port):
                raise SettingsError(
                    f"bootstrap must be HOST:PORT[,HOST:PORT...] with ports 1-65535,"
                    f" not {self.bootstrap!r}"
                )
        topics = {name: getattr(self, name) for name in TOPIC_SETTINGS}
        for name, topic in topics.items():
            _check_topic(name, topic)
        if len(set(topics.values())) < len(topics):
            same = sorted(
                name for name, topic in topics.items() if list(topics.values()).count(topic) > 1
            )
            raise SettingsError(
                f"{' and '.join(same)} name the same topic {topics[same[0]]!r}: each topic has"
                " one use (a kill topic that is the input topic would feed signals to the guard)"
            )
        _check_topic("app_id", self.app_id)
        if not 1 <= self.metrics_port <= 65535:
            raise SettingsError(
                f"metrics_port must be between 1 and 65535, not {self.metrics_port}"
            )
        if not math.isfinite(self.scope_hold) or self.scope_hold < 0:
            raise SettingsError(f"scope_hold must be 0 or more seconds, not {self.scope_hold}")
        for name in ("commit_interval", "recovery_delay"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0 or (name == "commit_interval" and value == 0):
                raise SettingsError(f"{name} must be a positive number of seconds, not {value}")
        if self.partitions < 1:
            raise SettingsError("partitions must be at least 1")
        if self.scope_partitions < 1:
            raise SettingsError("scope_partitions must be at least 1")
        if self.replication_factor < 0:
            raise SettingsError("replication_factor must be 0 (chosen for the cluster) or more")
        if self.session_timeout < 6:
            raise SettingsError("session_timeout must be at least 6 seconds (the broker's minimum)")
        if self.processing_guarantee not in ("at_least_once", "exactly_once"):
            raise SettingsError(
                "processing_guarantee must be at_least_once or exactly_once,"
                f" not {self.processing_guarantee!r}"
            )
        if self.batch_size < 1:
            raise SettingsError("batch_size must be at least 1")
        if self.state_cache < 0:
            raise SettingsError("state_cache must be 0 or more")
        if self.standby_replicas < 0:
            raise SettingsError("standby_replicas must be 0 or more")
        if not 1 <= self.fetch_max_wait <= 1500:
            raise SettingsError("fetch_max_wait must be between 1 and 1500 milliseconds")
        if self.state_ttl <= 0:
            raise SettingsError("state_ttl must be a positive number of seconds")
        if self.rocksdb_write_buffer_mb < 1 or self.rocksdb_block_cache_mb < 1:
            raise SettingsError("rocksdb_write_buffer_mb and rocksdb_block_cache_mb must be >= 1")
        if self.dead_after <= 0:
            raise SettingsError("dead_after must be a positive number of seconds")
        if not MIN_SIGNAL_TTL <= self.signal_ttl <= MAX_SIGNAL_TTL:
            raise SettingsError(
                f"signal_ttl must be between {MIN_SIGNAL_TTL:g} and {MAX_SIGNAL_TTL:g} seconds,"
                f" not {self.signal_ttl:g} (agents must be able to read a kill before it expires)"
            )
        logger_levels(self.log_levels)  # a typo is an error at start, not a silent no-op
        if self.allow_unsigned and (self.signing_key or self.signing_key_file):
            raise SettingsError(
                "a signing key and SPANGUARD_ALLOW_UNSIGNED=true: sign, or send unsigned signals,"
                " not both"
            )

    def signing_key_bytes(self) -> bytes | None:
        """The signing key, from SPANGUARD_SIGNING_KEY or the key file; None when unset."""
        key = _secret(self.signing_key, self.signing_key_file, "SPANGUARD_SIGNING_KEY")
        return key.encode() if key is not None else None

    def kill_signing_key(self) -> bytes | None:
        """The key the worker signs with. Signals are signed by default: no key is an error,
        unless SPANGUARD_ALLOW_UNSIGNED says so (then None: unsigned signals)."""
        key = self.signing_key_bytes()
        if key is None:
            if self.allow_unsigned:
                return None
            raise SettingsError(
                "no signing key: set SPANGUARD_SIGNING_KEY or SPANGUARD_SIGNING_KEY_FILE (e.g. the"
                " output of `openssl rand -hex 32`), the same key the agents' KillSwitch is given;"
                " SPANGUARD_ALLOW_UNSIGNED=true sends unsigned signals instead (insecure)"
            )
        if len(key) < MIN_SIGNING_KEY_BYTES:
            raise SettingsError(
                f"the signing key has {len(key)} bytes; it needs at least {MIN_SIGNING_KEY_BYTES}"
                " (e.g. the output of `openssl rand -hex 32`)"
            )
        return key

    # The state tables: the trace table, and those of the scopes beyond the trace.
    table_name: typing.ClassVar[str] = "trace-state"
    conversation_table_name: typing.ClassVar[str] = "conversation-state"
    agent_window_table_name: typing.ClassVar[str] = "agent-window-state"
    tool_window_table_name: typing.ClassVar[str] = "tool-window-state"

    def changelog_of(self, table_name: str) -> str:
        """What Faust names a state table's changelog topic."""
        return f"{self.app_id}-{table_name}-changelog"

    @property
    def changelog_topic(self) -> str:
        return self.changelog_of(self.table_name)

    @property
    def conversation_changelog_topic(self) -> str:
        return self.changelog_of(self.conversation_table_name)

    @property
    def agent_window_changelog_topic(self) -> str:
        return self.changelog_of(self.agent_window_table_name)

    @property
    def tool_window_changelog_topic(self) -> str:
        return self.changelog_of(self.tool_window_table_name)

    @property
    def store_url(self) -> str:
        return "rocksdb://" if self.store == "rocksdb" else "memory://"

    @property
    def store_options(self) -> dict[str, int] | None:
        """What each table's RocksDB is opened with (faust.stores.rocksdb.RocksDBOptions)."""
        if self.store != "rocksdb":
            return None
        mib = 1024 * 1024
        return {
            "write_buffer_size": self.rocksdb_write_buffer_mb * mib,
            "block_cache_size": self.rocksdb_block_cache_mb * mib,
        }

    @classmethod
    def from_sources(
        cls, flags: Mapping[str, Any], environ: Mapping[str, str] | None = None
    ) -> WorkerSettings:
        """Flags that are not None win over SPANGUARD_<NAME> variables, which win over defaults."""
        return _load(cls, flags, environ)


# -- the goal judge -----------------------------------------------------------------------------

ENV_JUDGE_URL: Final = "SPANGUARD_JUDGE_URL"
ENV_JUDGE_MODEL: Final = "SPANGUARD_JUDGE_MODEL"


@dataclass(frozen=True)
class GoalSettings:
    """Where the judge is: SPANGUARD_JUDGE_<NAME>. base_url is the OpenAI-style base, with its
    /v1 (vLLM http://host:8000/v1, Ollama http://host:11434/v1, llama.cpp server
    http://host:8080/v1, https://api.openai.com/v1)."""

    ENV_GROUP: typing.ClassVar[str] = "JUDGE_"

    base_url: str | None = setting(
        None, "OpenAI-compatible base URL of the judge, with its /v1", env=ENV_JUDGE_URL
    )
    model: str | None = setting(None, "judge model (a policy's goal.model overrides it)")
    api_key: str | None = setting(None, "bearer key of the judge API (none for local servers)",
                                  secret=True)  # fmt: skip
    timeout: float = setting(10.0, "seconds per judge attempt, connect to last byte")
    max_attempts: int = setting(3, "judge attempts per invocation")
    max_concurrency: int = setting(4, "judge requests in flight")
    api_key_file: str | None = setting(
        None, "file holding the judge's API key (a mounted Secret)", compare=False
    )

    def __post_init__(self) -> None:
        if self.base_url is not None:
            url = self.base_url.strip().rstrip("/")
            try:
                parts = urlsplit(url)
                parts.port  # noqa: B018 - raises on a port out of range or not a number
            except ValueError as exc:
                raise SettingsError(f"{ENV_JUDGE_URL} is not a usable URL: {exc}") from None
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise SettingsError(
                    f"{ENV_JUDGE_URL} must be an http(s) URL, got {redact_url(url)!r}"
                )
            object.__setattr__(self, "base_url", url)
        if self.api_key_file is not None:
            key = _secret(self.api_key, self.api_key_file, "SPANGUARD_JUDGE_API_KEY")
            object.__setattr__(self, "api_key", key)
        if not (math.isfinite(self.timeout) and self.timeout > 0):
            raise SettingsError("SPANGUARD_JUDGE_TIMEOUT must be a positive number of seconds")
        if self.max_attempts < 1:
            raise SettingsError("SPANGUARD_JUDGE_MAX_ATTEMPTS must be at least 1")
        if self.max_concurrency < 1:
            raise SettingsError("SPANGUARD_JUDGE_MAX_CONCURRENCY must be at least 1")

    @property
    def enabled(self) -> bool:
        """A judge is configured: a URL and a model."""
        return bool(self.base_url and self.model)

    @classmethod
    def from_sources(
        cls, flags: Mapping[str, Any], environ: Mapping[str, str] | None = None
    ) -> GoalSettings:
        return _load(cls, flags, environ)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> GoalSettings:
        return _load(cls, {}, environ)


# -- paging -------------------------------------------------------------------------------------

DEFAULT_EVENTS_URL: Final = "https://events.pagerduty.com"
ENQUEUE_PATH: Final = "/v2/enqueue"
SEVERITIES: Final = ("critical", "error", "warning", "info")
ENV_ROUTING_KEY: Final = "SPANGUARD_PAGERDUTY_ROUTING_KEY"
ENV_EVENTS_URL: Final = "SPANGUARD_PAGERDUTY_URL"
ENV_TRACE_URL_TEMPLATE: Final = "SPANGUARD_TRACE_URL_TEMPLATE"
LINK_FIELDS: Final = ("trace_id", "span_id", "service", "agent")


@dataclass(frozen=True)
class PagerSettings:
    """Where and how to page: SPANGUARD_PAGERDUTY_<NAME>. Paging is on when a routing key is
    set; `routing_key` is a secret, excluded from repr and comparisons."""

    ENV_GROUP: typing.ClassVar[str] = "PAGERDUTY_"

    routing_key: str | None = setting(
        None, "the PagerDuty integration's routing key", secret=True, compare=False
    )
    routing_key_file: str | None = setting(
        None, "file holding the routing key (a mounted Secret)", compare=False, repr=False
    )
    events_url: str = setting(
        DEFAULT_EVENTS_URL, "Events API v2 base URL (https only)", env=ENV_EVENTS_URL
    )
    trace_url_template: str | None = setting(
        None,
        "link to the trace in an incident, e.g. https://tempo.example/trace/{trace_id}",
        env=ENV_TRACE_URL_TEMPLATE,
    )
    default_severity: Severity = setting("error", "severity of an incident whose policy names none")
    max_attempts: int = setting(6, "tries per page")
    timeout: float = setting(10.0, "seconds per Events API request")
    ca_file: str | None = setting(
        None, "CA bundle that verifies the Events API's certificate", env="SSL_CERT_FILE"
    )
    backoff_base: float = option(0.5, "seconds before the 2nd attempt, doubling after that")
    backoff_cap: float = option(30.0, "the longest backoff, in seconds")

    def __post_init__(self) -> None:
        key = _secret(self.routing_key, self.routing_key_file, ENV_ROUTING_KEY, PagerConfigError)
        if key is None or not key.strip():
            raise PagerConfigError(
                f"no PagerDuty routing key: set {ENV_ROUTING_KEY} or {ENV_ROUTING_KEY}_FILE"
            )
        object.__setattr__(self, "routing_key", key)
        url = self.events_url.strip().rstrip("/")
        if url.endswith(ENQUEUE_PATH):
            url = url[: -len(ENQUEUE_PATH)]
        if not url.lower().startswith("https://"):
            raise PagerConfigError(
                f"{ENV_EVENTS_URL}: the PagerDuty Events API URL must use https:// "
                f"(the pagerduty client refuses plain http), got {redact_userinfo(url)!r}"
            )
        object.__setattr__(self, "events_url", url)
        if self.default_severity not in SEVERITIES:
            raise PagerConfigError(
                f"default severity must be one of {', '.join(SEVERITIES)},"
                f" got {self.default_severity!r}"
            )
        if self.max_attempts < 1:
            raise PagerConfigError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if self.backoff_base < 0 or self.backoff_cap < 0:
            raise PagerConfigError("backoff_base and backoff_cap must not be negative")
        if self.timeout <= 0:
            raise PagerConfigError(f"timeout must be positive, got {self.timeout}")
        if self.trace_url_template is not None:
            try:
                self.trace_url_template.format_map(dict.fromkeys(LINK_FIELDS, "0"))
            except (KeyError, IndexError, ValueError) as exc:
                raise PagerConfigError(
                    f"{ENV_TRACE_URL_TEMPLATE}: cannot fill {self.trace_url_template!r}: {exc!r}"
                    " (placeholders: {trace_id}, {span_id}, {service}, {agent})"
                ) from None
        if self.ca_file is not None and not Path(self.ca_file).is_file():
            raise PagerConfigError(f"SSL_CERT_FILE: no such file {self.ca_file!r}")

    @staticmethod
    def configured(flags: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> bool:
        """Whether a routing key is given at all (paging is off without one)."""
        return _secret_given(flags, environ, "routing_key_file", ENV_ROUTING_KEY)

    @classmethod
    def from_sources(
        cls, flags: Mapping[str, Any], environ: Mapping[str, str] | None = None
    ) -> PagerSettings:
        return _load(cls, flags, environ)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> PagerSettings:
        """Settings from the environment; keyword `overrides` win over it."""
        return _load(cls, overrides, environ)


# -- webhooks -----------------------------------------------------------------------------------

ENV_WEBHOOK_URL: Final = "SPANGUARD_WEBHOOK_URL"
WEBHOOK_TEMPLATES: Final = ("json", "slack")


@dataclass(frozen=True)
class WebhookSettings:
    """Where detections of every agent are posted: SPANGUARD_WEBHOOK_<NAME>. The sink is on when
    a URL is set; the URL is a secret (a Slack incoming webhook's path is its credential)."""

    ENV_GROUP: typing.ClassVar[str] = "WEBHOOK_"

    url: str | None = setting(
        None, "https URL detections are posted to (a Slack incoming webhook, ...)", secret=True,
        compare=False,
    )  # fmt: skip
    url_file: str | None = setting(
        None, "file holding the webhook URL (a mounted Secret)", compare=False, repr=False
    )
    template: Literal["json", "slack"] = setting(
        "json", "body shape: json (the detection and a summary) or slack (incoming webhook)"
    )
    signing_key: str | None = setting(
        None, "HMAC key: the body's signature goes in X-Spanguard-Signature", secret=True,
        compare=False,
    )  # fmt: skip
    signing_key_file: str | None = setting(
        None, "file holding the webhook signing key (a mounted Secret)", compare=False, repr=False
    )
    max_attempts: int = setting(6, "tries per notification")
    timeout: float = setting(10.0, "seconds per webhook request")
    ca_file: str | None = setting(None, "CA bundle that verifies the webhook's certificate")
    backoff_base: float = option(0.5, "seconds before the 2nd attempt, doubling after that")
    backoff_cap: float = option(30.0, "the longest backoff, in seconds")

    def __post_init__(self) -> None:
        url = _secret(self.url, self.url_file, ENV_WEBHOOK_URL)
        if url is None or not url.strip():
            raise SettingsError(f"no webhook URL: set {ENV_WEBHOOK_URL} or {ENV_WEBHOOK_URL}_FILE")
        url = url.strip()
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 - raises on a port out of range or not a number
        except ValueError:
            # The URL is a secret: not even the parser's message, which may quote it.
            raise SettingsError(f"{ENV_WEBHOOK_URL} is not a usable URL") from None
        if parts.scheme.lower() != "https" or not parts.netloc:
            # The URL is a secret: name its scheme and host only.
            raise SettingsError(
                f"{ENV_WEBHOOK_URL} must be an https:// URL, got {parts.scheme or '(none)'}://"
                f"{parts.hostname or ''}..."
            )
        object.__setattr__(self, "url", url)
        key = _secret(self.signing_key, self.signing_key_file, "SPANGUARD_WEBHOOK_SIGNING_KEY")
        object.__setattr__(self, "signing_key", key)
        if self.template not in WEBHOOK_TEMPLATES:
            raise SettingsError(
                f"SPANGUARD_WEBHOOK_TEMPLATE must be one of {', '.join(WEBHOOK_TEMPLATES)}"
            )
        if self.max_attempts < 1:
            raise SettingsError("SPANGUARD_WEBHOOK_MAX_ATTEMPTS must be at least 1")
        if not (math.isfinite(self.timeout) and self.timeout > 0):
            raise SettingsError("SPANGUARD_WEBHOOK_TIMEOUT must be a positive number of seconds")
        if self.backoff_base < 0 or self.backoff_cap < 0:
            raise SettingsError("backoff_base and backoff_cap must not be negative")
        if self.ca_file is not None and not Path(self.ca_file).is_file():
            raise SettingsError(f"SPANGUARD_WEBHOOK_CA_FILE: no such file {self.ca_file!r}")

    @property
    def host(self) -> str:
        """What logs may say about the URL: its host, never its path."""
        return urlsplit(self.url).netloc.rpartition("@")[2] if self.url else ""

    @staticmethod
    def configured(flags: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> bool:
        """Whether a URL is given at all (the sink is off without one)."""
        return _secret_given(flags, environ, "url_file", ENV_WEBHOOK_URL)

    @classmethod
    def from_sources(
        cls, flags: Mapping[str, Any], environ: Mapping[str, str] | None = None
    ) -> WebhookSettings:
        return _load(cls, flags, environ)


# -- the registry -------------------------------------------------------------------------------

SETTINGS_CLASSES: Final = (
    WorkerSettings,
    KafkaSecurity,
    GoalSettings,
    PagerSettings,
    WebhookSettings,
)
REGISTRY: Final[tuple[Setting, ...]] = tuple(
    entry for cls in SETTINGS_CLASSES for entry in settings_of(cls)
)


def settings_table(entries: tuple[Setting, ...] = REGISTRY) -> str:
    """A markdown table of settings (all of the registry unless given some)."""
    rows = ["| variable | flag | default | what |", "|---|---|---|---|"]
    for entry in entries:
        default = "" if entry.default is None else f"`{_shown(entry.default)}`"
        flag = f"`{entry.flag}`" if entry.flag else "(environment only)"
        rows.append(f"| `{entry.env}` | {flag} | {default} | {entry.help} |")
    return "\n".join(rows) + "\n"


# A heading per settings class in docs/settings.md, in the registry's order.
_GROUP_TITLES: Final = {
    "WorkerSettings": "The worker, its topics and its state",
    "KafkaSecurity": "Connecting to Kafka (TLS, mutual TLS, SASL)",
    "GoalSettings": "The goal verifier's judge",
    "PagerSettings": "Paging (PagerDuty)",
    "WebhookSettings": "Webhooks (Slack and others)",
}

_DOCUMENT_HEAD: Final = """\
# Settings reference

Generated from the registry in `config/settings.py` by `python -m spanguard.config.settings`.
A test fails when this file and the registry differ. Edit the registry, then run
`python -m spanguard.config.settings > docs/settings.md`.

A flag wins over its variable, which wins over the default. `spanguard worker --help` lists
every flag with its variable. Secrets have no flag, because a command line shows in `ps`. Set
the variable, or `<NAME>_FILE` naming a file that holds the value (a mounted Secret). The
file has a flag, `--<name>-file` (`--kafka-sasl-password-file`). Setting both is an error. A
file is read within bounds (64 kB), and whitespace around the value is not part of it. A value
that cannot work stops the command with one line and exit 2, before any connection.
"""


def settings_document() -> str:
    """docs/settings.md: one table per settings class, from the registry."""
    parts = [_DOCUMENT_HEAD]
    for owner, title in _GROUP_TITLES.items():
        entries = tuple(entry for entry in REGISTRY if entry.owner == owner)
        parts.append(f"\n## {title}\n\n{settings_table(entries)}")
    covered = {entry.owner for entry in REGISTRY} - set(_GROUP_TITLES)
    if covered:
        raise RuntimeError(f"settings classes without a heading in docs/settings.md: {covered}")
    return "".join(parts)


def _shown(value: Any) -> str:
    """A default as a user would type it in a variable (booleans in lower case)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def redact_url(url: str) -> str:
    """scheme://host[:port]/path: no credentials, query or fragment (never raises: it is
    what error messages and reprs show of a URL that may be malformed)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
    except ValueError:
        return "(not a URL)"
    port: int | str | None
    try:
        port = parts.port
    except ValueError:
        port = "(bad port)"
    if port is not None:
        host = f"{host}:{port}"
    return f"{parts.scheme}://{host}{parts.path}"


def redact_userinfo(url: str) -> str:
    """The URL without any user:password@ part, the rest as given."""
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest.split("/", 1)[0]:
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


if __name__ == "__main__":  # python -m spanguard.config.settings > docs/settings.md
    print(settings_document(), end="")
