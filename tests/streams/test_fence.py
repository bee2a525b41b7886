"""The worker's lease on its partitions (streams/fence.py): held from an answered heartbeat,
lapsed when heartbeats stop being answered, fenced at a revocation that finds it lapsed.

The clock is the test's own where the rules are pure; the heartbeats are aiokafka's own group
coordinator's, against the real broker.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from spanguard.streams.fence import LEASE_SHARE, Lease
from tests.support.leases import SESSION, Clock


def owned_lease(clock: Clock) -> Lease:
    lease = Lease(SESSION, clock=clock)
    lease.rebalance_began()
    lease.assigned(None)  # no coordinator: the rules alone
    return lease


def test_nothing_is_held_before_the_first_assignment() -> None:
    clock = Clock()
    lease = Lease(SESSION, clock=clock)
    lease.renewed(clock.now)  # a heartbeat alone owns nothing
    assert not lease.held()


def test_an_answered_heartbeat_holds_the_partitions_for_a_share_of_the_session() -> None:
    clock = Clock()
    lease = owned_lease(clock)
    clock.now += SESSION * LEASE_SHARE - 0.1
    assert lease.held()
    clock.now += 0.2
    assert not lease.held()  # the coordinator may evict this member from here on
    lease.renewed(clock.now - 1.0)  # sent a second ago, answered now
    assert lease.held()
    clock.now += SESSION * LEASE_SHARE - 1.0
    assert not lease.held()  # counted from when it was sent, not answered


def test_a_revocation_under_a_lease_that_holds_is_an_ordinary_rebalance() -> None:
    clock = Clock()
    lease = owned_lease(clock)
    assert not lease.fence_if_lapsed()
    assert lease.epoch == 0 and lease.holds(0)


def test_a_revocation_after_the_lease_lapsed_fences_until_the_next_assignment() -> None:
    clock = Clock()
    lease = owned_lease(clock)
    clock.now += SESSION  # frozen past the session timeout
    assert lease.fence_if_lapsed()
    assert lease.epoch == 1 and lease.fenced == 1
    assert not lease.holds(0)  # a batch fetched before is dropped
    assert not lease.holds(1)  # and nothing is owned until the next assignment
    assert not lease.fence_if_lapsed()  # one fence per lapse
    lease.rebalance_began()
    lease.assigned(None)
    assert lease.holds(1) and not lease.holds(0)


@pytest.mark.parametrize(("then", "goes_on"), [("renewed", True), ("fenced", False)])
def test_a_batch_waits_on_a_lapsed_lease_then_goes_on_once_renewed_or_is_dropped_when_fenced(
    then: str, goes_on: bool
) -> None:
    clock = Clock()
    lease = owned_lease(clock)
    clock.now += SESSION

    async def answer_later() -> bool:
        waiting = asyncio.ensure_future(lease.wait(0))
        await asyncio.sleep(0.2)
        if then == "renewed":
            assert not waiting.done()  # no decision, no write while it is lapsed
            lease.renewed(clock.now)
        else:
            assert lease.fence_if_lapsed()
        return await asyncio.wait_for(waiting, 2)

    assert asyncio.run(answer_later()) is goes_on


@pytest.mark.kafka
def test_aiokafkas_heartbeats_renew_the_lease_and_leaving_the_group_fences_it() -> None:
    from aiokafka import AIOKafkaConsumer
    from confluent_kafka.admin import AdminClient, NewTopic

    from tests.support.kafka_harness import CLUSTER, ensure_broker

    ensure_broker()
    topic = f"t{uuid.uuid4().hex[:8]}-lease"
    admin = AdminClient(CLUSTER.config())
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)

    async def run() -> None:
        lease = Lease(6.0)
        consumer = AIOKafkaConsumer(
            topic,
            bootstrap_servers=CLUSTER.bootstrap,
            group_id=f"{topic}-group",
            session_timeout_ms=6000,
            heartbeat_interval_ms=300,
        )
        lease.rebalance_began()
        await consumer.start()
        try:
            deadline = time.monotonic() + 60
            while not consumer.assignment():
                assert time.monotonic() < deadline, "no assignment in 60 s"
                await consumer.getmany(timeout_ms=200)
            lease.assigned(consumer._coordinator)
            first = lease.valid_until
            await asyncio.sleep(1.5)  # a few heartbeats answered
            assert lease.valid_until > first
            assert lease.held() and not lease.fence_if_lapsed()
        finally:
            await consumer.stop()  # leaves the group: the coordinator forgets this member
        assert lease.held()  # the clock alone would still say held
        assert lease.fence_if_lapsed()  # but the member is gone: fenced

    try:
        asyncio.run(run())
    finally:
        admin.delete_topics([topic])
