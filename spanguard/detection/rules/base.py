"""What a rule is: the interface each rule module implements, its fired mark and what it trips.

The guard keys each call once, (tool name, args hash, result hash), and keeps the trace's
window of keys; a rule gets that key and the state, keeps its own counts up to date on every
call if it has any (`counts = True` and `count`), and decides (`check`): a `Trip` with the
evidence, or None. What happens next is the same for every rule and lives in the guard (one
decision per trace and rule, downgrade then kill where the policy says, a flag in shadow mode,
re-armed by an operator's release); a rule never builds a Decision itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Final, NamedTuple

from mypy_extensions import mypyc_attr

from spanguard.schemas.decision import NO_EVIDENCE, NO_SPEND, Evidence, Spend

if TYPE_CHECKING:
    from spanguard.detection.conventions.events import AgentRun, TokenUsage, ToolCall
    from spanguard.detection.trace_state import CallKey, TraceState
    from spanguard.schemas.decision import Decision
    from spanguard.schemas.policy import AgentPolicy

__all__ = [
    "DOWNGRADE",
    "FLAG",
    "KILL",
    "OFF",
    "PAUSE",
    "AgentRule",
    "BudgetRule",
    "Fired",
    "GuardObserver",
    "Rule",
    "TokenRule",
    "ToolCallRule",
    "Trip",
]

KILL: Final = "kill"
DOWNGRADE: Final = "downgrade"
FLAG: Final = "flag"
PAUSE: Final = "pause"  # the agent waits for an operator's release or kill, or the timeout
OFF: Final = "off"  # what `wanted` answers when the policy switches the rule off


class Fired(NamedTuple):
    """A decision a trace's rule has taken already: (rule, action)."""

    rule: str
    action: str

    def __str__(self) -> str:
        return f"{self.rule}:{self.action}"  # the changelog's form, in every state version

    @classmethod
    def parse(cls, text: str) -> Fired:
        rule, _, action = text.partition(":")
        return cls(rule, action)


@dataclass(slots=True)
class Trip:
    """What a rule found: the reason, and the evidence or the spend the decision carries."""

    reason: str
    evidence: Evidence = NO_EVIDENCE
    spend: Spend = NO_SPEND
    # The system message the agent gets if this trip is a downgrade.
    message: str | None = None
    # The evidence cannot tell a loop from healthy work (arguments not recorded): only a flag.
    flag_only: bool = False


@mypyc_attr(allow_interpreted_subclasses=True)
class Rule:
    """One rule of the guard. Subclasses set the class attributes and implement `check`."""

    name: ClassVar[str]
    catches: ClassVar[str]  # one line for people: what it catches (the README's table)
    settings: ClassVar[str]  # the policy section that configures it
    default_action: ClassVar[str]  # what it does under the default policy
    # An operator's release lets the agent call tools again: a rule that killed the trace for
    # what it did counts again from a fresh window. A spent token budget stays spent.
    rearm_on_release: ClassVar[bool] = True
    # After a kill or downgrade the rules count from a fresh window (the agent got a message).
    restarts_window: ClassVar[bool] = True
    # Its decisions may stop the agent (kill, downgrade, pause: a kill signal, so its name is
    # in the kill signal's rule enum and every client's list); False: it only ever flags.
    stops_agent: ClassVar[bool] = True

    def __init__(self) -> None:
        self.killed = Fired(self.name, KILL)
        self.flagged = Fired(self.name, FLAG)
        self.downgraded = Fired(self.name, DOWNGRADE)
        self.paused = Fired(self.name, PAUSE)

    def wanted(self, policy: AgentPolicy) -> str:
        """What `policy` asks of this rule: kill, downgrade, pause, flag, or off."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<rule {self.name}>"


@mypyc_attr(allow_interpreted_subclasses=True)
class ToolCallRule(Rule):
    """A rule over a trace's tool calls. The `key` its methods get is the guard's key of the
    call, (tool name, args hash, result hash); a rule that counts over a window of its own keeps
    it in the state (tool_polling's `polls`)."""

    # True when `count` keeps state of its own: the guard calls it on every counted call.
    counts: ClassVar[bool] = False
    # True when it reads only the calls of traces with agents (a handoff, or a trace with an
    # agent tree): the guard asks it about no other call, at no cost to single-agent traces.
    agents_only: ClassVar[bool] = False

    def count(self, state: TraceState, call: ToolCall, key: CallKey, policy: AgentPolicy) -> None:
        """Bring the rule's own counts up to date with this call, before the call joins the
        trace's window and before any rule decides."""

    def check(
        self, state: TraceState, call: ToolCall, key: CallKey, policy: AgentPolicy
    ) -> Trip | None:
        raise NotImplementedError


@mypyc_attr(allow_interpreted_subclasses=True)
class TokenRule(Rule):
    """A rule over a trace's token usage (the guard keeps the totals in the state)."""

    def check_tokens(
        self, state: TraceState, usage: TokenUsage, policy: AgentPolicy
    ) -> Trip | None:
        raise NotImplementedError


class BudgetRule(TokenRule):
    """A hard cap on what a trace spends: off without a budget, else it kills (or pauses, once,
    where the policy pauses: then the answer stands). What was spent stays spent: a release
    does not re-arm it, and a kill starts no fresh window."""

    default_action = "off (no budget); kill when one is set"
    rearm_on_release = False
    restarts_window = False

    def has_budget(self, policy: AgentPolicy) -> bool:
        raise NotImplementedError

    def wanted(self, policy: AgentPolicy) -> str:
        if not self.has_budget(policy):
            return OFF
        return PAUSE if policy.action == PAUSE else KILL


@mypyc_attr(allow_interpreted_subclasses=True)
class AgentRule(Rule):
    """A rule over a trace's agent tree (`state.agent_tree`, spanguard/detection/agent_tree.py):
    the guard asks it after each agent run it places there."""

    def check_run(self, state: TraceState, run: AgentRun, policy: AgentPolicy) -> Trip | None:
        raise NotImplementedError


@mypyc_attr(allow_interpreted_subclasses=True)
class GuardObserver:
    """What the guard tells observers (metrics, the replay page): override what you need.

    Called on the hot path, in the guard's thread: keep it cheap and never raise.
    """

    def on_tool_call(
        self, trace_id: str, state: TraceState, call: ToolCall, key: CallKey | None
    ) -> None:
        """A tool call the guard read: its key, or None when no rule counted it (arguments
        not recorded under `missing_args: skip`, or a tool the policy exempts)."""

    def on_decision(self, decision: Decision, state: TraceState) -> None:
        """A decision the guard took (before it is returned to the caller)."""
