"""Deployment files: the Helm chart (helm lint / helm template), docker-compose.yml, the Dockerfile.

Helm comes from scripts/helm.sh, which builds it from the Go module proxy into
~/.cache/spanguard once (a few minutes the first time; skipped only where `go` is absent).
`docker compose config` needs only the docker CLI and its compose plugin, no engine.
"""

from __future__ import annotations

import base64
import fnmatch
import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

from spanguard.config.policy_file import load_policy
from spanguard.config.settings import ENV_PREFIX, REGISTRY, WorkerSettings
from tests.support.helm import ALERTS, MONITORING_ON

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "spanguard"
HELM_SH = ROOT / "scripts" / "helm.sh"
COMPOSE = ROOT / "docker-compose.yml"
RELEASE = "sg"
FULLNAME = "sg-spanguard"
# The first `go install` of helm compiles a few hundred packages: minutes on a small machine.
HELM_INSTALL_TIMEOUT = 1800

# Paging variables the chart sets when values.pagerduty is filled in.
ALERTING_ENV = {
    "SPANGUARD_PAGERDUTY_ROUTING_KEY_FILE",
    "SPANGUARD_PAGERDUTY_URL",
    "SPANGUARD_TRACE_URL_TEMPLATE",
}
# Every variable spanguard reads: the chart may set no other SPANGUARD_* name.
KNOWN_ENV = {entry.env for entry in REGISTRY} | {
    f"{entry.env}_FILE" for entry in REGISTRY if entry.secret
}


# ---------------------------------------------------------------- helm


@pytest.fixture(scope="module")
def helm() -> Path:
    """scripts/helm.sh, with helm installed (once, into the cache)."""
    proc = subprocess.run(
        [str(HELM_SH), "path"],
        capture_output=True,
        text=True,
        timeout=HELM_INSTALL_TIMEOUT,
    )
    if proc.returncode != 0:
        if shutil.which("go") is None:
            pytest.skip(f"go is not installed, so scripts/helm.sh cannot build helm: {proc.stderr}")
        pytest.fail(f"scripts/helm.sh path failed:\n{proc.stderr}")
    binary = Path(proc.stdout.strip().splitlines()[-1])
    assert binary.is_file() and os.access(binary, os.X_OK), binary
    return HELM_SH


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def assert_template_refused(helm: Path, args: list[str], sets: list[str], message: str) -> None:
    """`helm template` with `args` and each of `sets` as --set fails with `message`, and
    renders nothing."""
    for item in sets:
        args = [*args, "--set", item]
    proc = run_helm(helm, *args)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert proc.stdout == ""


class StrictLoader(yaml.SafeLoader):
    """safe_load that rejects a mapping with a duplicate key, as the API server's decoder does."""


def _unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    keys = [loader.construct_object(key, deep=deep) for key, _ in node.value]
    duplicates = {key for key in keys if keys.count(key) > 1}
    if duplicates:
        raise yaml.constructor.ConstructorError(
            None, None, f"duplicate keys {sorted(duplicates)}", node.start_mark
        )
    return loader.construct_mapping(node, deep=deep)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def render(helm: Path, *sets: str) -> list[dict[str, Any]]:
    args = ["template", RELEASE, str(CHART), "--namespace", "agents"]
    for item in sets:
        args += ["--set", item]
    proc = run_helm(helm, *args)
    assert proc.returncode == 0, proc.stderr
    docs = [doc for doc in yaml.safe_load_all(proc.stdout) if doc]
    assert docs == [doc for doc in yaml.load_all(proc.stdout, Loader=StrictLoader) if doc]
    return docs


def only(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''} in {[d['kind'] for d in docs]}"
    return found[0]


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    sts = only(docs, "StatefulSet")
    (worker,) = sts["spec"]["template"]["spec"]["containers"]
    return worker


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def test_helm_lint(helm: Path) -> None:
    proc = run_helm(helm, "lint", "--strict", str(CHART))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout
    with_keys = run_helm(
        helm,
        "lint",
        "--strict",
        str(CHART),
        "--set",
        "signingKey.value=k-16-bytes-at-least,pagerduty.routingKey=r,persistence.enabled=false",
    )
    assert with_keys.returncode == 0, with_keys.stdout + with_keys.stderr


