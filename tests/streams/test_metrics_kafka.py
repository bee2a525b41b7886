"""Every metric the chart's dashboard and alert rules use exists on a real worker's /metrics.

The worker runs with its default settings against the real broker; one looping agent is
killed first, so that labelled series (decisions, latency) have samples, as in production.
The expressions are read from what `helm template` renders with the monitoring flags on, and
parsed as PromQL (promql-parser), not grepped.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from typing import Any

import promql_parser
import pytest
from prometheus_client.parser import text_string_to_metric_families

from spanguard import __version__
from tests.support.helm import ALERTS, MONITORING_ON, render
from tests.support.kafka_harness import Collector, WorkerProcess, producer
from tests.support.spans import AgentRecorder, encode
from tests.support.worker import running_worker

pytestmark = pytest.mark.kafka

# Series Prometheus makes itself for every target; no exporter has them.
SYNTHETIC = {"up"}
# Grafana's interval variables, given a value PromQL accepts.
GRAFANA_INTERVALS = re.compile(r"\$__(rate_interval|interval|range)\b")


def metric_names(expr: str) -> set[str]:
    """The metric names `expr` selects (vector and range selectors, at any depth)."""
    names: set[str] = set()

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)
        return True

    promql_parser.walk(promql_parser.parse(GRAFANA_INTERVALS.sub("5m", expr)), visit)
    return names


def test_metric_names_are_parsed_not_grepped() -> None:
    expr = 'sum by (rule) (rate(a_total{x="b_total"}[5m])) / on () group_left () c or absent(up)'
    assert metric_names(expr) == {"a_total", "c", "up"}
    assert metric_names("histogram_quantile(0.9, rate(h_bucket[$__rate_interval]))") == {"h_bucket"}


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        text = query.get("query", "") if isinstance(query, dict) else ""
        match = re.fullmatch(r"label_values\((\w+),\s*\w+\)", text)
        if match:
            exprs.append(match.group(1))  # label_values(metric, label): the metric must exist
        else:
            assert not text, f"a templating query this test does not read: {text}"
    return exprs


def shipped_exprs() -> dict[str, list[str]]:
    docs = render(*MONITORING_ON)
    (dashboard_cm,) = [
        d
        for d in docs
        if d["kind"] == "ConfigMap" and "grafana_dashboard" in d["metadata"]["labels"]
    ]
    dashboard = json.loads(dashboard_cm["data"]["spanguard.json"])
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    alerts = {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(alerts) == ALERTS
    return {"dashboard": dashboard_exprs(dashboard), "alerts": list(alerts.values())}


def scrape(port: int) -> dict[str, list[Any]]:
    """Samples by name; a labelled counter declared with no series yet (its labels come with
    its first event) is there with none."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        if family.type == "counter" and not family.samples:
            samples[f"{family.name}_total"] = []
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    with running_worker(tmp_path_factory.mktemp("metrics")) as running:
        yield running.process, running.collector


def loop_through_worker(process: WorkerProcess, collector: Collector, service: str) -> list[Any]:
    """A trace calling one tool 3 times, produced as the Collector would; wait for its kill."""
    agent = AgentRecorder(service)
    for _ in range(3):
        agent.tool("search_docs", {"query": "refund policy"})
    out = producer()
    for span in agent.finished():
        value = encode([span]).SerializeToString()
        out.produce(process.topics.input, key=agent.trace_id.encode(), value=value)
    assert out.flush(10) == 0
    collector.wait(lambda m: m["key"] == agent.trace_id.encode(), timeout=30)
    return agent.finished()


def latency(samples: dict[str, list[Any]], suffix: str) -> dict[str, float]:
    """spanguard_detection_latency_seconds_<suffix> by rule."""
    return {
        s.labels["rule"]: s.value for s in samples[f"spanguard_detection_latency_seconds_{suffix}"]
    }


def scrape_until(port: int, ready: Any, timeout: float = 30.0) -> dict[str, list[Any]]:
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(port)
        if ready(samples):
            return samples
        assert time.monotonic() < deadline, sorted(samples)
        time.sleep(0.2)


def test_every_metric_of_the_dashboard_and_the_alerts_is_exported(worker) -> None:
    exprs = shipped_exprs()  # helm first: a chart that does not render fails before Kafka work
    process, collector = worker
    loop_through_worker(process, collector, "support-bot")
    # The lag timer's first reading, and the latency observed once the signal was acked.
    samples = scrape_until(
        process.port,
        lambda s: "spanguard_consumer_lag" in s and "spanguard_decisions_total" in s,
    )
    for source, expressions in exprs.items():
        assert expressions, source
        for expr in expressions:
            missing = metric_names(expr) - SYNTHETIC - set(samples)
            assert not missing, f"{source}: {expr!r} uses {missing}, not on /metrics"


