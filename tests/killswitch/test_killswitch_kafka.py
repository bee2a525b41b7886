"""The agent-side KillSwitch against the real broker: signed signals in, AgentKilled out."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

import pytest
from opentelemetry.sdk.trace import TracerProvider

from spanguard.killswitch.client import KillSwitch
from spanguard.killswitch.signals import AgentKilled
from spanguard.schemas.decision import sign
from tests.support.kafka_harness import BOOTSTRAP, CLUSTER, ensure_broker, producer
from tests.support.spans import kill_signal

pytestmark = pytest.mark.kafka

KEY = b"killswitch-test-key"


def make_signal(trace_id: str, action: str = "kill", message: str | None = None) -> dict:
    return kill_signal(trace_id, action, message).to_dict()


@pytest.fixture(scope="module")
def topic():
    ensure_broker()
    from confluent_kafka.admin import AdminClient, NewTopic

    name = f"t{uuid.uuid4().hex[:8]}-agent-kill-signals"
    admin = AdminClient(CLUSTER.config())
    admin.create_topics([NewTopic(name, 3, 1)])[name].result(30)
    yield name
    admin.delete_topics([name])


def publish(topic: str, record: dict, key: bytes | None = KEY) -> None:
    if key is not None:
        record = sign(record, key)
    out = producer()
    out.produce(topic, key=record["trace_id"].encode(), value=json.dumps(record).encode())
    assert out.flush(10) == 0


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise TimeoutError("condition not met")


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