def test_template_defaults(helm: Path, tmp_path: Path) -> None:
    docs = render(helm)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        [
            "ConfigMap",
            "Job",
            "PodDisruptionBudget",
            "Secret",
            "Service",
            "Service",
            "ServiceAccount",
            "StatefulSet",
        ]
    ), kinds

    sts = only(docs, "StatefulSet")
    spec = sts["spec"]
    assert spec["replicas"] == 1
    assert spec["serviceName"] == f"{FULLNAME}-headless"
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    worker = container(docs)
    assert worker["image"] == "ghcr.io/spanguard/spanguard:0.1.0"
    assert worker["command"] == ["spanguard"] and worker["args"] == ["worker"]
    assert worker["securityContext"]["allowPrivilegeEscalation"] is False
    assert worker["securityContext"]["readOnlyRootFilesystem"] is True
    assert worker["resources"]["requests"]["cpu"] and worker["resources"]["limits"]["memory"]

    env = env_of(worker)
    assert env["SPANGUARD_BOOTSTRAP"] == "kafka:9092"
    assert env["SPANGUARD_PARTITIONS"] == "8"
    assert env["SPANGUARD_SCOPE_PARTITIONS"] == "2"  # the scope topics': few records, packed
    assert env["SPANGUARD_STORE"] == "rocksdb"
    assert env["SPANGUARD_STATE_TTL"] == "3600"
    assert env["SPANGUARD_METRICS_PORT"] == "9464"
    assert env["SPANGUARD_LOG_LEVEL"] == "INFO"
    # No key given: the chart generates one (signed by default), no paging.
    assert env["SPANGUARD_SIGNING_KEY_FILE"] == "/etc/spanguard/secrets/signing-key"
    assert "SPANGUARD_ALLOW_UNSIGNED" not in env
    assert "SPANGUARD_PAGERDUTY_ROUTING_KEY_FILE" not in env
    assert "SPANGUARD_SIGNING_KEY" not in env  # the key itself is never an env value here
    secret = only(docs, "Secret", f"{FULLNAME}-signing-key")
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    generated = base64.b64decode(secret["data"]["signing-key"])
    assert len(generated) == 64 and generated.isalnum()

    # RocksDB state on a PVC per pod, mounted at the data dir.
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi"
    mounts = {m["name"]: m["mountPath"] for m in worker["volumeMounts"]}
    assert mounts["data"] == env["SPANGUARD_DATA_DIR"] == "/var/lib/spanguard"
    assert "data" not in {v["name"] for v in pod["volumes"]}

    # Probes: startup waits for the HTTP server; liveness and readiness ask the span agent.
    (port,) = worker["ports"]
    assert port == {"name": "metrics", "containerPort": 9464, "protocol": "TCP"}
    paths = {"startupProbe": "/metrics", "livenessProbe": "/livez", "readinessProbe": "/readyz"}
    for probe, path in paths.items():
        assert worker[probe]["httpGet"] == {"path": path, "port": "metrics"}, probe

    # The policy: a ConfigMap mounted where SPANGUARD_POLICY points, and a valid policy.
    cm = only(docs, "ConfigMap", f"{FULLNAME}-policy")
    policy_file = Path(env["SPANGUARD_POLICY"])
    assert mounts["policy"] == str(policy_file.parent)
    (policy_volume,) = [v for v in pod["volumes"] if v["name"] == "policy"]
    assert policy_volume["configMap"]["name"] == cm["metadata"]["name"]
    local = tmp_path / policy_file.name
    local.write_text(cm["data"][policy_file.name])
    assert load_policy(str(local)).defaults.loop.threshold == 3

    # Metrics Service with scrape annotations; PDB.
    svc = only(docs, "Service", f"{FULLNAME}-metrics")
    assert svc["spec"]["ports"] == [
        {"name": "metrics", "port": 9464, "targetPort": "metrics", "protocol": "TCP"}
    ]
    assert svc["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert svc["metadata"]["annotations"]["prometheus.io/port"] == "9464"
    assert svc["spec"]["selector"] == spec["selector"]["matchLabels"]
    assert only(docs, "Service", f"{FULLNAME}-headless")["spec"]["clusterIP"] == "None"
    pdb = only(docs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == spec["selector"]["matchLabels"]


def test_env_is_what_the_worker_reads(helm: Path) -> None:
    """Every SPANGUARD_* variable the chart sets is a worker setting (or an alerting one), and
    the worker parses the rendered values, also for numbers Go would print as 1e+06."""
    docs = render(
        helm,
        "worker.stateTtl=1000000",
        "kafka.partitions=1000000",
        "kafka.bootstrap=broker-0.kafka.svc:9093",
        "signingKey.value=k-16-bytes-at-least",
        "pagerduty.routingKey=r",
        "pagerduty.url=https://events.example",
        "pagerduty.traceUrlTemplate=https://tempo.example/trace/{trace_id}",
    )
    env = env_of(container(docs))
    assert set(env) >= ALERTING_ENV
    unknown = {k for k in env if k.startswith(ENV_PREFIX)} - KNOWN_ENV
    assert not unknown, f"not in the settings registry: {unknown}"
    settings = WorkerSettings.from_sources({}, {k: v for k, v in env.items() if isinstance(v, str)})
    assert settings.bootstrap == "broker-0.kafka.svc:9093"
    assert settings.partitions == 1_000_000
    assert settings.state_ttl == 1_000_000.0
    assert settings.metrics_port == 9464
    assert settings.metrics_host == "0.0.0.0"
    assert settings.signing_key_file == "/etc/spanguard/secrets/signing-key"


def test_template_secrets_from_values(helm: Path) -> None:
    docs = render(
        helm,
        "signingKey.value=s3cret-signing-key-0123",
        "pagerduty.routingKey=R0UTING",
        "pagerduty.url=https://events.example/",
        "pagerduty.traceUrlTemplate=https://tempo.example/trace/{trace_id}",
    )
    worker = container(docs)
    env = env_of(worker)
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    assert set(secrets) == {f"{FULLNAME}-signing-key", f"{FULLNAME}-pagerduty"}
    decoded = base64.b64decode(secrets[f"{FULLNAME}-signing-key"]["data"]["signing-key"])
    assert decoded == b"s3cret-signing-key-0123"
    decoded = base64.b64decode(secrets[f"{FULLNAME}-pagerduty"]["data"]["routing-key"])
    assert decoded == b"R0UTING"

    # Both keys are files in the mounted secrets directory; the env names them.
    assert env["SPANGUARD_SIGNING_KEY_FILE"] == "/etc/spanguard/secrets/signing-key"
    assert (
        env["SPANGUARD_PAGERDUTY_ROUTING_KEY_FILE"]
        == "/etc/spanguard/secrets/pagerduty-routing-key"
    )
    assert env["SPANGUARD_PAGERDUTY_URL"] == "https://events.example/"
    assert env["SPANGUARD_TRACE_URL_TEMPLATE"] == "https://tempo.example/trace/{trace_id}"
    mounts = {m["name"]: m for m in worker["volumeMounts"]}
    assert mounts["secrets"]["mountPath"] == "/etc/spanguard/secrets"
    assert mounts["secrets"]["readOnly"] is True
    pod = only(docs, "StatefulSet")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "secrets"]
    sources = {s["secret"]["name"]: s["secret"]["items"] for s in volume["projected"]["sources"]}
    assert sources == {
        f"{FULLNAME}-signing-key": [{"key": "signing-key", "path": "signing-key"}],
        f"{FULLNAME}-pagerduty": [{"key": "routing-key", "path": "pagerduty-routing-key"}],
    }
    assert volume["projected"]["defaultMode"] & 0o007 == 0  # not world-readable
    # The keys' values never appear outside their Secrets.
    rendered = json.dumps([d for d in docs if d["kind"] != "Secret"])
    assert "s3cret-signing-key-0123" not in rendered and "R0UTING" not in rendered


def test_template_existing_secrets_and_policy(helm: Path) -> None:
    docs = render(
        helm,
        "signingKey.existingSecret=team-signing",
        "signingKey.key=hmac",
        "pagerduty.existingSecret=team-pd",
        "existingPolicyConfigMap.name=team-policy",
        "existingPolicyConfigMap.key=guard.yaml",
    )
    assert not [d for d in docs if d["kind"] in ("Secret", "ConfigMap")]
    env = env_of(container(docs))
    assert env["SPANGUARD_POLICY"] == "/etc/spanguard/policy/guard.yaml"
    assert env["SPANGUARD_SIGNING_KEY_FILE"] == "/etc/spanguard/secrets/signing-key"
    pod = only(docs, "StatefulSet")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["policy"]["configMap"]["name"] == "team-policy"
    sources = [s["secret"] for s in volumes["secrets"]["projected"]["sources"]]
    assert sources == [
        {"name": "team-signing", "items": [{"key": "hmac", "path": "signing-key"}]},
        {"name": "team-pd", "items": [{"key": "routing-key", "path": "pagerduty-routing-key"}]},
    ]


def test_template_webhook_from_values_and_from_an_existing_secret(helm: Path) -> None:
    url = "https://hooks.slack.com/services/T0/B0/S3CRET"
    docs = render(helm, f"webhook.url={url}", "webhook.template=slack", "worker.deadAfter=90")
    env = env_of(container(docs))
    unknown = {k for k in env if k.startswith(ENV_PREFIX)} - KNOWN_ENV
    assert not unknown, f"not in the settings registry: {unknown}"
    assert env["SPANGUARD_WEBHOOK_URL_FILE"] == "/etc/spanguard/secrets/webhook-url"
    assert env["SPANGUARD_WEBHOOK_TEMPLATE"] == "slack"
    assert "SPANGUARD_WEBHOOK_SIGNING_KEY_FILE" not in env
    dead_after = {"SPANGUARD_DEAD_AFTER": env["SPANGUARD_DEAD_AFTER"]}
    assert WorkerSettings.from_sources({}, dead_after).dead_after == 90.0
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    stored = secrets[f"{FULLNAME}-webhook"]["data"]["webhook-url"]
    assert base64.b64decode(stored).decode() == url
    # The URL is a credential: it appears in its Secret only.
    assert "S3CRET" not in json.dumps([d for d in docs if d["kind"] != "Secret"])

    docs = render(
        helm,
        "webhook.existingSecret=team-hook",
        "webhook.key=url",
        "webhook.signingKeyKey=hmac",
    )
    assert f"{FULLNAME}-webhook" not in {d["metadata"]["name"] for d in docs}
    env = env_of(container(docs))
    assert env["SPANGUARD_WEBHOOK_TEMPLATE"] == "json"
    assert env["SPANGUARD_WEBHOOK_SIGNING_KEY_FILE"] == "/etc/spanguard/secrets/webhook-signing-key"
    pod = only(docs, "StatefulSet")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "secrets"]
    sources = {s["secret"]["name"]: s["secret"]["items"] for s in volume["projected"]["sources"]}
    assert sources["team-hook"] == [
        {"key": "url", "path": "webhook-url"},
        {"key": "hmac", "path": "webhook-signing-key"},
    ]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["webhook.url=http://hooks.example/x"], "does not match pattern"),
        (["webhook.url=https://a", "webhook.existingSecret=s"], "not both"),
        (["webhook.url=https://a", "webhook.signingKeyKey=k"], "names a key of"),
        (["webhook.template=teams"], "webhook/template"),
    ],
)
def test_template_refuses_a_bad_webhook(helm: Path, values: list[str], message: str) -> None:
    proc = run_helm(helm, "template", RELEASE, str(CHART), *(f"--set={v}" for v in values))
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_template_without_policy_or_persistence(helm: Path) -> None:
    docs = render(helm, "policy=", "persistence.enabled=false", "replicaCount=8")
    assert not [d for d in docs if d["kind"] == "ConfigMap"]
    sts = only(docs, "StatefulSet")
    assert sts["spec"]["replicas"] == 8
    assert "volumeClaimTemplates" not in sts["spec"]
    env = env_of(container(docs))
    assert "SPANGUARD_POLICY" not in env  # the built-in defaults
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["data"] == {"name": "data", "emptyDir": {}}


