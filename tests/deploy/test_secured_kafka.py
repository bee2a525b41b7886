"""Every client against a real secured broker: SASL_SSL (SCRAM-SHA-512) and mutual TLS.

The broker is scripts/kafka.sh's, started for this module on ports and a data dir of its own
(never the shared 9092 one) with a SASL_SSL listener, an SSL listener that requires a client
certificate, and the plaintext one beside them. Its certificates come from a throwaway CA made
here with trustme; its SCRAM user is created when its storage is formatted.

- A looping agent is killed end to end with every hop over SASL_SSL: the Collector's kafka
  exporter (deploy/collector/kafka-tls.yaml + kafka-sasl.yaml), the worker (Faust over
  aiokafka) and the agent's killswitch (confluent-kafka), all from one set of SPANGUARD_KAFKA_*
  variables.
- A wrong password and an untrusted certificate each end the worker, `topics create`,
  `explain`, `backtest` and the killswitch with one clear line and exit 1 instead of a hang or
  a retry loop.
- `explain` and `backtest` read the secured cluster; without the security settings they say so
  in one line; a half-configured setting stops them (and `kill`, `topics create`) with exit 2.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import trustme
from cryptography.hazmat.primitives import serialization

from spanguard.config.kafka_security import KafkaSecurity
from spanguard.errors import KafkaConnectError
from spanguard.killswitch.client import KillSwitch
from spanguard.killswitch.signals import AgentKilled
from spanguard.schemas.decision import sign
from tests.support.kafka_harness import (
    ROOT,
    Cluster,
    Topics,
    WorkerProcess,
    collector_env,
    free_port,
    producer,
)
from tests.support.spans import kill_signal

pytestmark = pytest.mark.kafka

KAFKA_SH = ROOT / "scripts" / "kafka.sh"
COLLECTOR_SH = ROOT / "scripts" / "collector.sh"
USER = "spanguard"
SIGNING_KEY = "secured-e2e-signing-key-0123"
# Far more than a refusal takes (well under a second here), far less than a retry loop runs.
FAIL_FAST_S = 30


@dataclass
class SecuredBroker:
    plaintext: Cluster
    sasl_ssl: Cluster
    mtls: Cluster
    password: str
    other_ca: Path


def make_pki(directory: Path) -> dict[str, Path]:
    directory.mkdir(parents=True)
    ca = trustme.CA()
    broker = ca.issue_cert("127.0.0.1", "localhost")
    # Kafka's PEM keystore reads a PKCS#8 key, then the certificate chain, from one file.
    key = serialization.load_pem_private_key(broker.private_key_pem.bytes(), None)
    pkcs8 = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    chain = b"".join(pem.bytes() for pem in broker.cert_chain_pems)
    (directory / "broker.pem").write_bytes(pkcs8 + chain)
    ca.cert_pem.write_to_path(directory / "ca.pem")
    client = ca.issue_cert("spanguard-client")
    client.cert_chain_pems[0].write_to_path(directory / "client.pem")
    client.private_key_pem.write_to_path(directory / "client.key")
    trustme.CA().cert_pem.write_to_path(directory / "other-ca.pem")
    return {
        name: directory / name for name in ("ca.pem", "client.pem", "client.key", "other-ca.pem")
    }


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    root = tmp_path_factory.mktemp("secured-kafka")
    pki = make_pki(root / "tls")
    ports = {name: free_port() for name in ("plain", "controller", "sasl_ssl", "ssl")}
    password = secrets.token_urlsafe(18)
    script = [
        str(KAFKA_SH),
        "--port", str(ports["plain"]), "--controller-port", str(ports["controller"]),
        "--sasl-ssl-port", str(ports["sasl_ssl"]), "--ssl-port", str(ports["ssl"]),
        "--tls-dir", str(root / "tls"), "--data-dir", str(root / "kafka"),
    ]  # fmt: skip
    env = {**os.environ, "KAFKA_SCRAM_USERS": f"{USER}:{password}"}
    up = subprocess.run([*script, "up"], env=env, capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    ca = str(pki["ca.pem"])
    sasl = KafkaSecurity(
        "SASL_SSL",
        ssl_ca_location=ca,
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username=USER,
        sasl_password=password,
    )
    mtls = KafkaSecurity(
        "SSL",
        ssl_ca_location=ca,
        ssl_certificate_location=str(pki["client.pem"]),
        ssl_key_location=str(pki["client.key"]),
    )
    yield SecuredBroker(
        plaintext=Cluster(f"127.0.0.1:{ports['plain']}"),
        sasl_ssl=Cluster(f"127.0.0.1:{ports['sasl_ssl']}", sasl, "secured broker"),
        mtls=Cluster(f"127.0.0.1:{ports['ssl']}", mtls, "secured broker"),
        password=password,
        other_ca=pki["other-ca.pem"],
    )
    down = subprocess.run([*script, "down", "--purge"], capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr


# ---------------------------------------------------------------------- end to end


def test_a_looping_agent_is_killed_with_every_hop_over_sasl_ssl(secured, tmp_path):
    cluster = secured.sasl_ssl
    topics = Topics(cluster=cluster)
    worker = WorkerProcess(topics, tmp_path / "worker", env={"SPANGUARD_SIGNING_KEY": SIGNING_KEY})
    # The same SPANGUARD_KAFKA_* variables as the worker's and the agent's.
    collector_environment, http_port = collector_env(
        cluster.bootstrap, topics.input, tmp_path / "collector",
        OTELCOL_METRICS_LEVEL="none", **cluster.env(),
    )  # fmt: skip
    configs = [str(ROOT / "deploy" / "collector" / name) for name in
               ("config.yaml", "kafka-tls.yaml", "kafka-sasl.yaml")]  # fmt: skip
    worker.start()
    try:
        up = subprocess.run([str(COLLECTOR_SH), "up", *configs], env=collector_environment,
                            capture_output=True, text=True, timeout=900)  # fmt: skip
        assert up.returncode == 0, up.stdout + up.stderr
        agent = subprocess.run(
            [sys.executable, "-m", "spanguard.cli.demo", "agent", "support", "--step-delay", "0.3",
             "--otlp-endpoint", f"http://127.0.0.1:{http_port}", "--bootstrap", cluster.bootstrap,
             "--kill-topic", topics.kills],
            env={**os.environ, **cluster.env(), "SPANGUARD_SIGNING_KEY": SIGNING_KEY},
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert agent.returncode == 0, agent.stdout + agent.stderr
        result = json.loads(agent.stdout.strip().splitlines()[-1])
        assert result["status"] == "killed", result
        assert result["reason"] == "search_docs called 3x in last 3 steps"
        assert 3 <= result["calls"] <= 4, result
    finally:
        subprocess.run([str(COLLECTOR_SH), "down"], env=collector_environment, timeout=60)
        assert worker.stop() == 0
    log = worker.log_text()
    assert '"security.protocol": "SASL_SSL"' in log  # the worker says how it connects ...
    assert secured.password not in log  # ... and never with what
    collector_log = (tmp_path / "collector" / "collector.log").read_text(errors="replace")
    assert "Everything is ready" in collector_log, collector_log
    assert "\terror\t" not in collector_log, collector_log
    assert secured.password not in collector_log
    topics.delete()


# ---------------------------------------------------------------------- refusals


def wrong_password(secured: SecuredBroker) -> KafkaSecurity:
    return replace(secured.sasl_ssl.security, sasl_password="not-" + secured.password)


def untrusted(secured: SecuredBroker) -> KafkaSecurity:
    return replace(secured.sasl_ssl.security, ssl_ca_location=str(secured.other_ca))


FAILURES = {
    "wrong password": (wrong_password, "the broker refused the credentials"),
    "untrusted certificate": (
        untrusted,
        "the broker's certificate is not trusted (ssl.ca.location)",
    ),
}


def command(client: str, tmp_path: Path) -> tuple[list[str], str]:
    if client == "worker":
        return [sys.executable, "-m", "spanguard.cli", "worker",
                "--data-dir", str(tmp_path), "--metrics-port", str(free_port())], "spanguard worker: "  # fmt: skip
    if client == "topics create":
        return [sys.executable, "-m", "spanguard.cli", "topics", "create"], "spanguard topics: "
    if client == "explain":
        return [sys.executable, "-m", "spanguard.cli", "explain", uuid.uuid4().hex], "spanguard explain: "  # fmt: skip
    if client == "backtest":
        policy = tmp_path / "policy.yaml"
        policy.write_text("defaults:\n  loop: {threshold: 3}\n")
        return [sys.executable, "-m", "spanguard.cli", "backtest", "--since", "1h",
                "--policy", str(policy)], "spanguard backtest: "  # fmt: skip
    # An agent process whose KillSwitch cannot enter the cluster.
    return [sys.executable, "-m", "spanguard.cli.demo", "agent", "support",
            "--otlp-endpoint", "http://127.0.0.1:9"], "spanguard.cli.demo: "  # fmt: skip


@pytest.mark.parametrize("failure", list(FAILURES))
@pytest.mark.parametrize("client", ["worker", "topics create", "explain", "backtest", "killswitch"])
def test_a_refused_connection_ends_the_process_with_one_clear_line(
    secured, tmp_path, client, failure
):
    make, expected = FAILURES[failure]
    security = make(secured)
    args, prefix = command(client, tmp_path)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SPANGUARD_")},
        "SPANGUARD_BOOTSTRAP": secured.sasl_ssl.bootstrap,
        "SPANGUARD_KILL_TOPIC": f"t{uuid.uuid4().hex[:8]}-kills",
        "SPANGUARD_SIGNING_KEY": SIGNING_KEY,  # as deployed: the worker refuses to run unsigned
        **security.to_env(),
    }
    # A hang or an endless retry would run into the timeout (TimeoutExpired fails the test).
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=FAIL_FAST_S)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith(f"{prefix}Kafka at {secured.sasl_ssl.bootstrap}: {expected}"), lines
    # librdkafka's own line for the failure, at most once, beside ours: no retry log.
    assert len(lines) <= 2, "\n".join(lines)  # whole: a repr cut short hides which line is extra
    assert secured.password not in result.stderr


@pytest.mark.parametrize("failure", list(FAILURES))
def test_a_killswitch_that_cannot_enter_raises_and_stops_its_consumer(secured, failure):
    make, expected = FAILURES[failure]
    switch = KillSwitch(secured.sasl_ssl.bootstrap, "agent-kill-signals",
                        signing_key=SIGNING_KEY, security=make(secured), start=False)  # fmt: skip
    with pytest.raises(KafkaConnectError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        switch.start()
    switch._thread.join(timeout=5)
    assert not switch._thread.is_alive()  # nothing keeps reconnecting in the background


# ---------------------------------------------------------------------- mutual TLS


def test_mutual_tls_topics_and_killswitch(secured, tmp_path):
    cluster = secured.mtls
    topics = Topics(cluster=cluster)
    created = subprocess.run(
        [sys.executable, "-m", "spanguard.cli", "topics", "create", "--bootstrap",
         cluster.bootstrap, *topics.flags(), "--partitions", "2"],
        env={**os.environ, **cluster.env()}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert created.returncode == 0, created.stderr
    assert f"{topics.kills}: created" in created.stdout

    trace_id = uuid.uuid4().hex
    with KillSwitch(cluster.bootstrap, topics.kills, signing_key=SIGNING_KEY,
                    security=cluster.security) as switch:  # fmt: skip
        record = sign(kill_signal(trace_id).to_dict(), SIGNING_KEY.encode())
        out = producer(secured.plaintext)  # the listeners share one broker
        out.produce(topics.kills, key=trace_id.encode(), value=json.dumps(record).encode())
        assert out.flush(10) == 0
        for _ in range(200):
            if switch.received:
                break
            switch._stop.wait(0.05)
        with pytest.raises(AgentKilled):
            switch.check(trace_id)

    without_cert = KafkaSecurity("SSL", ssl_ca_location=cluster.security.ssl_ca_location)
    with pytest.raises(KafkaConnectError, match="refused the client certificate"):
        KillSwitch(cluster.bootstrap, topics.kills, signing_key=SIGNING_KEY, security=without_cert)
    topics.delete()


# ---------------------------------------------------------------------- the operator's readers


def spanguard(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The CLI with only `env` as its SPANGUARD_* settings (none inherited from this process)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPANGUARD_")}
    return subprocess.run([sys.executable, "-m", "spanguard.cli", *args], env={**clean, **env},
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_explain_and_backtest_read_the_secured_cluster(secured, tmp_path):
    """`spanguard kill` writes a decision over SASL_SSL, `explain` finds it there, `backtest`
    reads the spans topic there; without the SPANGUARD_KAFKA_* settings each ends with one line
    naming the cluster, never a hang or a traceback."""
    from confluent_kafka.admin import AdminClient, NewTopic

    from tests.support.spans import AgentRecorder, encode

    cluster = secured.sasl_ssl
    topics = Topics(cluster=cluster)
    admin = AdminClient(cluster.config())
    wanted = [NewTopic(name, num_partitions=2) for name in (topics.detections, topics.input)]
    for future in admin.create_topics(wanted).values():
        future.result(timeout=30)
    names = ["--detections-topic", topics.detections, "--kill-topic", topics.kills]
    env = {**cluster.env(), "SPANGUARD_SIGNING_KEY": SIGNING_KEY}
    trace_id = uuid.uuid4().hex

    killed = spanguard("kill", trace_id, "--reason", "looping on refunds", *names, env=env)
    assert killed.returncode == 0, killed.stderr
    explained = spanguard("explain", trace_id, "--json", "--bootstrap", cluster.bootstrap,
                          "--detections-topic", topics.detections, env=env)  # fmt: skip
    assert explained.returncode == 0, explained.stderr
    [record] = [json.loads(line) for line in explained.stdout.splitlines()]
    assert (record["trace_id"], record["rule"], record["reason"]) == (
        trace_id, "manual", "looping on refunds"
    )  # fmt: skip

    agent = AgentRecorder("support-bot", "bot")
    for _ in range(4):
        agent.tool("search_docs", {"query": "refund policy"})
    agent.finish()
    out = producer(cluster)
    for span in agent.finished():
        out.produce(
            topics.input, key=agent.trace_id.encode(), value=encode([span]).SerializeToString()
        )
    assert out.flush(10) == 0
    policy = tmp_path / "new.yaml"
    policy.write_text("defaults:\n  loop: {threshold: 3}\n")
    backtested = spanguard("backtest", "--since", "1h", "--policy", str(policy), "--json",
                           "--input-topic", topics.input, env=env)  # fmt: skip
    assert backtested.returncode == 0, backtested.stderr
    report = json.loads(backtested.stdout)
    assert report["records"] == 5 and report["skipped"] == 0, report
    assert report["decisions"]["new"] == 1, report
    assert f"reading 5 records of {topics.input}" in backtested.stderr

    # The same commands, the same cluster, no security settings: a refusal, not plaintext.
    bare = {"SPANGUARD_BOOTSTRAP": cluster.bootstrap}
    for name, result in (
        ("explain", spanguard("explain", trace_id, "--timeout", "5",
                              "--detections-topic", topics.detections, env=bare)),
        ("backtest", spanguard("backtest", "--since", "1h", "--policy", str(policy),
                               "--input-topic", topics.input, env=bare)),
    ):  # fmt: skip
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1, result.stdout + result.stderr
        assert lines[-1].startswith(f"spanguard {name}: Kafka at {cluster.bootstrap}"), lines
        assert lines[-1].endswith("(a TLS or SASL listener? set SPANGUARD_KAFKA_SECURITY_PROTOCOL"
                                  " and its settings)"), lines  # fmt: skip
        # librdkafka's own line for the failure, at most once, beside ours: no retry log.
        assert len(lines) <= 2, lines
        assert "Traceback" not in result.stderr and not result.stdout
    topics.delete()


@pytest.mark.parametrize("command_name", ["explain", "backtest", "kill", "topics create"])
def test_a_half_configured_security_setting_is_refused_before_any_connection(
    secured, tmp_path, command_name
):
    """SASL_SSL without its password: exit 2 and one line naming the missing setting."""
    args = {
        "explain": ["explain", uuid.uuid4().hex],
        "backtest": ["backtest", "--since", "1h", "--policy", str(tmp_path / "absent.yaml")],
        "kill": ["kill", uuid.uuid4().hex, "--reason", "test"],
        "topics create": ["topics", "create"],
    }[command_name]
    security = secured.sasl_ssl.security
    env = {
        "SPANGUARD_BOOTSTRAP": secured.sasl_ssl.bootstrap,
        "SPANGUARD_SIGNING_KEY": SIGNING_KEY,
        "SPANGUARD_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "SPANGUARD_KAFKA_SSL_CA_LOCATION": str(security.ssl_ca_location),
        "SPANGUARD_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "SPANGUARD_KAFKA_SASL_USERNAME": USER,
    }
    result = spanguard(*args, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    first = command_name.split()[0]
    assert result.stderr.strip().splitlines() == [
        f"spanguard {first}: bad setting: security.protocol SASL_SSL needs sasl.password"
    ]
