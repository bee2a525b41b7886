"""The guard policy: defaults plus per-agent overrides, read from YAML and checked by JSON Schema.

Shape (every field optional):

    defaults:
      loop: {window: 10, threshold: 3, failing_threshold: null, enabled: true}
                                 # failing_threshold: the same call failing trips at this
                                 #   many instead (null: threshold)
      polling: {window: 30, threshold: 20, tools: [], enabled: true}   # changing result
      tools: {}                  # tool name -> {threshold, window} for tool_loop, or
                                 #   {exempt: true}: no rule counts its calls, or
                                 #   {exempt_when: {action: [scroll_down]}}: those calls, or
                                 #   {cycle: false}: a cycle with a call of it does not trip
      cycle: {max_period: 10, repeats: 3, compare_results: true, enabled: true}
                                 # a sequence of calls repeated; compare_results false:
                                 #   by tool and arguments alone
      no_progress: {threshold: 4, action: flag}  # different calls, one same empty result
      multi_agent: {cycles: 2, max_depth: 5, max_sub_agents: 20}
                                 # agents of one trace: the same handoffs repeated `cycles`
                                 #   times, agents nested deeper than max_depth, more agent
                                 #   runs than max_sub_agents; null: that rule off
      volatile_keys: [...]       # added to the built-in volatile keys
      fold: {}                   # tool name -> [case, whitespace]: folded before hashing
      token_budget: null         # tokens per trace; null = no budget
      usd_budget: null           # US dollars per trace, priced from the spans' models; null = none
      conversation: {enabled: false, action: flag, token_budget: null, usd_budget: null,
                     kill_ttl: 3600}
                                 # the traces of one conversation as one scope (loops, cycles
                                 #   and budgets across them); a kill also refuses the
                                 #   conversation's later traces for kill_ttl s:
                                 #   docs/conversations.md
      agent_budget: {window: 1h, tokens: null, usd: null, action: flag}
                                 # per agent over a rolling window (1h, 1d or seconds), across
                                 #   all its traces; kill: every trace of the agent refused
                                 #   until the window frees: docs/agent-scope.md
      prices: {}                 # model -> {input_mtok, output_mtok, cache_read_mtok,
                                 #   cache_write_mtok}: USD per million tokens, before the
                                 #   genai-prices database
      action: kill               # kill | downgrade | pause | flag (flag: shadow mode, every
                                 #   rule only records and notifies; a token budget otherwise
                                 #   kills, or pauses)
      pause: {timeout: 900, fallback: kill}  # action pause: the agent waits for an operator's
                                 #   release or kill; unanswered after `timeout` s, `fallback`
      autonomous: false          # true: also page on-call
      missing_args: skip         # skip | name_only
      user_turns: forget         # forget | keep: a new user message in the spans starts the
                                 #   count afresh, or is counted through (automated "continue")
      record_arguments: false    # keep raw tool arguments in decisions
      severity: error            # PagerDuty severity for autonomous agents
      goal: {enabled: false, model: null, min_confidence: 0.7, sample_rate: 1.0}
    agents:                      # first match wins; match on resource or span attributes
      - match: {service.name: research-assistant}
        loop: {window: 20, threshold: 4}
    fleet: {enabled: false, action: flag, min_traces: 8, min_fraction: 0.5, window: 300,
            step: 30, max_tools: 1000, recover_after: 3, loop_traces: 3}
                                 # global: one tool (or model) failing or looping across
                                 #   many traces of any agents is one incident (contain:
                                 #   the tool refused to every client): docs/policy.md

A policy file is outside input: whatever it holds, loading it ends in a Policy or in one
PolicyError line naming the file, the field and the problem, quickly. The file is read by
`spanguard.config.policy_file.load_policy`; this module parses its text (`Policy.from_yaml`)
or a mapping (`Policy.from_mapping`). The file's size, its
nesting and what its YAML aliases expand to are bounded before anything is built from it (an
alias bomb is refused in milliseconds); keys the schema does not know are errors that name
the closest valid key, as are duplicate keys, keys that are not strings (YAML reads an unquoted
`on` or `yes` as a boolean) and numbers that are not finite (`.nan`, `.inf`).
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, is_dataclass, replace
from importlib import resources
from typing import TYPE_CHECKING, Any, Literal, TypeGuard, TypeVar, cast

import jsonschema
import yaml
from jsonschema.protocols import Validator

from spanguard.errors import PolicyError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "DEFAULT_VOLATILE_KEYS",
    "MAX_POLICY_BYTES",
    "MAX_POLICY_DEPTH",
    "MAX_POLICY_NODES",
    "AgentBudgetPolicy",
    "AgentPolicy",
    "ConversationPolicy",
    "CyclePolicy",
    "FleetPolicy",
    "FleetPolicyError",
    "GoalPolicy",
    "LoopPolicy",
    "MultiAgentPolicy",
    "NoProgressPolicy",
    "PausePolicy",
    "Policy",
    "PollingPolicy",
    "ToolPolicy",
]

# A real policy is a few kB, five levels deep, a few hundred values. These bounds are far above
# that and far below what could cost a worker seconds to load.
MAX_POLICY_BYTES = 1024 * 1024
MAX_POLICY_DEPTH = 32
# Values once every YAML alias is expanded (what validation and merging walk).
MAX_POLICY_NODES = 100_000
# No setting counts past this: a larger integer is a typo (or an attack on int parsing).
MAX_POLICY_INTEGER = 2**53
# The agent budget's window by name, in seconds.
WINDOW_NAMES = {"1h": 3600, "1d": 86400}

# Keys that change on every call without changing its intent.
DEFAULT_VOLATILE_KEYS: frozenset[str] = frozenset(
    {"timestamp", "request_id", "trace_id", "span_id", "nonce", "now", "_ts", "correlation_id"}
)

# What a policy may ask for on a loop. "flag" is shadow mode: every rule of the agent records,
# counts and notifies its decision, and no signal reaches the agent.
# "pause": the agent waits for an operator (`spanguard release` or `spanguard kill`), or for
# `pause.timeout` seconds, after which `pause.fallback` applies.
LoopAction = Literal["kill", "downgrade", "pause", "flag"]
MissingArgs = Literal["skip", "name_only"]
UserTurns = Literal["forget", "keep"]
NoProgressAction = Literal["flag", "kill", "downgrade", "pause", "off"]
PauseFallback = Literal["kill", "release"]
Severity = Literal["critical", "error", "warning", "info"]
FleetAction = Literal["flag", "contain"]
# A dataclass of settings: a section, a tool's settings, or an agent's.
_Settings = TypeVar("_Settings", bound="DataclassInstance")


# -- how a setting is read and written back -----------------------------------------------------

# A setting stored otherwise than as written carries, in its field's metadata, how it is read
# ("read": the value in force and the YAML value -> the value to store) and written back
# ("write": the stored value -> the YAML value). `_merged` and `_document` follow the fields: a
# field with no such metadata is stored and written as is, and a field holding a section (a
# dataclass) is merged and written field by field.
_Read = Callable[[Any, Any], Any]
_Write = Callable[[Any], Any]


def _setting(default: Any, *, read: _Read, write: _Write) -> Any:
    return field(default=default, metadata={"read": read, "write": write})


def _replaced_set(_current: frozenset[str], names: list[str]) -> frozenset[str]:
    return frozenset(names)


def _added_set(current: frozenset[str], names: list[str]) -> frozenset[str]:
    return current | frozenset(names)


def _window_seconds(_current: int, window: str | int) -> int:
    return WINDOW_NAMES[window] if isinstance(window, str) else window


def _as_is(value: Any) -> Any:
    return value


def _exempt_values(
    _current: tuple[tuple[str, frozenset[str]], ...], by_argument: Mapping[str, list[Any]]
) -> tuple[tuple[str, frozenset[str]], ...]:
    # Compared with str() of the call's argument (ToolPolicy.exempts): YAML types them.
    return tuple(
        sorted(
            (str(argument), frozenset(map(str, matched)))
            for argument, matched in by_argument.items()
        )
    )


def _exempt_document(by_argument: tuple[tuple[str, frozenset[str]], ...]) -> Any:
    return {argument: sorted(values) for argument, values in by_argument} or None


def _merged_tools(
    current: tuple[tuple[str, ToolPolicy], ...], by_tool: Mapping[str, Mapping[str, Any]]
) -> tuple[tuple[str, ToolPolicy], ...]:
    """An entry's tools laid over the ones in force, each tool's settings field by field."""
    tools = dict(current)
    for name, settings in by_tool.items():
        tools[name] = _merged(tools.get(name, ToolPolicy()), settings)
    return tuple(sorted(tools.items()))


def _tools_document(tools: tuple[tuple[str, ToolPolicy], ...]) -> dict[str, Any]:
    # A tool's unset settings (None: the entry's loop setting) are left out.
    return {
        name: {key: value for key, value in _document(tool).items() if value is not None}
        for name, tool in tools
    }


def _merged_folds(
    current: tuple[tuple[str, frozenset[str]], ...], by_tool: Mapping[str, list[str]]
) -> tuple[tuple[str, frozenset[str]], ...]:
    folds = dict(current)
    folds.update((tool, frozenset(how)) for tool, how in by_tool.items())
    return tuple(sorted(folds.items()))


def _folds_document(folds: tuple[tuple[str, frozenset[str]], ...]) -> dict[str, list[str]]:
    return {tool: sorted(how) for tool, how in folds}


_Prices = tuple[tuple[str, tuple[tuple[str, float], ...]], ...]


def _merged_prices(current: _Prices, by_model: Mapping[str, Mapping[str, float]]) -> _Prices:
    # A model's prices replace its earlier ones whole; model names compare in lower case.
    prices = dict(current)
    for model, rates in by_model.items():
        prices[model.lower()] = tuple(sorted(rates.items()))
    return tuple(sorted(prices.items()))


def _prices_document(prices: _Prices) -> dict[str, dict[str, float]]:
    return {model: dict(rates) for model, rates in prices}


# -- the settings, one class per section of the file --------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolPolicy:
    """A policy's settings for one named tool (`tools:`); None = the entry's loop setting."""

    threshold: int | None = None
    window: int | None = None
    exempt: bool = False  # no rule counts its calls (a `sleep`, a `wait_for_job` poller)
    cycle: bool = True  # False: a cycle with a call of this tool in it does not trip
    # Argument -> values: a call whose argument has one of them is exempt (a browser tool's
    # `action: scroll_down`), the tool's other calls are counted.
    exempt_when: tuple[tuple[str, frozenset[str]], ...] = _setting(
        (), read=_exempt_values, write=_exempt_document
    )

    def exempts(self, arguments: Any) -> bool:
        """Whether a call with these (decoded) arguments is exempt from every rule."""
        if self.exempt:
            return True
        if not self.exempt_when or not isinstance(arguments, dict):
            return False
        for name, values in self.exempt_when:
            value = arguments.get(name)
            if isinstance(value, str | int | float | bool) and str(value) in values:
                return True
        return False


@dataclass(frozen=True, slots=True)
class LoopPolicy:
    """`loop:` tool_loop, the same call `threshold` times in the last `window` calls."""

    window: int = 10
    threshold: int = 3
    # The same call failing again trips at this many instead (None: `threshold`).
    failing_threshold: int | None = None
    enabled: bool = True  # false: tool_loop is off for this agent


@dataclass(frozen=True, slots=True)
class PollingPolicy:
    """`polling:` the same call whose recorded result changes; much more patience than a loop."""

    window: int = 30
    threshold: int = 20
    # Always polling, even when the result repeats.
    tools: frozenset[str] = _setting(frozenset(), read=_replaced_set, write=sorted)
    enabled: bool = True  # false: tool_polling is off for this agent


@dataclass(frozen=True, slots=True)
class CyclePolicy:
    """`cycle:` a sequence of 2..`max_period` calls (same tools, arguments and results)
    repeated `repeats` times in a row."""

    max_period: int = 10
    repeats: int = 3
    # False: calls compared by tool and arguments alone, whatever they returned (a round
    # whose results change every time still trips).
    compare_results: bool = True
    enabled: bool = True


@dataclass(frozen=True, slots=True)
class NoProgressPolicy:
    """`no_progress:` `threshold` different calls of one tool in the loop window, one same
    empty result."""

    threshold: int = 4
    action: NoProgressAction = "flag"


@dataclass(frozen=True, slots=True)
class MultiAgentPolicy:
    """`multi_agent:` the agents of one trace. `cycles`: handoff_cycle, the same sequence of
    handoffs (agents and inputs) repeated so many times with nothing new between; `max_depth`:
    delegation_depth, agents nested in one another beyond it; `max_sub_agents`: agent_fan_out,
    agent runs a trace starts beyond its first. None: that rule is off."""

    cycles: int | None = 2
    max_depth: int | None = 5
    max_sub_agents: int | None = 20


@dataclass(frozen=True, slots=True)
class ConversationPolicy:
    """`conversation:` tool_loop and cycle over the calls of all of a conversation's traces
    (a repeat spanning traces: `action`), and its budgets."""

    enabled: bool = False
    action: Literal["flag", "kill"] = "flag"
    token_budget: int | None = None
    usd_budget: float | None = None
    # Seconds a kill of the conversation scope refuses every later trace of the conversation
    # (its conversation-scoped signal's expiry); an operator's release lifts it sooner.
    kill_ttl: float = 3600.0


@dataclass(frozen=True, slots=True)
class AgentBudgetPolicy:
    """`agent_budget:` tokens and US dollars per agent over a rolling window of `window`
    seconds, across all of its traces (spanguard/detection/agent_budget.py)."""

    window: int = _setting(3600, read=_window_seconds, write=_as_is)
    tokens: int | None = None
    usd: float | None = None
    action: Literal["flag", "kill"] = "flag"


@dataclass(frozen=True, slots=True)
class GoalPolicy:
    """`goal:` the goal verifier; off by default (every verdict is a model call that costs)."""

    enabled: bool = False
    model: str | None = None  # None: the judge's configured default model
    min_confidence: float = 0.7
    sample_rate: float = 1.0


@dataclass(frozen=True, slots=True)
class PausePolicy:
    """`pause:` under action pause, how long the agent waits for an operator, and what
    applies after that."""

    timeout: float = 900.0
    fallback: PauseFallback = "kill"


class FleetPolicyError(PolicyError):
    """A fleet setting that cannot be used; `field` names it."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"fleet.{name}: {message}")
        self.field = name


