"""Money per trace: inference spans priced by the model they name (genai-prices' bundled
database, or the policy's own prices), the usd budget, and what a model without a price costs."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from datetime import UTC, datetime

import pytest
from genai_prices import Usage, calc_price

from spanguard.detection.conventions.keys import PRICE_KEYS
from spanguard.detection.explain import explain_records
from spanguard.detection.guard import Guard
from spanguard.detection.pricing import micro_usd, pico_usd
from spanguard.detection.trace_state import TraceState
from spanguard.errors import PolicyError
from spanguard.schemas.decision import KillSignal, keyring, read_signal, sign, validate
from spanguard.schemas.policy import Policy
from tests.support.spans import AgentRecorder, span_id_of

from .test_rules import run


def database_micro_usd(model: str, provider: str, span, **counts: int) -> int:
    """What genai-prices itself says the span's usage cost, at the span's end time."""
    ended = datetime.fromtimestamp(span.end_time / 1e9, UTC)
    price = calc_price(Usage(**counts), model, provider_id=provider, genai_request_timestamp=ended)
    return micro_usd(pico_usd(price.total_price))


def spent(guard: Guard, trace_id: str) -> int:
    state = guard.states[trace_id]
    assert state.inference_cost is not None
    return micro_usd(state.inference_cost)


def test_usage_is_priced_from_the_database_by_model_and_provider():
    agent = AgentRecorder()
    chat = agent.chat(100_000, 10_000, **{"gen_ai.provider.name": "openai"})
    cached = agent.chat(
        100_000,
        2_000,
        **{"gen_ai.provider.name": "openai", "gen_ai.usage.cache_read.input_tokens": 80_000},
    )
    guard = Guard(price_usage=True)
    assert run(guard, agent.finished()) == []
    expected = database_micro_usd(
        "gpt-4o", "openai", chat, input_tokens=100_000, output_tokens=10_000
    ) + database_micro_usd(
        "gpt-4o",
        "openai",
        cached,
        input_tokens=100_000,
        cache_read_tokens=80_000,
        output_tokens=2_000,
    )
    assert spent(guard, agent.trace_id) == expected
    # Cached input is cheaper than fresh input: the second call, with more cache, cost less.
    assert expected < 2 * database_micro_usd(
        "gpt-4o", "openai", chat, input_tokens=100_000, output_tokens=10_000
    )
    assert (guard.stats.priced_usage, guard.stats.unpriced_usage) == (2, 0)


def test_response_model_and_the_ai_sdk_provider_names_are_understood():
    agent = AgentRecorder()
    span = agent.span(
        "ai.generateText.doGenerate",
        {
            "ai.operationId": "ai.generateText.doGenerate",
            "ai.model.id": "gpt-4o-mini",
            "ai.model.provider": "openai.chat",
            "ai.usage.inputTokens": 50_000,
            "ai.usage.outputTokens": 5_000,
        },
    )
    guard = Guard(price_usage=True)
    run(guard, agent.finished())
    assert spent(guard, agent.trace_id) == database_micro_usd(
        "gpt-4o-mini", "openai", span, input_tokens=50_000, output_tokens=5_000
    )


def test_tiered_prices_go_through_the_databases_own_calculation():
    # gemini-2.5-pro costs more per token past 200k input tokens.
    agent = AgentRecorder()
    small = agent.chat(
        100_000, 1_000, **{"gen_ai.request.model": "gemini-2.5-pro", "gen_ai.system": "gcp.gemini"}
    )
    large = agent.chat(
        300_000, 1_000, **{"gen_ai.request.model": "gemini-2.5-pro", "gen_ai.system": "gcp.gemini"}
    )
    guard = Guard(price_usage=True)
    run(guard, agent.finished())
    small_cost = database_micro_usd(
        "gemini-2.5-pro", "google", small, input_tokens=100_000, output_tokens=1_000
    )
    large_cost = database_micro_usd(
        "gemini-2.5-pro", "google", large, input_tokens=300_000, output_tokens=1_000
    )
    assert large_cost > 3 * small_cost  # the tier applied
    assert spent(guard, agent.trace_id) == small_cost + large_cost


def test_usd_budget_kills_on_the_span_that_crossed_it_with_money_in_micro_dollars():
    policy = Policy.from_mapping(
        {
            "defaults": {
                "usd_budget": 1.0,
                "prices": {"gpt-4o": {"input_mtok": 2, "output_mtok": 10}},
            }
        }
    )
    agent = AgentRecorder()
    for _ in range(4):
        agent.chat(100_000, 20_000)  # 0.20 + 0.20 = $0.40 a call: crosses $1 on the 3rd
    decisions = run(Guard(policy), agent.finished())
    assert len(decisions) == 1
    decision = decisions[0]
    chats = [s for s in agent.finished() if s.name.startswith("chat")]
    assert decision.span_id == span_id_of(chats[2])
    assert (decision.rule, decision.action) == ("cost_budget", "kill")
    assert (decision.spend.cost_micro_usd, decision.spend.budget_micro_usd) == (
        1_200_000,
        1_000_000,
    )
    assert decision.spend.tokens == 360_000
    assert "$1.2000 spent, over the budget of $1" in decision.reason
    validate(decision.to_dict(), "detection")
    signal = KillSignal.from_decision(decision)
    assert signal.evidence["cost_micro_usd"] == 1_200_000
    key = b"spanguard-test-key-current-0001"
    record = sign(signal.to_dict(), key)
    validate(record, "kill-signal")
    read = read_signal(json.dumps(record).encode(), keyring(key))  # safe integers only
    assert read.evidence["budget_micro_usd"] == 1_000_000
    explained = explain_records(decision.trace_id, [decision.to_dict()])
    assert "budget $1.0000 per trace" in explained
    assert "360000 tokens, $1.2000" in explained


def test_policy_prices_come_before_the_database_and_match_any_case():
    policy = Policy.from_mapping(
        {
            "defaults": {
                "usd_budget": 100,
                "prices": {
                    "My-Finetune": {"input_mtok": 1.5, "output_mtok": 6, "cache_read_mtok": 0.15}
                },
            }
        }
    )
    agent = AgentRecorder()
    agent.chat(
        1_000_000,
        100_000,
        **{"gen_ai.request.model": "my-finetune", "gen_ai.usage.cache_read.input_tokens": 500_000},
    )
    guard = Guard(policy)
    run(guard, agent.finished())
    # 500k fresh at 1.5 + 500k cached at 0.15 + 100k out at 6 = 0.75 + 0.075 + 0.6
    assert spent(guard, agent.trace_id) == 1_425_000


def test_a_model_without_a_price_is_warned_once_counted_and_never_free(caplog):
    policy = Policy.from_mapping({"defaults": {"usd_budget": 0.01}})
    agent = AgentRecorder()
    for _ in range(3):
        agent.chat(1_000, 100, **{"gen_ai.request.model": "in-house-llm-7b"})
    guard = Guard(policy)
    with caplog.at_level(logging.WARNING, logger="spanguard.core"):
        decisions = run(guard, agent.finished())
    warnings = [r for r in caplog.records if "in-house-llm-7b" in r.getMessage()]
    assert len(warnings) == 1 and "not as free" in warnings[0].getMessage()
    assert decisions == []  # nothing priced: no budget crossed on a made-up zero
    state = guard.states[agent.trace_id]
    assert state.unpriced_tokens == 3_300 and state.inference_cost is None
    assert (guard.stats.priced_usage, guard.stats.unpriced_usage) == (0, 3)


def test_without_the_price_database_only_policy_prices_apply_and_the_rest_is_unpriced(caplog):
    """An agent's lean install has no genai-prices (the `prices` extra): gpt-4o, which the
    database knows, is then unpriced and warned about with the install line, never free."""
    policy = Policy.from_mapping(
        {
            "defaults": {
                "usd_budget": 100,
                "prices": {"my-model": {"input_mtok": 1, "output_mtok": 1}},
            }
        }
    )
    agent = AgentRecorder()
    agent.chat(1_000_000, 0, **{"gen_ai.request.model": "my-model"})
    agent.chat(1_000, 100, **{"gen_ai.request.model": "gpt-4o"})
    guard = Guard(policy)
    assert guard.pricer is not None
    guard.pricer.has_database = False
    with caplog.at_level(logging.WARNING, logger="spanguard.core"):
        run(guard, agent.finished())
    warnings = [r.getMessage() for r in caplog.records if "gpt-4o" in r.getMessage()]
    assert len(warnings) == 1 and "spanguard[prices]" in warnings[0]
    assert spent(guard, agent.trace_id) == 1_000_000
    assert guard.states[agent.trace_id].unpriced_tokens == 1_100
    assert (guard.stats.priced_usage, guard.stats.unpriced_usage) == (1, 1)


def test_a_cost_with_unpriced_tokens_says_it_is_a_lower_bound():
    policy = Policy.from_mapping(
        {"defaults": {"usd_budget": 0.5, "prices": {"gpt-4o": {"input_mtok": 5, "output_mtok": 5}}}}
    )
    agent = AgentRecorder()
    agent.chat(50_000, 0, **{"gen_ai.request.model": "mystery-model"})
    agent.chat(200_000, 0)  # $1.00
    (decision,) = run(Guard(policy), agent.finished())
    assert decision.spend.unpriced_tokens == 50_000
    assert "at least" in decision.reason
    assert "50000 tokens of models without a price" in explain_records(
        decision.trace_id, [decision.to_dict()]
    )


def test_without_a_usd_budget_nothing_is_priced_and_no_price_key_is_read():
    guard = Guard(Policy.from_mapping({"defaults": {"token_budget": 1000}}))
    assert guard.pricer is None and guard.wanted_keys.isdisjoint(PRICE_KEYS)
    agent = AgentRecorder()
    agent.chat(100, 10)
    run(guard, agent.finished())
    assert guard.states[agent.trace_id].inference_cost is None


def test_the_cost_survives_the_changelog():
    policy = Policy.from_mapping({"defaults": {"usd_budget": 10}})
    agent = AgentRecorder()
    agent.chat(10_000, 1_000, **{"gen_ai.provider.name": "openai"})
    agent.chat(10_000, 1_000, **{"gen_ai.request.model": "unknown-model"})
    guard = Guard(policy)
    run(guard, agent.finished())
    state = guard.states[agent.trace_id]
    back = TraceState.from_bytes(state.to_bytes())
    assert back.inference_cost == state.inference_cost > 0
    assert back.unpriced_tokens == 11_000
    # A trace never priced writes none of the cost keys.
    assert "inference_cost" not in TraceState().to_dict()


@pytest.mark.parametrize(
    "settings, field",
    [
        ({"usd_budget": 0}, "usd_budget"),
        ({"usd_budget": -1}, "usd_budget"),
        ({"prices": {"m": {"input_mtok": 1}}}, "prices.m"),
        ({"prices": {"m": {"input_mtok": 1, "output_mtok": -2}}}, "prices.m.output_mtok"),
        ({"prices": {"m": {"input_mtok": 1, "output_mtok": 2, "per_request": 1}}}, "prices.m"),
    ],
)
def test_bad_money_settings_name_the_field(settings, field):
    with pytest.raises(PolicyError, match=f"field defaults.{field}"):
        Policy.from_mapping({"defaults": settings})


def test_effective_policy_round_trips_money_settings():
    policy = Policy.from_mapping(
        {
            "defaults": {
                "usd_budget": 2.5,
                "prices": {"m": {"input_mtok": 1, "output_mtok": 2}},
            }
        }
    )
    assert Policy.from_mapping(policy.effective()) == policy


def test_pricing_works_offline_from_the_bundled_database():
    """No network at any point: sockets refuse to connect before genai-prices is imported."""
    script = """