def test_topics_job_hook(helm: Path) -> None:
    docs = render(helm, "kafka.partitions=12", "kafka.replicationFactor=3")
    job = only(docs, "Job")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install"
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["spanguard"] and c["args"] == ["topics", "create"]
    job_env = env_of(c)
    worker_env = env_of(container(docs))
    assert job_env["SPANGUARD_PARTITIONS"] == "12"
    assert job_env["SPANGUARD_SCOPE_PARTITIONS"] == "2"
    assert job_env["SPANGUARD_REPLICATION_FACTOR"] == "3"
    # The same settings as the worker, so the topics are the ones it reads and writes.
    assert {k: v for k, v in worker_env.items() if k in job_env} == job_env
    assert job["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert not [d for d in render(helm, "topicsJob.enabled=false") if d["kind"] == "Job"]


def test_generated_signing_keys_differ_and_unsigned_is_an_explicit_choice(helm: Path) -> None:
    def key_of(docs: list[dict[str, Any]]) -> bytes:
        secret = only(docs, "Secret", f"{FULLNAME}-signing-key")
        return base64.b64decode(secret["data"]["signing-key"])

    assert key_of(render(helm)) != key_of(render(helm))  # random, not a constant of the chart
    unsigned = render(helm, "worker.allowUnsigned=true")
    assert not [d for d in unsigned if d["kind"] == "Secret"]
    env = env_of(container(unsigned))
    assert env["SPANGUARD_ALLOW_UNSIGNED"] == "true" and "SPANGUARD_SIGNING_KEY_FILE" not in env
    assert WorkerSettings.from_sources({}, env).kill_signing_key() is None
    # A key given wins over the insecure setting: signals stay signed.
    signed = env_of(
        container(render(helm, "worker.allowUnsigned=true", "signingKey.value=" + "k" * 32))
    )
    assert "SPANGUARD_ALLOW_UNSIGNED" not in signed and "SPANGUARD_SIGNING_KEY_FILE" in signed


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["signingKey.generate=false"], "kill signals are signed: set signingKey.value"),
        (["signingKey.value=short"], "signingKey.value has 5 bytes; the worker needs at least 16"),
    ],
)
def test_a_chart_without_a_usable_key_does_not_render(helm: Path, sets, message) -> None:
    assert_template_refused(helm, ["template", RELEASE, str(CHART)], sets, message)


