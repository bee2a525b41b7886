"""The guard's rules, one module each, named for what it catches; `RULES` is the registry.

Adding a rule: docs/rules.md, "Adding a rule". The guard runs the tool-call rules in the
registry's order (the first decision on a call wins). Every list of rule names outside Python
(the README's rule table, the schemas' `rule` enums, `Rule` in schemas/decision.py, the
killswitch clients' lists) is this registry's, written by scripts/rule_lists.py (a test fails
when one differs).
"""

from __future__ import annotations

from spanguard.detection.rules.agent_fan_out import AgentFanOut
from spanguard.detection.rules.base import Rule
from spanguard.detection.rules.cost_budget import CostBudget
from spanguard.detection.rules.cycle import Cycle
from spanguard.detection.rules.delegation_depth import DelegationDepth
from spanguard.detection.rules.handoff_cycle import HandoffCycle
from spanguard.detection.rules.no_progress import NoProgress
from spanguard.detection.rules.token_budget import TokenBudget
from spanguard.detection.rules.tool_loop import ToolLoop
from spanguard.detection.rules.tool_polling import ToolPolling

__all__ = [
    "AGENT_FAN_OUT",
    "CONTAINING_RULES",
    "COST_BUDGET",
    "CYCLE",
    "DELEGATION_DEPTH",
    "HANDOFF_CYCLE",
    "NO_PROGRESS",
    "OTHER_RULES",
    "RULES",
    "TOKEN_BUDGET",
    "TOOL_LOOP",
    "TOOL_POLLING",
    "markdown_table",
    "rule_named",
    "rule_names",
]

TOOL_LOOP = ToolLoop()
CYCLE = Cycle()
TOOL_POLLING = ToolPolling()
NO_PROGRESS = NoProgress()
TOKEN_BUDGET = TokenBudget()
COST_BUDGET = CostBudget()
HANDOFF_CYCLE = HandoffCycle()
DELEGATION_DEPTH = DelegationDepth()
AGENT_FAN_OUT = AgentFanOut()

# In the order the guard runs them on a call (handoffs are handoff_cycle's alone: see its module).
RULES: tuple[Rule, ...] = (
    TOOL_LOOP,
    CYCLE,
    TOOL_POLLING,
    NO_PROGRESS,
    TOKEN_BUDGET,
    COST_BUDGET,
    HANDOFF_CYCLE,
    DELEGATION_DEPTH,
    AGENT_FAN_OUT,
)
# The names a decision may carry besides the registry's rules, and whether it may stop the
# agent: the agent scope's budget (spanguard/detection/agent_budget.py), the goal verifier's
# verdict (it only flags), an operator's `spanguard kill` or `release`, and the fleet rules over
# one tool across every agent (spanguard/detection/fleet.py: their action `contain` refuses the
# tool to every client, it stops no agent).
OTHER_RULES: tuple[tuple[str, bool], ...] = (
    ("agent_budget", True),
    ("goal_unmet", False),
    ("manual", True),
    ("tool_failing", False),
    ("loop_signature", False),
)
# The fleet rules: they stop no agent, but their signals contain a tool (scope tool), so a kill
# signal may carry them.
CONTAINING_RULES = frozenset({"tool_failing", "loop_signature"})


def rule_named(name: str) -> Rule:
    for rule in RULES:
        if rule.name == name:
            return rule
    raise KeyError(f"no rule named {name!r} (rules: {', '.join(r.name for r in RULES)})")


def rule_names(*, signals: bool = False) -> list[str]:
    """Every rule name a detection may carry, in the wire schemas' order: the registry's, then
    the others; `signals`: only those a kill signal may carry (they may stop the agent, or
    contain a tool)."""
    named = [(rule.name, rule.stops_agent) for rule in RULES] + list(OTHER_RULES)
    return [
        name
        for name, stops_agent in named
        if stops_agent or not signals or name in CONTAINING_RULES
    ]


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
