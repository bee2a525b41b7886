"""Agent budgets over a window in the worker, on the real broker: an agent's traces land on
different partitions, their usage records meet on the agent usage topic, and the agent-windows
agent decides each crossed window once, through a SIGKILL of one of two workers; the
agent-scoped kill stops a new trace of that agent until `spanguard release --agent` lifts it.

The expected decisions are the pure core's (Guard + AgentBudgetGuard over the same spans): the
worker must decide exactly what replay decides, no more, no fewer."""

from __future__ import annotations

import collections
import json
import signal
import time
import uuid

import pytest
import yaml
from opentelemetry.trace import SpanKind

from spanguard.detection.agent_budget import AgentBudgetGuard
from spanguard.detection.guard import Guard
from spanguard.killswitch.client import KillSwitch
from spanguard.killswitch.signals import AgentKilled
from spanguard.schemas.policy import Policy
from tests.detection.test_rules import run
from tests.support.kafka_harness import (
    BOOTSTRAP,
    SIGNING_KEY,
    Collector,
    Topics,
    ensure_broker,
    producer,
)
from tests.support.spans import AgentRecorder, encode
from tests.support.waiting import wait_until
from tests.support.worker import operator_cli, running_worker, send_spans, worker_starter

pytestmark = pytest.mark.kafka

# The shipped defaults, and an hourly token budget for every agent that kills.
POLICY = {"defaults": {"agent_budget": {"window": "1h", "tokens": 10_000, "action": "kill"}}}
AGENTS = 6
TRACES = 14  # 1,000 tokens each
CROSSING = 10  # the round whose trace takes each agent over its budget (the 11th)
PARTITIONS = 4


def trace_of(service: str, tokens: int = 1000, ended_at_ns: int | None = None) -> AgentRecorder:
    """One short run of agent `service`/triage: a chat span, then its root span."""
    agent = AgentRecorder(service, "triage", **{"gen_ai.agent.name": "triage"})
    attributes = {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "gpt-4o",
        "gen_ai.usage.input_tokens": tokens,
        "gen_ai.usage.output_tokens": 0,
    }
    if ended_at_ns is None:
        agent.span("chat gpt-4o", attributes, kind=SpanKind.CLIENT)
    else:  # a clock of its own
        span = agent.tracer.start_span(
            "chat gpt-4o",
            context=agent._context,
            kind=SpanKind.CLIENT,
            attributes=attributes,
            start_time=ended_at_ns - 1_000_000,
        )
        span.end(end_time=ended_at_ns)
    agent.finish()
    return agent


def core_decisions(runs: list[AgentRecorder]) -> list:
    policy = Policy.from_mapping(POLICY)
    guard = Guard(policy, agent_budgets=AgentBudgetGuard(policy))
    return [d for agent in runs for d in run(guard, agent.finished())]


def usage_rows(collector: Collector, topic: str) -> int:
    """Distinct usage rows on the agent usage topic (a Kafka record holds a batch's; a batch
    decided again after the SIGKILL sends its rows again)."""
    return len(
        {
            (row[2], row[3])
            for message in collector.where(lambda m: m["topic"] == topic)
            for row in json.loads(message["value"])["r"]
        }
    )


def values_on(collector: Collector, topic: str) -> list[dict]:
    return [json.loads(m["value"]) for m in collector.where(lambda m: m["topic"] == topic)]


def send_without_service(topic: str, agent: AgentRecorder) -> None:
    """The agent's spans with `service.name` set to "" (the SDK itself would fill in
    unknown_service), one message per span keyed by the trace id."""
    out = producer()
    for span in agent.finished():
        request = encode([span])
        for attribute in request.resource_spans[0].resource.attributes:
            if attribute.key == "service.name":
                attribute.value.string_value = ""
        out.produce(topic, key=agent.trace_id.encode(), value=request.SerializeToString())
    assert out.flush(10) == 0


