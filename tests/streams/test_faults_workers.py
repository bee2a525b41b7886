"""A worker that freezes, and one cut off from the brokers, on a three-broker cluster.

Both are zombies: a worker whose partitions moved to the other one while it could not act, that
then wakes up with what it had fetched and decided. Neither may send a second decision for a
trace nor write stale state: after it is back, the loops go on with more identical calls, and a
worker that took a partition back with a stale state (not killed, fewer calls) would kill them a
second time. Shipped defaults: the session timeout is 30 s, so each test takes a minute or two.
"""

from __future__ import annotations

import time

import pytest

from tests.support.faults import (
    SHIPPED_PARTITIONS,
    KafkaCluster,
    KillLedger,
    Pipeline,
    freeze,
    loops_and_clean,
    processed,
    thaw,
    unconsumed,
    wait_for_kills,
    wait_processed,
)

pytestmark = [pytest.mark.kafka, pytest.mark.faults]

LOOPS = 12
CLEAN = 4
CALLS = 12  # 3 before the fault (the threshold call last), 5 during, 4 after the zombie is back
SESSION_TIMEOUT = 30.0  # the worker's shipped session timeout


def progress(workers: list) -> list[dict[str, float]]:
    """What each worker has processed and what it has left: where a stall is."""
    wanted = ("tool_calls_observed", "consumer_lag", "spans_total")
    return [
        {
            name: value
            for name, value in (worker.metrics() or {}).items()
            if any(w in name for w in wanted)
        }
        for worker in workers
    ]


def kills_or_stall(pipeline: Pipeline, ledger: KillLedger, timeout: float) -> float:
    """wait_for_kills; a miss names the partitions the worker holding them all (the other one
    frozen or cut off) has not consumed (partition: lag, None if never fetched)."""
    try:
        return wait_for_kills(ledger, pipeline.collector, timeout=timeout)
    except AssertionError as exc:
        takeover = pipeline.workers[0]
        left = unconsumed(takeover, pipeline.topics.input, SHIPPED_PARTITIONS)
        raise AssertionError(f"{exc}; not consumed by the takeover: {left}") from None


def rescued(workers: list) -> str:
    """What the workers' guards against lost records did: Faust's resume kept records (it
    would have dropped them), and the fetch watch found stalls and sought partitions again."""
    totals: dict[str, float] = {}
    for worker in workers:
        for name, value in (worker.metrics() or {}).items():
            for wanted in ("flow_control_records_kept", "fetch_stalls", "fetch_stall_seeks"):
                if name.startswith(f"spanguard_{wanted}_total"):
                    totals[wanted] = totals.get(wanted, 0) + value
    return ", ".join(f"{name} {value:.0f}" for name, value in sorted(totals.items()))


def after_zombie(pipeline: Pipeline, ledger: KillLedger, everyone: list) -> float:
    """Both workers back in the group, each holding spans partitions: more identical calls
    must not bring a second kill. Returns how long the group took to take the zombie back."""
    from bench.bench_pipeline import wait_for_group

    back = time.monotonic()
    admin = pipeline.kafka.admin()
    wait_for_group(admin, pipeline.topics.app_id, pipeline.topics.input, members=2)
    rejoined = time.monotonic() - back
    before = processed(*pipeline.workers)
    pipeline.spans.send(everyone, slice(8, CALLS))
    pipeline.spans.flush()
    try:
        wait_processed(pipeline.workers, before + 4 * len(everyone), timeout=240)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; per worker: {progress(pipeline.workers)}") from None
    time.sleep(5)  # time for a second kill to show up, were there one
    ledger.read(pipeline.collector)
    return rejoined


