"""The agent-side KillSwitch against the real broker: signed signals in, AgentKilled out."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
import time
import uuid

import pytest
from opentelemetry.sdk.trace import TracerProvider

from spanguard.killswitch.client import KillSwitch
from spanguard.killswitch.signals import AgentKilled
from spanguard.schemas.decision import sign
from tests.support.kafka_harness import BOOTSTRAP, ensure_broker, producer, scratch_topic
from tests.support.spans import kill_signal
from tests.support.waiting import wait_until

pytestmark = pytest.mark.kafka

KEY = b"killswitch-test-key"


def make_signal(trace_id: str, action: str = "kill", message: str | None = None) -> dict:
    return kill_signal(trace_id, action, message).to_dict()


@pytest.fixture(scope="module")
def topic():
    ensure_broker()
    with scratch_topic(3) as name:
        yield name


def publish(topic: str, record: dict, key: bytes | None = KEY) -> None:
    if key is not None:
        record = sign(record, key)
    out = producer()
    out.produce(topic, key=record["trace_id"].encode(), value=json.dumps(record).encode())
    assert out.flush(10) == 0


def trace() -> str:
    return uuid.uuid4().hex


def test_kill_raises_for_its_trace_only_and_keeps_raising(topic):
    killed, other = trace(), trace()
    with KillSwitch(BOOTSTRAP, topic, signing_key=KEY) as switch:
        assert switch.check(killed) is None
        publish(topic, make_signal(killed))
        wait_until(lambda: switch.received >= 1)
        # The signal arrived before this check(): it is not lost.
        for _ in range(2):
            with pytest.raises(AgentKilled) as caught:
                switch.check(killed)
            assert caught.value.trace_id == killed
            assert "search_docs called 4x" in str(caught.value)
        assert switch.check(other) is None


def test_downgrade_message_is_handed_over_once(topic):
    downgraded = trace()
    with KillSwitch(BOOTSTRAP, topic, signing_key=KEY) as switch:
        publish(topic, make_signal(downgraded, "downgrade", "Try a different approach."))
        wait_until(lambda: switch.received >= 1)
        assert switch.check(downgraded) == "Try a different approach."
        assert switch.check(downgraded) is None
        publish(topic, make_signal(downgraded, "kill"))
        wait_until(lambda: switch.received >= 2)
        with pytest.raises(AgentKilled):
            switch.check(downgraded)


def test_unsigned_and_forged_signals_are_ignored_and_counted(topic):
    victim = trace()
    with KillSwitch(BOOTSTRAP, topic, signing_key=KEY) as switch:
        publish(topic, make_signal(victim), key=None)  # unsigned
        publish(topic, make_signal(victim), key=b"attacker's key")  # forged
        tampered = sign(make_signal(victim), KEY)
        tampered["reason"] = "edited after signing"
        publish(topic, tampered, key=None)
        wait_until(lambda: switch.received >= 3)
        assert switch.rejected == 3
        assert switch.check(victim) is None


def fuzzed_records(count: int) -> list[bytes | None]:
    """Every bad record of the unit table, plus `count` mutations of a valid signed signal:
    flipped bytes, cuts, splices of junk (the same ones every run)."""
    from tests.test_bad_input import KILL_RECORDS

    records: list[bytes | None] = [value for _, value, _ in KILL_RECORDS]
    valid = json.dumps(sign(make_signal(trace()), KEY)).encode()
    signed = json.loads(valid)
    rng = random.Random(20261203)
    for _ in range(count):
        data = bytearray(valid)
        mutation = rng.choice(("flip", "cut", "splice", "noise"))
        if mutation == "flip":
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif mutation == "cut":
            data = data[: rng.randrange(len(data))]
        elif mutation == "splice":
            at = rng.randrange(len(data))
            data[at:at] = rng.randbytes(rng.randint(1, 64))
        else:
            data = bytearray(rng.randbytes(rng.randint(1, 2048)))
        if _parses_to(bytes(data), signed):
            continue  # a flip of a space into a tab or a newline: the same signed signal
        records.append(bytes(data))
    return records


def _parses_to(data: bytes, signed: object) -> bool:
    try:
        return json.loads(data) == signed
    except ValueError:
        return False


def test_no_record_stops_the_consumer_and_the_next_kill_is_delivered(topic, caplog):
    """Anyone who can write to the topic can send anything; the guard must keep working."""
    victim = trace()
    records = fuzzed_records(300)
    caplog.set_level(logging.WARNING, logger="spanguard.killswitch")
    with KillSwitch(BOOTSTRAP, topic, signing_key=KEY) as switch:
        out = producer()
        for value in records:
            out.produce(topic, key=b"junk", value=value)
        assert out.flush(10) == 0
        publish(topic, make_signal(victim))
        wait_until(lambda: switch.received >= len(records) + 1, timeout=30)
        with pytest.raises(AgentKilled):
            switch.check(victim)
        assert switch.signals.delivered == 1
        assert sum(switch.ignored.values()) == len(records)
        assert switch.ignored["internal"] == 0
        logged = [r for r in caplog.records if "ignored a kill-signal record" in r.getMessage()]
        assert len(logged) == len(switch.ignored)  # once per kind, not once per record


def test_rotation_expiry_and_the_unsigned_opt_in(topic):
    """During a key rotation both keys kill; an expired signal does not; unsigned signals only
    reach an agent that opted in to them."""
    new_key = b"killswitch-rotated-key"
    by_old, by_new, late = trace(), trace(), trace()
    with KillSwitch(BOOTSTRAP, topic, signing_keys=[KEY, new_key]) as switch:
        publish(topic, make_signal(by_old), key=KEY)
        publish(topic, make_signal(by_new), key=new_key)
        expired = {**make_signal(late), "expires_at": "2026-01-01T00:00:00.000+00:00"}
        publish(topic, expired, key=new_key)
        wait_until(lambda: switch.received >= 3)
        for trace_id in (by_old, by_new):
            with pytest.raises(AgentKilled):
                switch.check(trace_id)
        assert switch.check(late) is None and switch.expired == 1
    unsigned = trace()
    with KillSwitch(BOOTSTRAP, topic, allow_unsigned=True) as switch:
        publish(topic, make_signal(unsigned), key=None)
        wait_until(lambda: switch.received >= 1)
        with pytest.raises(AgentKilled):
            switch.check(unsigned)


def test_signals_before_start_are_not_replayed(topic):
    old = trace()
    publish(topic, make_signal(old))
    with KillSwitch(BOOTSTRAP, topic, signing_key=KEY) as switch:
        time.sleep(0.5)
        assert switch.check(old) is None  # it started at the latest offset


def test_current_span_threads_and_asyncio(topic):
    provider = TracerProvider()
    tracer = provider.get_tracer("agent")
    with KillSwitch(BOOTSTRAP, topic, signing_key=KEY) as switch:
        with tracer.start_as_current_span("invoke_agent support") as span:
            trace_id = format(span.get_span_context().trace_id, "032x")
            assert switch.check() is None
            publish(topic, make_signal(trace_id))
            wait_until(lambda: switch.received >= 1)
            with pytest.raises(AgentKilled):
                switch.check()  # the current span's trace

        outcomes: list[str] = []

        def worker() -> None:
            try:
                switch.check(trace_id)
                outcomes.append("ran")
            except AgentKilled:
                outcomes.append("killed")

        threads = [threading.Thread(target=worker) for _ in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert outcomes == ["killed"] * 16

        async def agent_step() -> str:
            switch.check(trace_id)
            return "ran"

        with pytest.raises(AgentKilled):
            asyncio.run(agent_step())
