"""The guard's rules, one module each, named for what it catches; `RULES` is the registry.

Adding a rule: a module here with a `Rule` subclass (base.py), its policy section in
schemas/policy.py and policy.schema.json, its entry in `RULES` and its tests. The guard runs
the tool-call rules in the registry's order (the first decision on a call wins), and the
README's rule table is this registry's (`python -m spanguard.detection.rules` prints it; a
test fails when the two differ).
"""

from __future__ import annotations

from spanguard.detection.rules.base import Rule
from spanguard.detection.rules.cost_budget import CostBudget
from spanguard.detection.rules.cycle import Cycle
from spanguard.detection.rules.no_progress import NoProgress
from spanguard.detection.rules.token_budget import TokenBudget
from spanguard.detection.rules.tool_loop import ToolLoop
from spanguard.detection.rules.tool_polling import ToolPolling

__all__ = [
    "COST_BUDGET",
    "CYCLE",
    "NO_PROGRESS",
    "RULES",
    "TOKEN_BUDGET",
    "TOOL_LOOP",
    "TOOL_POLLING",
    "markdown_table",
    "rule_named",
]

TOOL_LOOP = ToolLoop()
CYCLE = Cycle()
TOOL_POLLING = ToolPolling()
NO_PROGRESS = NoProgress()
TOKEN_BUDGET = TokenBudget()
COST_BUDGET = CostBudget()

# In the order the guard runs them on a call.
RULES: tuple[Rule, ...] = (TOOL_LOOP, CYCLE, TOOL_POLLING, NO_PROGRESS, TOKEN_BUDGET, COST_BUDGET)


def rule_named(name: str) -> Rule:
    for rule in RULES:
        if rule.name == name:
            return rule
    raise KeyError(f"no rule named {name!r} (rules: {', '.join(r.name for r in RULES)})")


def markdown_table() -> str:
    """The README's rule table, from the registry."""
    lines = [
        "| rule | catches | policy section (defaults) | default action |",
        "|---|---|---|---|",
    ]
    for rule in RULES:
        lines.append(
            f"| `{rule.name}` | {rule.catches} | `{rule.settings}` | {rule.default_action} |"
        )
    return "\n".join(lines) + "\n"