import socket
def refuse(*args, **kwargs):
    raise OSError("network used")
socket.socket.connect = refuse
socket.create_connection = refuse
socket.getaddrinfo = refuse
from spanguard.detection.conventions.events import TokenUsage
from spanguard.detection.pricing import Pricer
usage = TokenUsage(b"12345678", 1100, False, None, None, 1_780_000_000_000_000_000,
                   input_tokens=1000, output_tokens=100, request_model="gpt-4o", provider="openai")
pricer = Pricer()
print(pricer.cost(usage), pricer.cost(usage))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.split()
    assert first == second and int(first) > 0


def test_the_replay_page_shows_each_tripped_traces_tokens_and_cost(tmp_path):
    import io

    from spanguard.cli.replay import replay
    from spanguard.schemas.otlp import encode_json_line
    from tests.support.spans import encode

    agent = AgentRecorder()
    chat = agent.chat(100_000, 10_000, **{"gen_ai.provider.name": "openai"})
    for _ in range(4):
        agent.tool("search_docs", {"query": "refund policy"})
    path = tmp_path / "spans.jsonl"
    path.write_text(encode_json_line(encode(agent.finished())) + "\n")
    page = tmp_path / "page.html"
    err = io.StringIO()
    replay([str(path)], Policy(), stdout=io.StringIO(), stderr=err, html=str(page))
    cost = database_micro_usd("gpt-4o", "openai", chat, input_tokens=100_000, output_tokens=10_000)
    assert f"110,000 tokens · ${cost / 1e6:,.4f}" in page.read_text()
    assert "1 usage spans priced, 0 without a price" in err.getvalue()


