"""The conversation scope in the worker, on the real broker: a conversation's traces land on
different partitions, their compact call records meet on the conversation topic, and the
conversation agent decides across them, once per decision, through a SIGKILL of a worker.

The expected decisions are the pure core's (Guard + ConversationGuard over the same spans, in
the same order): the worker must decide exactly what replay decides, no more, no fewer."""

from __future__ import annotations

import collections
import json
import signal
import time
from collections.abc import Callable

import pytest
import yaml

from spanguard.detection.conversation import ConversationGuard
from spanguard.detection.guard import Guard
from spanguard.schemas.policy import Policy
from tests.detection.test_conversation import turn
from tests.detection.test_rules import run
from tests.support.kafka_harness import Collector, Topics, WorkerProcess, ensure_broker
from tests.support.spans import AgentRecorder
from tests.support.worker import running_worker, send_spans

pytestmark = pytest.mark.kafka

TURNS = 6  # each searching "refund policy" twice with the same empty result


def core_decisions(policy_text: dict, conversations: list[list[AgentRecorder]]) -> list:
    """What the pure core decides for these turns, each conversation's in order."""
    policy = Policy.from_mapping(policy_text)
    guard = Guard(policy, conversations=ConversationGuard(policy))
    return [d for turns in conversations for agent in turns for d in run(guard, agent.finished())]


def wait_until(
    condition: Callable[[], bool], timeout: float, what: str, seen: Callable[[], object] = str
) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}; seen: {seen()}"
        time.sleep(0.2)


def records_of(collector: Collector, topic: str) -> list[dict]:
    return [m for m in list(collector.messages) if m["topic"] == topic]


def calls_on(collector: Collector, topic: str) -> int:
    """Call and usage records on the conversation topic (a Kafka record holds a batch's)."""
    return sum(len(json.loads(m["value"])["r"]) for m in records_of(collector, topic))


@pytest.mark.parametrize(
    ("action", "expected_actions"),
    [("kill", ["kill", "kill", "kill"]), (None, ["flag"])],
    ids=["kill", "default-flag"],
)
def test_a_conversation_of_six_traces_is_decided_once_per_repeat(
    tmp_path, action, expected_actions
):
    conversation = {"enabled": True, **({"action": action} if action else {})}
    policy = {"defaults": {"conversation": conversation}}
    turns = [turn("conv-refund") for _ in range(TURNS)]
    expected = core_decisions(policy, [turns])
    assert [d.action for d in expected] == expected_actions  # the core's own answer

    with running_worker(
        tmp_path, policy=yaml.safe_dump(policy), collect=("kills", "detections", "conversations")
    ) as worker:
        topics = worker.topics
        for index, agent in enumerate(turns):
            send_spans(topics.input, agent)
            # In call order across traces, as the core reads them: the next turn waits for
            # this one's records on the conversation topic.
            wait_until(
                lambda i=index: calls_on(worker.collector, topics.conversations) >= 2 * (i + 1),
                60,
                f"turn {index}'s conversation records",
                lambda: calls_on(worker.collector, topics.conversations),
            )
        wait_until(
            lambda: len(records_of(worker.collector, topics.detections)) >= len(expected),
            60,
            "the conversation's decisions",
        )
        time.sleep(2.0)  # time for a duplicate to show up, were there one
        detections = [
            json.loads(m["value"]) for m in records_of(worker.collector, topics.detections)
        ]
        kills = [json.loads(m["value"]) for m in records_of(worker.collector, topics.kills)]
        metrics = worker.process.metrics() or {}

    assert [(d["decision_id"], d["trace_id"], d["action"]) for d in detections] == [
        (d.decision_id, d.trace_id, d.action) for d in expected
    ]
    assert all(d["scope"] == "conversation" and d["traces"] >= 2 for d in detections)
    assert all(d["conversation_id"] == "conv-refund" for d in detections)
    wanted_kills = [d for d in expected if d.action == "kill"]
    assert sorted(k["signal_id"] for k in kills) == sorted(d.decision_id for d in wanted_kills)
    # Compact records: hashes and ids, never the arguments.
    for message in records_of(worker.collector, topics.conversations):
        assert b"refund" not in message["value"] and message["key"] == b"conv-refund"
    assert metrics['spanguard_conversation_records_total{what="read"}'] == 2 * TURNS
    assert metrics["spanguard_conversation_decisions_total"] == len(expected)


