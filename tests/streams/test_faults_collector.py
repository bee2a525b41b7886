"""The real Collector SIGKILLed and restarted while spans it accepted still wait for Kafka.

The agents' spans go through the Collector built from deploy/collector/builder-config.yaml
(OTLP/HTTP in, kafka exporter out, partitioned by trace id as it does) into a three-broker
cluster and two shipped workers. The Collector reaches Kafka through a TCP proxy that cuts it
off (connections reset, new ones refused) while the threshold calls arrive: the Collector
answers them 200 and holds them. Then it is SIGKILLed, the network healed, the Collector
restarted.

- With its sending queue on disk (deploy/collector/persistent-queue.yaml, file_storage) the
  restarted Collector sends what it held: every loop is killed at its threshold call. So
  does the packing one (packed.yaml with packed-persistent-queue.yaml).
- Without it (config.yaml alone: batch processor and an in-memory queue) everything it held is
  gone though the agents were told it was delivered: no looping trace whose threshold call was
  held is ever killed. The test asserts that loss too, so the docs' claim stays true.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.faults import (
    COLLECTOR_CONFIG,
    PACKED,
    PACKED_QUEUE,
    PERSISTENT_QUEUE,
    KafkaCluster,
    KillLedger,
    Pipeline,
    RealCollector,
    loops_and_clean,
    processed,
    wait_for_kills,
    wait_processed,
)
from tests.support.kafka_harness import ROOT

pytestmark = pytest.mark.kafka

LOOPS = 8
CLEAN = 4
CONFIG = ROOT / "deploy" / "collector" / "config.yaml"
PERSISTENT = ROOT / "deploy" / "collector" / "persistent-queue.yaml"


def run(kafka: KafkaCluster, tmp_path: Path, persistent: bool, packed: bool = False) -> None:
    proxied, proxies = kafka.proxied()
    pipeline = Pipeline(kafka, tmp_path)
    otelcol = None
    try:
        pipeline.start()
        # One bootstrap broker, reached through its proxy; the others come from its metadata,
        # advertised on the proxied listener: every connection of the Collector is proxied.
        otelcol = RealCollector(
            tmp_path / "otelcol",
            proxied.bootstrap.split(",")[0],
            pipeline.topics.input,
            persistent,
            packed,
        ).up()
        loops, clean = loops_and_clean(LOOPS, CLEAN)
        ledger = KillLedger(loops, clean)
        everyone = loops + clean
        otelcol.export(everyone, slice(0, 2))
        wait_processed(pipeline.workers, 2 * len(everyone))

        for proxy in proxies:
            proxy.cut()
        held = otelcol.export(everyone, slice(2, 8))  # answered 200, held by the Collector
        time.sleep(1.0)  # past the batch timeout: the spans sit in the exporter's queue
        killed = time.monotonic()
        otelcol.kill()
        for proxy in proxies:
            proxy.heal()
        otelcol.up()
        label = "file_storage" if persistent else "in-memory queue"
        if persistent:
            done = wait_for_kills(ledger, pipeline.collector, timeout=180)
            wait_processed(pipeline.workers, 8 * len(everyone), timeout=120)
            time.sleep(3)
            ledger.read(pipeline.collector)
            print(
                "\n"
                + ledger.summary(f"Collector SIGKILLed holding {held} spans ({label})",
                                 done - killed)
                + f"; spans processed {processed(*pipeline.workers):.0f} of {8 * len(everyone)}"
            )  # fmt: skip
            ledger.check()
        else:
            time.sleep(20)  # what the restarted Collector would send, it has sent by now
            ledger.read(pipeline.collector)
            seen = processed(*pipeline.workers)
            print(
                "\n"
                + ledger.summary(f"Collector SIGKILLed holding {held} spans ({label})", None)
                + f"; spans processed {seen:.0f} of {8 * len(everyone)}"
            )
            assert len(ledger.lost) == LOOPS, "the in-memory queue kept spans across a SIGKILL?"
            assert seen == 2 * len(everyone)
    finally:
        if otelcol is not None:
            otelcol.down()
        pipeline.close()
        for proxy in proxies:
            proxy.close()


def test_collector_sigkilled_with_its_queue_on_disk_loses_no_span(
    kafka_cluster: KafkaCluster, tmp_path
) -> None:
    run(kafka_cluster, tmp_path, persistent=True)


def test_the_packing_collector_sigkilled_with_its_queue_on_disk_loses_no_span(
    kafka_cluster: KafkaCluster, tmp_path
) -> None:
    """The same through spanguard_pack (packed.yaml, packed-persistent-queue.yaml): what it
    held is sent after the restart, packed by partition and decided where it lands."""
    run(kafka_cluster, tmp_path, persistent=True, packed=True)


@pytest.mark.faults
def test_collector_sigkilled_with_its_queue_in_memory_loses_what_it_held(
    kafka_cluster: KafkaCluster, tmp_path
) -> None:
    run(kafka_cluster, tmp_path, persistent=False)


def test_the_persistent_queue_overlay_validates(tmp_path) -> None:
    """persistent-queue.yaml over config.yaml is a config the built Collector accepts (it has
    the file_storage extension), and it takes the batch processor out of the pipeline."""
    import yaml

    overlay = yaml.safe_load(PERSISTENT_QUEUE.read_text(encoding="utf-8"))
    assert overlay["service"]["pipelines"]["traces"]["processors"] == []
    assert overlay["exporters"]["kafka"]["sending_queue"]["storage"] == "file_storage/queue"
    binary = subprocess.run(
        [str(ROOT / "scripts" / "collector.sh"), "path"],
        capture_output=True, text=True, timeout=900, check=True,
    ).stdout.strip()  # fmt: skip
    result = subprocess.run(
        [binary, "validate", "--config", str(COLLECTOR_CONFIG), "--config", str(PERSISTENT_QUEUE)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SPANGUARD_COLLECTOR_QUEUE_DIR": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr


def test_the_packing_queue_overlay_validates(tmp_path) -> None:
    """packed-persistent-queue.yaml gives spanguard_pack the stock exporter's queue on disk,
    and the four files together are a config the built Collector accepts."""
    import yaml

    stock = yaml.safe_load(PERSISTENT_QUEUE.read_text(encoding="utf-8"))
    packed = yaml.safe_load(PACKED_QUEUE.read_text(encoding="utf-8"))
    queue = packed["exporters"]["spanguard_pack"]["sending_queue"]
    assert queue == stock["exporters"]["kafka"]["sending_queue"]
    binary = subprocess.run(
        [str(ROOT / "scripts" / "collector.sh"), "path"],
        capture_output=True, text=True, timeout=900, check=True,
    ).stdout.strip()  # fmt: skip
    configs = [COLLECTOR_CONFIG, PERSISTENT_QUEUE, PACKED, PACKED_QUEUE]
    result = subprocess.run(
        [binary, "validate", *(arg for c in configs for arg in ("--config", str(c)))],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SPANGUARD_COLLECTOR_QUEUE_DIR": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr
