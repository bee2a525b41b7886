"""The agent scope over time in the worker: a repartition of compact usage records by agent.

An agent's traces land on every partition (they are keyed by trace id), so no span agent sees
an agent's whole spend. Instead the span agent's guard records each change of a trace's usage
(`AgentUsageRecorder`, given to the guard as its agent budgets), and the span agent sends the
batch's records to the agent usage topic, one Kafka record per agent, keyed by the agent's
identity (`agent_key`). The agent-windows agent (`AgentWindowsAgent`) reads that topic, keeps
each agent's `AgentWindow` in a table keyed by the same identity (its changelog follows the
partition a record arrives on, as the trace table's does), decides with the pure core's code
(spanguard/detection/agent_budget.py) and sends its decisions down the trace decisions' path:
detections topic, signed agent-scoped kill with its expiry, and from the detections topic
paging and the webhook.

What the records hold: the agent's identity (in the key), the trace and span ids, the span's
end time, token and micro-dollar deltas (pico-dollars on the wire, as the core counts), and the
topic partition and offset of the span message each came from; never arguments. One Kafka
record per agent and span batch: `{"v": 1, "s": [source, ...], "r": [row, ...]}`, one row per
agent, bucket of its window and span message: the sum of that message's usage spans in that
bucket, named after the last of them (its trace is the one a crossing names). The window counts
the same from it as from a row per span, and a message of 80 spans sends a few rows, not 30.

Records sent twice (a span batch decided again after a crash re-sends what it had sent) are
dropped by where they came from: the span agent reads each source partition in order and sends
a batch's records before it moves on, so a window remembers the last offset it counted of each
source partition (a few hundred at most) and drops a record of an offset at or below it. Unlike
a list of recent span ids, this is exact however many records one crash re-sends.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

import faust
from faust.types import EventT

from spanguard import compact_json
from spanguard.detection.agent_budget import (
    MAX_SOURCES,
    AgentBudgetGuard,
    AgentUsage,
    AgentWindow,
    agent_key,
    bucket_seconds,
)
from spanguard.detection.pipeline import Outcome
from spanguard.outcomes import CountedOutcome, Tally
from spanguard.schemas.decision import Decision
from spanguard.schemas.policy import AgentPolicy, Policy
from spanguard.streams.decoded_states import DecodedStates
from spanguard.streams.delivery import Send
from spanguard.streams.faust_internals import event_context
from spanguard.streams.fence import Lease
from spanguard.streams.state_table import StateTable
from spanguard.streams.write_back import ScopeAgent

if TYPE_CHECKING:
    from spanguard.streams.wiring import Worker

__all__ = [
    "AgentUsageRecorder",
    "AgentWindowCount",
    "AgentWindowTable",
    "AgentWindowsAgent",
    "WorkerAgentBudgets",
    "agent_usage_sends",
    "agent_window_tally",
    "agent_window_view",
    "agent_windows_wanted",
    "decode_usage",
    "encode_usage",
    "longest_window",
]

log = logging.getLogger("spanguard.worker")

RECORD_VERSION = 1
# Agents whose idle window is deleted per batch at most: bounded work.
EVICT_PER_BATCH = 256
# Longest text field a record may carry (names are bounded to 200 characters upstream).
MAX_FIELD_CHARS = 512
# Agent windows one worker keeps at most: a flood of made-up agent names costs itself (its
# records are counted and dropped), never the windows of the agents already kept.
MAX_AGENTS_PER_WORKER = 10_000
# Messages logged once each: the reasons a record was refused.
MAX_TOLD = 64
MAX_AGENT_WIDTHS_KEPT = 4096  # agents whose window width is kept (bounded: a fleet has a few)

Row = tuple[AgentUsage, str | None, int]  # a usage record, its source partition, its offset


def _has_budget(policy: AgentPolicy) -> bool:
    return policy.agent_budget.tokens is not None or policy.agent_budget.usd is not None


def agent_windows_wanted(policy: Policy) -> bool:
    """Whether any policy entry sets an agent budget: when none does, the worker builds none of
    it (no usage record sent, no table, no agent)."""
    return any(_has_budget(p) for p in policy.entries)


def longest_window(policy: Policy) -> int:
    """The longest agent budget window of any policy entry (seconds): an agent idle that long
    has nothing left in its window, so its state can go."""
    entries = policy.entries
    return max((p.agent_budget.window for p in entries if _has_budget(p)), default=0)


class AgentWindowCount(CountedOutcome):
    """What the agent scope over time counts in the worker."""

    RECORDS_SENT = "agent_usage_records_sent"
    RECORDS_READ = "agent_usage_records_read"
    DUPLICATES = "agent_usage_duplicates"
    # Not counted: an agent whose service name is empty (span side, told once).
    NO_IDENTITY = "agent_usage_no_identity"
    # Not counted: a new agent past MAX_AGENTS_PER_WORKER on this worker (told once).
    OVER_AGENT_CAP = "agent_usage_over_agent_cap"
    DECISIONS = "agent_window_decisions"
    LATE = "agent_window_late_spans"  # ended before the window's newest bucket: counted into it
    RESETS = "agent_window_resets"  # a span a whole window away: the window started afresh
    EVICTED = "agent_windows_evicted"


def agent_window_tally(worker: Worker) -> Tally:
    """Where the span agent and the agent-windows agent count (streams/app.py makes it)."""
    tally = worker.counted[AgentWindowCount]
    assert isinstance(tally, Tally)
    return tally


class _TellOnce:
    def __init__(self) -> None:
        self.told: set[str] = set()

    def __call__(self, what: str, message: str, *args: object) -> None:
        if what in self.told or len(self.told) >= MAX_TOLD:
            return
        self.told.add(what)
        log.warning(message, *args)


# -- the trace side: record, do not decide ----------------------------------------------------


class AgentUsageRecorder(AgentBudgetGuard):
    """Given to the span agent's guard as its agent budgets: it keeps the usage records of
    agents whose policy sets an agent budget, for the span agent to send, and decides nothing
    (the agent-windows agent does, from the topic)."""

    def __init__(self, policy: Policy, tally: Tally | None = None) -> None:
        super().__init__(policy)
        self.tally = Tally() if tally is None else tally
        self.records: list[AgentUsage] = []
        self.sources: list[Any] = []  # aligned with `records`: the message each came from
        # The current message's usage: (service, agent name, bucket) -> its sum so far.
        self._summed: dict[tuple[str, str | None, int], AgentUsage] = {}
        # (service, agent name) -> the bucket width of its window, 0 when it has no budget.
        self._agent_widths: dict[tuple[str, str | None], int] = {}
        self._tell = _TellOnce()

    def observe_usage(self, record: AgentUsage) -> Decision | None:
        self.observe_spend(
            record.service,
            record.agent_name,
            record.trace_id,
            record.span_id,
            record.end_time_unix_nano,
            record.tokens,
            record.cost,
        )
        return None

    def observe_spend(
        self,
        service: str,
        agent_name: str | None,
        trace_id: str,
        span_id: bytes,
        ended: int,
        tokens: int,
        cost: int,
    ) -> None:
        if tokens <= 0 and cost <= 0:
            return
        # Every inference span asks: the agent's window width (0: no budget) is kept per agent.
        agent = (service, agent_name)
        width = self._agent_widths.get(agent)
        if width is None:
            policy = self._policy(service, agent_name)
            width = bucket_seconds(policy.agent_budget.window) if _has_budget(policy) else 0
            if len(self._agent_widths) >= MAX_AGENT_WIDTHS_KEPT:
                self._agent_widths.clear()
            self._agent_widths[agent] = width
        if not width:
            return
        if not service:
            self.tally.add(AgentWindowCount.NO_IDENTITY)
            self._tell(
                "no-identity",
                "agent budgets: usage of a trace whose service.name is empty is not counted in"
                " any agent window (counted in spanguard_agent_usage_records_total"
                '{what="no_identity"})',
            )
            return
        # One record per agent and bucket of its window for the spans of one message: the
        # window counts them the same, from a few rows instead of one per inference span.
        bucket = int((ended / 1e9) // width) if ended else 0  # as the window reckons it
        key = (service, agent_name, bucket)
        summed = self._summed.get(key)
        if summed is None:
            self._summed[key] = AgentUsage(
                service, agent_name, trace_id, span_id, ended, tokens, cost
            )
            return
        # The last span stands for the sum: a crossing is decided at it, naming its trace.
        summed.trace_id = trace_id
        summed.span_id = span_id
        if ended > summed.end_time_unix_nano:
            summed.end_time_unix_nano = ended
        summed.tokens += tokens
        summed.cost += cost

    def retract(self, decision: Decision) -> None:
        """Nothing to undo: the trace side takes no agent budget decision."""

    def sourced(self, message: Any) -> None:
        """The records since the last call came from `message`."""
        if self._summed:
            self.records.extend(self._summed.values())
            self._summed.clear()
        self.sources.extend([message] * (len(self.records) - len(self.sources)))

    def drain(self) -> tuple[list[AgentUsage], list[Any]]:
        """The records and the message each came from, in order."""
        self.sourced(None)  # records of no message (a direct caller): no source
        taken = self.records, self.sources
        self.records, self.sources = [], []
        return taken


def _source_of(message: Any) -> tuple[str, int] | None:
    if message is None:
        return None
    return f"{message.topic}:{message.partition}", int(message.offset)


def encode_usage(records: Iterable[AgentUsage], sources: Iterable[Any]) -> dict[str, bytes]:
    """{agent key: one record value holding the agent's usage rows, in order}; `sources`,
    aligned with `records`, are the messages they came from (None: no source)."""
    grouped: dict[str, tuple[list[str], list[list[Any]]]] = {}
    for record, message in zip(records, sources, strict=True):
        key = agent_key(record.service, record.agent_name)
        names, rows = grouped.setdefault(key, ([], []))
        source = _source_of(message)
        if source is None:
            where, offset = -1, -1
        else:
            if source[0] not in names:
                names.append(source[0])
            where, offset = names.index(source[0]), source[1]
        span_id, end = record.span_id.hex(), record.end_time_unix_nano
        rows.append([where, offset, record.trace_id, span_id, end, record.tokens, record.cost])
    return {
        key: compact_json.dumps({"v": RECORD_VERSION, "s": names, "r": rows})
        for key, (names, rows) in grouped.items()
    }


# Copied from streams/conversations.py's record checks (a dozen lines; the two record formats
# differ in every other field).
def _text(value: Any, what: str, optional: bool = False, empty: bool = False) -> Any:
    if value is None and optional:
        return None
    if not isinstance(value, str) or (not value and not empty) or len(value) > MAX_FIELD_CHARS:
        raise ValueError(f"{what} is not a string of 1-{MAX_FIELD_CHARS} characters")
    return value


def _count(value: Any, what: str, least: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{what} is not an integer of at least {least}")
    return value


def decode_usage(
    key: bytes | None, value: bytes | None
) -> tuple[tuple[str, str | None], list[Row]]:
    """The agent and the usage rows of one message of the agent usage topic; ValueError says
    what is wrong."""
    if not key:
        raise ValueError("no agent identity in the key")
    try:
        identity = json.loads(key)
        body = compact_json.loads(value or b"")
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"not an agent usage record: {exc}") from None
    if not isinstance(identity, list) or len(identity) != 2:
        raise ValueError("the key is not [service, agent name]")
    service = _text(identity[0], "service")
    agent_name = _text(identity[1], "agent name", optional=True, empty=True)
    if not isinstance(body, dict) or body.get("v") != RECORD_VERSION:
        raise ValueError(f"not a version {RECORD_VERSION} agent usage record")
    names, rows = body.get("s"), body.get("r")
    if not isinstance(names, list) or not isinstance(rows, list):
        raise ValueError("no source or row list")
    names = [_text(name, "source") for name in names]
    records: list[Row] = []
    for row in rows:
        if not isinstance(row, list) or len(row) != 7:
            raise ValueError("a row is not [source, offset, trace, span, end, tokens, cost]")
        where = _count(row[0], "source index", least=-1)
        if where >= len(names):
            raise ValueError(f"source index {where} of {len(names)} sources")
        offset = _count(row[1], "offset", least=-1)
        trace_id = _text(row[2], "trace id")
        try:
            span_id = bytes.fromhex(_text(row[3], "span id"))
        except ValueError:
            raise ValueError("span id is not hex") from None
        end = _count(row[4], "end time")
        tokens, cost = _count(row[5], "tokens"), _count(row[6], "cost")
        usage = AgentUsage(service, agent_name, trace_id, span_id, end, tokens, cost)
        records.append((usage, names[where] if where >= 0 else None, offset))
    return (service, agent_name), records


def agent_usage_sends(worker: Worker, records: list[AgentUsage], sources: list[Any]) -> list[Send]:
    """The span agent's records for the agent usage topic, one per agent, in order; a record
    that cannot be written leaves a dead letter pointing at the first message that
    contributed to it (`sources` is aligned with `records`)."""
    topic = worker.agent_usage_out
    assert topic is not None
    first_source: dict[str, Any] = {}
    for record, source in zip(records, sources, strict=True):
        first_source.setdefault(agent_key(record.service, record.agent_name), source)
    return [
        Send(
            topic,
            {"key": key.encode(), "value": value},
            source=first_source[key],
            deferred=True,
        )
        for key, value in encode_usage(records, sources).items()
    ]


# -- the agent side: decide ---------------------------------------------------------------


def agent_window_view(
    table: MutableMapping[bytes, bytes], bucket_seconds: float = 60.0, cache_size: int = 0
) -> DecodedStates:
    """The agent window table as the scope reads it: AgentWindows, written once per commit
    interval, idle ones evicted with bounded work (streams/decoded_states.py)."""
    return DecodedStates(
        table,
        bucket_seconds=bucket_seconds,
        cache_size=cache_size,
        decode=AgentWindow.from_bytes,  # type: ignore[arg-type]
    )


class AgentWindowTable(MutableMapping[tuple[str, str | None], AgentWindow]):
    """The core's (service, agent name) keys over the table's text keys (`agent_key`)."""

    def __init__(self, states: DecodedStates) -> None:
        self.states = states

    def __getitem__(self, key: tuple[str, str | None]) -> AgentWindow:
        # (DecodedStates is typed by the trace state; this table's codec makes AgentWindows.)
        return self.states[agent_key(*key)]  # type: ignore[return-value]

    def get(self, key: tuple[str, str | None], default: Any = None) -> Any:
        return self.states.get(agent_key(*key), default)

    def __setitem__(self, key: tuple[str, str | None], window: AgentWindow) -> None:
        self.states[agent_key(*key)] = window  # type: ignore[assignment]

    def __delitem__(self, key: tuple[str, str | None]) -> None:
        del self.states[agent_key(*key)]

    def __iter__(self) -> Iterator[tuple[str, str | None]]:
        for text in self.states:
            service, agent_name = json.loads(text)
            yield service, agent_name

    def __len__(self) -> int:
        return len(self.states)


class WorkerAgentBudgets(AgentBudgetGuard):
    """The agent budgets over the worker's table: rows counted before (the same source
    partition at or below the offset last counted) are dropped, and a new agent past
    `max_agents` on this worker is not kept."""

    def __init__(
        self,
        policy: Policy,
        states: DecodedStates,
        tally: Tally | None = None,
        max_agents: int = MAX_AGENTS_PER_WORKER,
        **kwargs: Any,
    ) -> None:
        super().__init__(policy, windows=AgentWindowTable(states), max_agents=max_agents, **kwargs)
        self.states = states
        self.tally = Tally() if tally is None else tally
        self._tell = _TellOnce()

    def observe_rows(self, agent: tuple[str, str | None], rows: list[Row]) -> list[Decision]:
        """One message's rows of one agent: each counted once, the decisions taken."""
        start = self.windows.get(agent)
        if start is None and self.states.indexed() >= self.max_agents:
            self.tally.add(AgentWindowCount.OVER_AGENT_CAP, len(rows))
            self._tell(
                "cap",
                "agent budgets: more than %d agents on this worker; the usage of new ones is"
                ' not counted (spanguard_agent_usage_records_total{what="over_agent_cap"})',
                self.max_agents,
            )
            return []
        if start is not None:
            # Kept in the batch's windows: the core's own read below is a dict lookup.
            self.windows[agent] = start
        counted_before = dict(start.sources) if start is not None else {}
        late, resets = (start.late, start.resets) if start is not None else (0, 0)
        reached: dict[str, int] = {}
        decisions: list[Decision] = []
        for usage, source, offset in rows:
            if source is not None:
                if offset <= counted_before.get(source, -1):
                    self.tally.add(AgentWindowCount.DUPLICATES)
                    continue
                reached[source] = max(reached.get(source, -1), offset)
            decision = self.observe_usage(usage)
            if decision is not None:
                decisions.append(decision)
        self.take()  # returned here; the core also keeps them for a guard that would collect
        window = self.windows.get(agent)
        if window is None:  # no budget for this agent: nothing kept
            return decisions
        self.tally.add(AgentWindowCount.LATE, max(window.late - late, 0))
        self.tally.add(AgentWindowCount.RESETS, max(window.resets - resets, 0))
        if reached:
            sources = window.sources
            for source, offset in reached.items():
                sources.pop(source, None)  # most recently counted last
                sources[source] = offset
            while len(sources) > MAX_SOURCES:
                del sources[next(iter(sources))]
            self.windows[agent] = window
        return decisions


