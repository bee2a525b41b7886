"""The scope topics (conversations, agent usage) and their tables' changelogs get
`scope_partitions` partitions (2 by default): their records are packed and few, and every
partition a worker holds is named in each of its fetches. Topics made before with another
count are used as they are, and two scope topics that disagree are refused."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from spanguard.cli.main import _flags, build_parser
from spanguard.config.settings import WorkerSettings
from spanguard.connectors.topics import scope_partitions_found
from spanguard.errors import SettingsError
from tests.support.kafka_harness import CLUSTER, Topics, ensure_broker


def settings_for(topics: Topics, *extra: str) -> WorkerSettings:
    args = build_parser().parse_args(
        ["worker", "--bootstrap", CLUSTER.bootstrap, *topics.flags(), *extra]
    )
    return WorkerSettings.from_sources(_flags(args, "WorkerSettings"), CLUSTER.env())


def topics_create(topics: Topics) -> None:
    """`spanguard topics create` for `topics`, as an operator runs it."""
    result = subprocess.run(
        [sys.executable, "-m", "spanguard.cli", "topics", "create", "--bootstrap",
         CLUSTER.bootstrap, *topics.flags()],
        capture_output=True, text=True, timeout=120, env={**os.environ, **CLUSTER.env()},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]


def partitions_of(names: list[str]) -> dict[str, int]:
    """Once every one of `names` is in the cluster's metadata (a topic just made may not be)."""
    admin = AdminClient(CLUSTER.config())
    deadline = time.monotonic() + 30
    while True:
        metadata = admin.list_topics(timeout=10)
        if all(name in metadata.topics for name in names) or time.monotonic() > deadline:
            return {name: len(metadata.topics[name].partitions) for name in names}
        time.sleep(0.2)


def test_scope_partitions_below_one_are_refused():
    with pytest.raises(SettingsError, match="scope_partitions must be at least 1"):
        WorkerSettings.from_sources({}, {"SPANGUARD_SCOPE_PARTITIONS": "0"})


def test_topics_create_gives_the_scope_topics_and_changelogs_their_own_count():
    ensure_broker()
    topics = Topics()
    try:
        topics_create(topics)
        settings = settings_for(topics)
        counts = partitions_of(
            [
                settings.input_topic,
                settings.repartition_topic,
                settings.changelog_topic,
                settings.conversation_topic,
                settings.agent_usage_topic,
                settings.conversation_changelog_topic,
                settings.agent_window_changelog_topic,
            ]
        )
        assert counts == {
            settings.input_topic: 8,
            settings.repartition_topic: 8,
            settings.changelog_topic: 8,
            settings.conversation_topic: 2,
            settings.agent_usage_topic: 2,
            settings.conversation_changelog_topic: 2,
            settings.agent_window_changelog_topic: 2,
        }
        assert scope_partitions_found(settings) == 2
    finally:
        topics.delete()


def test_scope_topics_made_before_are_used_with_their_count_and_two_that_disagree_refused():
    ensure_broker()
    topics = Topics()
    admin = AdminClient(CLUSTER.config())
    try:
        settings = settings_for(topics)
        assert scope_partitions_found(settings) is None  # neither exists yet
        admin.create_topics([NewTopic(topics.conversations, 8, 1)])[topics.conversations].result(30)
        partitions_of([topics.conversations])
        assert scope_partitions_found(settings) == 8  # an earlier release made it with 8
        # `topics create` makes the missing scope topics with the count found, not 2.
        topics_create(topics)
        assert set(
            partitions_of(
                [
                    settings.conversation_topic,
                    settings.agent_usage_topic,
                    settings.conversation_changelog_topic,
                    settings.agent_window_changelog_topic,
                ]
            ).values()
        ) == {8}
        assert partitions_of([settings.input_topic]) == {settings.input_topic: 8}
        other = Topics()
        try:
            made = admin.create_topics([NewTopic(other.conversations, 8, 1)])
            made[other.conversations].result(30)
            made = admin.create_topics([NewTopic(other.agent_usage, 3, 1)])
            made[other.agent_usage].result(30)
            partitions_of([other.conversations, other.agent_usage])
            with pytest.raises(SettingsError, match="the scope topics differ in partitions"):
                scope_partitions_found(settings_for(other))
        finally:
            other.delete()
    finally:
        topics.delete()
