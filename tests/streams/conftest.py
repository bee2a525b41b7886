"""The three-broker cluster of the fault tests: started once per run, only when one asks.

SPANGUARD_FAULTS_CLUSTER_DIR names a `scripts/kafka-cluster.sh` data dir to use (started if it
is not running) and leave running at the end, for runs one after the other.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.faults import KafkaCluster


@pytest.fixture(scope="session")
def cluster_of_three(tmp_path_factory) -> KafkaCluster:
    kept = os.environ.get("SPANGUARD_FAULTS_CLUSTER_DIR")
    directory = Path(kept) if kept else tmp_path_factory.mktemp("kafka-cluster")
    cluster = KafkaCluster(directory).up()
    yield cluster
    if not kept:
        cluster.down()


@pytest.fixture
def kafka_cluster(cluster_of_three: KafkaCluster) -> KafkaCluster:
    """Every node up and every partition in sync, whatever the test before did to it."""
    cluster_of_three.up()
    cluster_of_three.wait_in_sync()
    return cluster_of_three