class AgentWindowsAgent(ScopeAgent):
    """Reads the agent usage topic in batches: decides each record and sends the decisions
    (acked by the broker) per batch; writes the changed windows once per commit interval and
    acks the messages once the changelog acked those writes, under the span agent's lease (as
    the conversation agent does: streams/write_back.py, ScopeAgent)."""

    def __init__(
        self, worker: Worker, topic: faust.TopicT, states: DecodedStates, lease: Lease
    ) -> None:
        table = states.table
        assert isinstance(table, StateTable)  # its changelog writes are awaited before acks
        super().__init__(worker, states, table, lease)
        self.topic = topic
        self.outcomes = agent_window_tally(worker)
        policy = worker.guard.policy
        self.guard = WorkerAgentBudgets(policy, states, self.outcomes, clock=worker.guard.clock)
        # An agent idle a whole window (or the state TTL, if longer) has an empty window.
        self.idle_after = max(worker.settings.state_ttl, float(longest_window(policy)))

    def attach(self, app: faust.App) -> None:
        self.attach_writes(app)
        app.agent(self.topic, name="guard-agent-windows")(self.guard_agent_windows)

    async def guard_agent_windows(self, stream: faust.StreamT) -> None:
        await self.run_batches(stream, 0.01, self.guard_batch)

    def decide(self, events: list[EventT]) -> list[Send]:
        outbox = self.worker.outbox
        sends: list[Send] = []
        for event in events:
            message = event.message
            try:
                agent, rows = decode_usage(message.key, message.value)
            except ValueError as exc:
                sends.append(outbox.dead_letter(message, f"agent usage record: {exc}"))
                continue
            self.outcomes.add(AgentWindowCount.RECORDS_READ, len(rows))
            with event_context(event):
                decisions = self.guard.observe_rows(agent, rows)
            self.outcomes.add(AgentWindowCount.DECISIONS, len(decisions))
            sends.extend(outbox.sends_for(Outcome(decisions=decisions), message))
        return sends

    def settle(self, sends: list[Send], failed: list[Send]) -> None:
        """A decision whose signal was not sent is not decided: it can trip again."""
        lost = {id(send) for send in failed}
        for send in sends:
            if send.decision is not None and id(send) not in lost:
                self.worker.latency.signal_sent(send.decision)
        for send in failed:
            if send.decision is not None:
                self.guard.retract(send.decision)
                self.worker.health.lost_signals += 1
                log.error(
                    "agent kill signal not sent; it can trip again",
                    extra={"service": send.decision.agent.service},
                )

    def evict_idle(self, events: list[EventT]) -> None:
        cutoff = self.worker.guard.clock() - self.idle_after
        evicted = self.states.evict_idle(events, cutoff, EVICT_PER_BATCH)
        if evicted:
            self.outcomes.add(AgentWindowCount.EVICTED, evicted)
            log.info("evicted idle agent windows", extra={"evicted": evicted})
