"""The killswitch tests' shared fixture: the topics an operator command sends to."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from tests.support.kafka_harness import CLUSTER, Topics, ensure_broker


@pytest.fixture(scope="module")
def topics() -> Iterator[Topics]:
    """A fresh kill topic (three partitions, as a fleet's) and detections topic, for the tests
    of `spanguard kill|release|contain` on the real broker; deleted after."""
    ensure_broker()
    names = Topics()
    admin = AdminClient(CLUSTER.config())
    created = admin.create_topics([NewTopic(names.kills, 3, 1), NewTopic(names.detections, 1, 1)])
    for future in created.values():
        future.result(30)
    yield names
    names.delete()
