"""Enforcement at the LLM gateway, end to end: the real LiteLLM proxy (`litellm --config`, from
the gateway's virtualenv, `make gateway-venv`) with spanguard's guardrail and its `otel`
callback exporting to the real Collector, the default `spanguard worker` signing with the
stack's key file, and a scripted model on a local port (no network).

Rows (each prints its calls before the refusal and the time from the kill signal's record to
the refusal):
- instrumented: an agent on the OpenTelemetry SDK's defaults (5 s batches), no spanguard
  adapter, sending its traceparent: refused at the model call after its 4th looping tool call
  (the 3rd identical call trips the rule; the proxy sees it in the request that carries its
  result, the 4th).
- plain: an agent with no instrumentation at all, named only by `x-spanguard-run`: the
  gateway's own spans are all the worker sees; refused the same way. Its healthy twin finishes.
  Then a release (`spanguard release`) lets its next call through.
- forged and expired kills of a running agent's trace refuse nothing.

`make test` runs the plain row with its twin; `make test-agents` runs all (marker `agents`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.support import gateway
from tests.support.guarded_agents import stack
from tests.support.kafka_harness import BOOTSTRAP, producer

pytestmark = pytest.mark.kafka

STEP_DELAY = float(os.environ.get("SPANGUARD_TEST_STEP_DELAY", "0.3"))
TRIPS_AT = 3  # the default policy's tool_loop threshold
# The proxy sees the 3rd call in the request that carries its result: the agent has run its
# 4th by the time that request's span has been read; the next call is refused.
REFUSED_AFTER = TRIPS_AT + 1


@pytest.fixture(scope="module")
def gateway_stack(tmp_path_factory):
    if (reason := gateway.missing()) is not None:
        pytest.skip(reason)
    workdir = Path(tmp_path_factory.mktemp("gateway-e2e"))
    with stack(workdir) as running, gateway.ScriptedModel() as model:
        config = gateway.proxy_config(
            model.base_url,
            kill_topic=running.topics.kills,
            ack_topic=running.topics.acks,
            bootstrap_servers=BOOTSTRAP,
        )
        env = {
            "SPANGUARD_SIGNING_KEY_FILE": running.key_file,
            "OTEL_ENDPOINT": f"{running.endpoint}/v1/traces",
            # The gateway is ours to configure: its spans leave every 50 ms, not every 5 s.
            "OTEL_BSP_SCHEDULE_DELAY": "50",
            "OTEL_SERVICE_NAME": "litellm-gateway",
        }
        with gateway.Proxy(config, workdir / "proxy", env=env) as proxy:
            _wait_guarded(proxy)
            proxy.model = model  # what the proxy sent on, for the downgrade row
            yield running, proxy


def _wait_guarded(proxy: gateway.Proxy, timeout: float = 60) -> None:
    """Until the guardrail's consumer is positioned (its log says nothing of an unreachable
    topic, and a call passes): the first calls must not race the consumer's start."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, _ = gateway.chat(proxy.base_url, [{"role": "user", "content": "healthy"}])
        if status == 200 and "cannot be read" not in proxy.log_tail(400):
            time.sleep(1.0)  # KillSwitch.start() resolves end offsets before it returns
            return
        time.sleep(0.5)
    raise AssertionError(f"proxy never guarded:\n{proxy.log_tail()}")