def test_replicas_above_partitions_fail(helm: Path) -> None:
    assert_template_refused(
        helm,
        ["template", RELEASE, str(CHART)],
        ["replicaCount=9", "kafka.partitions=8"],
        "replicaCount (9) must not exceed kafka.partitions (8)",
    )


def test_autoscaling_on_consumer_lag_never_past_the_partitions(helm: Path) -> None:
    """Off by default (the StatefulSet keeps replicaCount); on, a KEDA ScaledObject scales the
    StatefulSet on the workers' lag metric, at most to the partition count, and the StatefulSet
    leaves its replicas to it."""
    assert not [d for d in render(helm) if d["kind"] == "ScaledObject"]
    prometheus = "http://prometheus-operated.monitoring.svc:9090"
    docs = render(
        helm,
        "autoscaling.enabled=true",
        f"autoscaling.prometheus.serverAddress={prometheus}",
        "kafka.partitions=12",
        "autoscaling.minReplicas=2",
    )
    scaled = only(docs, "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": only(docs, "StatefulSet")["metadata"]["name"],
    }
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 12)  # 0 = the partitions
    assert "replicas" not in only(docs, "StatefulSet")["spec"]
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    meta = trigger["metadata"]
    assert meta["serverAddress"] == prometheus
    assert meta["threshold"] == "20000"
    # The metric the worker exports (streams/metrics.py), for this release's pods and the two
    # topics the span agent reads.
    query = promql_parser.parse(meta["query"])
    assert "spanguard_consumer_lag" in meta["query"], meta["query"]
    assert f'job="{FULLNAME}-metrics"' in meta["query"]
    assert 'namespace="agents"' in meta["query"]
    assert 'topic=~"otlp_spans|spanguard-otlp-repartition"' in meta["query"]
    assert query is not None
    # A cap below the partitions is kept as given.
    capped = only(
        render(
            helm,
            "autoscaling.enabled=true",
            f"autoscaling.prometheus.serverAddress={prometheus}",
            "autoscaling.maxReplicas=4",
        ),
        "ScaledObject",
    )
    assert capped["spec"]["maxReplicaCount"] == 4


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ["autoscaling.maxReplicas=9", "kafka.partitions=8"],
            "autoscaling.maxReplicas (9) must not exceed kafka.partitions (8)",
        ),
        (
            ["autoscaling.minReplicas=5", "autoscaling.maxReplicas=4"],
            "autoscaling.minReplicas (5) must not exceed autoscaling.maxReplicas (4)",
        ),
        ([], "autoscaling.prometheus.serverAddress is required"),
    ],
)
def test_autoscaling_refuses_more_workers_than_partitions(
    helm: Path, sets: list[str], message: str
) -> None:
    args = ["template", RELEASE, str(CHART), "--set", "autoscaling.enabled=true"]
    if not any("serverAddress" in s for s in sets) and "serverAddress" not in message:
        args += ["--set", "autoscaling.prometheus.serverAddress=http://prometheus:9090"]
    assert_template_refused(helm, args, sets, message)