def test_the_guard_counts_tokens_by_price_and_the_cost_of_the_priced_ones():
    """What the worker exports as spanguard_usage_tokens_total{price} and
    spanguard_usage_cost_usd_total: the traces' spend as their budgets count it."""
    policy = Policy.from_mapping({"defaults": {"usd_budget": 1000}})
    priced, unpriced = AgentRecorder(), AgentRecorder()
    priced.chat(1_000, 100, **{"gen_ai.provider.name": "openai"})
    priced.chat(2_000, 200, **{"gen_ai.provider.name": "openai"})
    # The agent's own total repeats its inference spans: counted once, not twice.
    priced.finish(**{"gen_ai.usage.input_tokens": 3_000, "gen_ai.usage.output_tokens": 300})
    unpriced.chat(500, 50, **{"gen_ai.request.model": "in-house-llm-7b"})
    guard = Guard(policy)
    run(guard, [*priced.finished(), *unpriced.finished()])
    stats = guard.stats
    assert (stats.tokens_priced, stats.tokens_unpriced, stats.tokens_not_priced) == (3_300, 550, 0)
    assert stats.cost_pico_usd == guard.states[priced.trace_id].inference_cost > 0

    # A token budget without a usd one reads tokens and prices none.
    plain = AgentRecorder()
    plain.chat(700, 70)
    tokens_only = Guard(Policy.from_mapping({"defaults": {"token_budget": 1_000_000}}))
    run(tokens_only, plain.finished())
    stats = tokens_only.stats
    assert (stats.tokens_priced, stats.tokens_unpriced, stats.tokens_not_priced) == (0, 0, 770)
    assert stats.cost_pico_usd == 0


def test_rates_kept_per_model_and_day_keep_a_policys_prices_apart_from_the_databases():
    from spanguard.detection.conventions.events import TokenUsage
    from spanguard.detection.pricing import ModelRates, Pricer

    def usage(day: int) -> TokenUsage:
        ended = 1_780_000_000_000_000_000 + day * 86_400 * 10**9
        span = TokenUsage(b"12345678", 1100, False, None, None, ended)
        span.input_tokens, span.output_tokens = 1000, 100
        span.request_model, span.provider = "gpt-4o", "openai"
        return span

    pricer = Pricer()
    override = {"gpt-4o": ModelRates.per_million({"input_mtok": 1, "output_mtok": 2})}
    database = Pricer().cost(usage(0))
    assert database is not None
    # The same span priced under a policy's own price, then under none, then again: each
    # answer is its own, the second and third from what the first ones kept.
    for _ in range(2):
        assert pricer.cost(usage(0), override) == 1000 * 10**6 + 100 * 2 * 10**6
        assert pricer.cost(usage(0)) == database
    # Another day is looked up again (a price changes by date), and answers alike here.
    assert pricer.cost(usage(1)) == Pricer().cost(usage(1))
    assert pricer.priced_events == 5
