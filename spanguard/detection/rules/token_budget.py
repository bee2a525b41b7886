"""token_budget: input + output tokens per trace from inference spans (agent spans repeat the
aggregate and count only for a trace without inference usage); crossing the budget trips it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from spanguard.detection.pricing import micro_usd
from spanguard.detection.rules.base import BudgetRule, Trip
from spanguard.detection.rules.cost_budget import trace_cost, trace_tokens
from spanguard.schemas.decision import Spend

if TYPE_CHECKING:
    from spanguard.detection.conventions.events import TokenUsage
    from spanguard.detection.trace_state import TraceState
    from spanguard.schemas.policy import AgentPolicy

__all__ = ["TokenBudget"]


class TokenBudget(BudgetRule):
    name = "token_budget"
    catches = "input + output tokens of a trace over the budget (a hard cap: it kills)"
    settings = "token_budget: null (no budget)"

    def has_budget(self, policy: AgentPolicy) -> bool:
        return policy.token_budget is not None

    def check_tokens(
        self, state: TraceState, usage: TokenUsage, policy: AgentPolicy
    ) -> Trip | None:
        budget = policy.token_budget
        if budget is None:
            return None
        used = trace_tokens(state)
        if used <= budget:
            return None
        priced = state.inference_cost is not None or state.aggregate_cost
        return Trip(
            f"{used} tokens used, over the budget of {budget}",
            spend=Spend(
                tokens=used,
                token_budget=budget,
                cost_micro_usd=micro_usd(trace_cost(state)) if priced else None,
            ),
        )
