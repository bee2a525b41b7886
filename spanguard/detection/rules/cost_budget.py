"""cost_budget: the US dollars a trace spent, each inference span priced by the model it names
(spanguard/detection/pricing.py), over the policy's `usd_budget` trips it. Agent spans that
repeat the aggregate count only for a trace without priced inference spans, as for tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING

from spanguard.detection.pricing import micro_usd, pico_usd
from spanguard.detection.rules.base import BudgetRule, Trip
from spanguard.schemas.decision import Spend

if TYPE_CHECKING:
    from spanguard.detection.conventions.events import TokenUsage
    from spanguard.detection.trace_state import TraceState
    from spanguard.schemas.policy import AgentPolicy

__all__ = ["CostBudget", "trace_cost", "trace_tokens"]


def trace_cost(state: TraceState) -> int:
    """The trace's cost so far in pico-dollars: its inference spans', else its agents' totals."""
    return state.inference_cost if state.inference_cost is not None else state.aggregate_cost


def trace_tokens(state: TraceState) -> int:
    """The trace's tokens so far: its inference spans', else its agents' totals."""
    return state.inference_tokens if state.inference_tokens is not None else state.aggregate_tokens


class CostBudget(BudgetRule):
    name = "cost_budget"
    catches = (
        "US dollars a trace spent (tokens priced by model: genai-prices or the policy's prices)"
        " over the budget (a hard cap: it kills)"
    )
    settings = "usd_budget: null (no budget), prices: {}"

    def has_budget(self, policy: AgentPolicy) -> bool:
        return policy.usd_budget is not None

    def check_tokens(
        self, state: TraceState, usage: TokenUsage, policy: AgentPolicy
    ) -> Trip | None:
        if policy.usd_budget is None:
            return None
        spent = trace_cost(state)
        budget = pico_usd(policy.usd_budget)
        if spent <= budget:
            return None
        tokens = trace_tokens(state)
        reason = f"${spent / 1e12:.4f} spent, over the budget of ${policy.usd_budget:g}"
        if state.unpriced_tokens:
            reason += f" (at least: {state.unpriced_tokens} tokens of models without a price)"
        return Trip(
            reason,
            spend=Spend(
                tokens=tokens,
                cost_micro_usd=micro_usd(spent),
                budget_micro_usd=micro_usd(budget),
                unpriced_tokens=state.unpriced_tokens or None,
            ),
        )
