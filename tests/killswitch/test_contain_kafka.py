"""A tool contained on the real broker: `spanguard contain --tool NAME` and `release --tool`
(the real CLI, signed with the worker's key) against an agent's KillSwitch, which refuses
calls to that tool (ToolContained) and to no other until the release or the contain's end."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime

import pytest
from confluent_kafka import Consumer, TopicPartition

from spanguard.killswitch.client import KillSwitch
from spanguard.killswitch.signals import ToolContained
from tests.support.kafka_harness import BOOTSTRAP, CLUSTER, SIGNING_KEY
from tests.support.waiting import wait_until
from tests.support.worker import operator_cli

pytestmark = pytest.mark.kafka


def _records(topic: str) -> list[tuple[bytes, dict]]:
    consumer = Consumer(
        {**CLUSTER.config(), "group.id": f"t-{uuid.uuid4().hex}", "enable.auto.commit": False}
    )
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        found = []
        while (message := consumer.poll(2.0)) is not None:
            if not message.error():
                found.append((message.key(), json.loads(message.value())))
        return found
    finally:
        consumer.close()


def test_a_contained_tool_is_refused_to_an_agent_until_released(topics):
    tool = f"search_docs_{uuid.uuid4().hex[:6]}"
    trace = uuid.uuid4().hex
    with KillSwitch(BOOTSTRAP, topics.kills, signing_key=SIGNING_KEY, ack_topic=None) as switch:
        assert switch.check(trace, tool=tool) is None
        done = operator_cli(
            "contain", topics, "--tool", tool, "--server", "docs-mcp", "--for", "30m",
            "--reason", "the index answers 503",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert f"tool {tool} on docs-mcp" in done.stdout
        wait_until(lambda: switch.received >= 1)
        with pytest.raises(ToolContained) as refused:
            switch.check(trace, tool=tool)
        assert refused.value.signal.operator == "alice"
        assert "the index answers 503; use another tool" in str(refused.value)
        assert switch.check(trace, tool="web_search") is None
        assert switch.check(trace) is None
        assert switch.check(trace, tool=tool, server="other-mcp") is None
        until = datetime.fromisoformat(refused.value.signal.expires_at) - datetime.now(UTC)
        assert 29 * 60 < until.total_seconds() <= 30 * 60
        done = operator_cli("release", topics, "--tool", tool, "--server", "docs-mcp")
        assert done.returncode == 0, done.stderr
        wait_until(lambda: switch.received >= 2)
        assert switch.check(trace, tool=tool) is None
        assert switch.signals.tool_calls_refused == 1
    records = _records(topics.kills)
    assert [key for key, _ in records] == [f"tool:docs-mcp/{tool}".encode()] * 2
    assert [record["kind"] for _, record in records] == ["kill", "release"]
    assert all(record["signature"] and record["scope"] == "tool" for _, record in records)
    assert _records(topics.detections) == []  # a tool signal has no detection record


def test_the_cli_refuses_a_contain_without_a_reason_or_with_a_bad_duration(topics):
    no_reason = operator_cli("contain", topics, "--tool", "search_docs")
    assert no_reason.returncode == 2 and "--reason" in no_reason.stderr
    bad = operator_cli("contain", topics, "--tool", "x", "--for", "soon", "--reason", "r")
    assert bad.returncode == 2 and "not a duration" in bad.stderr
    long_name = operator_cli("contain", topics, "--tool", "t" * 201, "--reason", "r")
    assert long_name.returncode == 2 and "1 to 200" in long_name.stderr
    two = operator_cli("release", topics, "--tool", "x", "--agent", "svc")
    assert two.returncode == 2
