"""The real OpenTelemetry Collector that spanguard ships (deploy/collector/).

The binary is built by scripts/collector.sh with the OpenTelemetry Collector Builder from the Go
module proxy (cached outside the repo; the first build takes a few minutes). `validate` checks
the shipped config and rejects broken ones; the end-to-end test sends spans with the real
OpenTelemetry SDK's OTLP/HTTP exporter to a Collector started by the script, and reads what the
kafka exporter wrote to a fresh topic of the real broker.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "collector.sh"
MANIFEST = ROOT / "deploy" / "collector" / "builder-config.yaml"
CONFIG = ROOT / "deploy" / "collector" / "config.yaml"
PACKED = ROOT / "deploy" / "collector" / "packed.yaml"
BUILD_TIMEOUT = 1800  # a cold first build on 2 cores: modules download + compile


@pytest.fixture(scope="module")
def binary() -> Path:
    """The Collector binary (built once, then reused from the cache)."""
    result = subprocess.run(
        [str(SCRIPT), "path"], capture_output=True, text=True, timeout=BUILD_TIMEOUT
    )
    if result.returncode != 0:
        if shutil.which("go") is None:
            pytest.skip(
                "the Collector is built from Go modules and `go` is not on PATH "
                f"(install Go >= 1.26); {result.stderr.strip()}"
            )
        pytest.fail(f"scripts/collector.sh path failed:\n{result.stdout}\n{result.stderr}")
    path = Path(result.stdout.strip().splitlines()[-1])
    assert path.is_file() and os.access(path, os.X_OK), path
    return path


def validate(binary: Path, *configs: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """`otelcol validate` of `configs`, each laid over the ones before it."""
    return subprocess.run(
        [
            str(binary),
            "validate",
            *(arg for config in configs for arg in ("--config", str(config))),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )


def exporting_to_collector(service: str, http_port: int) -> TracerProvider:
    """A tracer provider for `service` whose spans go to the Collector's OTLP/HTTP port."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{http_port}/v1/traces", timeout=10)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


# ------------------------------------------------------------------ the binary and its config


