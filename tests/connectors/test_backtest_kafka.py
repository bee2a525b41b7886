"""`spanguard backtest` against the real broker: OTLP records with their record times, read
back by time range through both policies."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from spanguard.config.kafka_security import KafkaSecurity
from spanguard.connectors.backtest import read_history
from spanguard.detection.backtest import Backtest
from spanguard.schemas.policy import Policy
from tests.support.kafka_harness import BOOTSTRAP, CLUSTER, ensure_broker, producer
from tests.support.spans import AgentRecorder, encode

pytestmark = pytest.mark.kafka

DAY = 86_400
NOW = time.time()
# One under the built-in default (3): a loop of two is a new kill, one of three both policies'.
STRICT = "defaults:\n  loop: {threshold: 2}\n"


def looping(service: str, calls: int) -> AgentRecorder:
    agent = AgentRecorder(service, "bot")
    for _ in range(calls):
        agent.tool("search_docs", {"query": "refund policy"})
    agent.finish()
    return agent


def send(topic: str, agent: AgentRecorder, at: float, *, partition: int) -> None:
    out = producer()
    for index, span in enumerate(agent.finished()):
        out.produce(
            topic,
            key=agent.trace_id.encode(),
            value=encode([span]).SerializeToString(),
            partition=partition,
            timestamp=int((at + index) * 1000),
        )
    assert out.flush(10) == 0


@pytest.fixture(scope="module")
def history():
    """A two-partition spans topic: a loop of two three days ago, one an hour ago (another
    partition), one of three an hour ago, and a record that is not OTLP."""
    ensure_broker()
    topic = f"t{uuid.uuid4().hex[:8]}-otlp_spans"
    admin = AdminClient(CLUSTER.config())
    for future in admin.create_topics([NewTopic(topic, num_partitions=2)]).values():
        future.result(timeout=30)
    old, recent, both = looping("old-bot", 2), looping("support-bot", 2), looping("loud-bot", 3)
    send(topic, old, NOW - 3 * DAY, partition=0)
    send(topic, recent, NOW - 3600, partition=1)
    send(topic, both, NOW - 3000, partition=0)
    out = producer()
    out.produce(topic, key=b"junk", value=b"\x00not otlp", partition=1,
                timestamp=int((NOW - 1800) * 1000))  # fmt: skip
    assert out.flush(10) == 0
    yield topic, old, recent, both
    for future in admin.delete_topics([topic], operation_timeout=30).values():
        future.result(timeout=30)


def backtest(tmp_path: Path, topic: str, *args: str) -> subprocess.CompletedProcess[str]:
    policy = tmp_path / "new.yaml"
    policy.write_text(STRICT)
    return subprocess.run(
        [sys.executable, "-m", "spanguard.cli", "backtest", "--policy", str(policy),
         "--bootstrap", BOOTSTRAP, "--input-topic", topic, *args],
        capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", **CLUSTER.env()},
    )  # fmt: skip


def test_the_last_two_days_add_one_kill_and_skip_the_record_that_is_not_otlp(
    history, tmp_path: Path
) -> None:
    topic, old, recent, both = history
    result = backtest(tmp_path, topic, "--since", "2d", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["records"] == 3 + 4 + 1  # two calls and the root, three and the root, junk
    assert report["skipped"] == 1 and "not an OTLP" in report["skip_reasons"][0]
    assert report["decisions"] == {"new": 2, "current": 1}
    assert report["added"] == 1 and report["removed"] == 0
    [change] = report["changes"]
    assert (change["service"], change["rule"], change["action"]) == (
        "support-bot", "tool_loop", "kill"
    )  # fmt: skip
    assert change["added_traces"] == [recent.trace_id]  # both policies kill `both`
    assert both.trace_id not in result.stdout
    assert report["current_policy"] == "the built-in defaults"
    assert f"reading 8 records of {topic}" in result.stderr
    assert old.trace_id not in result.stdout


def test_a_time_range_reads_only_its_records_and_the_text_report_names_the_trace(
    history, tmp_path: Path
) -> None:
    topic, old, _, _ = history
    start = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(NOW - 4 * DAY))
    end = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(NOW - 2 * DAY))
    current = tmp_path / "current.yaml"
    current.write_text("defaults:\n  loop: {threshold: 4}\n")
    html = tmp_path / "changes.html"
    result = backtest(tmp_path, topic, "--from", start, "--to", end, "--against", str(current),
                      "--html", str(html))  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"+ {old.trace_id} old-bot tool_loop -> kill" in result.stdout
    assert "1 added, 0 removed in 1 changed traces" in result.stdout
    assert f"against {current}" in result.stdout
    page = html.read_text()
    assert f'id="trace-{old.trace_id}"' in page and "added tool_loop → kill" in page


def test_a_start_before_the_oldest_record_says_what_is_there(history, tmp_path: Path) -> None:
    topic, *_ = history
    result = backtest(tmp_path, topic, "--since", "30d")
    assert result.returncode == 0, result.stderr
    assert f"{topic} holds records from" in result.stderr
    assert "(nothing older was written)" in result.stderr


def test_records_deleted_by_retention_are_named_as_such(tmp_path: Path) -> None:
    ensure_broker()
    topic = f"t{uuid.uuid4().hex[:8]}-otlp_spans"
    admin = AdminClient(CLUSTER.config())
    for future in admin.create_topics([NewTopic(topic, num_partitions=1)]).values():
        future.result(timeout=30)
    try:
        send(topic, looping("a", 3), NOW - 2 * DAY, partition=0)
        send(topic, looping("b", 3), NOW - DAY, partition=0)
        # What retention does to a topic: its oldest records are gone, the log start moves.
        for future in admin.delete_records([TopicPartition(topic, 0, 4)]).values():
            future.result(timeout=30)
        result = backtest(tmp_path, topic, "--since", "7d", "--json")
        assert result.returncode == 0, result.stderr
        assert "its retention deleted older records" in result.stderr
        assert json.loads(result.stdout)["records"] == 4
    finally:
        for future in admin.delete_topics([topic]).values():
            future.result(timeout=30)


def test_a_topic_that_does_not_exist_is_one_line_and_exit_2(tmp_path: Path) -> None:
    ensure_broker()
    topic = f"t{uuid.uuid4().hex[:8]}-missing"
    result = backtest(tmp_path, topic, "--since", "1d")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"spanguard backtest: topic {topic} does not exist at {BOOTSTRAP} (is --input-topic right?)"
    ]
    assert topic not in AdminClient(CLUSTER.config()).list_topics(timeout=10).topics


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--since", "7 days"], "is not a duration"),
        (["--from", "last tuesday"], "is not an ISO 8601 time"),
        (["--since", "1d", "--from", "2026-01-01"], "not both"),
        ([], "give the history to read"),
        (["--from", "2026-02-01", "--to", "2026-01-01"], "--to must be after"),
    ],
)
def test_bad_times_are_usage_errors(tmp_path: Path, args: list[str], said: str) -> None:
    result = backtest(tmp_path, "any-topic", *args)
    assert result.returncode == 2 and said in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_the_reader_commits_nothing_and_reads_to_the_end_offsets(history) -> None:
    topic, *_ = history
    new, current = Policy.from_yaml(STRICT), Policy()
    run = Backtest(new, current)
    plan = read_history(
        BOOTSTRAP, CLUSTER.security or KafkaSecurity(), topic, 0, None, run, progress=False
    )
    assert plan.total == 3 + 3 + 4 + 1
    report = run.finish()
    assert report.records == plan.total and report.decisions == [3, 1]
    groups = AdminClient(CLUSTER.config()).list_consumer_groups().result(timeout=30)
    # No group of any kind consumed the topic: offsets were assigned, never committed.
    assert not [g for g in groups.valid if g.group_id.startswith("spanguard-backtest-")]


def test_progress_says_records_read_of_how_many_and_time_left() -> None:
    import io

    from spanguard.connectors.backtest import _Progress

    stream = io.StringIO()
    bar = _Progress(stream, 1000, enabled=True)
    bar.update(250)
    line = stream.getvalue()
    assert "250 of 1,000 records ( 25%)" in line and "records/s" in line and "left" in line
    quiet = io.StringIO()
    _Progress(quiet, 1000, enabled=False).update(250)  # not a terminal: nothing
    assert quiet.getvalue() == ""