def _kill_records(running, trace_id: str, timeout: float = 10) -> list[tuple[dict, float]]:
    """The kill topic's records for `trace_id` (the signal, its broker timestamp in s)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(
        {"bootstrap.servers": BOOTSTRAP, "group.id": f"t-{uuid.uuid4().hex}",
         "enable.auto.commit": False}
    )  # fmt: skip
    try:
        metadata = consumer.list_topics(running.topics.kills, timeout=10)
        partitions = metadata.topics[running.topics.kills].partitions
        consumer.assign([TopicPartition(running.topics.kills, p, 0) for p in partitions])
        found, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None:
                if found:
                    break
                continue
            if message.error():
                continue
            record = json.loads(message.value())
            if record.get("trace_id") == trace_id:
                found.append((record, message.timestamp()[1] / 1000))
        return found
    finally:
        consumer.close()


def _report(name: str, run: gateway.AgentRun, running) -> str:
    kill_to_refusal = "-"
    if run.trace_id and run.refused_at:
        kills = [
            ts for record, ts in _kill_records(running, run.trace_id) if record["kind"] == "kill"
        ]
        if kills:
            kill_to_refusal = f"{(run.refused_at - min(kills)) * 1000:.0f} ms"
    return (
        f"{name:14} {run.scenario:8} {run.status:9} calls={run.calls:2d}"
        f" kill->refusal={kill_to_refusal:>8} http={run.refusal_status or 200}"
        f" sees={(run.refusal or {}).get('error', {}).get('message', '-')[:120]}"
    )


def _assert_refused_by_the_loop(run: gateway.AgentRun) -> None:
    assert run.status == "refused" and run.refusal_status == 403, run
    # The 4th call at the earliest; one more when the kill lands within a step of a loaded host.
    assert REFUSED_AFTER <= run.calls <= REFUSED_AFTER + 1, run
    error = run.refusal["error"]
    assert "rule tool_loop" in error["message"] and "spanguard release" in error["message"], error
    details = error["provider_specific_fields"]
    assert details["spanguard"]["decision_id"] and details["spanguard"]["rule"] == "tool_loop"
    assert details["spanguard"]["release"] == f"spanguard release {run.trace_id}", details


def test_a_plain_agent_is_refused_its_twin_finishes_and_a_release_lets_it_go_on(gateway_stack):
    running, proxy = gateway_stack
    loop_run, healthy_run = f"plain-loop-{uuid.uuid4().hex[:8]}", f"plain-ok-{uuid.uuid4().hex[:8]}"
    with ThreadPoolExecutor(2) as pool:
        looping = pool.submit(
            gateway.run_agent, proxy.base_url, "loop", step_delay=STEP_DELAY, run_id=loop_run
        )
        healthy = pool.submit(
            gateway.run_agent, proxy.base_url, "healthy", step_delay=0.2, run_id=healthy_run
        )
        loop, twin = looping.result(), healthy.result()
    from spanguard.killswitch.gateway import derived_trace_id

    loop.trace_id, twin.trace_id = derived_trace_id(loop_run), derived_trace_id(healthy_run)
    print("\n" + _report("plain", loop, running) + "\n" + _report("plain twin", twin, running))
    _assert_refused_by_the_loop(loop)
    assert twin.status == "finished" and twin.calls == gateway.HEALTHY_CALLS, twin

    # A release by the operator: the run's next call goes through.
    _operator(running, "release", loop.trace_id)
    messages = [{"role": "user", "content": "healthy"}]
    deadline, status = time.monotonic() + 10, 0
    while time.monotonic() < deadline and status != 200:
        status, body = gateway.chat(proxy.base_url, messages, {"x-spanguard-run": loop_run})
        time.sleep(0.2)
    assert status == 200, body


@pytest.mark.agents
def test_an_instrumented_agent_without_adapter_is_refused_at_the_model_call(gateway_stack):
    running, proxy = gateway_stack
    run = gateway.run_agent(
        proxy.base_url, "loop", step_delay=STEP_DELAY, endpoint=f"{running.endpoint}/v1/traces"
    )
    print("\n" + _report("instrumented", run, running))
    _assert_refused_by_the_loop(run)


@pytest.mark.agents
def test_forged_and_expired_kills_refuse_nothing(gateway_stack):
    from spanguard.schemas.decision import sign
    from tests.support.spans import kill_signal

    running, proxy = gateway_stack
    trace_id = uuid.uuid4().hex
    key = Path(running.key_file).read_text().strip().encode()
    forged = sign(kill_signal(trace_id).to_dict(), b"not-the-workers-key-at-all-0123")
    old = kill_signal(trace_id)
    two_hours_ago = (datetime.now(UTC) - timedelta(hours=2)).isoformat(timespec="milliseconds")
    expired_signal = type(old).from_dict(
        {**old.to_dict(), "detected_at": two_hours_ago,
         "expires_at": (datetime.now(UTC) - timedelta(hours=1)).isoformat(timespec="milliseconds"),
         "signal_id": uuid.uuid4().hex}
    )  # fmt: skip
    expired = sign(expired_signal.to_dict(), key)
    send = producer()
    for record in (forged, expired):
        send.produce(running.topics.kills, json.dumps(record).encode(), key=trace_id.encode())
    send.flush(10)
    time.sleep(1.0)  # read by the proxy's consumer (and ignored)
    run = gateway.run_agent(proxy.base_url, "healthy", step_delay=0.05, trace_id=trace_id)
    print("\n" + _report("forged+expired", run, running))
    assert run.status == "finished" and run.calls == gateway.HEALTHY_CALLS, run
    # The control: the same trace killed with the worker's key is refused.
    send.produce(
        running.topics.kills, json.dumps(sign(kill_signal(trace_id).to_dict(), key)).encode()
    )
    send.flush(10)
    deadline, status = time.monotonic() + 10, 200
    while time.monotonic() < deadline and status == 200:
        time.sleep(0.2)
        status, body = gateway.chat(
            proxy.base_url,
            [{"role": "user", "content": "healthy"}],
            {"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"},
        )
    assert status == 403, body


def _operator(running, *scope: str) -> None:
    """`spanguard kill` or `release` by an operator, signed with the stack's key."""
    done = subprocess.run(
        [sys.executable, "-m", "spanguard.cli", *scope, "--bootstrap", BOOTSTRAP,
         "--kill-topic", running.topics.kills, "--reason", "test"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "SPANGUARD_SIGNING_KEY_FILE": running.key_file,
             "SPANGUARD_SIGNING_KEY": ""},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def _status_until(proxy, headers: dict[str, str], wanted: int, timeout: float = 10):
    deadline, status, body = time.monotonic() + timeout, 0, None
    while time.monotonic() < deadline:
        status, body = gateway.chat(proxy.base_url, [{"role": "user", "content": "hi"}], headers)
        if status == wanted:
            break
        time.sleep(0.2)
    return status, body


@pytest.mark.agents
def test_an_operators_conversation_and_agent_kills_refuse_the_calls_that_name_them(gateway_stack):
    """A kill of a conversation or an agent scope refuses every call that names it (by the
    x-spanguard-* headers), whatever its run; other conversations and agents go on."""
    running, proxy = gateway_stack
    conversation, agent = f"conv-{uuid.uuid4().hex[:8]}", f"billing-{uuid.uuid4().hex[:8]}"
    _operator(running, "kill", "--conversation", conversation)
    _operator(running, "kill", "--agent", f"{agent}/refunds")
    in_conversation = {"x-spanguard-conversation": conversation, "x-spanguard-run": "r-1"}
    status, body = _status_until(proxy, in_conversation, 403)
    assert status == 403 and conversation in json.dumps(body), body
    status, body = _status_until(proxy, {"x-spanguard-agent": f"{agent}/refunds"}, 403)
    assert status == 403 and agent in json.dumps(body), body
    elsewhere = {"x-spanguard-conversation": "conv-other", "x-spanguard-agent": f"{agent}/other"}
    assert _status_until(proxy, elsewhere, 200)[0] == 200
    _operator(running, "release", "--conversation", conversation)
    assert _status_until(proxy, in_conversation, 200)[0] == 200


def _send_signed(running, record: dict) -> None:
    from spanguard.schemas.decision import sign

    key = Path(running.key_file).read_text().strip().encode()
    send = producer()
    send.produce(
        running.topics.kills, json.dumps(sign(record, key)).encode(),
        key=record["trace_id"].encode(),
    )  # fmt: skip
    send.flush(10)


@pytest.mark.agents
def test_a_downgrade_reaches_the_model_and_a_pause_holds_then_refuses(gateway_stack):
    """A downgrade refuses nothing and hands the model its system message; a paused trace's
    call waits (the guardrail's pause_wait_seconds, 5 s) and is refused with 423 while the
    pause lasts; a release lets it through."""
    from tests.support.spans import kill_signal

    running, proxy = gateway_stack
    downgraded, paused = uuid.uuid4().hex, uuid.uuid4().hex
    advice = "You repeat search_docs: stop and report what you found."
    _send_signed(running, kill_signal(downgraded, "downgrade", advice).to_dict())
    until = (datetime.now(UTC) + timedelta(minutes=5)).isoformat(timespec="milliseconds")
    pause = {**kill_signal(paused).to_dict(), "kind": "pause", "pause_until": until,
             "pause_fallback": "kill", "signal_id": uuid.uuid4().hex}  # fmt: skip
    _send_signed(running, pause)
    time.sleep(1.0)  # read by the proxy's consumer

    def traceparent(trace_id: str) -> dict[str, str]:
        return {"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"}

    status, body = gateway.chat(
        proxy.base_url, [{"role": "user", "content": "healthy"}], traceparent(downgraded)
    )
    assert status == 200, body
    sent = proxy.model.bodies[-1]["messages"]
    assert {"role": "system", "content": advice} in sent, sent

    started = time.monotonic()
    status, body = gateway.chat(
        proxy.base_url, [{"role": "user", "content": "healthy"}], traceparent(paused)
    )
    waited = time.monotonic() - started
    print(f"\npaused: http={status} after {waited:.1f} s")
    assert status == 423 and "pause" in json.dumps(body).lower(), body
    assert waited >= 4.0  # it waited for the operator before refusing
    _operator(running, "release", paused)
    assert _status_until(proxy, traceparent(paused), 200)[0] == 200


def test_a_contained_tool_leaves_the_request_the_model_gets(gateway_stack):
    """`spanguard contain --tool` takes the tool out of every request's `tools` (the model
    cannot call it, the agent takes its other tool); a request whose every tool is contained
    is left whole; `spanguard release --tool` gives it back."""
    running, proxy = gateway_stack
    contained = f"search_docs_{uuid.uuid4().hex[:6]}"

    def function(name: str) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}

    def sent_tools(*names: str) -> list[str]:
        status, body = gateway.chat(
            proxy.base_url,
            [{"role": "user", "content": "healthy"}],
            tools=[function(name) for name in names],
        )
        assert status == 200, body
        return [tool["function"]["name"] for tool in proxy.model.bodies[-1]["tools"]]

    def until(names: tuple[str, ...], wanted: list[str], timeout: float = 10) -> list[str]:
        deadline, got = time.monotonic() + timeout, []
        while time.monotonic() < deadline and (got := sent_tools(*names)) != wanted:
            time.sleep(0.2)
        return got

    both = (contained, "web_search")
    assert sent_tools(*both) == list(both)
    _operator(running, "contain", "--tool", contained, "--for", "10m")
    assert until(both, ["web_search"]) == ["web_search"]
    assert sent_tools(contained) == [contained]  # its only tool: the request is left whole
    assert "every tool of a request" in proxy.log_tail(2000)
    _operator(running, "release", "--tool", contained)
    assert until(both, list(both)) == list(both)
