"""The conversation scope in the worker, on the real broker: a conversation's traces land on
different partitions, their compact call records meet on the conversation topic, and the
conversation agent decides across them, once per decision, through a SIGKILL of a worker.

The expected decisions are the pure core's (Guard + ConversationGuard over the same spans, in
the same order): the worker must decide exactly what replay decides, no more, no fewer."""

from __future__ import annotations

import collections
import contextlib
import json
import signal
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import yaml

from spanguard.detection.conversation import ConversationGuard
from spanguard.detection.guard import Guard
from spanguard.killswitch.client import KillSwitch
from spanguard.killswitch.signals import AgentKilled
from spanguard.schemas.policy import Policy
from spanguard.streams.conversations import conversation_partition, decode_records
from tests.detection.test_conversation import linked_traces, turn
from tests.detection.test_rules import run
from tests.support.kafka_harness import (
    BOOTSTRAP,
    CLUSTER,
    SIGNING_KEY,
    Collector,
    Topics,
    ensure_broker,
    producer,
)
from tests.support.spans import AgentRecorder
from tests.support.worker import (
    RunningWorker,
    running_worker,
    send_spans,
    start_worker,
    worker_starter,
)

pytestmark = pytest.mark.kafka

TURNS = 6  # each searching "refund policy" twice with the same empty result


def core_guard(policy_text: dict) -> Guard:
    """The pure core with the conversation scope, as replay runs it."""
    policy = Policy.from_mapping(policy_text)
    return Guard(policy, conversations=ConversationGuard(policy))


def core_decisions(policy_text: dict, conversations: list[list[AgentRecorder]]) -> list:
    """What the pure core decides for these turns, each conversation's in order."""
    guard = core_guard(policy_text)
    return [d for turns in conversations for agent in turns for d in run(guard, agent.finished())]


@contextlib.contextmanager
def worker_and_switch(tmp_path, policy: dict) -> Iterator[tuple[RunningWorker, KillSwitch]]:
    """A worker on `policy` collecting its kills, detections and conversation records, and an
    agent's killswitch reading its signals (signed with its key)."""
    with (
        running_worker(
            tmp_path,
            policy=yaml.safe_dump(policy),
            collect=("kills", "detections", "conversations"),
        ) as worker,
        KillSwitch(
            BOOTSTRAP, worker.topics.kills, signing_key=SIGNING_KEY, ack_topic=None
        ) as switch,
    ):
        yield worker, switch


def wait_until(
    condition: Callable[[], bool], timeout: float, what: str, seen: Callable[[], object] = str
) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}; seen: {seen()}"
        time.sleep(0.2)


def refused(switch: KillSwitch, trace: str, conversation: str | None = None) -> str | None:
    """The scope of the kill a check of `trace` raises (None: it passes)."""
    try:
        switch.check(trace, conversation_id=conversation)
    except AgentKilled as killed:
        return killed.scope
    return None


def records_of(collector: Collector, topic: str) -> list[dict]:
    return [m for m in list(collector.messages) if m["topic"] == topic]


def calls_on(collector: Collector, topic: str) -> int:
    """Call and usage records on the conversation topic (a Kafka record holds a batch's)."""
    return sum(len(decode_records(m["key"], m["value"])) for m in records_of(collector, topic))


