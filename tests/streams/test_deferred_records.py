"""Records acked at the flush, without a broker (streams/write_back.py, WriteBack): a message
held with a record still in flight is not acked until the broker acks that record; a fence or a
stop meanwhile acks nothing and drops the records unawaited. And the agent-windows agent under
the span agent's lease, as the conversation agent is (test_conversation_agent.py).

The agents, their Worker and the Faust app are the real ones, built as the worker builds them
but not started (as in test_span_agent_fence.py). A record in flight is an asyncio future, as
the producer's delivery future is; the test decides when the broker "acks" it.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from faust.events import Event
from faust.types.tuples import Message

from spanguard.config.settings import WorkerSettings
from spanguard.detection.agent_budget import AgentUsage
from spanguard.detection.conversation import ConversationCall
from spanguard.schemas.policy import Policy
from spanguard.streams.agent_windows import AgentWindowCount, encode_usage
from spanguard.streams.agents import guard_spans
from spanguard.streams.agents.guard_agent_windows import AgentWindowsAgent
from spanguard.streams.agents.guard_spans import SpanAgent
from spanguard.streams.app import agent_window_states, build_worker, faust_app
from spanguard.streams.delivery import Send
from spanguard.streams.fence import Lease
from tests.detection.test_conversation import turn
from tests.support.leases import SESSION, Clock, batch_frozen_then_revoked, wait_empty
from tests.support.spans import encode

KEY = "ab" * 32
BUDGET = {"defaults": {"agent_budget": {"tokens": 100, "window": 3600}}}


def span_agent(data_dir: Path, clock: Clock, policy: dict | None = None) -> SpanAgent:
    settings = WorkerSettings(data_dir=str(data_dir), signing_key=KEY, store="memory")
    app = faust_app(settings)
    worker = build_worker(app, settings, Policy.from_mapping(policy or {}), None, None, None)
    agent = SpanAgent(worker, Lease(SESSION, clock=clock))
    agent.lease.rebalance_began()
    agent.lease.assigned(None)  # no coordinator: the clock alone says whether it holds
    return agent


def one_input_message(
    data_dir: Path, policy: dict | None = None
) -> tuple[Clock, SpanAgent, list[Event]]:
    """A span agent on `policy` (and its lease's clock), and one message of the input topic
    taken from its stream."""
    clock = Clock()
    agent = span_agent(data_dir, clock, policy)
    return clock, agent, taken(agent, agent.worker.settings.input_topic, [b"m0"])


def taken(agent: SpanAgent, topic: str, values: list[bytes], key: bytes = b"k") -> list[Event]:
    """Messages as the stream hands them over, each awaited by Faust until acked."""
    app = agent.worker.app
    events = []
    for offset, value in enumerate(values):
        message = Message(topic, 0, offset, time.time(), 0, None, key, value, None)
        app.consumer._unacked_messages.add(message)
        events.append(Event(app, message.key, message.value, None, message))
    return events


def in_flight(agent: SpanAgent, source: Message) -> tuple[Send, asyncio.Future]:
    """A repartition pack produced from `source`, its delivery future not yet resolved."""
    send = agent.worker.outbox.repartition_sends([("a" * 32, b"part")], source)[0]
    assert send.deferred
    return send, asyncio.get_running_loop().create_future()


def held_with_a_record_in_flight(agent: SpanAgent, events: list[Event]) -> asyncio.Future:
    """A batch's messages held, with a record of the first deferred and not yet acked: its
    delivery future, for the test to resolve."""
    agent.write_back.hold(events)
    send, delivery = in_flight(agent, events[0].message)
    agent.write_back.defer([send], [delivery])
    return delivery


def test_a_message_is_acked_only_once_the_records_it_sent_are_acked(tmp_path: Path) -> None:
    agent = span_agent(tmp_path, Clock())
    events = taken(agent, agent.worker.settings.input_topic, [b"m0", b"m1"])

    async def batch_then_flush() -> None:
        delivery = held_with_a_record_in_flight(agent, events)
        flush = asyncio.ensure_future(agent.write_back.flush())
        await asyncio.sleep(0.3)
        assert not flush.done(), "the flush acked messages before their record was acked"
        assert not any(event.message.acked for event in events)
        delivery.set_result(None)  # the broker's ack
        await asyncio.wait_for(flush, 2)

    asyncio.run(batch_then_flush())
    assert all(event.message.acked for event in events)
    assert agent.write_back.deferred == [] and agent.write_back.held == []


def test_a_split_message_hands_its_packs_over_before_the_next_message_is_decided(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Unkeyed messages of several traces each are split into packs for the repartition topic:
    # each message's go to the producer as it is split, so they are on their way (and decided
    # where they land) while the rest of the batch is split.
    agent = span_agent(tmp_path, Clock())
    values = [
        encode([*turn(None).finished(), *turn(None).finished()]).SerializeToString()
        for _ in range(3)
    ]
    events = taken(agent, agent.worker.settings.input_topic, values, key=b"")
    steps: list[str] = []
    handle = agent.worker.pipeline.handle

    def handling(key, value, home):  # type: ignore[no-untyped-def]
        steps.append("split")
        return handle(key, value, home)

    async def producing(sends: list[Send]) -> list[asyncio.Future]:
        steps.extend("pack" for send in sends if send.topic is agent.worker.outbox.repartition)
        return [asyncio.get_running_loop().create_future() for _ in sends]

    monkeypatch.setattr(agent.worker.pipeline, "handle", handling)
    monkeypatch.setattr(guard_spans, "produce", producing)

    async def decide() -> list[tuple[Send, object]]:
        agent.worker.states.begin_batch()
        return (await agent.decide(events)).packs

    packed = asyncio.run(decide())
    assert steps.count("split") == 3 and packed
    assert len(packed) == steps.count("pack")
    # Every message's packs were handed over before the next message was split.
    assert steps[0] == "split" and steps[-1] == "pack"
    runs = "".join("s" if step == "split" else "p" for step in steps)
    assert runs.count("sp") == 3, runs


def test_a_flush_whose_acks_wait_in_the_background_acks_its_messages_only_after_them(
    tmp_path: Path,
) -> None:
    agent = span_agent(tmp_path, Clock())
    events = taken(agent, agent.worker.settings.input_topic, [b"m0", b"m1"])

    async def flush_in_background() -> None:
        delivery = held_with_a_record_in_flight(agent, events)
        # Returns without the record's ack: the span agent's next batch does not wait for it.
        await asyncio.wait_for(agent.write_back.flush(acks_in_background=True), 1)
        assert (
            len(agent.write_back.acking) == 1
            and agent.write_back.held == []
            and agent.write_back.deferred == []
        )
        await asyncio.sleep(0.3)
        assert not any(event.message.acked for event in events)
        assert agent.write_back.written == [events]  # a fence now would release them
        delivery.set_result(None)  # the broker's ack
        await asyncio.wait_for(asyncio.gather(*agent.write_back.acking), 2)

    asyncio.run(flush_in_background())
    assert all(event.message.acked for event in events)
    assert agent.write_back.acking == set() and agent.write_back.written == []


def test_a_background_flush_that_fails_leaves_its_messages_unacked_and_says_so(
    tmp_path: Path,
) -> None:
    agent = span_agent(tmp_path, Clock())
    events = taken(agent, agent.worker.settings.input_topic, [b"m0"])

    async def not_written_either(unsent: list) -> None:
        # As WriteBack.dead_letter_refused raises when the broker refuses the dead
        # letters too (the awaited flush's case, on the real broker: test_deferred_records_kafka.py).
        raise RuntimeError(f"{len(unsent)} dead letters could not be written either")

    agent.write_back.dead_letter_refused = not_written_either  # type: ignore[method-assign]

    async def refused_in_background() -> None:
        delivery = held_with_a_record_in_flight(agent, events)
        await agent.write_back.flush(acks_in_background=True)
        # The broker refuses the record, and its dead letter cannot be written either: the
        # messages must never be acked.
        delivery.set_exception(RuntimeError("refused"))
        await asyncio.wait_for(asyncio.gather(*agent.write_back.acking), 30)

    asyncio.run(refused_in_background())
    assert not events[0].message.acked
    assert agent.write_back.unackable is not None
    assert agent.worker.health.last_error is not None  # said: /livez turns red
    with pytest.raises(RuntimeError, match="left unacked"):
        agent.write_back.hold(taken(agent, agent.worker.settings.input_topic, [b"m1"]))


def test_a_fence_while_a_record_is_in_flight_acks_nothing_and_drops_the_record(
    tmp_path: Path,
) -> None:
    clock, agent, events = one_input_message(tmp_path)

    async def fenced_mid_flush() -> None:
        delivery = held_with_a_record_in_flight(agent, events)
        flush = asyncio.ensure_future(agent.write_back.flush())
        await asyncio.sleep(0.2)
        clock.now += SESSION  # the lease lapsed: the partitions may be another's already
        await agent.write_back.flush_before_waiting(wait_empty)()  # the revocation fences
        await asyncio.wait_for(flush, 2)
        delivery.set_result(None)  # acked too late: nothing of it may ack its message now

    asyncio.run(fenced_mid_flush())
    assert agent.lease.fenced == 1
    assert not events[0].message.acked
    assert events[0].message not in agent.worker.app.consumer._unacked_messages  # released
    assert agent.write_back.deferred == []


def test_a_fence_drops_the_records_of_batches_not_yet_flushed(tmp_path: Path) -> None:
    clock, agent, events = one_input_message(tmp_path)

    async def fenced_between_batches() -> None:
        held_with_a_record_in_flight(agent, events)
        clock.now += SESSION
        await agent.write_back.flush_before_waiting(wait_empty)()

    asyncio.run(fenced_between_batches())
    assert agent.write_back.deferred == [] and agent.write_back.held == []
    assert not events[0].message.acked


@pytest.mark.parametrize("stop", [asyncio.CancelledError(), RuntimeError("broken batch")])
def test_a_batch_cut_short_drops_the_records_awaiting_the_flush(
    tmp_path: Path, stop: BaseException
) -> None:
    agent = span_agent(tmp_path, Clock())
    events = taken(agent, agent.worker.settings.input_topic, [b"m0"])

    async def cut_short() -> None:
        held_with_a_record_in_flight(agent, events)
        agent.write_back.in_batch = True
        agent.write_back.interrupted(stop)

    asyncio.run(cut_short())
    assert agent.write_back.deferred == [] and agent.write_back.held == []
    assert not events[0].message.acked


CONVERSATIONS = {"defaults": {"conversation": {"enabled": True}}}


def held_call(agent: SpanAgent, source: Message) -> None:
    """A call held for the conversation scope, as the span agent's batch leaves it."""
    assert agent.worker.recorder is not None
    call = ConversationCall("conv", "a" * 32, b"s" * 8, 10**18, ("search", "h", None), "svc", None)
    agent.worker.recorder.hand_call(call)
    agent.worker.recorder.sourced(source)
    agent.holding_since = time.monotonic()
    assert agent.holds_records()


@pytest.mark.parametrize("how", ["fenced", "cut short"])
def test_calls_held_for_the_scopes_go_with_messages_never_acked(tmp_path: Path, how: str) -> None:
    clock, agent, events = one_input_message(tmp_path, CONVERSATIONS)

    async def dropped() -> None:
        agent.write_back.hold(events)
        held_call(agent, events[0].message)
        if how == "fenced":
            clock.now += SESSION  # the lease lapsed: the next owner decides them again
            await agent.write_back.flush_before_waiting(wait_empty)()
        else:
            agent.write_back.in_batch = True
            agent.write_back.interrupted(asyncio.CancelledError())

    asyncio.run(dropped())
    assert not agent.holds_records() and agent.holding_since is None
    assert agent.take_scope_records() == []  # nothing left for a later flush to send
    assert not events[0].message.acked


# -- the agent-windows agent under the lease -------------------------------------------------


def windows_agents(data_dir: Path, clock: Clock) -> tuple[SpanAgent, AgentWindowsAgent]:
    """The span agent and the agent-windows agent over one lease, as streams/app.py makes them."""
    spans = span_agent(data_dir, clock, BUDGET)
    worker = spans.worker
    assert worker.agent_usage_out is not None
    states = agent_window_states(worker.app, worker.settings)
    return spans, AgentWindowsAgent(worker, worker.agent_usage_out, states, spans.lease)


def usage_records(tokens: list[int]) -> list[tuple[bytes, bytes]]:
    """One agent's usage records, one a message (as the span agent sends them)."""
    records = []
    for index, count in enumerate(tokens):
        usage = AgentUsage("svc", None, "a" * 32, index.to_bytes(8, "big"), 10**18, count, 0)
        ((key, value),) = encode_usage([usage], [None]).items()
        records.append((key.encode(), value))
    return records


def test_agent_windows_wait_for_the_flush_and_a_fence_drops_them_unwritten(
    tmp_path: Path,
) -> None:
    clock = Clock()
    spans, agent = windows_agents(tmp_path, clock)
    records = usage_records([10, 20])  # under the budget: no decision, no send
    key = records[0][0]
    topic = agent.worker.settings.agent_usage_topic
    events = taken(spans, topic, [value for _, value in records], key)
    agent.write_back.hold(events)
    agent.states.begin_batch()
    assert agent.decide(events) == []
    # Decided, not written: the windows wait for the flush of the commit interval.
    assert agent.states.unflushed == 1 and agent.table.unconfirmed == []
    assert agent.write_back.held == events and not any(e.message.acked for e in events)

    # Faust's wait for every message, wrapped by each agent as attach() does.
    revocation = agent.write_back.flush_before_waiting(
        spans.write_back.flush_before_waiting(wait_empty)
    )
    clock.now += SESSION  # the lease lapsed: another worker may own the partitions already
    asyncio.run(revocation())
    assert spans.lease.fenced == 1
    assert (
        agent.write_back.held == []
        and agent.states.unflushed == 0
        and agent.table.unconfirmed == []
    )
    assert not any(event.message.acked for event in events)
    unacked = agent.worker.app.consumer._unacked_messages
    assert not any(event.message in unacked for event in events)


def test_an_agent_windows_batch_under_a_lapsed_lease_decides_nothing(tmp_path: Path) -> None:
    clock = Clock()
    spans, agent = windows_agents(tmp_path, clock)
    ((key, value),) = usage_records([500])  # over the budget: a decision, were it decided
    events = taken(spans, agent.worker.settings.agent_usage_topic, [value], key)
    batch_frozen_then_revoked(spans, agent, events, clock, SESSION)
    assert agent.write_back.held == [] and agent.states.unflushed == 0
    assert agent.outcomes.count(AgentWindowCount.DECISIONS) == 0