@dataclass(frozen=True, slots=True)
class FleetPolicy:
    """`fleet:` the fleet rules over one tool (or model) across every agent, over a sliding
    window (spanguard/detection/fleet.py). Global, not per agent: a top-level section of the
    policy, beside `defaults`, since a tool is shared by agents under any entry. Off by
    default; the worker's `--mode observe` turns `contain` into `flag` as it does every
    agent's action. Defaults: see tests/support/fleet.py's precision table, which they are
    chosen on."""

    enabled: bool = False
    # flag: an incident is recorded and notified; contain: the tool refused to every client
    action: FleetAction = "flag"
    min_traces: int = 8
    min_fraction: float = 0.5
    window: int = 300  # seconds
    step: int = 30  # seconds; the window is a whole number of steps
    max_tools: int = 1000
    recover_after: int = 3
    loop_traces: int = 3

    def __post_init__(self) -> None:
        _check_bool(self, "enabled")
        if self.action not in ("flag", "contain"):
            raise FleetPolicyError("action", f"must be flag or contain, not {self.action!r}")
        for name, low in (("min_traces", 1), ("recover_after", 1), ("loop_traces", 2)):
            _check_int(self, name, low, 1_000_000)
        _check_int(self, "step", 1, 3600)
        _check_int(self, "window", self.step, 86_400)
        _check_int(self, "max_tools", 1, 1_000_000)
        if self.window % self.step:
            raise FleetPolicyError("window", f"must be a whole number of steps ({self.step} s)")
        fraction = self.min_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, int | float):
            raise FleetPolicyError("min_fraction", f"must be a number, not {fraction!r}")
        if not (math.isfinite(fraction) and 0 < fraction <= 1):
            raise FleetPolicyError("min_fraction", f"must be in (0, 1], not {fraction!r}")

    @classmethod
    def from_mapping(cls, section: Mapping[str, Any]) -> FleetPolicy:
        """The settings of a policy's `fleet` mapping; an unknown key is an error."""
        known = {item.name for item in fields(cls)}
        for key in section:
            if key not in known:
                raise FleetPolicyError(str(key), f"unknown setting (known: {', '.join(known)})")
        return cls(**dict(section))

    @property
    def steps(self) -> int:
        return self.window // self.step


