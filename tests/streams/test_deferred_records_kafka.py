"""Records acked at the flush, on the real broker (docs/design.md, "Records acked at the flush"):
the span agent's batch produces its repartition and conversation packs without waiting for them,
its flush awaits their acks before it acks the messages; a pack the broker refuses leaves a
dead letter pointing at its message, written before that message is acked; and when even the
dead letter is refused, the messages are never acked (decided again after a restart).

The span agent, its Worker and the Faust app are the real ones, built as the worker builds them;
the batch is handed to `guard_batch` directly (as the stream would), and its records go through
Faust's producer to the broker. A topic's `max.message.bytes` is how the broker refuses one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from confluent_kafka.admin import AdminClient, NewTopic
from faust.events import Event
from faust.types.tuples import Message

from spanguard.config.settings import WorkerSettings
from spanguard.schemas.policy import Policy
from spanguard.streams.agents.guard_spans import SpanAgent, SpanCount
from spanguard.streams.app import build_worker, faust_app
from spanguard.streams.conversations import ConversationCount
from spanguard.streams.delivery import HEADER_OFFSET, HEADER_REASON, HEADER_TOPIC
from spanguard.streams.fence import Lease
from tests.detection.test_conversation import turn
from tests.support.kafka_harness import CLUSTER, Collector, Topics, end_offsets, ensure_broker
from tests.support.spans import encode

pytestmark = pytest.mark.kafka

KEY = "ab" * 32
PARTITIONS = 4
SCOPE_ON = {"defaults": {"conversation": {"enabled": True}}}
REFUSING = {"max.message.bytes": "64"}  # every pack is larger: the broker refuses it
T = TypeVar("T")


@pytest.fixture
def topics() -> Iterator[Topics]:
    ensure_broker()
    names = Topics()
    yield names
    names.delete()


def create(topics: Topics, refusing: tuple[str, ...] = ()) -> None:
    """The worker's topics; those named in `refusing` refuse every record of a pack's size."""
    names = [
        topics.input, topics.repartition, topics.conversations, topics.agent_usage,
        topics.kills, topics.detections, topics.dead_letters, topics.goal_checks,
        f"{topics.app_id}-trace-state-changelog",
    ]  # fmt: skip
    admin = AdminClient(CLUSTER.config())
    futures = admin.create_topics(
        [
            NewTopic(name, PARTITIONS, 1, config=REFUSING if name in refusing else {})
            for name in names
        ]
    )
    for future in futures.values():
        future.result(30)


def span_agent(data_dir: Path, topics: Topics, **changed: Any) -> SpanAgent:
    """The span agent on the shipped settings, but for those `changed` (each test says why)."""
    settings = WorkerSettings(
        data_dir=str(data_dir),
        signing_key=KEY,
        store="memory",
        bootstrap=CLUSTER.bootstrap,
        partitions=PARTITIONS,
        **topics.settings(),
        **changed,
    )
    app = faust_app(settings)
    worker = build_worker(app, settings, Policy.from_mapping(SCOPE_ON), None, None, None)
    agent = SpanAgent(worker, Lease(30.0))
    assert settings.changelog_topic == f"{topics.app_id}-trace-state-changelog"
    agent.lease.rebalance_began()
    agent.lease.assigned(None)  # no group: the clock alone says whether it holds
    return agent


def taken(
    agent: SpanAgent, values: list[tuple[bytes | None, bytes]], first: int = 0
) -> list[Event]:
    """Input messages as the stream hands them over, each awaited by Faust until acked."""
    app = agent.worker.app
    events = []
    for offset, (key, value) in enumerate(values, first):
        message = Message(agent.worker.settings.input_topic, 0, offset, time.time(), 0, None,
                          key, value, None)  # fmt: skip
        app.consumer._unacked_messages.add(message)
        events.append(Event(app, message.key, message.value, None, message))
    return events


def a_batch(agent: SpanAgent, conversation: str = "conv-deferred", first: int = 0) -> list[Event]:
    """A trace naming a conversation, keyed by its id (its calls go to the conversation topic),
    then an unkeyed message of two traces (repacked to the repartition topic); at offsets from
    `first`."""
    keyed = turn(conversation)
    one, two = turn(None), turn(None)
    unkeyed = encode([*one.finished(), *two.finished()]).SerializeToString()
    return taken(
        agent,
        [(keyed.trace_id.encode(), encode(keyed.finished()).SerializeToString()), (None, unkeyed)],
        first,
    )


async def stop(agent: SpanAgent) -> None:
    await agent.worker.app.producer.stop()


def run(agent: SpanAgent, work: Coroutine[Any, Any, T]) -> T:
    """Run on the app's own loop, as the worker does: Faust's producer buffer (the changelog
    writes) waits on a queue of that loop."""
    return agent.worker.app.loop.run_until_complete(asyncio.wait_for(work, 120))


def test_the_packs_are_acked_by_the_flush_before_their_messages(tmp_path, topics):
    create(topics)
    agent = span_agent(tmp_path, topics)
    events = a_batch(agent)
    acked_with: list[tuple[int, list[int], list[int]]] = []

    def noting_what_was_written(event: Event):
        ack = event.ack

        def ack_after_looking() -> bool:
            written = end_offsets(topics.repartition, PARTITIONS)
            packs = end_offsets(topics.conversations, PARTITIONS)
            acked_with.append((event.message.offset, written, packs))
            return ack()

        return ack_after_looking

    for event in events:
        event.ack = noting_what_was_written(event)  # type: ignore[method-assign]

    async def batch_then_flush() -> list[str]:
        try:
            await agent.guard_batch(events)
            # The batch is over: its repartition packs were produced, not waited for, its
            # conversation pack is held (`scope_hold`), and its messages wait for the flush,
            # which sends the held pack first.
            deferred = [send.topic.get_topic_name() for send, _ in agent.write_back.deferred]
            assert agent.write_back.held == events and not any(e.message.acked for e in events)
            assert agent.holds_records()
            await agent.write_back.flush()
            return deferred
        finally:
            await stop(agent)

    deferred = run(agent, batch_then_flush())
    assert sorted(set(deferred)) == [topics.repartition]
    assert not agent.holds_records()
    assert all(event.message.acked for event in events) and agent.write_back.deferred == []
    repacked = deferred.count(topics.repartition)
    # When each message was acked, every pack of the batch was in its topic already.
    assert [offset for offset, _, _ in acked_with] == [0, 1]
    for _, written, packs in acked_with:
        assert sum(written) == repacked and sum(packs) == 1
    assert agent.outcomes.count(SpanCount.DEAD_LETTERS) == 0


def test_held_calls_go_out_in_one_pack_once_their_hold_is_over_acked_before_their_messages(
    tmp_path, topics
):
    create(topics)
    # A hold no batch outlasts, however loaded the machine; the test moves its start back.
    agent = span_agent(tmp_path, topics, scope_hold=60.0)
    first = a_batch(agent)
    second = a_batch(agent, "conv-deferred", first=len(first))
    events = first + second
    packs_at_ack: list[int] = []
    for event in events:
        ack = event.ack

        def ack_after_looking(ack=ack) -> bool:
            packs_at_ack.append(sum(end_offsets(topics.conversations, PARTITIONS)))
            return ack()

        event.ack = ack_after_looking  # type: ignore[method-assign]

    async def two_batches_then_flush() -> tuple[int, list[str]]:
        try:
            await agent.guard_batch(first)
            rows_after_first = agent.conversation_records.count(ConversationCount.RECORDS_SENT)
            assert agent.holding_since is not None
            agent.holding_since -= 60.0  # the hold is over: the next batch sends what is held
            await agent.guard_batch(second)
            sent = [send.topic.get_topic_name() for send, _ in agent.write_back.deferred]
            await agent.write_back.flush()
            return rows_after_first, sent
        finally:
            await stop(agent)

    rows_after_first, sent = run(agent, two_batches_then_flush())
    assert rows_after_first == 0  # held through the first batch
    # Both batches' calls of the one conversation, in one pack sent by the second batch.
    assert agent.conversation_records.count(ConversationCount.RECORDS_SENT) == 4
    assert sent.count(topics.conversations) == 1
    assert packs_at_ack == [1, 1, 1, 1]  # each message acked after the pack was written
    assert all(event.message.acked for event in events)


def test_a_pack_the_broker_refuses_leaves_a_dead_letter_before_its_message_is_acked(
    tmp_path, topics
):
    create(topics, refusing=(topics.conversations,))
    agent = span_agent(tmp_path, topics)
    events = a_batch(agent)
    letters_at_ack: list[int] = []
    ack = events[0].ack

    def ack_after_looking() -> bool:
        letters_at_ack.append(sum(end_offsets(topics.dead_letters, PARTITIONS)))
        return ack()

    events[0].ack = ack_after_looking  # type: ignore[method-assign]
    collector = Collector(topics.dead_letters)

    async def batch_then_flush() -> None:
        try:
            await agent.guard_batch(events)
            await agent.write_back.flush()
        finally:
            await stop(agent)

    try:
        run(agent, batch_then_flush())
        deadline = time.monotonic() + 30
        while not collector.messages and time.monotonic() < deadline:
            time.sleep(0.1)
        letters = list(collector.messages)
    finally:
        collector.close()

    assert letters_at_ack == [1], "the message was acked before its dead letter was written"
    assert all(event.message.acked for event in events)  # nothing left waiting
    assert agent.outcomes.count(SpanCount.DEAD_LETTERS) == 1
    (letter,) = letters
    headers = dict(letter["headers"])
    reason = headers[HEADER_REASON].decode()
    assert reason.startswith(f"could not be written to {topics.conversations}: ")
    assert "TooLarge" in reason  # the broker's own error, said
    # It points at the message the pack's calls came from: the conversation's trace.
    assert headers[HEADER_TOPIC].decode() == topics.input
    assert headers[HEADER_OFFSET] == b"0"
    assert letter["key"] == b"conv-deferred"  # a pack of one conversation keeps its id


def test_a_dead_letter_refused_too_leaves_the_messages_unacked_and_says_so(tmp_path, topics):
    create(topics, refusing=(topics.conversations, topics.dead_letters))
    agent = span_agent(tmp_path, topics)
    events = a_batch(agent)

    async def batch_then_flush() -> None:
        try:
            await agent.guard_batch(events)
            await agent.write_back.flush_outside_batch()  # as the flush timer runs it
        finally:
            await stop(agent)

    run(agent, batch_then_flush())
    assert not any(event.message.acked for event in events)
    assert isinstance(agent.write_back.unackable, RuntimeError)
    assert "could not be written either" in str(agent.write_back.unackable)
    # Said loudly (/livez turns red): the restart decides the messages again.
    assert "could not be written either" in (agent.worker.health.last_error or "")
    with pytest.raises(RuntimeError, match="left unacked"):
        agent.write_back.hold(taken(agent, [(None, b"")]))