@pytest.mark.parametrize(
    ("action", "expected_actions"),
    # Killed at the 3rd identical call (the 2nd turn's 1st); the window restarts at each kill.
    [("kill", ["kill", "kill", "kill", "kill"]), (None, ["flag"])],
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

    with worker_and_switch(tmp_path, policy) as (worker, switch):
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
        wait_until(lambda: switch.received >= len(kills), 30, "the killswitch's signals")
        # Checked without their conversation: a kill reaches only the trace that tripped it.
        stopped = {agent.trace_id for agent in turns if refused(switch, agent.trace_id)}
        # A turn that starts after the kills, checked before any call of its own.
        next_turn = refused(switch, uuid.uuid4().hex, "conv-refund")
        elsewhere = refused(switch, uuid.uuid4().hex, "conv-other")

    assert [(d["decision_id"], d["trace_id"], d["action"]) for d in detections] == [
        (d.decision_id, d.trace_id, d.action) for d in expected
    ]
    assert all(d["scope"] == "conversation" and d["traces"] >= 2 for d in detections)
    assert all(d["conversation_id"] == "conv-refund" for d in detections)
    wanted_kills = sorted(d.decision_id for d in expected if d.action == "kill")
    # A kill stops its trace (a trace signal) and the conversation's later traces (a
    # conversation signal, until the decision's scope_until): two signals, one decision id.
    traced = [k for k in kills if "scope" not in k]
    scoped = [k for k in kills if k.get("scope") == "conversation"]
    assert len(traced) + len(scoped) == len(kills)
    assert sorted(k["signal_id"] for k in traced) == wanted_kills
    assert sorted(k["signal_id"] for k in scoped) == wanted_kills
    until = {d["decision_id"]: d.get("scope_until") for d in detections}
    for record in scoped:
        assert record["conversation_id"] == "conv-refund" and record["key_id"]
        assert record["expires_at"] == until[record["signal_id"]]
    kill_keys = {m["key"] for m in records_of(worker.collector, topics.kills)}
    assert kill_keys <= {b"conversation:conv-refund", *(k["trace_id"].encode() for k in traced)}
    killed_traces = {d.trace_id for d in expected if d.action == "kill"}
    assert stopped == killed_traces
    assert next_turn == ("conversation" if killed_traces else None)
    assert elsewhere is None
    # Compact records: hashes and ids, never the arguments.
    for message in records_of(worker.collector, topics.conversations):
        assert b"refund policy" not in message["value"] and b"query" not in message["value"]
        assert message["key"] == b"conv-refund"  # a pack of one conversation: keyed by its id
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


def test_scope_topics_an_earlier_release_made_with_8_partitions_are_used_with_their_8(tmp_path):
    """`SPANGUARD_SCOPE_PARTITIONS` is 2, but topics made before with 8 (the spans' count, as
    earlier releases made them) keep working: the worker reads their count at start and packs
    each conversation for the partition it had, where its state is."""
    from confluent_kafka.admin import AdminClient, NewTopic

    ensure_broker()
    # A conversation whose partition of 8 is none of 2: a worker packing for 2 fails here.
    conversation = next(
        f"conv-{n}" for n in range(100) if conversation_partition(f"conv-{n}", 8) >= 2
    )
    policy = {"defaults": {"conversation": {"enabled": True, "action": "kill"}}}
    turns = [turn(conversation) for _ in range(TURNS)]
    expected = core_decisions(policy, [turns])
    topics = Topics()
    admin = AdminClient(CLUSTER.config())
    for name in (topics.conversations, topics.agent_usage):
        admin.create_topics([NewTopic(name, 8, 1)])[name].result(30)
    worker = start_worker(topics, tmp_path / "worker", yaml.safe_dump(policy))
    collector = Collector(topics.detections, topics.conversations)  # once its topics exist
    try:
        for index, agent in enumerate(turns):
            send_spans(topics.input, agent)
            wait_until(
                lambda i=index: calls_on(collector, topics.conversations) >= 2 * (i + 1),
                60,
                f"turn {index}'s conversation records",
                lambda: calls_on(collector, topics.conversations),
            )
        wait_until(
            lambda: len(records_of(collector, topics.detections)) >= len(expected),
            60,
            "the conversation's decisions",
        )
        log = worker.log_path.read_text()
    finally:
        collector.close()
        code = worker.stop()
        topics.delete()
    assert code == 0
    assert "the scope topics have 8 partitions" in log
    packs = records_of(collector, topics.conversations)
    assert {m["partition"] for m in packs} == {conversation_partition(conversation, 8)}
    detections = [json.loads(m["value"]) for m in records_of(collector, topics.detections)]
    assert [d["decision_id"] for d in detections] == [d.decision_id for d in expected]


CONVERSATIONS = 6
PARTITIONS = 4
SCOPES = ("trace", "conversation")


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
    assert len(expected_ids) == len(expected) == 4 * CONVERSATIONS

    topics = Topics()
    collector = Collector(topics.kills, topics.conversations)

    start = worker_starter(topics, tmp_path, policy_file, PARTITIONS)
    first, second = start("a", "b")
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
        (second,) = start("b-rescheduled")
        workers = [first, second]
        records_through(3)
        for index in (4, 5):
            send_turn(index)
            records_through(index)

        def signals() -> list[tuple[str, str]]:
            """(signal id, scope) of each record on the kill topic: a kill sends a trace
            signal and a conversation signal under its decision's id."""
            records = [json.loads(m["value"]) for m in records_of(collector, topics.kills)]
            return [(r["signal_id"], r.get("scope", "trace")) for r in records]

        wanted = {(i, scope) for i in expected_ids for scope in ("trace", "conversation")}
        wait_until(lambda: wanted <= set(signals()), 120, "every expected kill's signals")
        recovered = time.monotonic() - killed_at
        time.sleep(3.0)  # time for a duplicate or a false kill to show up, were there one
        counts = collections.Counter(signals())
        doubled = sum(n - 1 for n in counts.values())
        lost = [i for i in expected_ids if any((i, s) not in counts for s in SCOPES)]
        unexpected = {i for i, _ in counts if i not in expected_ids}
        decided = len({i for i, _ in counts} & set(expected_ids))
        print(
            f"\nconversations {CONVERSATIONS}: loops expected {len(expected_ids)},"
            f" decided {decided}, doubled {doubled}, lost {len(lost)},"
            f" unexpected {len(unexpected)}, recovery {recovered:.1f} s from the SIGKILL"
            " to the last expected kill's signals"
        )
        assert not lost and not unexpected
        assert doubled == 0, counts
        assert set(counts) == wanted  # each decision: one trace and one conversation signal
        by_trace = {d.trace_id for d in expected}
        kills = [json.loads(m["value"]) for m in records_of(collector, topics.kills)]
        assert {k["trace_id"] for k in kills} == by_trace
        for kill in kills:
            if kill.get("scope") == "conversation":
                assert (
                    kill["conversation_id"] == expected_ids[kill["signal_id"]].scope.conversation_id
                )
    finally:
        collector.close()
        for worker in workers:
            worker.stop()
        topics.delete()


def test_runs_linked_to_one_callers_trace_are_one_conversation_in_the_worker(tmp_path):
    """VoltAgent's runs, a trace each linked to the request that asked for it (the real
    library's spans), partitioned by trace id: the worker joins them as the core does and its
    kill stops the caller's trace too."""
    policy = {"defaults": {"conversation": {"enabled": True, "action": "kill"}}}
    caller, traces = linked_traces("linked_runs_repeat")
    core = core_guard(policy)
    expected = [d for _trace, request in traces for d in core.process(request)]
    assert [d.action for d in expected] == ["kill", "kill"]  # the core's own answer

    with worker_and_switch(tmp_path, policy) as (worker, switch):
        topics = worker.topics
        out = producer()
        runs = 0
        for trace, request in traces:
            out.produce(topics.input, key=trace.encode(), value=request.SerializeToString())
            assert out.flush(10) == 0
            if trace == caller:
                continue
            runs += 1  # each run's lookup on the conversation topic before the next run
            wait_until(
                lambda n=runs: calls_on(worker.collector, topics.conversations) >= n,
                60,
                f"run {runs}'s conversation record",
                lambda: calls_on(worker.collector, topics.conversations),
            )
        wait_until(
            lambda: len(records_of(worker.collector, topics.detections)) >= len(expected),
            60,
            "the conversation's decisions",
        )
        kills = [json.loads(m["value"]) for m in records_of(worker.collector, topics.kills)]
        wait_until(lambda: switch.received >= len(kills), 30, "the killswitch's signals")
        time.sleep(2.0)  # time for a duplicate to show up, were there one
        detections = [
            json.loads(m["value"]) for m in records_of(worker.collector, topics.detections)
        ]
        caller_stopped = refused(switch, caller)
        metrics = worker.process.metrics() or {}

    assert [(d["decision_id"], d["trace_id"], d["action"]) for d in detections] == [
        (d.decision_id, d.trace_id, d.action) for d in expected
    ]
    assert {d["conversation_id"] for d in detections} == {f"trace:{caller}"}
    # Each kill: the run that tripped, the conversation, and the caller's trace.
    stopped = collections.Counter((k.get("scope", "trace"), k["trace_id"]) for k in kills)
    assert stopped[("trace", caller)] == len(expected)
    assert {trace for scope, trace in stopped if scope == "trace"} == {
        caller,
        *(d.trace_id for d in expected),
    }
    assert caller_stopped == "trace"
    assert metrics["spanguard_linked_runs_total"] == runs == 6