def test_latency_build_info_lag_and_process_metrics(worker) -> None:
    process, collector = worker
    before = scrape(process.port)
    spans = loop_through_worker(process, collector, "latency-bot")
    count = sum(latency(before, "count").values()) + 1
    samples = scrape_until(process.port, lambda s: sum(latency(s, "count").values()) >= count)
    counts = latency(samples, "count")
    assert counts["tool_loop"] == latency(before, "count")["tool_loop"] + 1
    assert counts["token_budget"] == 0  # a series from the start, at zero
    # Seconds from the 3rd call's end to the ack: positive, and no more than until now.
    observed = latency(samples, "sum")["tool_loop"] - latency(before, "sum")["tool_loop"]
    assert 0 < observed <= time.time() - spans[2].end_time / 1e9
    decisions = samples["spanguard_decisions_total"]
    assert {"rule": "tool_loop", "action": "kill", "service": "latency-bot"} in [
        s.labels for s in decisions
    ]

    # Usage is priced only for a usd budget: the default policy has none, the series are 0.
    priced = {s.labels["outcome"]: s.value for s in samples["spanguard_usage_spans_priced_total"]}
    assert priced == {"priced": 0, "unpriced": 0}
    # Nor does it read tokens (no token budget either): the spend series are there, at 0.
    assert {s.value for s in samples["spanguard_usage_tokens_total"]} == {0}
    assert [s.value for s in samples["spanguard_usage_cost_usd_total"]] == [0]

    (build,) = samples["spanguard_build_info"]
    assert build.labels["version"] == __version__ and build.value == 1
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "python_info"):
        assert name in samples, name
    lags = samples["spanguard_consumer_lag"]
    topics = process.topics
    assert {(s.labels["topic"], s.labels["partition"]) for s in lags} >= {
        (topics.input, "0"),
        (topics.input, "1"),
        (topics.detections, "0"),
        (topics.detections, "1"),
    }
    assert all(s.value >= 0 for s in lags)

    # RocksDB's memory, by table and kind (the store is RocksDB by default): the trace's
    # states were written, so the trace table's memtables hold something, within their bound.
    memory = {
        (s.labels["table"], s.labels["kind"]): s.value
        for s in samples["spanguard_table_memory_bytes"]
    }
    table = "trace-state"  # WorkerSettings.table_name
    assert {kind for name, kind in memory if name == table} == {
        "memtables",
        "block_cache",
        "table_readers",
    }
    assert 0 < memory[(table, "memtables")] < 3 * 16 * 1024 * 1024 * 2  # 2 partitions


def test_tokens_and_dollars_of_a_priced_trace_reach_metrics(tmp_path) -> None:
    """A usd budget prices usage: a real worker's /metrics counts the trace's tokens as priced
    and its cost in dollars, as genai-prices prices gpt-4o, and a made-up model's as unpriced."""
    from datetime import UTC, datetime

    from genai_prices import Usage, calc_price

    # The budget: crossed by the priced trace's second call only.
    policy = "defaults:\n  usd_budget: 0.05\n"
    with running_worker(tmp_path, policy=policy) as running:
        process = running.process
        priced, unpriced = AgentRecorder("priced-bot"), AgentRecorder("unpriced-bot")
        chat = priced.chat(10_000, 1_000, **{"gen_ai.provider.name": "openai"})
        priced.chat(10_000, 1_000, **{"gen_ai.provider.name": "openai"})
        unpriced.chat(500, 50, **{"gen_ai.request.model": "in-house-llm-7b"})
        out = producer()
        for agent in (priced, unpriced):
            for span in agent.finished():
                value = encode([span]).SerializeToString()
                out.produce(process.topics.input, key=agent.trace_id.encode(), value=value)
        assert out.flush(10) == 0

        def tokens(samples: dict[str, list[Any]]) -> dict[str, float]:
            return {s.labels["price"]: s.value for s in samples["spanguard_usage_tokens_total"]}

        samples = scrape_until(
            process.port,
            lambda s: tokens(s).get("unpriced") and s["spanguard_decided_cost_usd_total"],
        )
        assert tokens(samples) == {"priced": 22_000, "unpriced": 550, "off": 0}
        ended = datetime.fromtimestamp(chat.end_time / 1e9, UTC)
        price = calc_price(
            Usage(input_tokens=10_000, output_tokens=1_000),
            "gpt-4o",
            provider_id="openai",
            genai_request_timestamp=ended,
        )
        call = float(price.total_price)  # $0.035 at gpt-4o's $2.50 / $10 per million
        assert 0.025 < call < 0.05, "the budget is set for two calls of this price"
        (cost,) = samples["spanguard_usage_cost_usd_total"]
        assert cost.value == pytest.approx(2 * call, rel=1e-9)
        # The kill carries what the trace had spent: both calls.
        (decided,) = samples["spanguard_decided_cost_usd_total"]
        assert decided.labels == {"rule": "cost_budget", "action": "kill", "scope": "trace"}
        assert decided.value == pytest.approx(2 * call, abs=1e-6)
        (sent,) = samples["spanguard_decisions_sent_total"]
        assert (sent.labels, sent.value) == (decided.labels, 1)