def first_two_calls(pipeline: Pipeline) -> tuple[list, list, KillLedger, list]:
    """The loops and clean agents of a run, and their first two calls each, processed: (loops,
    clean, the ledger of their kills, everyone)."""
    loops, clean = loops_and_clean(LOOPS, CLEAN, calls=CALLS)
    everyone = loops + clean
    pipeline.spans.send(everyone, slice(0, 2))
    pipeline.spans.flush()
    wait_processed(pipeline.workers, 2 * len(everyone))
    return loops, clean, KillLedger(loops, clean), everyone


def check_after(pipeline: Pipeline, ledger: KillLedger) -> None:
    """Every worker is still running, and every property of the ledger holds."""
    for worker in pipeline.workers:
        assert worker.process.poll() is None, worker.log_tail()
    ledger.check()


def test_worker_frozen_past_its_session_timeout(kafka_cluster: KafkaCluster, tmp_path) -> None:
    pipeline = Pipeline(kafka_cluster, tmp_path).start()
    try:
        _, _, ledger, everyone = first_two_calls(pipeline)
        time.sleep(2.5)  # past the commit interval

        zombie = pipeline.workers[1]
        # The threshold call arrives and the worker freezes with it fetched, maybe decided,
        # maybe half-written: whatever it holds is stale by the time it wakes.
        pipeline.spans.send(everyone, slice(2, 3))
        pipeline.spans.flush()
        freeze(zombie.process.pid)
        frozen = time.monotonic()
        pipeline.spans.send(everyone, slice(3, 8))
        pipeline.spans.flush()
        done = kills_or_stall(pipeline, ledger, timeout=SESSION_TIMEOUT + 180)
        time.sleep(max(0.0, frozen + SESSION_TIMEOUT + 10 - time.monotonic()))
        thaw(zombie.process.pid)
        thawed = time.monotonic()
        rejoined = after_zombie(pipeline, ledger, everyone)
        print(
            "\n"
            + ledger.summary(
                f"worker SIGSTOPped {thawed - frozen:.0f} s (session timeout {SESSION_TIMEOUT:.0f} s),"
                f" back in the group {rejoined:.0f} s after SIGCONT",
                done - frozen,
            )
            + f"; {rescued(pipeline.workers)}"
        )
        check_after(pipeline, ledger)
    finally:
        pipeline.close()


def test_worker_cut_off_from_the_brokers_then_healed(kafka_cluster: KafkaCluster, tmp_path) -> None:
    proxied, proxies = kafka_cluster.proxied()
    pipeline = Pipeline(kafka_cluster, tmp_path, worker_clusters=(None, proxied))
    try:
        pipeline.start()
        loops, clean, ledger, everyone = first_two_calls(pipeline)
        time.sleep(2.5)

        pipeline.spans.send(everyone, slice(2, 3))
        pipeline.spans.flush()
        for proxy in proxies:  # no byte either way, every connection left open
            proxy.stall()
        cut = time.monotonic()
        pipeline.spans.send(everyone, slice(3, 8))
        pipeline.spans.flush()
        # The other worker takes the partitions after the session timeout; the cut-off one
        # may hold decisions it made before the cut, written to sockets that do not move.
        done: float | None = None
        while time.monotonic() < cut + SESSION_TIMEOUT + 20:
            if done is None and ledger.complete(pipeline.collector):
                done = time.monotonic()  # every kill sent while the cut lasts
            time.sleep(0.2)
        during = len(KillLedger(loops, clean).read(pipeline.collector).by_trace())
        for proxy in proxies:
            proxy.heal()
        healed = time.monotonic()
        if done is None:
            done = kills_or_stall(pipeline, ledger, timeout=180)
        rejoined = after_zombie(pipeline, ledger, everyone)
        print(
            "\n"
            + ledger.summary(
                f"worker cut off from the brokers {healed - cut:.0f} s ({during} of {LOOPS} loops"
                f" killed meanwhile), back in the group {rejoined:.0f} s after the heal",
                done - cut,
            )
            + f"; {rescued(pipeline.workers)}"
        )
        check_after(pipeline, ledger)
    finally:
        pipeline.close()
        for proxy in proxies:
            proxy.close()