def _check_bool(policy: FleetPolicy, name: str) -> None:
    if not isinstance(getattr(policy, name), bool):
        raise FleetPolicyError(name, f"must be true or false, not {getattr(policy, name)!r}")


def _check_int(policy: FleetPolicy, name: str, low: int, high: int) -> None:
    value = getattr(policy, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise FleetPolicyError(name, f"must be a whole number, not {value!r}")
    if not low <= value <= high:
        raise FleetPolicyError(name, f"must be between {low} and {high}, not {value}")


@dataclass(frozen=True, slots=True)
class AgentPolicy:
    """The settings in force for one agent: one attribute per key of a policy entry, a
    section's settings in a section class (`policy.loop.threshold`)."""

    loop: LoopPolicy = LoopPolicy()
    polling: PollingPolicy = PollingPolicy()
    cycle: CyclePolicy = CyclePolicy()
    no_progress: NoProgressPolicy = NoProgressPolicy()
    multi_agent: MultiAgentPolicy = MultiAgentPolicy()
    # Tool name -> its own tool_loop threshold/window, or exempt from every rule; an entry's
    # tools are laid over the defaults', tool by tool.
    tools: tuple[tuple[str, ToolPolicy], ...] = _setting(
        (), read=_merged_tools, write=_tools_document
    )
    # An entry's volatile keys are added to the ones in force.
    volatile_keys: frozenset[str] = _setting(DEFAULT_VOLATILE_KEYS, read=_added_set, write=sorted)
    # Tool name -> foldings ("case", "whitespace") applied to its string arguments.
    fold: tuple[tuple[str, frozenset[str]], ...] = _setting(
        (), read=_merged_folds, write=_folds_document
    )
    token_budget: int | None = None
    # US dollars per trace; the spans' usage priced by model (spanguard/detection/pricing.py).
    usd_budget: float | None = None
    # Model name (lower case) -> its prices, USD per million tokens: ((key, value), ...).
    prices: tuple[tuple[str, tuple[tuple[str, float], ...]], ...] = _setting(
        (), read=_merged_prices, write=_prices_document
    )
    action: LoopAction = "kill"
    autonomous: bool = False
    missing_args: MissingArgs = "skip"
    # A new user message in the spans: "forget" the calls before it (repeats the user asked
    # for are not the agent's loop), or "keep" counting through it (a harness that sends an
    # automated "continue" as the user).
    user_turns: UserTurns = "forget"
    record_arguments: bool = False
    severity: Severity = "error"
    conversation: ConversationPolicy = ConversationPolicy()
    agent_budget: AgentBudgetPolicy = AgentBudgetPolicy()
    goal: GoalPolicy = GoalPolicy()
    pause: PausePolicy = PausePolicy()

    @property
    def counts_conversation_usage(self) -> bool:
        """The conversation scope is on with a budget (tokens or dollars) that usage counts
        against: without one, no usage is handed to the conversation at all."""
        conversation = self.conversation
        return conversation.enabled and (
            conversation.token_budget is not None or conversation.usd_budget is not None
        )

    def merged(self, settings: Mapping[str, Any]) -> AgentPolicy:
        """These settings with `settings` (one validated policy section) laid over them."""
        return _merged(self, settings)

    @property
    def shadow(self) -> bool:
        """Shadow mode: every rule flags, nothing is sent to the agent."""
        return self.action == "flag"

    def tool(self, tool_name: str) -> ToolPolicy | None:
        """The policy's `tools:` entry for `tool_name`, if any."""
        for name, settings in self.tools:
            if name == tool_name:
                return settings
        return None

    @property
    def loop_span(self) -> int:
        """How many calls the trace's window keeps: the widest tool_loop window in force."""
        return max([self.loop.window, *(t.window for _, t in self.tools if t.window is not None)])

    @property
    def history(self) -> int:
        """How many calls the trace's window keeps: the widest tool_loop window in force, or
        the longest cycle period (the cycle rule compares a call with the one a period ago)."""
        span = self.loop_span if self.tools else self.loop.window
        return max(span, self.cycle.max_period) if self.cycle.enabled else span

    def folding(self, tool_name: str) -> frozenset[str]:
        """The foldings the policy asks for on `tool_name`'s string arguments."""
        for tool, how in self.fold:
            if tool == tool_name:
                return how
        return frozenset()


def _merged(settings: _Settings, document: Mapping[str, Any]) -> _Settings:
    """`settings` with `document` (their part of a validated policy file) laid over them,
    field by field: a key the document leaves out keeps the setting in force."""
    changes: dict[str, Any] = {}
    for setting in fields(settings):
        if setting.name not in document:
            continue
        value = document[setting.name]
        current = getattr(settings, setting.name)
        read = setting.metadata.get("read")
        if read is not None:
            changes[setting.name] = read(current, value)
        elif _is_section(current):
            changes[setting.name] = _merged(current, value)
        else:
            changes[setting.name] = value
    return replace(settings, **changes)


def _document(settings: DataclassInstance) -> dict[str, Any]:
    """`settings` as their part of a policy file, every setting written out."""
    document: dict[str, Any] = {}
    for setting in fields(settings):
        value = getattr(settings, setting.name)
        write = setting.metadata.get("write")
        if write is not None:
            document[setting.name] = write(value)
        elif _is_section(value):
            document[setting.name] = _document(value)
        else:
            document[setting.name] = value
    return document


def _is_section(value: Any) -> TypeGuard[DataclassInstance]:
    return is_dataclass(value) and not isinstance(value, type)


@dataclass(frozen=True, slots=True)
class _Rule:
    match: tuple[tuple[str, str], ...]
    policy: AgentPolicy


@dataclass(frozen=True)
class Policy:
    """Defaults plus ordered per-agent rules; `for_attributes` picks the one in force."""

    defaults: AgentPolicy = field(default_factory=AgentPolicy)
    rules: tuple[_Rule, ...] = ()
    fleet: FleetPolicy = field(default_factory=FleetPolicy)  # global: no entry has its own

    @property
    def entries(self) -> list[AgentPolicy]:
        """Every entry an agent can be under: the defaults, then each rule's."""
        return [self.defaults, *(rule.policy for rule in self.rules)]

    @property
    def match_keys(self) -> frozenset[str]:
        """Every attribute name some rule matches on."""
        return frozenset(key for rule in self.rules for key, _ in rule.match)

    def for_attributes(self, attributes: Mapping[str, str]) -> AgentPolicy:
        """The first rule whose match equals `attributes`, else the defaults."""
        for rule in self.rules:
            if all(attributes.get(key) == value for key, value in rule.match):
                return rule.policy
        return self.defaults

    def entry_of(self, policy: AgentPolicy) -> tuple[str, dict[str, str] | None]:
        """Which entry `policy` is: "defaults", or "agents.N" and its match (a decision
        names it, so `explain` can point at the lines of the file that decided)."""
        for index, rule in enumerate(self.rules):
            if rule.policy is policy:  # for_attributes hands out the entry's own object
                return f"agents.{index}", dict(rule.match)
        return "defaults", None

    def observed(self) -> Policy:
        """This policy in shadow mode for every agent (the worker's `--mode observe`)."""
        return Policy(
            replace(self.defaults, action="flag"),
            tuple(_Rule(rule.match, replace(rule.policy, action="flag")) for rule in self.rules),
            replace(self.fleet, action="flag"),
        )

    def effective(self) -> dict[str, Any]:
        """The policy in force, every setting written out, in the file's own shape: loading
        this document gives back an equal Policy (what `spanguard policy check` prints)."""
        return {
            "defaults": _document(self.defaults),
            "agents": [
                {"match": dict(rule.match), **_document(rule.policy)} for rule in self.rules
            ],
            "fleet": _document(self.fleet),
        }

    @classmethod
    def from_mapping(cls, document: Any, *, source: str = "policy") -> Policy:
        if document is None:
            document = {}
        _check_tree(document, source)
        _validate(document, source)
        defaults = AgentPolicy().merged(document.get("defaults") or {})
        _check_loop(defaults, f"{source}: field defaults.loop")
        rules = []
        for index, entry in enumerate(document.get("agents") or ()):
            # Match values compare as strings: attributes arrive typed, YAML guesses types.
            match = tuple((key, _as_text(value)) for key, value in entry["match"].items())
            merged = defaults.merged(entry)
            _check_loop(merged, f"{source}: field agents.{index}.loop")
            rules.append(_Rule(match, merged))
        try:
            fleet = FleetPolicy.from_mapping(document.get("fleet") or {})
        except FleetPolicyError as exc:
            raise PolicyError(f"{source}: field {exc}") from None
        return cls(defaults, tuple(rules), fleet)

    @classmethod
    def from_yaml(cls, data: bytes | str, *, source: str = "policy") -> Policy:
        """A policy from YAML text (bytes must be UTF-8), within the bounds above."""
        if len(data) > MAX_POLICY_BYTES:
            raise PolicyError(f"{source}: larger than {MAX_POLICY_BYTES} bytes: not a policy")
        if isinstance(data, bytes):
            try:
                data = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise PolicyError(
                    f"{source}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})"
                ) from None
        return cls.from_mapping(_load_yaml(data, source), source=source)


# -- reading YAML within bounds -----------------------------------------------------------------


def _load_yaml(text: str, source: str) -> Any:
    """Compose the YAML into nodes, bound what they expand to, and only then build values."""
    try:
        loader = yaml.SafeLoader(text)  # it already refuses unprintable characters
    except yaml.YAMLError as exc:
        raise PolicyError(f"{source}: not valid YAML: {_yaml_problem(exc)}") from None
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise PolicyError(f"{source}: nested more than {MAX_POLICY_DEPTH} levels") from None
        if node is None:
            return None
        _check_nodes(node, source)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise PolicyError(f"{source}: not valid YAML: {_yaml_problem(exc)}") from None
    finally:
        loader.dispose()


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line: the problem and where (PyYAML's own message spans several lines)."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        text = " ".join(part for part in (exc.context, exc.problem) if part) or "invalid"
        if mark is not None:
            text += f" (line {mark.line + 1}, column {mark.column + 1})"
        return text
    return " ".join(str(exc).split())


def _check_nodes(root: yaml.Node, source: str) -> None:
    """Refuse, before construction, what would make a policy slow or ambiguous to build: too
    many values once aliases are expanded (the alias bomb), nesting too deep, a recursive alias
    and duplicate keys. Each node's expanded size is computed once, so this is linear in the
    file, whatever its aliases would expand to."""
    sizes: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded values, depth)
    on_path: set[int] = set()
    # An explicit stack: (node, children already pushed?)
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        key = id(node)
        if key in sizes and not expanded:
            continue
        children = _children(node, source)
        if not expanded:
            if key in on_path:
                raise PolicyError(f"{source}: a YAML alias refers to itself (line {_line(node)})")
            on_path.add(key)
            stack.append((node, True))
            for child in children:
                if id(child) in on_path:
                    raise PolicyError(
                        f"{source}: a YAML alias refers to itself (line {_line(child)})"
                    )
                if id(child) not in sizes:
                    stack.append((child, False))
            if len(on_path) > MAX_POLICY_DEPTH:
                raise PolicyError(
                    f"{source}: nested more than {MAX_POLICY_DEPTH} levels (line {_line(node)})"
                )
            continue
        on_path.discard(key)
        total = 1 + sum(sizes[id(child)][0] for child in children)
        depth = 1 + max((sizes[id(child)][1] for child in children), default=0)
        if total > MAX_POLICY_NODES:
            raise PolicyError(
                f"{source}: more than {MAX_POLICY_NODES} values once its YAML aliases are"
                f" expanded (line {_line(node)}): not a policy"
            )
        if depth > MAX_POLICY_DEPTH:
            raise PolicyError(
                f"{source}: nested more than {MAX_POLICY_DEPTH} levels once its YAML aliases"
                f" are expanded (line {_line(node)})"
            )
        sizes[key] = (total, depth)


def _children(node: yaml.Node, source: str) -> list[yaml.Node]:
    if isinstance(node, yaml.ScalarNode) and node.tag == _YAML_INT and len(node.value) > 24:
        # Constructing it would cost time quadratic in its digits (or raise past 4300 of them).
        raise PolicyError(
            f"{source}: an integer of {len(node.value)} characters (line {_line(node)}):"
            f" out of range (at most {MAX_POLICY_INTEGER})"
        )
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        seen: set[tuple[str, str]] = set()
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode):
                if (key.tag, key.value) in seen:
                    raise PolicyError(
                        f"{source}: key {key.value!r} appears twice in one mapping"
                        f" (line {_line(key)})"
                    )
                seen.add((key.tag, key.value))
        return [part for pair in node.value for part in pair]
    return []


