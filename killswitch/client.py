"""The agent side: a background consumer of agent-kill-signals and a `check()` before each step.

    switch = KillSwitch(bootstrap_servers="kafka:9092")  # the key as the worker reads it
    ...
    message = switch.check()      # raises AgentKilled once this trace is killed
    if message:                   # a downgrade: hand the model this system message
        messages.append({"role": "system", "content": message})

The consumer starts at the latest offsets (signals sent before this process started are about
other processes' traces) and keeps every signal in a bounded SignalBook, so a signal that
arrives between two `check()` calls is never lost. `check()` takes a lock and reads memory: it
is safe from threads and from asyncio code, and never blocks on Kafka.

Anyone who can write to the topic can send anything: the consumer thread reads every record
through `read_signal` (spanguard.schemas.decision), which turns any bytes into a signal or
into a `BadSignal` naming its kind. A bad record is counted (`switch.ignored[kind]`), logged
once per kind, and costs only itself: the thread never dies, and the next valid signal is
delivered.

Signals are obeyed only when signed with one of the agent's keys and not past their
`expires_at`. The keys: `signing_key=` / `signing_keys=[new, old]` (while the worker's key is
rotated), else the worker's own variables, SPANGUARD_SIGNING_KEY or SPANGUARD_SIGNING_KEY_FILE
and, while rotating, SPANGUARD_PREVIOUS_SIGNING_KEY[_FILE], read by spanguard.config.secrets (the
worker's reader: surrounding whitespace is not part of a key). `allow_unsigned=True` obeys
unsigned signals instead: anyone who can write to the topic can then stop or steer the agent.

A check's conversation and agent (a conversation or agent kill stops every trace of it) come
from its arguments, else the KillSwitch's `conversation_id=` / `agent=`, else the OpenTelemetry
baggage and a resource: `tracer_provider=`'s, else the current span's, else the global
provider's; `scope()` says what a check would use.

The constructor starts the consumer (unless `start=False`); `start()` is idempotent.
A check that finds no trace (no trace id and no current span) is counted in `unguarded` and
warned about once: a tool call nothing guarded is never silent. A kill or downgrade obeyed
through `check()` is acknowledged on `ack_topic` (spanguard.killswitch.acks).

TLS and SASL come from `security=` (a `KafkaSecurity`), by default from the same
SPANGUARD_KAFKA_* variables the worker reads. A wrong password or an untrusted certificate makes
`start()` raise `KafkaConnectError` at once, instead of waiting for a broker that will never
let it in.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from spanguard.config.kafka_security import KafkaSecurity
from spanguard.config.secrets import normalize_secret, signing_keys_from_env
from spanguard.connectors.kafka_clients import ClientErrors, LibrdkafkaLog, wait_for_metadata
from spanguard.errors import SettingsError
from spanguard.killswitch.acks import DEFAULT_ACK_TOPIC, AckSender, ack_record
from spanguard.killswitch.signals import (
    AgentKilled,
    SignalBook,
    ToolContained,
    current_agent,
    current_conversation_id,
    current_trace_id,
)
from spanguard.schemas.decision import (  # read_signal and BadSignal re-exported: agents' API
    AgentIdentity,
    BadSignal,
    KillSignal,
    keyring,
    read_signal,
)

__all__ = [
    "KillSwitch",
    "parse_agent",
]


def parse_agent(text: str) -> AgentIdentity:
    """ "SERVICE/NAME" or "SERVICE" (every agent name of the service) as an AgentIdentity."""
    service, _, name = text.partition("/")
    if not service:
        raise ValueError(f"{text!r} names no service: SERVICE or SERVICE/NAME")
    return AgentIdentity(service, name or None)


# Kinds of bad records: the format ones count as `malformed`, the signature ones as `rejected`.
MALFORMED_KINDS = frozenset(
    {"empty", "too_large", "not_utf8", "not_json", "too_deep", "not_object", "invalid"}
)
REJECTED_KINDS = frozenset({"unsigned", "unknown_key", "forged"})

# What a topic reports while it is being created or its leaders elected.
_SETTLING = frozenset(
    {
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError._TIMED_OUT,
        KafkaError._TRANSPORT,
    }
)

log = logging.getLogger("spanguard.killswitch")

# Signal ids acked, and downgrades waiting for their message to be read, kept per process.
MAX_ACKED = 10_000


def _signing_keyring(
    signing_key: bytes | str | None,
    signing_keys: Iterable[bytes | str],
    allow_unsigned: bool,
    environ: Mapping[str, str] | None,
) -> dict[str, bytes]:
    """The keys a KillSwitch checks signals with ({} with allow_unsigned): the ones given, else
    the worker's own variables and files; a SettingsError for keys and allow_unsigned both,
    or neither."""
    given = [*([signing_key] if signing_key else []), *signing_keys]
    if not given and not allow_unsigned:
        # The worker's own variables and files, read by the same reader
        # (spanguard.config.secrets).
        given = list(signing_keys_from_env(environ))
    # The same whitespace rule as the worker's: a key file's trailing newline is not the key.
    keys = keyring([normalize_secret(key) for key in given])
    if keys and allow_unsigned:
        raise SettingsError("give signing keys or allow_unsigned=True, not both")
    if not keys and not allow_unsigned:
        raise SettingsError(
            "no signing key: pass signing_key=, or set SPANGUARD_SIGNING_KEY or"
            " SPANGUARD_SIGNING_KEY_FILE (the worker's key), or pass allow_unsigned=True"
            " to obey unsigned signals (insecure)"
        )
    return keys


class KillSwitch:
    def __init__(
        self,
        bootstrap_servers: str,
        topic: str = "agent-kill-signals",
        *,
        signing_key: bytes | str | None = None,
        signing_keys: Iterable[bytes | str] = (),
        allow_unsigned: bool = False,
        signals: SignalBook | None = None,
        consumer_config: dict[str, Any] | None = None,
        security: KafkaSecurity | None = None,
        start: bool = True,
        clock: Callable[[], datetime] | None = None,
        environ: Mapping[str, str] | None = None,
        ack_topic: str | None = DEFAULT_ACK_TOPIC,
        conversation_id: str | None = None,
        agent: AgentIdentity | str | None = None,
        tracer_provider: Any = None,
    ) -> None:
        keys = _signing_keyring(signing_key, signing_keys, allow_unsigned, environ)
        self.topic = topic
        self.security = security if security is not None else KafkaSecurity.from_env()
        self._errors = ClientErrors(bootstrap_servers)
        self._clock = clock or (lambda: datetime.now(UTC))
        self.signals = signals if signals is not None else SignalBook(clock=self._clock)
        # The process's conversation and agent, when it has one of each (a check's own win;
        # else the OpenTelemetry baggage and a resource are read: the `tracer_provider`'s
        # given, else the current span's, else the global provider's).
        self.conversation_id = conversation_id
        self.agent = parse_agent(agent) if isinstance(agent, str) else agent
        self._tracer_provider = tracer_provider
        self._keys: Mapping[str, bytes] | None = keys or None  # None: unsigned signals obeyed
        self._config = {
            "bootstrap.servers": bootstrap_servers,
            **self.security.confluent_config(),
            "error_cb": self._on_error,
            "logger": LibrdkafkaLog(log),  # librdkafka's lines via logging, repeats dropped
            # Every process reads every partition itself: no group, no rebalance, no commits.
            "group.id": f"spanguard-killswitch-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "fetch.wait.max.ms": 50,
            **(consumer_config or {}),
        }
        self.received = 0
        # Records that were not delivered, by kind (see read_signal); each kind is logged once.
        self.ignored: Counter[str] = Counter()
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._error: Exception | None = None
        # Checks that found no trace to check: each one is a tool call nothing guarded.
        self.unguarded = 0
        self._unguarded_warned: set[str] = set()
        # Adapters' checks whose spans may reach the guard late (an export the adapter could
        # not make prompt: spanguard.killswitch.export.ensure_prompt_export); warned once.
        self.late_export = 0
        self._late_export_warned = False
        # Acks of the signals this process obeyed (None: not written); see killswitch/acks.py.
        producer_config = {
            "bootstrap.servers": bootstrap_servers,
            **self.security.confluent_config(),
            "logger": LibrdkafkaLog(log),
        }
        self.acks = AckSender(ack_topic, producer_config) if ack_topic else None
        self._ack_key = next(iter(keys.values())) if keys else None  # the first: the current
        self._ack_lock = threading.Lock()
        self._acked: OrderedDict[str, None] = OrderedDict()
        self._downgrades: OrderedDict[str, deque[KillSignal]] = OrderedDict()
        self._start_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="spanguard-killswitch", daemon=True)
        if start:
            self.start()

    def start(self, timeout: float = 30.0) -> KillSwitch:
        """Start the consumer and wait until it is positioned at the latest offsets.

        Idempotent: the constructor starts it (unless `start=False`), and a later `start()`
        only waits for the same consumer to be ready (or raises its start error again)."""
        with self._start_lock:
            if self._thread.ident is None:  # never started
                self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"kill-signal consumer not ready in {timeout}s")
        if self._error is not None:
            raise self._error
        return self

    def check(
        self,
        trace_id: str | None = None,
        *,
        conversation_id: str | None = None,
        agent: AgentIdentity | str | None = None,
        tool: str | None = None,
        server: str | None = None,
    ) -> str | None:
        """Raise AgentKilled if the trace (default: the current span's), its conversation or
        its agent was killed; ToolContained (an AgentKilled) if the call is to a `tool` (on
        `server`; None: whichever) that spanguard has contained; return a downgrade's system
        message once; else None.

        The conversation: `conversation_id`, else the KillSwitch's, else the OpenTelemetry
        baggage's `gen_ai.conversation.id` / `session.id`. The agent: `agent` (an
        AgentIdentity or "SERVICE[/NAME]"), else the KillSwitch's, else a resource's
        `service.name` and `gen_ai.agent.name`: the `tracer_provider`'s, else the current
        span's, else the global provider's."""
        try:
            self.signals.check_scopes(*self.scope(conversation_id, agent))
        except AgentKilled as killed:
            self._acknowledge(killed.signal)
            raise
        trace_id = trace_id or current_trace_id()
        if trace_id is None:
            self.note_unguarded(
                "KillSwitch.check()",
                "no trace id given and no OpenTelemetry span is current; pass the run's trace"
                " id, check() inside the agent's span, or use an adapter of"
                " spanguard.killswitch.adapters",
            )
            self.check_tool(tool, server)
            return None
        try:
            message = self.signals.check(trace_id, tool=tool, server=server)
        except ToolContained:
            raise  # a refused call: the agent goes on, nothing to acknowledge
        except AgentKilled as killed:
            self._acknowledge(killed.signal)
            raise
        if message is not None:
            with self._ack_lock:
                waiting = self._downgrades.get(trace_id.lower())
                signal = waiting.popleft() if waiting else None
            if signal is not None:
                self._acknowledge(signal)
        return message

    def check_tool(self, tool: str | None, server: str | None = None) -> None:
        """Raise ToolContained if `tool` (on `server`; None: whichever) is contained (not
        acknowledged: an ack says an agent stopped or was steered)."""
        self.signals.check_tool(tool, server)

    def check_scopes(
        self, conversation_id: str | None = None, agent: AgentIdentity | str | None = None
    ) -> None:
        """Raise AgentKilled if the conversation or agent (as `scope()` finds them) is killed:
        `check()` for a call that names no trace (the gateway's), acknowledged the same way."""
        try:
            self.signals.check_scopes(*self.scope(conversation_id, agent))
        except AgentKilled as killed:
            self._acknowledge(killed.signal)
            raise

    def scope(
        self, conversation_id: str | None = None, agent: AgentIdentity | str | None = None
    ) -> tuple[str | None, AgentIdentity | None]:
        """The conversation and agent a check stands for, each from the first source that
        names it: the arguments, the KillSwitch's own, the OpenTelemetry baggage
        (`gen_ai.conversation.id`, then `session.id`) or a resource (`service.name` and
        `gen_ai.agent.name`, never mixed with another source's): the `tracer_provider`'s,
        else the current span's, else the global provider's (see `current_agent`)."""
        if isinstance(agent, str):
            agent = parse_agent(agent)
        return (
            conversation_id or self.conversation_id or current_conversation_id(),
            agent or self.agent or current_agent(self._tracer_provider),
        )

    def _acknowledge(self, signal: KillSignal) -> None:
        """Write the ack of `signal` once (a killed trace's every later check raises again)."""
        if self.acks is None:
            return
        with self._ack_lock:
            if signal.signal_id in self._acked:
                return
            self._acked[signal.signal_id] = None
            while len(self._acked) > MAX_ACKED:
                self._acked.popitem(last=False)
        self.acks.send(ack_record(signal, obeyed_at=self._clock(), key=self._ack_key))

    def note_unguarded(self, where: str, what_to_do: str) -> None:
        """Count a tool call that could not be checked (no trace found); warn once per `where`.

        Never silent: an agent that cannot be told its trace was killed is not guarded."""
        with self._ack_lock:
            self.unguarded += 1
            first = where not in self._unguarded_warned
            self._unguarded_warned.add(where)
        if first:
            from spanguard.killswitch.adapters import unguarded_warning

            log.warning(unguarded_warning(where, what_to_do, "KillSwitch.unguarded"))

    def note_late_export(self, where: str, problem: str) -> None:
        """Count a check whose spans may reach the guard late; warn once, naming the fix.

        Never silent: a loop seen seconds late is stopped a dozen calls late."""
        from spanguard.killswitch.adapters import late_export_warning

        with self._ack_lock:
            self.late_export += 1
            first = not self._late_export_warned
            self._late_export_warned = True
        if first:
            log.warning(late_export_warning(where, problem, "KillSwitch.late_export"))

    # -- pause: kept apart from check(), which never blocks ---------------------------------

    def wait(self, trace_id: str | None = None, timeout: float | None = None) -> str | None:
        """`check()`; while the trace is paused (AgentPaused), block until an operator's
        `spanguard release` (returns: go on) or `spanguard kill` (raises AgentKilled), or the
        pause's deadline, when the policy's fallback applies. See SignalBook.wait."""
        trace_id = trace_id or current_trace_id()
        if trace_id is None:
            return None
        return self.signals.wait(trace_id, timeout)

    async def wait_async(
        self,
        trace_id: str | None = None,
        # The same signature as the blocking wait() it runs in a thread.
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> str | None:
        """`wait()` for asyncio code: the blocking wait runs in a thread."""
        import asyncio

        trace_id = trace_id or current_trace_id()  # read here: the context is this task's
        return await asyncio.to_thread(self.wait, trace_id, timeout)

    @property
    def malformed(self) -> int:
        """Records that are not a kill signal at all (bytes, JSON or shape)."""
        return sum(n for kind, n in self.ignored.items() if kind in MALFORMED_KINDS)

    @property
    def rejected(self) -> int:
        """Signals unsigned, signed with a key this agent does not hold, or forged."""
        return sum(n for kind, n in self.ignored.items() if kind in REJECTED_KINDS)

    @property
    def expired(self) -> int:
        """Valid signals read after their `expires_at`."""
        return self.ignored["expired"]

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        if self.acks is not None:
            self.acks.close()

    def __enter__(self) -> KillSwitch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _on_error(self, error: Any) -> None:
        refused = self._errors.refused
        self._errors(error)
        if refused is None and self._errors.refused is not None and self._ready.is_set():
            # Once, not per reconnect: the credentials or certificate changed under us.
            log.error("kill-signal consumer: %s", self._errors.refused)

    def _run(self) -> None:
        consumer = Consumer(self._config)
        try:
            consumer.assign(self._end_positions(consumer))
        # Any failure to start is handed to start(), which raises it in the caller.
        except Exception as exc:  # noqa: BLE001
            self._error = exc
            self._ready.set()
            consumer.close()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                try:
                    message = consumer.poll(0.1)
                # A fatal client error: keep trying, never die.
                except Exception as exc:  # noqa: BLE001
                    self._ignore(BadSignal("consumer_error", repr(exc)), exc)
                    time.sleep(1.0)
                    continue
                if message is None:
                    continue
                if message.error():
                    log.warning("kill-signal consumer: %s", message.error())
                    continue
                try:
                    self._accept(message.value())
                # A bug must cost one record, never the thread.
                except Exception as exc:  # noqa: BLE001
                    self._ignore(BadSignal("internal", f"{type(exc).__name__}: {exc}"), exc)
        finally:
            consumer.close()

    def _end_positions(self, consumer: Consumer, timeout: float = 15.0) -> list[TopicPartition]:
        """Every partition at its end offset, resolved now (not OFFSET_END at the first fetch):
        every signal sent after start() returns is seen. A topic that was just created may
        not have its leaders yet: retriable errors are retried until `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                # Raises KafkaConnectError at once on a refused password or certificate.
                remaining = max(0.5, deadline - time.monotonic())
                metadata = wait_for_metadata(consumer, self._errors, self.topic, remaining)
                topic = metadata.topics.get(self.topic)
                if topic is None or not topic.partitions:
                    raise KafkaException(
                        KafkaError(
                            KafkaError.UNKNOWN_TOPIC_OR_PART, f"topic {self.topic!r} not found"
                        )
                    )
                if topic.error is not None:
                    raise KafkaException(topic.error)
                positions = []
                for partition in topic.partitions:
                    _low, high = consumer.get_watermark_offsets(
                        TopicPartition(self.topic, partition), timeout=timeout
                    )
                    positions.append(TopicPartition(self.topic, partition, high))
                return positions
            except KafkaException as exc:
                error = exc.args[0] if exc.args else None
                retriable = isinstance(error, KafkaError) and (
                    error.retriable() or error.code() in _SETTLING
                )
                if not retriable or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _accept(self, value: bytes | None) -> None:
        try:
            signal = read_signal(value, self._keys, self._clock())
            if self.signals.deliver(signal) and signal.kind == "downgrade":
                # Its message is handed over by a later check(): acked then, by this id.
                with self._ack_lock:
                    trace_id = signal.trace_id.lower()
                    self._downgrades.setdefault(trace_id, deque()).append(signal)
                    self._downgrades.move_to_end(trace_id)
                    while len(self._downgrades) > MAX_ACKED:
                        self._downgrades.popitem(last=False)
        except BadSignal as bad:
            self._ignore(bad)
        finally:
            # Counted once the record is dealt with: `received` tells a waiting test or
            # operator that what was read is already in the book (or in `ignored`).
            self.received += 1

    def _ignore(self, bad: BadSignal, error: Exception | None = None) -> None:
        self.ignored[bad.kind] += 1
        if self.ignored[bad.kind] == 1:  # once per kind: a flood of junk must not flood the log
            log.warning(
                "ignored a kill-signal record (%s): %s; further ones of this kind are counted"
                " in KillSwitch.ignored[%r], not logged",
                bad.kind,
                bad.detail,
                bad.kind,
                exc_info=error,
            )
