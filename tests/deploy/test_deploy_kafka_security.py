"""The chart and compose pass Kafka TLS/SASL as the SPANGUARD_KAFKA_* variables the worker reads.

The chart mounts the items of an existing Secret (kafka.security.existingSecret) as files and
points the *_LOCATION / *_FILE variables at them; here the rendered env is read by the real
KafkaSecurity with the mount path swapped for a directory holding real PEM files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trustme
import yaml

from spanguard.config.kafka_security import KafkaSecurity
from tests.deploy.test_deploy import ROOT, container, env_of, helm, only, render, run_helm  # noqa: F401

MOUNT = "/etc/spanguard/kafka"
SASL_SSL_MTLS = (
    "kafka.security.protocol=SASL_SSL",
    "kafka.security.saslMechanism=SCRAM-SHA-512",
    "kafka.security.saslUsername=spanguard",
    "kafka.security.existingSecret=kafka-user",
    "kafka.security.keys.sslCertificateLocation=user.crt",
    "kafka.security.keys.sslKeyLocation=user.key",
)


def secret_volume(pod_spec: dict[str, Any]) -> dict[str, Any]:
    (volume,) = [v for v in pod_spec["volumes"] if v["name"] == "kafka-security"]
    return volume["secret"]


def materialise(volume: dict[str, Any], directory: Path) -> None:
    """Write what the kubelet would: each item of the Secret at its path (real PEMs here)."""
    ca = trustme.CA()
    client = ca.issue_cert("spanguard")
    content = {
        "ca.crt": ca.cert_pem.bytes(),
        "tls.crt": client.cert_chain_pems[0].bytes(),
        "tls.key": client.private_key_pem.bytes(),
        "sasl-password": b"from-the-secret\n",
    }
    for item in volume["items"]:
        (directory / item["path"]).write_bytes(content[item["path"]])


def test_sasl_ssl_with_mtls_from_an_existing_secret(helm, tmp_path):  # noqa: F811
    docs = render(helm, *SASL_SSL_MTLS)
    sts = only(docs, "StatefulSet")
    job = only(docs, "Job")
    for pod in (sts["spec"]["template"]["spec"], job["spec"]["template"]["spec"]):
        volume = secret_volume(pod)
        assert volume["secretName"] == "kafka-user"
        assert {item["key"]: item["path"] for item in volume["items"]} == {
            "password": "sasl-password",
            "ca.crt": "ca.crt",
            "user.crt": "tls.crt",
            "user.key": "tls.key",
        }
        (c,) = pod["containers"]
        assert {"name": "kafka-security", "mountPath": MOUNT, "readOnly": True} in c["volumeMounts"]
    materialise(secret_volume(sts["spec"]["template"]["spec"]), tmp_path)
    env = {
        k: v.replace(MOUNT, str(tmp_path))
        for k, v in env_of(container(docs)).items()
        if isinstance(v, str)
    }
    assert "SPANGUARD_KAFKA_SASL_PASSWORD" not in env  # only ever the file
    security = KafkaSecurity.from_env(env)
    config = security.confluent_config()
    assert config["security.protocol"] == "SASL_SSL"
    assert config["sasl.mechanism"] == "SCRAM-SHA-512"
    assert config["sasl.username"] == "spanguard"
    assert config["sasl.password"] == "from-the-secret"
    assert config["ssl.ca.location"] == str(tmp_path / "ca.crt")
    assert config["ssl.certificate.location"] == str(tmp_path / "tls.crt")
    # The topics job gets the very same settings.
    (job_container,) = job["spec"]["template"]["spec"]["containers"]
    kafka_env = {k: v for k, v in env_of(container(docs)).items() if "KAFKA" in k}
    assert {k: v for k, v in env_of(job_container).items() if "KAFKA" in k} == kafka_env


def test_plaintext_by_default_and_ssl_with_system_cas_needs_no_secret(helm):  # noqa: F811
    docs = render(helm)
    env = env_of(container(docs))
    assert {k: v for k, v in env.items() if "KAFKA" in k} == {
        "SPANGUARD_KAFKA_SECURITY_PROTOCOL": "PLAINTEXT"
    }
    assert not [v for v in only(docs, "StatefulSet")["spec"]["template"]["spec"]["volumes"]
                if v["name"] == "kafka-security"]  # fmt: skip
    env = env_of(container(render(helm, "kafka.security.protocol=SSL")))
    security = KafkaSecurity.from_env({k: v for k, v in env.items() if isinstance(v, str)})
    assert security.confluent_config()["ssl.ca.location"] == "probe"  # the image's CA bundle


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["kafka.security.protocol=SASL_SSL"], "needs saslMechanism, saslUsername, and existingSecret"),
        (["kafka.security.saslMechanism=PLAIN"], "are set but protocol is PLAINTEXT"),
        (["kafka.security.protocol=TLS"], "protocol"),
        (["kafka.security.protocol=SSL", "kafka.security.existingSecret=s",
          "kafka.security.keys.sslCertificateLocation=tls.crt"], "go together"),
    ],
)  # fmt: skip
def test_inconsistent_chart_values_fail_the_render(helm, sets, message):  # noqa: F811
    args = ["template", "r", str(ROOT / "helm" / "spanguard")]
    for item in sets:
        args += ["--set", item]
    proc = run_helm(helm, *args)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_compose_passes_the_kafka_variables_from_the_shell():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    names = {"SPANGUARD_KAFKA_" + f.upper() for f in KafkaSecurity.__dataclass_fields__}
    for name in ("topics", "worker", "research-agent", "support-agent"):
        env = services[name]["environment"]
        kafka = {k for k in env if k.startswith("SPANGUARD_KAFKA_")}
        assert kafka <= names | {n + "_FILE" for n in names}, name
        assert env["SPANGUARD_KAFKA_SECURITY_PROTOCOL"] == (
            "${SPANGUARD_KAFKA_SECURITY_PROTOCOL:-PLAINTEXT}"
        ), name
        assert env["SPANGUARD_KAFKA_SASL_PASSWORD"] == "${SPANGUARD_KAFKA_SASL_PASSWORD:-}", name


def test_compose_runs_the_kafka_release_of_kafka_sh():
    import re

    # scripts/kafka.sh and scripts/kafka-cluster.sh share the release in their library.
    script = (ROOT / "scripts" / "lib" / "kafka-common.sh").read_text()
    (version,) = re.findall(r"^KAFKA_VERSION=(\S+)$", script, re.M)
    image = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["kafka"]["image"]
    assert image == f"apache/kafka:{version}"