def test_the_scope_off_sends_no_record(tmp_path):
    agents = [turn("conv-off") for _ in range(3)]
    with running_worker(tmp_path, collect=("conversations",)) as worker:
        for agent in agents:
            send_spans(worker.topics.input, agent)
        worker.process.wait_for("spanguard_tool_calls_observed_total", 6, timeout=60)
        time.sleep(1.0)
        metrics = worker.process.metrics() or {}
        assert worker.collector.messages == []
    assert metrics.get('spanguard_conversation_records_total{what="sent"}', 0) == 0


CONVERSATIONS = 6
PARTITIONS = 4


def test_sigkill_of_one_of_two_workers_decides_every_conversation_loop_once(tmp_path):
    ensure_broker()

    policy = {"defaults": {"conversation": {"enabled": True, "action": "kill"}}}
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(policy))
    conversations = {
        f"conv-{n}": [turn(f"conv-{n}") for _ in range(TURNS)] for n in range(CONVERSATIONS)
    }
    expected = core_decisions(policy, list(conversations.values()))
    expected_ids = {d.decision_id: d for d in expected}
    assert len(expected_ids) == len(expected) == 3 * CONVERSATIONS

    topics = Topics()
    collector = Collector(topics.kills, topics.conversations)

    def start(name: str) -> WorkerProcess:
        return WorkerProcess(
            topics, tmp_path / name, partitions=PARTITIONS, policy=policy_file
        ).start()

    first, second = start("a"), start("b")
    workers = [first, second]
    try:

        def send_turn(index: int) -> None:
            for turns in conversations.values():
                send_spans(topics.input, turns[index])

        def records_through(index: int) -> None:
            wait_until(
                lambda: (
                    calls_on(collector, topics.conversations) >= 2 * CONVERSATIONS * (index + 1)
                ),
                90,
                f"turn {index}'s conversation records",
            )

        for index in range(3):
            send_turn(index)
            records_through(index)
        send_turn(3)
        killed_at = time.monotonic()
        second.stop(signal.SIGKILL)  # mid-conversation, its turn 3 maybe half decided
        # Rescheduled without its volume: its conversations come back from the changelog.
        second = start("b-rescheduled")
        workers = [first, second]
        records_through(3)
        for index in (4, 5):
            send_turn(index)
            records_through(index)

        def signal_ids() -> list[str]:
            return [
                json.loads(m["value"])["signal_id"] for m in records_of(collector, topics.kills)
            ]

        wait_until(lambda: set(expected_ids) <= set(signal_ids()), 120, "every expected kill")
        recovered = time.monotonic() - killed_at
        time.sleep(3.0)  # time for a duplicate or a false kill to show up, were there one
        sent = signal_ids()
        counts = collections.Counter(sent)
        doubled = sum(n - 1 for n in counts.values())
        lost = [i for i in expected_ids if i not in counts]
        unexpected = [i for i in counts if i not in expected_ids]
        decided = len(set(counts) & set(expected_ids))
        print(
            f"\nconversations {CONVERSATIONS}: loops expected {len(expected_ids)},"
            f" decided {decided}, doubled {doubled}, lost {len(lost)},"
            f" unexpected {len(unexpected)}, recovery {recovered:.1f} s from the SIGKILL"
            " to the last expected kill"
        )
        assert not lost and not unexpected
        assert doubled == 0, counts
        by_trace = {d.trace_id for d in expected}
        kills = [json.loads(m["value"]) for m in records_of(collector, topics.kills)]
        assert {k["trace_id"] for k in kills} == by_trace
    finally:
        collector.close()
        for worker in workers:
            worker.stop()
        topics.delete()