def test_sigkill_of_one_of_two_workers_decides_every_crossed_window_once(tmp_path):
    ensure_broker()
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(POLICY))
    run_id = uuid.uuid4().hex[:6]
    services = [f"svc-{run_id}-{n}" for n in range(AGENTS)]
    runs = {service: [trace_of(service) for _ in range(TRACES)] for service in services}
    expected = core_decisions([agent for traces in runs.values() for agent in traces])
    expected_ids = {d.decision_id for d in expected}
    assert len(expected_ids) == len(expected) == AGENTS  # one crossed window per agent
    assert all(d.scope_kind == "agent" and d.action == "kill" for d in expected)

    topics = Topics()
    collector = Collector(topics.kills, topics.agent_usage, topics.detections)

    start = worker_starter(topics, tmp_path, policy_file, PARTITIONS)
    first, second = start("a", "b")
    workers = [first, second]
    # The first agent's KillSwitch, reading from now on (the topics exist once a worker runs).
    switch = KillSwitch(
        BOOTSTRAP,
        topics.kills,
        signing_key=SIGNING_KEY,
        ack_topic=None,
        agent=f"{services[0]}/triage",
    )
    try:

        def send_round(index: int) -> None:
            for service in services:
                send_spans(topics.input, runs[service][index])

        def rows_through(index: int) -> None:
            wait_until(
                lambda: usage_rows(collector, topics.agent_usage) >= AGENTS * (index + 1),
                90,
                f"round {index}'s usage records",
            )

        for index in range(CROSSING):
            send_round(index)
            rows_through(index)
        send_round(CROSSING)
        killed_at = time.monotonic()
        # Mid-run, as the windows cross: its span batches and its agent windows maybe half
        # decided, its kills maybe sent and its windows not yet written.
        second.stop(signal.SIGKILL)
        # Rescheduled without its volume: its windows come back from the changelog.
        (second,) = start("b-rescheduled")
        workers = [first, second]
        rows_through(CROSSING)
        for index in range(CROSSING + 1, TRACES):
            send_round(index)
            rows_through(index)

        def signal_ids() -> list[str]:
            return [record["signal_id"] for record in values_on(collector, topics.kills)]

        wait_until(lambda: expected_ids <= set(signal_ids()), 120, "every expected kill")
        recovered = time.monotonic() - killed_at
        time.sleep(3.0)  # time for a duplicate or a false kill to show up, were there one
        counts = collections.Counter(signal_ids())
        doubled = sum(n - 1 for n in counts.values())
        lost = expected_ids - set(counts)
        unexpected = set(counts) - expected_ids
        detections = collections.Counter(
            d["decision_id"] for d in values_on(collector, topics.detections)
        )
        sent_rows = usage_rows(collector, topics.agent_usage)
        all_rows = sum(
            len(json.loads(m["value"])["r"])
            for m in collector.where(lambda m: m["topic"] == topics.agent_usage)
        )
        dropped = sum(
            (w.metrics() or {}).get('spanguard_agent_usage_records_total{what="duplicate"}', 0)
            for w in workers
        )
        print(
            f"\nagent windows {AGENTS} agents x {TRACES} traces: windows crossed"
            f" {len(expected_ids)}, decided {len(set(counts) & expected_ids)}, doubled"
            f" {doubled}, lost {len(lost)}, unexpected {len(unexpected)}; usage rows sent"
            f" {all_rows} ({sent_rows} distinct, of {AGENTS * TRACES} usage spans), dropped as"
            f" sent twice {dropped:.0f}; recovery {recovered:.1f} s from the SIGKILL to the last"
            " expected kill"
        )
        assert not lost and not unexpected
        assert doubled == 0, counts
        assert set(detections) == expected_ids and max(detections.values()) == 1, detections
        kills = values_on(collector, topics.kills)
        assert all(k["scope"] == "agent" and k["agent"]["name"] == "triage" for k in kills)

        # The agent's KillSwitch refuses a new trace until an operator releases the agent.
        wait_until(lambda: switch.received >= AGENTS, 60, "the kills at the agent")
        with pytest.raises(AgentKilled) as caught:
            switch.check(uuid.uuid4().hex)
        assert caught.value.scope == "agent"
        released = operator_cli("release", topics, "--agent", f"{services[0]}/triage")
        assert released.returncode == 0, released.stderr
        wait_until(lambda: switch.received >= AGENTS + 1, 60, "the release at the agent")
        assert switch.check(uuid.uuid4().hex) is None
    finally:
        switch.close()
        collector.close()
        for worker in workers:
            worker.stop()
        topics.delete()


def test_bad_identities_and_clocks_cost_themselves_counted(tmp_path):
    run_id = uuid.uuid4().hex[:6]
    good, skewed = f"ok-{run_id}", f"skewed-{run_id}"
    now_ns = time.time_ns()
    with running_worker(
        tmp_path,
        policy=yaml.safe_dump(POLICY),
        collect=("kills", "dead_letters", "agent_usage"),
    ) as worker:
        topics = worker.topics
        # A service with an empty name: its spend is no agent's, counted and told once.
        for _ in range(12):
            send_without_service(topics.input, trace_of("nameless"))
        # A clock a year ahead, then the real time again: its own window starts afresh twice.
        send_spans(topics.input, trace_of(skewed, 6000, now_ns + 365 * 86400 * 10**9))
        send_spans(topics.input, trace_of(skewed, 6000, now_ns))
        # A record no span agent wrote: a dead letter with its reason, the partition goes on.
        out = producer()
        out.produce(topics.agent_usage, key=b'["",null]', value=b'{"v":1,"s":[],"r":[]}')
        assert out.flush(10) == 0
        # Meanwhile an agent that crosses its budget is killed, once.
        for _ in range(11):
            send_spans(topics.input, trace_of(good))
        wait_until(lambda: values_on(worker.collector, topics.kills), 60, "the good agent's kill")
        metrics = worker.process.wait_for(
            'spanguard_agent_usage_records_total{what="no_identity"}', 12, timeout=60
        )
        metrics = worker.process.wait_for(
            'spanguard_agent_window_clock_skews_total{what="reset"}', 1, timeout=60
        )
        time.sleep(1.5)
        kills = values_on(worker.collector, topics.kills)
        dead = worker.collector.where(lambda m: m["topic"] == topics.dead_letters)
        log = worker.process.log_text()
    assert [k["agent"]["service"] for k in kills] == [good]
    assert len(dead) == 1 and b"agent usage record" in dead[0]["headers"]["spanguard.reason"]
    assert log.count("service.name is empty") == 1
    assert metrics['spanguard_agent_window_clock_skews_total{what="reset"}'] == 1
    assert metrics["spanguard_agent_window_decisions_total"] == 1
