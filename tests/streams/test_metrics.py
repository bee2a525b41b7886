"""Every counted outcome is on /metrics, with the count its owner reported.

The outcome enums are found in the source tree (every subclass of CountedOutcome declared in
a module of the installed package), not taken from the metrics module, so an enum or a member
added later fails here until the worker exports it. The worker is built in-process by
create_app (no broker is contacted) and scraped through its own registry.
"""

from __future__ import annotations

import ast
import importlib
import json
import tomllib
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from spanguard.config.settings import GoalSettings, WorkerSettings
from spanguard.goal.verifier import GoalVerifier
from spanguard.outcomes import Counted, CountedOutcome, Tally
from spanguard.schemas.policy import Policy
from spanguard.streams.app import create_app
from spanguard.streams.metrics import EXPORTED, Series
from tests.support.python_source import parse_python

ROOT = Path(__file__).resolve().parents[2]


def _package_modules() -> dict[str, Path]:
    """Import name -> file, for every module of the folders pyproject.toml installs."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found = {}
    for package, folder in config["tool"]["setuptools"]["package-dir"].items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            found[".".join([package, *(p for p in parts if p != "__init__")])] = path
    return found


def outcome_enums() -> set[type[CountedOutcome]]:
    """Every CountedOutcome enum declared in the source tree, imported."""
    enums = set()
    for module, path in _package_modules().items():
        for node in ast.walk(parse_python(path)):
            if isinstance(node, ast.ClassDef) and any(
                ast.unparse(base).endswith("CountedOutcome") for base in node.bases
            ):
                enums.add(getattr(importlib.import_module(module), node.name))
    return enums


def report(source: Counted, outcome: CountedOutcome, times: int) -> None:
    """Count `outcome` `times` times the way its owner does: into a tally, or (the guard's
    hot-path counters, the pipeline's, the release reader's) the field the member names."""
    if isinstance(source, Tally):
        source.add(outcome, times)
    else:
        setattr(source, outcome.value, getattr(source, outcome.value) + times)


def scrape(app) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = generate_latest(app.spanguard.registry).decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample_key(series: Series) -> tuple[str, frozenset[tuple[str, str]]]:
    return f"spanguard_{series.metric}_total", frozenset(series.labels)


def worker_app():
    verifier = GoalVerifier(
        Policy(),
        GoalSettings(),
        judge_factory=lambda model: None,  # never asked: no checks
    )
    return create_app(WorkerSettings(allow_unsigned=True), verifier=verifier)


def test_the_source_tree_declares_the_outcome_enums_the_worker_counts() -> None:
    names = {kind.__name__ for kind in outcome_enums()}
    # The owners named in the design: a rename or a move must not make them vanish silently.
    assert {
        "GuardCount",
        "PipelineCount",
        "PageOutcome",
        "WebhookOutcome",
        "GoalOutcome",
        "ReleaseCount",
        "SpanCount",
        "HealthCount",
        "ReleaseSkip",
    } <= names


def test_every_counted_outcome_is_exported_with_its_count() -> None:
    app = worker_app()
    counted = app.spanguard.counted
    expected: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    times = 0
    for kind in sorted(outcome_enums(), key=lambda kind: kind.__name__):
        assert kind in counted, f"no part of the worker counts {kind.__name__}"
        for outcome in kind:
            assert outcome in EXPORTED, f"{kind.__name__}.{outcome.name} is not exported"
            times += 1  # a different count per member: a mix-up shows
            report(counted[kind], outcome, times)
            for series in EXPORTED[outcome]:
                key = sample_key(series)
                expected[key] = expected.get(key, 0) + times * series.scale
    scraped = scrape(app)
    for key, value in expected.items():
        assert scraped.get(key) == value, key


def test_unreadable_detections_are_exported_for_paging_and_the_webhook() -> None:
    app = worker_app()
    worker = app.spanguard
    assert worker.paging.detection_to_page(b"not json", set()) is None
    scraped = scrape(app)
    unreadable = frozenset({("outcome", "unreadable")})
    assert scraped[("spanguard_pages_total", unreadable)] == 1
    assert scraped[("spanguard_webhooks_total", unreadable)] == 0
    assert scraped[("spanguard_dead_letters_total", frozenset())] == 0  # counted, not sent


def test_an_undeliverable_page_is_a_page_outcome_and_a_dead_letter() -> None:
    from spanguard.alerting.service import PageOutcome
    from spanguard.detection.pipeline import PipelineCount

    app = worker_app()
    worker = app.spanguard
    worker.paging.outcomes.add(PageOutcome.FAILED)
    worker.pipeline.handle(None, b"")  # an empty message: a dead letter of the pipeline
    assert worker.pipeline.count(PipelineCount.DEAD_LETTERS) == 1
    scraped = scrape(app)
    assert scraped[("spanguard_pages_total", frozenset({("outcome", "failed")}))] == 1
    assert scraped[("spanguard_dead_letters_total", frozenset())] == 2


def test_usage_is_exported_as_tokens_by_price_and_dollars() -> None:
    from spanguard.detection.guard import GuardCount

    app = worker_app()
    stats = app.spanguard.counted[GuardCount]
    stats.tokens_priced, stats.tokens_unpriced, stats.tokens_not_priced = 3_300, 550, 70
    stats.cost_pico_usd = 12_345_678_901_234  # $12.345678901234
    scraped = scrape(app)
    tokens = {
        price: scraped[("spanguard_usage_tokens_total", frozenset({("price", price)}))]
        for price in ("priced", "unpriced", "off")
    }
    assert tokens == {"priced": 3_300, "unpriced": 550, "off": 70}
    assert scraped[("spanguard_usage_cost_usd_total", frozenset())] == pytest.approx(
        12.345678901234, rel=1e-12
    )


def test_every_dashboard_panel_reads_metrics_the_worker_exports() -> None:
    """The shipped dashboard against the worker's own registry, in-process: every metric a
    panel's expression selects is a family on /metrics (tests/streams/test_metrics_kafka.py
    checks the same against a worker on the broker, with samples)."""
    from tests.streams.test_metrics_kafka import dashboard_exprs, metric_names

    dashboard = json.loads(
        (ROOT / "helm" / "spanguard" / "dashboards" / "spanguard.json").read_text()
    )
    text = generate_latest(worker_app().spanguard.registry).decode()
    exported = set()
    for family in text_string_to_metric_families(text):
        exported.add(family.name)
        exported.update(sample.name for sample in family.samples)
        if family.type == "counter":
            exported.add(f"{family.name}_total")
        if family.type == "histogram":
            exported.update(f"{family.name}_{suffix}" for suffix in ("bucket", "sum", "count"))
    for expr in dashboard_exprs(dashboard):
        missing = metric_names(expr) - exported
        assert not missing, f"{expr!r} uses {missing}, not exported by the worker"
    titles = " ".join(panel["title"] for panel in dashboard["panels"]).lower()
    for topic in (
        "tokens per second",
        "us dollars per hour",
        "budget decisions",
        "spend (24h)",
        "decisions with cost",
    ):
        assert topic in titles, topic


def test_every_decision_sent_is_counted_with_its_spend_by_rule_action_and_scope() -> None:
    """The outbox tells the metrics of each decision it sends, whatever its scope: it is
    counted, and what a priced budget's decision carries is summed (none: nothing added)."""
    from spanguard.detection.pipeline import Outcome
    from spanguard.schemas.decision import AgentIdentity, Decision, DecisionScope, ScopeKind, Spend

    def decision(rule: str, cost: int | None, scope: ScopeKind | None = None) -> Decision:
        return Decision(
            trace_id="a" * 32,
            span_id="b" * 16,
            rule=rule,  # type: ignore[arg-type]
            action="kill",
            reason="over budget",
            agent=AgentIdentity("support", None),
            detected_at="2026-06-01T12:00:00.000+00:00",
            spend=Spend(cost_micro_usd=cost),
            scope=DecisionScope(scope) if scope is not None else None,
        )

    app = worker_app()
    decisions = [
        decision("cost_budget", 2_600_000),
        decision("cost_budget", 1_400_001),
        decision("agent_budget", 9_000_000, scope="agent"),
        decision("tool_loop", None),
    ]
    app.spanguard.outbox.sends_for(Outcome(decisions=decisions), None)
    scraped = scrape(app)
    decided = {
        dict(labels)["rule"]: value
        for (name, labels), value in scraped.items()
        if name == "spanguard_decided_cost_usd_total"
    }
    assert decided == {"cost_budget": pytest.approx(4.000001), "agent_budget": 9.0}
    sent = {
        tuple(sorted(labels)): value
        for (name, labels), value in scraped.items()
        if name == "spanguard_decisions_sent_total"
    }
    assert sent == {
        (("action", "kill"), ("rule", "cost_budget"), ("scope", "trace")): 2,
        (("action", "kill"), ("rule", "agent_budget"), ("scope", "agent")): 1,
        (("action", "kill"), ("rule", "tool_loop"), ("scope", "trace")): 1,
    }
    assert scraped[
        (
            "spanguard_decided_cost_usd_total",
            frozenset({("rule", "agent_budget"), ("action", "kill"), ("scope", "agent")}),
        )
    ] == pytest.approx(9.0)


def test_the_last_span_batch_time_appears_once_a_batch_completes() -> None:
    app = worker_app()
    health = app.spanguard.health
    name = ("spanguard_last_span_batch_timestamp_seconds", frozenset())
    assert name not in scrape(app)  # no batch yet: no time, not a zero
    health.wall_clock = lambda: 1_764_831_234.567
    health.progressed()
    assert scrape(app)[name] == 1_764_831_234.567
    health.wall_clock = lambda: 1_764_831_240.125
    health.progressed()
    assert scrape(app)[name] == 1_764_831_240.125