def test_values_schema_rejects_typos(helm: Path) -> None:
    for setting, message in (
        ("kafka.bootstap=kafka:9092", "additional properties 'bootstap' not allowed"),
        ("worker.store=disk", "value must be one of 'rocksdb', 'memory'"),
        ("kafka.bootstrap=kafka", "/kafka/bootstrap"),
    ):
        proc = run_helm(helm, "template", RELEASE, str(CHART), "--set", setting)
        assert proc.returncode != 0, setting
        assert message in proc.stderr, (setting, proc.stderr)


def test_monitoring_ships_behind_its_flags(helm: Path) -> None:
    """Dashboard, ServiceMonitor and PrometheusRule: off by default, each on by its own flag,
    lint-clean, and wired to the metrics Service (the metric names themselves are checked
    against a real worker in tests/streams/test_metrics_kafka.py)."""
    lint = run_helm(helm, "lint", "--strict", str(CHART), "--set", ",".join(MONITORING_ON))
    assert lint.returncode == 0, lint.stdout + lint.stderr
    monitoring = {"ServiceMonitor", "PrometheusRule"}
    assert not [d for d in render(helm) if d["kind"] in monitoring]
    assert not [d for d in render(helm) if d["metadata"]["name"].endswith("-dashboard")]
    # A fixed key: without one the chart generates a new random Secret on every render.
    key = "signingKey.value=monitoring-test-signing-key-0123"
    for flag, kind in zip(
        MONITORING_ON, ("ConfigMap", "ServiceMonitor", "PrometheusRule"), strict=True
    ):
        added = [d for d in render(helm, key, flag) if d not in render(helm, key)]
        assert [d["kind"] for d in added] == [kind], flag

    docs = render(helm, *MONITORING_ON, "monitoring.serviceMonitor.labels.release=kps")
    dashboard = only(docs, "ConfigMap", f"{FULLNAME}-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(dashboard["data"]["spanguard.json"])
    assert shipped == json.loads((CHART / "dashboards" / "spanguard.json").read_text())
    titles = " ".join(panel["title"] for panel in shipped["panels"]).lower()
    for topic in ("decisions per minute", "service", "active traces", "consumer lag",
                  "dead letters", "detection latency"):  # fmt: skip
        assert topic in titles, topic

    # The ServiceMonitor selects the metrics Service only (the headless one would scrape twice).
    monitor = only(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kps"
    services = [d for d in docs if d["kind"] == "Service"]
    selected = [
        svc["metadata"]["name"]
        for svc in services
        if monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    ]
    assert selected == [f"{FULLNAME}-metrics"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"

    rule = only(docs, "PrometheusRule")
    alerts = {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}
    assert set(alerts) == ALERTS
    assert alerts["SpanguardConsumerLagGrowing"]["for"] == "5m"
    for name, alert in alerts.items():
        promql_parser.parse(alert["expr"])  # raises on an expression Prometheus would refuse
        # The ServiceMonitor's job: Prometheus Operator names it after the scraped Service.
        assert f'job="{FULLNAME}-metrics", namespace="agents"' in alert["expr"], name
        assert alert["labels"]["severity"] in ("critical", "warning"), name


def test_the_fetch_stall_alert_warns_on_stalls_in_15_minutes(helm: Path) -> None:
    """A stall is recovered by the fetch watch's seek in about 20 s: the alert is a warning on
    stalls of one kind counted in 15 minutes, above a threshold the values set (default 0)."""

    def stall_alert(*sets: str) -> dict:
        rule = only(render(helm, *MONITORING_ON, *sets), "PrometheusRule")
        (alert,) = [
            r
            for group in rule["spec"]["groups"]
            for r in group["rules"]
            if r["alert"] == "SpanguardFetchStalls"
        ]
        return alert

    alert = stall_alert()
    assert alert["labels"]["severity"] == "warning"
    assert "for" not in alert  # a counted stall is over already: no pending period
    expr = alert["expr"]
    assert expr.startswith("sum by (namespace, what) (increase(spanguard_fetch_stalls_total{")
    assert expr.endswith("}[15m])) > 0"), expr
    assert "$labels.what" in alert["annotations"]["description"]
    assert "docs/operating.md" in alert["annotations"]["description"]
    assert stall_alert("monitoring.prometheusRule.fetchStallThreshold=3")["expr"].endswith("> 3")
    negative = ",".join([*MONITORING_ON, "monitoring.prometheusRule.fetchStallThreshold=-1"])
    proc = run_helm(helm, "template", RELEASE, str(CHART), "--set", negative)
    assert proc.returncode != 0 and "fetchStallThreshold" in proc.stderr, proc.stderr


# ---------------------------------------------------------------- docker compose


def compose_command() -> list[str]:
    if shutil.which("docker") is not None:
        probe = subprocess.run(
            ["docker", "compose", "version"], capture_output=True, text=True, timeout=30
        )
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose") is not None:
        return ["docker-compose"]
    # No plugin: Compose v2 built from its Go module (scripts/compose.sh), as helm is.
    if shutil.which("go") is None:
        pytest.skip("no compose plugin, no docker-compose and no go to build it with")
    proc = subprocess.run(
        [str(ROOT / "scripts" / "compose.sh"), "path"], capture_output=True, text=True, timeout=1200
    )
    assert proc.returncode == 0, proc.stderr
    return [proc.stdout.strip()]


def test_docker_compose_config() -> None:
    command = compose_command()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPANGUARD_", "COMPOSE_"))}
    proc = subprocess.run(
        [*command, "-f", str(COMPOSE), "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    services = json.loads(proc.stdout)["services"]
    assert set(services) >= {"kafka", "topics", "collector", "worker"}
    assert services["collector"]["environment"]["KAFKA_BROKERS"] == "kafka:9092"
    assert services["worker"]["depends_on"]["topics"]["condition"] == (
        "service_completed_successfully"
    )


def test_compose_file_wiring() -> None:
    """What `docker compose config` does not check: the files it mounts exist, and the
    services agree on broker, topic and ports (plain YAML, no docker needed)."""
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert set(services) == {
        "kafka",
        "topics",
        "signing-key",
        "collector",
        "worker",
        "research-agent",
        "support-agent",
    }
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume["source"] if isinstance(volume, dict) else volume.split(":")[0]
            # ${VAR:-default} -> default: the file mounted when the variable is unset
            source = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", source)
            if source.startswith("."):
                assert (ROOT / source).is_file(), f"{name} mounts missing {source}"

    collector = services["collector"]
    assert "./deploy/collector/config.yaml:/etc/spanguard/collector.yaml:ro" in collector["volumes"]
    assert "0.165." in collector["image"]
    assert {"4317:4317", "4318:4318"} <= set(collector["ports"])
    assert collector["environment"]["KAFKA_BROKERS"] == "kafka:9092"

    assert services["topics"]["command"] == ["topics", "create"]
    assert services["worker"]["command"] == ["worker"]
    for name in ("topics", "worker"):
        env = services[name]["environment"]
        assert env["SPANGUARD_BOOTSTRAP"] == "kafka:9092", name
        assert env["SPANGUARD_INPUT_TOPIC"] == collector["environment"]["SPANGUARD_INPUT_TOPIC"]
    worker = services["worker"]
    assert worker["build"]["context"] == "."
    # The worker reads a policy only when SPANGUARD_POLICY is set on the host.
    assert (
        worker["environment"]["SPANGUARD_POLICY"]
        == "${SPANGUARD_POLICY:+/etc/spanguard/policy.yaml}"
    )
    policy_mount, key_mount = worker["volumes"]
    assert policy_mount["type"] == "bind"
    assert policy_mount["target"] == "/etc/spanguard/policy.yaml"
    # Signed: the worker and both agents read the key the signing-key service writes.
    key_file = worker["environment"]["SPANGUARD_SIGNING_KEY_FILE"]
    assert key_mount["source"] == "signing-key" and key_mount["read_only"] is True
    assert key_file.startswith(key_mount["target"] + "/")
    assert key_file in services["signing-key"]["command"][0]
    assert "SPANGUARD_SIGNING_KEY" not in worker["environment"]
    assert worker["depends_on"]["signing-key"]["condition"] == "service_completed_successfully"
    assert services["worker"]["depends_on"]["topics"]["condition"] == (
        "service_completed_successfully"
    )
    for name, agent in (("research-agent", "research"), ("support-agent", "support")):
        service = services[name]
        assert service["entrypoint"] + service["command"] == [
            "python",
            "-m",
            "spanguard.cli.demo",
            "agent",
            agent,
        ]
        assert service["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector:4318"
        assert service["environment"]["SPANGUARD_BOOTSTRAP"] == "kafka:9092"
        assert service["environment"]["SPANGUARD_SIGNING_KEY_FILE"] == key_file
        assert service["volumes"] == [key_mount]
        assert service["depends_on"]["worker"]["condition"] == "service_healthy"
    kafka_env = services["kafka"]["environment"]
    assert "INTERNAL://kafka:9092" in kafka_env["KAFKA_ADVERTISED_LISTENERS"]
    assert kafka_env["KAFKA_PROCESS_ROLES"] == "broker,controller"


# ---------------------------------------------------------------- Dockerfile


def test_dockerfile_and_context() -> None:
    lines = [
        line.strip()
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert lines[0].startswith("FROM python:3.11-slim")
    assert 'ENTRYPOINT ["spanguard"]' in lines and 'CMD ["worker"]' in lines
    (user,) = [line for line in lines if line.startswith("USER ")]
    uid = user.split()[1].split(":")[0]
    assert uid.isdigit() and uid != "0"  # numeric, so runAsNonRoot can verify it
    chart_values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert int(uid) == chart_values["podSecurityContext"]["runAsUser"]
    assert "ARG EXTRAS=worker" in lines
    assert any('pip install -c constraints.txt ".[${EXTRAS}]"' in line for line in lines)
    # The image runs the compiled detection core (setup.py), built with the pinned compiler.
    assert any("SPANGUARD_COMPILE=1" in line and "--no-build-isolation" in line for line in lines)

    # The build context keeps everything `pip install .` needs.
    ignored = [
        p.strip()
        for p in (ROOT / ".dockerignore").read_text().splitlines()
        if p.strip() and not p.startswith("#")
    ]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = ["pyproject.toml", "setup.py", pyproject["project"]["readme"]]
    needed += pyproject["tool"]["setuptools"]["package-dir"].values()
    for path in needed:
        assert not any(fnmatch.fnmatch(path, pattern) for pattern in ignored), path


# The settings a user gets from the chart and from compose are the worker's own defaults, so
# the integration tests (which run the defaults) run what ships.
SHIPPED_DEFAULTS = ("store", "batch_size", "commit_interval", "fetch_max_wait", "state_ttl")


def test_helm_compose_and_worker_defaults_agree(helm: Path) -> None:
    defaults = WorkerSettings()
    chart = WorkerSettings.from_sources(
        {}, {k: v for k, v in env_of(container(render(helm))).items() if isinstance(v, str)}
    )
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    (worker,) = [s for s in compose["services"].values() if "SPANGUARD_STORE" in str(s)]
    environment = {k: str(v) for k, v in worker["environment"].items() if "${" not in str(v)}
    composed = WorkerSettings.from_sources({}, environment)
    for name in SHIPPED_DEFAULTS:
        assert getattr(chart, name) == getattr(defaults, name), f"helm {name}"
        assert getattr(composed, name) == getattr(defaults, name), f"compose {name}"
    assert defaults.store == "rocksdb"


def test_compose_sets_only_registered_settings() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    for name, service in compose["services"].items():
        env = service.get("environment") or {}
        names = set(env) if isinstance(env, dict) else {item.split("=", 1)[0] for item in env}
        unknown = {k for k in names if k.startswith(ENV_PREFIX)} - KNOWN_ENV
        assert not unknown, f"{name}: not in the settings registry: {unknown}"