def test_binary_has_the_manifests_components_at_their_pinned_versions(binary: Path):
    pins = dict(
        re.findall(r"gomod:\s*(\S+)\s+(v\d+\.\d+\.\d+)", MANIFEST.read_text(encoding="utf-8"))
    )
    components = subprocess.run(
        [str(binary), "components"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    for module in (
        "go.opentelemetry.io/collector/receiver/otlpreceiver",
        "go.opentelemetry.io/collector/processor/batchprocessor",
        "github.com/open-telemetry/opentelemetry-collector-contrib/exporter/kafkaexporter",
    ):
        assert f"module: {module} {pins[module]}" in components, components
    # spanguard's own exporter, built from this checkout (the manifest's `path`).
    assert "name: spanguard_pack" in components, components
    # One release: core v0.X.0 with its stable v1 modules, contrib v0.X.y.
    minors = {
        v.split(".")[1]
        for m, v in pins.items()
        if v.startswith("v0.") and not m.startswith("spanguard.dev/")
    }
    assert len(minors) == 1, pins
    # The exporter's own module builds against the same core release.
    gomod = (ROOT / "deploy" / "collector" / "packexporter" / "go.mod").read_text("utf-8")
    core = pins["go.opentelemetry.io/collector/receiver/otlpreceiver"]
    for module, version in re.findall(r"(go\.opentelemetry\.io/collector/\S+) (v\S+)", gomod):
        assert version.startswith(("v1.", core)), (module, version, core)


ARGS_HASH = ROOT / "deploy" / "collector" / "args-hash.yaml"


def test_the_args_hash_overlay_validates_where_the_transform_processor_is_built(binary: Path):
    """deploy/collector/args-hash.yaml needs contrib's transform processor, which this build
    cannot include (its modules are refused by the module proxy here); a binary that has it
    must accept the overlay laid over the shipped config."""
    import yaml

    overlay = yaml.safe_load(ARGS_HASH.read_text(encoding="utf-8"))
    processors = overlay["service"]["pipelines"]["traces"]["processors"]
    assert set(processors) <= set(overlay["processors"]) | {"batch"}
    components = subprocess.run(
        [str(binary), "components"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    if "name: transform" not in components:
        pytest.skip("this Collector build has no transform processor (see args-hash.yaml)")
    result = validate(binary, CONFIG, ARGS_HASH)
    assert result.returncode == 0, result.stderr


def test_validate_passes_on_the_shipped_config(binary: Path):
    result = validate(binary, CONFIG)
    assert result.returncode == 0, result.stderr


def test_the_packed_overlay_validates_over_the_shipped_config(binary: Path):
    result = validate(binary, CONFIG, PACKED)
    assert result.returncode == 0, result.stderr


def test_validate_passes_with_the_environment_overrides(binary: Path):
    result = validate(
        binary,
        CONFIG,
        OTLP_GRPC_ENDPOINT="127.0.0.1:14317",
        OTLP_HTTP_ENDPOINT="127.0.0.1:14318",
        KAFKA_BROKERS="127.0.0.1:19092",
        SPANGUARD_INPUT_TOPIC="some-prefix-otlp_spans",
        OTELCOL_METRICS_PORT="18888",
        OTELCOL_METRICS_LEVEL="none",
    )
    assert result.returncode == 0, result.stderr


def test_the_script_validates_the_shipped_config():
    if shutil.which("go") is None and not _cached():
        pytest.skip("`go` is not on PATH and the Collector binary is not cached")
    result = subprocess.run(
        [str(SCRIPT), "validate"], capture_output=True, text=True, timeout=BUILD_TIMEOUT
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        pytest.param(
            "partition_traces_by_id: false",
            "partition_traces_by_idd: false",
            "has invalid keys: partition_traces_by_idd",
            id="unknown-exporter-key",
        ),
        pytest.param(
            "protocol_version: 2.1.0",
            "protocol_version: 99.1.0",
            "invalid protocol version",
            id="bad-protocol-version",
        ),
        pytest.param(
            "exporters: [kafka]",
            "exporters: [kafka/missing]",
            "kafka/missing",
            id="pipeline-names-a-missing-exporter",
        ),
    ],
)
def test_validate_rejects_a_broken_config(
    binary: Path, tmp_path: Path, old: str, new: str, message: str
):
    text = CONFIG.read_text(encoding="utf-8")
    assert old in text
    broken = tmp_path / "config.yaml"
    broken.write_text(text.replace(old, new), encoding="utf-8")
    result = validate(binary, broken)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def _cached() -> bool:
    result = subprocess.run([str(SCRIPT), "status"], capture_output=True, text=True, timeout=30)
    return "(built)" in result.stdout


# ------------------------------------------------------------------ end to end, real Kafka


@pytest.mark.kafka
def test_sdk_spans_reach_kafka_as_whole_batches(binary: Path, tmp_path: Path):
    pytest.importorskip(
        "opentelemetry.exporter.otlp.proto.http.trace_exporter",
        reason="needs opentelemetry-exporter-otlp-proto-http (the project's dev extra)",
    )
    from confluent_kafka.admin import AdminClient, NewTopic
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    from tests.support.kafka_harness import CLUSTER, ensure_broker, free_port
    from tests.support.kafka_harness import Collector as TopicReader

    bootstrap = ensure_broker()
    topic = f"t{uuid.uuid4().hex[:8]}-otlp_spans"
    admin = AdminClient(CLUSTER.config())
    for future in admin.create_topics([NewTopic(topic, num_partitions=3)]).values():
        future.result(timeout=30)

    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    env = {
        **os.environ,
        "OTLP_HTTP_ENDPOINT": f"127.0.0.1:{http_port}",
        "OTLP_GRPC_ENDPOINT": f"127.0.0.1:{grpc_port}",
        "OTELCOL_METRICS_PORT": str(metrics_port),
        "KAFKA_BROKERS": bootstrap,
        "SPANGUARD_INPUT_TOPIC": topic,
        "COLLECTOR_STATE_DIR": str(tmp_path / "collector"),
    }

    def script(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=BUILD_TIMEOUT
        )

    reader = None
    provider = None
    up = script("up")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert script("up").returncode == 0  # idempotent
        assert script("status").returncode == 0

        reader = TopicReader(topic)
        provider = exporting_to_collector("collector-e2e", http_port)
        tracer = provider.get_tracer("tests.test_collector")
        expected: dict[str, set[str]] = {}  # trace id hex -> span names
        for agent, calls in (("looping-agent", 5), ("research-agent", 3)):
            with tracer.start_as_current_span(f"invoke_agent {agent}") as root:
                for i in range(calls):
                    with tracer.start_as_current_span(f"execute_tool search-{i}") as child:
                        child.set_attribute("gen_ai.tool.name", "search")
            trace_id = format(root.get_span_context().trace_id, "032x")
            expected[trace_id] = {f"invoke_agent {agent}"} | {
                f"execute_tool search-{i}" for i in range(calls)
            }
        sent = time.monotonic()
        assert provider.force_flush(timeout_millis=10_000)

        seen: dict[str, set[str]] = {}
        records: list[set[str]] = []
        deadline = time.monotonic() + 30
        while seen != expected and time.monotonic() < deadline:
            time.sleep(0.05)
            seen, records = {}, []
            for message in reader.where(lambda m: True):
                # partition_traces_by_id off: a batch is one unkeyed record, traces together;
                # the worker re-keys them (streams/delivery.py).
                assert message["key"] is None, message["key"]
                request = ExportTraceServiceRequest.FromString(message["value"])
                spans = [
                    span
                    for resource_spans in request.resource_spans
                    for scope_spans in resource_spans.scope_spans
                    for span in scope_spans.spans
                ]
                assert spans, request
                assert {
                    attr.value.string_value
                    for resource_spans in request.resource_spans
                    for attr in resource_spans.resource.attributes
                    if attr.key == "service.name"
                } == {"collector-e2e"}
                for span in spans:
                    seen.setdefault(span.trace_id.hex(), set()).add(span.name)
                records.append({span.trace_id.hex() for span in spans})
        latency = time.monotonic() - sent
        assert seen == expected, f"after {latency:.1f}s: {seen} != {expected}"
        # One flush of the SDK, well inside the batch timeout: both traces in one record.
        assert len(records) == 1 and records[0] == set(expected), records
        print(f"OTLP/HTTP flush -> all spans read back from Kafka in {latency * 1000:.0f} ms")
    finally:
        if provider is not None:
            provider.shutdown()
        if reader is not None:
            reader.close()
        down = script("down")
        admin.delete_topics([topic])
    assert down.returncode == 0, down.stdout + down.stderr
    assert script("status").returncode == 1, "the Collector is still running after down"
    log = (tmp_path / "collector" / "collector.log").read_text(errors="replace")
    assert "Everything is ready" in log, log
    assert "\terror\t" not in log, log


@pytest.mark.kafka
def test_the_packed_collector_writes_one_marked_record_per_partition(binary: Path, tmp_path: Path):
    """deploy/collector/packed.yaml: a batch of many traces reaches the topic as one record per
    partition, on the partition the worker's FNV-1a gives each of its traces, marked with it;
    the partition count (3 here) is the topic's, which no setting names."""
    pytest.importorskip(
        "opentelemetry.exporter.otlp.proto.http.trace_exporter",
        reason="needs opentelemetry-exporter-otlp-proto-http (the project's dev extra)",
    )
    from confluent_kafka.admin import AdminClient, NewTopic
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    from spanguard.streams.agents.guard_spans import HEADER_PACK
    from spanguard.streams.partitioner import collector_partition
    from tests.support.kafka_harness import CLUSTER, collector_env, ensure_broker
    from tests.support.kafka_harness import Collector as TopicReader

    partitions = 3
    bootstrap = ensure_broker()
    topic = f"t{uuid.uuid4().hex[:8]}-otlp_spans"
    admin = AdminClient(CLUSTER.config())
    for future in admin.create_topics([NewTopic(topic, num_partitions=partitions)]).values():
        future.result(timeout=30)
    env, http_port = collector_env(
        bootstrap, topic, tmp_path / "collector", OTELCOL_METRICS_LEVEL="none"
    )
    up = subprocess.run(
        [str(SCRIPT), "up", str(CONFIG), str(PACKED)],
        capture_output=True, text=True, env=env, timeout=BUILD_TIMEOUT,
    )  # fmt: skip
    reader = provider = None
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        reader = TopicReader(topic)
        provider = exporting_to_collector("collector-pack", http_port)
        tracer = provider.get_tracer("tests.test_collector")
        expected: dict[str, int] = {}  # trace id hex -> spans
        for agent in range(12):
            with tracer.start_as_current_span(f"invoke_agent agent-{agent}") as root:
                for call in range(3):
                    with tracer.start_as_current_span(f"execute_tool search-{call}"):
                        pass
            expected[format(root.get_span_context().trace_id, "032x")] = 4
        assert provider.force_flush(timeout_millis=10_000)

        seen: dict[str, int] = {}
        deadline = time.monotonic() + 30
        while seen != expected and time.monotonic() < deadline:
            time.sleep(0.05)
            seen = {}
            messages = reader.where(lambda m: True)
            for message in messages:
                mark = message["headers"].get(HEADER_PACK)
                assert mark == f"{message['partition']}/{partitions}".encode(), message
                request = ExportTraceServiceRequest.FromString(message["value"])
                for resource_spans in request.resource_spans:
                    for scope_spans in resource_spans.scope_spans:
                        for span in scope_spans.spans:
                            trace_id = span.trace_id.hex()
                            home = collector_partition(trace_id.encode(), partitions)
                            assert home == message["partition"], (trace_id, message["partition"])
                            seen[trace_id] = seen.get(trace_id, 0) + 1
        assert seen == expected
        # One SDK flush is one batch: one record on each partition its traces live on.
        homes = {collector_partition(t.encode(), partitions) for t in expected}
        assert sorted(m["partition"] for m in messages) == sorted(homes)
    finally:
        if provider is not None:
            provider.shutdown()
        if reader is not None:
            reader.close()
        subprocess.run([str(SCRIPT), "down"], capture_output=True, env=env, timeout=60)
        admin.delete_topics([topic])
    log = (tmp_path / "collector" / "collector.log").read_text(errors="replace")
    assert "\terror\t" not in log, log
