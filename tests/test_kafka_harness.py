"""Which broker the tests use: SPANGUARD_TEST_BOOTSTRAP, else testcontainers where Docker
answers, else scripts/kafka.sh."""

from __future__ import annotations

import socket
import time

import pytest

from tests.support.kafka_harness import (
    FROM_ENV,
    KAFKA_SH,
    TESTCONTAINERS,
    docker_answers,
    select_cluster,
    select_source,
)


def never() -> bool:
    raise AssertionError("Docker must not be asked when the cluster is given")


@pytest.mark.parametrize(
    ("environ", "docker", "source"),
    [
        ({FROM_ENV: "kafka:9092"}, never, FROM_ENV),
        ({FROM_ENV: "kafka:9092"}, lambda: True, FROM_ENV),
        ({FROM_ENV: "  "}, lambda: True, TESTCONTAINERS),
        ({}, lambda: True, TESTCONTAINERS),
        ({}, lambda: False, KAFKA_SH),
    ],
)
def test_the_source_follows_the_environment_then_docker(environ, docker, source):
    assert select_source(environ, docker) == source


def test_a_given_cluster_comes_with_its_security_settings(tmp_path):
    ca = tmp_path / "ca.pem"
    import trustme

    trustme.CA().cert_pem.write_to_path(ca)
    cluster = select_cluster(
        {
            FROM_ENV: "broker.example:9094",
            "SPANGUARD_KAFKA_SECURITY_PROTOCOL": "SSL",
            "SPANGUARD_KAFKA_SSL_CA_LOCATION": str(ca),
        },
        never,
    )
    assert cluster.bootstrap == "broker.example:9094"
    assert cluster.config()["security.protocol"] == "SSL"
    assert cluster.env()["SPANGUARD_KAFKA_SSL_CA_LOCATION"] == str(ca)
    assert cluster.describe() == "SPANGUARD_TEST_BOOTSTRAP at broker.example:9094 (SSL)"


def test_kafka_sh_uses_kafka_port_and_testcontainers_a_port_of_its_own():
    assert select_cluster({"KAFKA_PORT": "19092"}, lambda: False).bootstrap == "127.0.0.1:19092"
    assert select_cluster({}, lambda: False).bootstrap == "127.0.0.1:9092"
    ours = select_cluster({}, lambda: True)
    assert ours.source == TESTCONTAINERS
    assert ours.bootstrap.startswith("127.0.0.1:") and ours.bootstrap != "127.0.0.1:9092"


def test_docker_answers_is_false_quickly_where_no_engine_listens(monkeypatch):
    with socket.socket() as sock:  # a port that refuses: nothing speaks Docker's API there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("DOCKER_HOST", f"tcp://127.0.0.1:{port}")
    started = time.monotonic()
    assert docker_answers(timeout=2) is False
    assert time.monotonic() - started < 10