_YAML_INT = "tag:yaml.org,2002:int"


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


# -- checking values ----------------------------------------------------------------------------


def _check_tree(document: Any, source: str) -> None:
    """Keys are strings and numbers finite, anywhere in the document (JSON Schema compares a
    NaN with neither minimum nor maximum, so `sample_rate: .nan` would pass it)."""
    stack: list[tuple[Any, str]] = [(document, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise PolicyError(
                f"{source}: field {where or '(top level)'}: {value} is not a finite number"
            )
        if type(value) is int and abs(value) > MAX_POLICY_INTEGER:
            raise PolicyError(
                f"{source}: field {where or '(top level)'}: an integer out of range"
                f" (at most {MAX_POLICY_INTEGER})"
            )
        if isinstance(value, Mapping):
            for key, item in value.items():
                if not isinstance(key, str):
                    hint = (
                        " (YAML reads unquoted yes/no/on/off/true/false as booleans: quote it)"
                        if isinstance(key, bool)
                        else " (quote it)"
                    )
                    raise PolicyError(
                        f"{source}: field {where or '(top level)'}: key {key!r}"
                        f" ({type(key).__name__}) is not a string{hint}"
                    )
                stack.append((item, f"{where}.{key}" if where else key))
        elif isinstance(value, list | tuple):
            stack.extend((item, f"{where}.{index}") for index, item in enumerate(value))


def _check_loop(policy: AgentPolicy, where: str) -> None:
    loop, polling, no_progress = policy.loop, policy.polling, policy.no_progress
    if loop.threshold > loop.window:
        raise PolicyError(
            f"{where}: threshold {loop.threshold} can never be reached"
            f" in a window of {loop.window} calls"
        )
    if loop.failing_threshold is not None and loop.failing_threshold > loop.window:
        raise PolicyError(
            f"{where}: failing_threshold {loop.failing_threshold} can never be reached"
            f" in a window of {loop.window} calls"
        )
    for name, tool in policy.tools:
        threshold = loop.threshold if tool.threshold is None else tool.threshold
        window = loop.window if tool.window is None else tool.window
        if threshold > window:
            raise PolicyError(
                f"{where.replace('.loop', '.tools.' + name)}: threshold {threshold} can never"
                f" be reached in a window of {window} calls"
            )
    if polling.threshold > polling.window:
        raise PolicyError(
            f"{where.replace('.loop', '.polling')}: threshold {polling.threshold} can"
            f" never be reached in a window of {polling.window} calls"
        )
    if no_progress.action != "off" and no_progress.threshold > loop.window:
        raise PolicyError(
            f"{where.replace('.loop', '.no_progress')}: threshold"
            f" {no_progress.threshold} can never be reached in a loop window of"
            f" {loop.window} calls"
        )


def _as_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


_SCHEMA: dict[str, Any] | None = None


def _schema() -> dict[str, Any]:
    global _SCHEMA
    if _SCHEMA is None:
        text = resources.files("spanguard.schemas").joinpath("policy.schema.json").read_text()
        _SCHEMA = json.loads(text)
    return _SCHEMA


def _is_count(checker: Any, instance: Any) -> bool:
    # JSON Schema's "integer" takes 4.0 (a number whose fraction is zero); what counts things
    # here takes only integers, so `window: 10.0` is refused instead of reaching islice().
    return isinstance(instance, int) and not isinstance(instance, bool)


# One type rule for every integer field of the schema, present and future sections alike.
# (types-jsonschema leaves extend() unannotated.)
_PolicyValidator: type[Validator] = jsonschema.validators.extend(  # type: ignore[no-untyped-call]
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_count),
)


def _validate(document: Any, source: str) -> None:
    validator = _PolicyValidator(_schema())
    errors = sorted(validator.iter_errors(document), key=lambda e: [str(p) for p in e.path])
    if not errors:
        return
    # An unknown key explains the errors around it (a misspelt field is also a missing one):
    # it comes first, with the valid key it is closest to.
    for error in errors:
        if error.validator in ("additionalProperties", "unevaluatedProperties"):
            where = ".".join(str(part) for part in error.absolute_path) or "(top level)"
            # (Such an error's schema is the object's schema and its instance the object; the
            # stubs also allow jsonschema's `_unset`, for an error not yet filled in.)
            allowed = _allowed_keys(cast("Mapping[str, Any]", error.schema))
            instance = cast("Mapping[str, Any]", error.instance)
            unknowns = sorted(key for key in instance if key not in allowed)
            if not unknowns:
                continue
            unknown = unknowns[0]
            close = difflib.get_close_matches(unknown, sorted(allowed), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            valid = ", ".join(sorted(allowed))
            raise PolicyError(
                f"{source}: field {where}: unknown key {unknown!r}{hint}; valid keys: {valid}"
            )
    error = jsonschema.exceptions.best_match(errors)
    where = ".".join(str(part) for part in error.absolute_path) or "(top level)"
    hint = ""
    if error.validator == "type" and isinstance(error.instance, float):
        hint = " (a count is a whole number: write it without a decimal point)"
    raise PolicyError(f"{source}: field {where}: {_one_line(error.message)}{hint}")


def _allowed_keys(schema: Mapping[str, Any]) -> set[str]:
    """The property names a (sub)schema declares, through its local $ref and allOf."""
    keys = set(schema.get("properties", {}))
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        keys |= _allowed_keys(_schema()["$defs"][ref.removeprefix("#/$defs/")])
    for part in schema.get("allOf", ()):
        keys |= _allowed_keys(part)
    return keys


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:300] + "..."
