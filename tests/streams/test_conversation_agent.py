"""The conversation agent's batches without a broker (streams/conversations.py): what a batch
decides and sends (a conversation kill as two signals), that its states wait for the flush of
the commit interval, and that a fenced worker drops them unwritten, the span agent's with them.

The agent, its Worker and the Faust app are the real ones, built as the worker builds them but
not started (as in test_span_agent_fence.py): nothing here sends, so no broker is reached.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from faust.events import Event
from faust.types.tuples import Message

from spanguard.config.settings import WorkerSettings
from spanguard.detection.conversation import ConversationCall
from spanguard.schemas.decision import keyring, read_signal
from spanguard.schemas.policy import Policy
from spanguard.streams.agents.guard_conversations import ConversationAgent
from spanguard.streams.agents.guard_spans import SpanAgent
from spanguard.streams.app import build_worker, conversation_states, faust_app
from spanguard.streams.conversations import encode_packs
from spanguard.streams.fence import Lease
from tests.support.leases import SESSION, Clock, batch_frozen_then_revoked

KEY = "ab" * 32
KILL = {"defaults": {"conversation": {"enabled": True, "action": "kill", "kill_ttl": 900}}}


def agents(data_dir: Path, clock: Clock) -> tuple[SpanAgent, ConversationAgent]:
    """Both agents over one lease, as streams/app.py makes them."""
    settings = WorkerSettings(data_dir=str(data_dir), signing_key=KEY, store="memory")
    app = faust_app(settings)
    worker = build_worker(app, settings, Policy.from_mapping(KILL), None, None, None)
    spans = SpanAgent(worker, Lease(SESSION, clock=clock))
    spans.lease.rebalance_began()
    spans.lease.assigned(None)  # no coordinator: the clock alone says whether it holds
    assert worker.conversations_out is not None
    states = conversation_states(app, settings)
    conversations = ConversationAgent(worker, worker.conversations_out, states, spans.lease)
    return spans, conversations


def call(trace: str, span: int) -> ConversationCall:
    key = ("search_docs", "a" * 16, "b" * 16)
    return ConversationCall("c", trace, span.to_bytes(8, "big"), 10**18, key, "svc", None)


def taken(agent: ConversationAgent, values: list[bytes]) -> list[Event]:
    """Conversation records as the stream hands them over, awaited by Faust until acked."""
    app = agent.worker.app
    topic = agent.worker.settings.conversation_topic
    events = []
    for offset, value in enumerate(values):
        message = Message(topic, 0, offset, time.time(), 0, None, b"c", value, None)
        app.consumer._unacked_messages.add(message)
        events.append(Event(app, message.key, message.value, None, message))
    return events


def loop_across_two_traces() -> list[bytes]:
    """Two messages of conversation c: 4 identical calls over two traces, the 3rd (the second
    trace's first) a repeat to kill."""
    first = [call("a" * 32, 1), call("a" * 32, 2)]
    second = [call("b" * 32, 3), call("b" * 32, 4)]
    return [encode_packs(records, 8)[0].value for records in (first, second)]


def test_a_kill_sends_its_trace_and_conversation_signals_and_its_state_waits_for_the_flush(
    tmp_path: Path,
) -> None:
    _, agent = agents(tmp_path, Clock())
    events = taken(agent, loop_across_two_traces())
    agent.write_back.hold(events)
    agent.states.begin_batch()
    sends = agent.decide(events)

    kills = [send for send in sends if send.topic is agent.worker.outbox.kill_signals]
    assert [send.kwargs["key"] for send in kills] == [b"b" * 32, b"conversation:c"]
    signals = [read_signal(send.kwargs["value"], keyring(KEY.encode())) for send in kills]
    traced, scoped = signals
    decision = kills[0].decision
    assert decision is not None and kills[1].decision is decision
    assert traced.signal_id == scoped.signal_id == decision.decision_id
    assert (traced.scope, scoped.scope, scoped.conversation_id) == (None, "conversation", "c")
    assert scoped.expires_at == decision.scope.until != traced.expires_at
    # Decided and sent per batch; written once per commit interval, its messages held till then.
    assert agent.states.unflushed == 1 and agent.table.unconfirmed == []
    assert agent.write_back.held == events and all(e.message.refcount == 1 for e in events)


def test_a_decision_whose_scoped_signal_failed_is_retracted_once(tmp_path: Path) -> None:
    _, agent = agents(tmp_path, Clock())
    events = taken(agent, loop_across_two_traces())
    agent.write_back.hold(events)
    agent.states.begin_batch()
    sends = agent.decide(events)
    scoped = [send for send in sends if send.kwargs["key"] == b"conversation:c"]
    agent.settle(sends, scoped)  # the trace's signal acked, the conversation's not
    assert agent.worker.health.lost_signals == 1
    state = agent.states.get("c")
    assert state is not None and "tool_loop:" + "b" * 32 not in state.killed  # can trip again
    assert agent.states.unflushed == 1  # the retraction is in the batch's states, unwritten


def test_a_fence_drops_both_agents_unwritten_states_and_releases_their_messages(
    tmp_path: Path,
) -> None:
    clock = Clock()
    spans, agent = agents(tmp_path, clock)
    events = taken(agent, loop_across_two_traces())
    agent.write_back.hold(events)
    agent.states.begin_batch()
    agent.decide(events)
    span_events = taken(agent, [b"x"])  # stands for a span message held by the span agent
    spans.write_back.held.extend(span_events)
    waited: list[bool] = []

    async def wait_empty() -> None:
        waited.append(True)

    # Faust's wait for every message, wrapped by each agent as attach() does; the outer one
    # (the conversation agent's) fences, the inner one drops its own all the same.
    revocation = agent.write_back.flush_before_waiting(
        spans.write_back.flush_before_waiting(wait_empty)
    )
    clock.now += SESSION  # the lease lapsed: another worker may own the partitions already
    asyncio.run(revocation())
    assert waited == [True] and spans.lease.fenced == 1
    assert agent.write_back.held == [] and spans.write_back.held == []
    assert agent.states.unflushed == 0 and agent.table.unconfirmed == []
    unacked = agent.worker.app.consumer._unacked_messages
    assert not any(event.message in unacked for event in events + span_events)
    assert all(event.message.refcount == 1 for event in events)  # none acked


def test_a_batch_under_a_lapsed_lease_decides_nothing(tmp_path: Path) -> None:
    clock = Clock()
    spans, agent = agents(tmp_path, clock)
    events = taken(agent, loop_across_two_traces())
    batch_frozen_then_revoked(spans, agent, events, clock, SESSION)
    assert agent.guard.calls == 0  # nothing decided
    assert agent.write_back.held == [] and agent.states.unflushed == 0


@pytest.mark.parametrize("stop", [asyncio.CancelledError(), RuntimeError("broken batch")])
def test_a_conversation_batch_cut_short_writes_nothing_of_it(
    tmp_path: Path, stop: BaseException
) -> None:
    _, agent = agents(tmp_path, Clock())
    events = taken(agent, loop_across_two_traces())
    agent.write_back.hold(events)
    agent.states.begin_batch()
    agent.decide(events)
    agent.write_back.in_batch = True
    crashed = agent.write_back.interrupted(stop)
    assert agent.write_back.held == [] and agent.states.unflushed == 0
    assert crashed is isinstance(stop, RuntimeError)
    if crashed:
        with pytest.raises(RuntimeError, match="left unacked"):
            agent.write_back.hold(taken(agent, [json.dumps({"v": 1, "r": []}).encode()]))
