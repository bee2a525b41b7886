"""The guard: OTLP requests in, decisions out. Pure Python, no I/O.

The Faust worker, `spanguard replay`, the in-process SpanProcessor and the benchmarks all run
this module; only where the per-trace state lives differs (a dict here, a Faust table there).

The rules are parts of their own, one module each in spanguard/detection/rules/ (tool_loop,
cycle, tool_polling, no_progress, token_budget, cost_budget, and over the trace's agent tree
handoff_cycle, delegation_depth, agent_fan_out; the registry is `rules.RULES`). The guard keys
each call once, keeps the trace's window, and runs every rule through one path: a rule decides
at most once per trace and action; `downgrade` first where the policy says so, then `kill`;
`flag` in shadow mode (policy `action: flag`, or the worker's `--mode observe`), which sends no
signal; an operator's release re-arms the rules that killed for what the agent did. Observers
(`GuardObserver`: metrics, the replay page) hear of every call and decision.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, cast

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from spanguard.detection.agent_budget import AgentBudgetGuard, AgentUsageSink, has_agent_budget
from spanguard.detection.agent_tree import AgentTree
from spanguard.detection.canonical import args_hash
from spanguard.detection.conventions.adapt import adapt_read, reading_of, resource_info
from spanguard.detection.conventions.capture import capture_setting
from spanguard.detection.conventions.events import (
    MISSING,
    AgentRun,
    AgentSeen,
    ResourceInfo,
    TokenUsage,
    ToolCall,
    UncarriedRequest,
)
from spanguard.detection.conventions.keys import (
    AGENT_NAME,
    CONVERSATION_KEY_SET,
    PRICE_KEYS,
    SERVICE_NAME,
    USAGE_KEYS,
    WANTED_KEYS,
)
from spanguard.detection.conversation import (
    ConversationCall,
    ConversationGuard,
    ConversationSink,
    ConversationUsage,
)
from spanguard.detection.fleet import (
    FleetGuard,
    ToolCallSink,
    agent_label,
    model_call,
    server_of,
    tool_call,
)
from spanguard.detection.pricing import ModelRates, Pricer
from spanguard.detection.results import result_key
from spanguard.detection.rules import COST_BUDGET as _COST_BUDGET
from spanguard.detection.rules import CYCLE as _CYCLE
from spanguard.detection.rules import NO_PROGRESS as _NO_PROGRESS
from spanguard.detection.rules import RULES
from spanguard.detection.rules import TOKEN_BUDGET as _TOKEN_BUDGET
from spanguard.detection.rules import TOOL_LOOP as _TOOL_LOOP
from spanguard.detection.rules import TOOL_POLLING as _TOOL_POLLING
from spanguard.detection.rules.base import (
    DOWNGRADE,
    FLAG,
    KILL,
    OFF,
    PAUSE,
    AgentRule,
    Fired,
    GuardObserver,
    Rule,
    TokenRule,
    ToolCallRule,
    Trip,
)
from spanguard.detection.scope import ScopeGuard
from spanguard.detection.trace_state import (
    MARK_BYTES,
    CallKey,
    TraceState,
    call_id_key,
    call_mark,
    iso_from_micros,
    shared_text,
)
from spanguard.outcomes import CountedOutcome
from spanguard.schemas.decision import (
    AgentIdentity,
    Decision,
    Pause,
    PolicyInForce,
    decision_id,
    linked_conversation,
)
from spanguard.schemas.otlp_view import parse_view, view_of
from spanguard.schemas.policy import AgentPolicy, Policy

__all__ = [
    "COST_BUDGET",
    "CYCLE",
    "NO_PROGRESS",
    "TOKEN_BUDGET",
    "TOOL_LOOP",
    "TOOL_POLLING",
    "Guard",
    "GuardCount",
    "GuardStats",
]

log = logging.getLogger("spanguard.core")

# The rules' names (the rule objects are spanguard.detection.rules.TOOL_LOOP and so on).
TOOL_LOOP = _TOOL_LOOP.name
CYCLE = _CYCLE.name
TOOL_POLLING = _TOOL_POLLING.name
NO_PROGRESS = _NO_PROGRESS.name
TOKEN_BUDGET = _TOKEN_BUDGET.name
COST_BUDGET = _COST_BUDGET.name
# How many recent span ids and call ids a trace remembers to drop redeliveries and partial
# spans: bounded, so a long trace costs the same memory as a short one.
MIN_RECENT_IDS = 32
# Traces with agents whose spans' parents are kept (Guard._agent_traces): the newest so many.
MAX_AGENT_TRACES = 4096
# Services told about their uncarried requests: the first so many (service names come from
# the spans, unbounded); the others are counted only. UNCARRIED and LINKED are what they were
# told of.
MAX_WARNED = 4096
UNCARRIED = "uncarried requests"
LINKED = "linked runs"

HASHING_HINT = (
    "or keep them private and still exact: hash them before they leave"
    " (spanguard.killswitch.hashing.ArgsHashingSpanProcessor in the agent, or"
    " deploy/collector/args-hash.yaml in the Collector); `missing_args: name_only` flags"
    " (never kills) repeats of a tool name"
)


class GuardCount(CountedOutcome):
    """What the guard counts: each member names a field of GuardStats."""

    SPANS = "spans"
    TOOL_CALLS = "tool_calls"
    TOKEN_EVENTS = "token_events"
    DUPLICATE_SPANS = "duplicate_spans"
    REPEATED_CALL_IDS = "repeated_call_ids"
    REISSUED_CALL_IDS = "reissued_call_ids"
    USER_TURNS = "user_turns"
    MISSING_ARGUMENTS = "missing_arguments"
    MALFORMED_SPANS = "malformed_spans"
    RELEASES_APPLIED = "releases_applied"
    PRICED_USAGE = "priced_usage"
    UNPRICED_USAGE = "unpriced_usage"
    CONVERSATION_CONFLICTS = "conversation_conflicts"
    # What the traces spent, as their budgets count it: tokens by whether a price was found
    # (priced), none was (unpriced), or usage is not priced at all (no usd budget asks), and
    # the priced tokens' cost.
    TOKENS_PRICED = "tokens_priced"
    TOKENS_UNPRICED = "tokens_unpriced"
    TOKENS_NOT_PRICED = "tokens_not_priced"
    COST_PICO_USD = "cost_pico_usd"
    # Agent runs of traces whose agent tree was full (MAX_RUNS): counted, not placed.
    AGENT_RUNS_UNPLACED = "agent_runs_unplaced"
    # Spans of traces with agents whose parent the tree could not keep (MAX_LINKS).
    AGENT_LINKS_UNKEPT = "agent_links_unkept"
    # Requests to agent services that started a trace of their own (UncarriedRequest).
    UNCARRIED_REQUESTS = "uncarried_requests"
    # Agent runs that started a trace of their own linked to their caller's (AgentRun.caller_trace_id).
    LINKED_RUNS = "linked_runs"


@dataclass
class GuardStats:
    """Counters the worker exports on /metrics and replay prints in its summary.

    Plain integers, bumped on the hot path; read by member (`count`) like any other tally.
    """

    spans: int = 0
    tool_calls: int = 0
    token_events: int = 0
    duplicate_spans: int = 0
    repeated_call_ids: int = 0  # partial spans of a call already counted
    reissued_call_ids: int = 0  # a call id made again after its call ended: counted anew
    user_turns: int = 0  # inference spans sent a new user message (the window starts anew)
    missing_arguments: int = 0
    malformed_spans: int = 0
    releases_applied: int = 0  # killed traces whose loop rules an operator's release re-armed
    # Inference spans whose usage was priced, and those no price was found for (their tokens
    # are counted as unpriced, never as free): spanguard/detection/pricing.py.
    priced_usage: int = 0
    unpriced_usage: int = 0
    # Spans naming a conversation other than the one their trace named first (the first wins).
    conversation_conflicts: int = 0
    # Tokens the traces spent (what their budgets count: inference spans, else an agent's
    # total), by pricing outcome, and the cost of the priced ones in pico-dollars.
    tokens_priced: int = 0
    tokens_unpriced: int = 0
    tokens_not_priced: int = 0
    cost_pico_usd: int = 0
    agent_runs_unplaced: int = 0
    agent_links_unkept: int = 0
    # Requests to agent services without their caller's trace context (an A2A server span
    # with no parent): each is a trace alone, a loop across services through it unseen.
    uncarried_requests: int = 0
    # Agent runs starting a trace of their own with a span link to their caller's trace
    # (VoltAgent's): the trace rules decide each run alone; the conversation scope, where on,
    # joins the runs of one caller.
    linked_runs: int = 0
    decisions: Counter[tuple[str, str]] = field(default_factory=Counter)  # (rule, action)

    def count(self, outcome: GuardCount) -> int:
        counted: int = getattr(self, outcome.value)
        return counted


def _raw_trace_id(trace_id: str) -> bytes:
    """A trace id's bytes as spans carry them; b"" for one that is no hex (a caller's own)."""
    try:
        return bytes.fromhex(trace_id)
    except ValueError:
        return b""


def _spent(state: TraceState) -> tuple[int, int]:
    """A trace's tokens and cost (pico-dollars) as its budgets count them."""
    tokens = (
        state.inference_tokens if state.inference_tokens is not None else state.aggregate_tokens
    )
    cost = state.inference_cost if state.inference_cost is not None else state.aggregate_cost
    return tokens, cost


def _now_iso(clock: Callable[[], float]) -> str:
    return datetime.fromtimestamp(clock(), UTC).isoformat(timespec="milliseconds")


def _iso_from_ns(unix_nano: int) -> str | None:
    """A span's OTLP time as ISO 8601 (microseconds), or None when the span has none."""
    return iso_from_micros(unix_nano // 1000) if unix_nano > 0 else None


@dataclass(slots=True)
class _Plan:
    """The rules one policy entry switches on, and what it wants of each."""

    history: int  # calls the trace's window keeps (AgentPolicy.history)
    recent_ids: int  # span ids and call ids a trace remembers (redeliveries, partial spans)
    # (rule, what the policy wants of it). Typed, so that compiled code calls the rules'
    # methods directly rather than as Python objects.
    call_rules: list[tuple[ToolCallRule, str]] = field(default_factory=list)
    counting: list[ToolCallRule] = field(default_factory=list)  # the rules that count
    token_rules: list[tuple[TokenRule, str]] = field(default_factory=list)
    # The tool-call rules that read only traces with agents (`agents_only`), after the others.
    handoff_rules: list[tuple[ToolCallRule, str]] = field(default_factory=list)
    agent_rules: list[tuple[AgentRule, str]] = field(default_factory=list)
    prices: dict[str, ModelRates] = field(default_factory=dict)  # the policy's own, by model


def _deciding_scopes(
    conversations: ConversationSink | None,
    agent_budgets: AgentUsageSink | None,
    tools: ToolCallSink | None,
) -> list[ScopeGuard]:
    """The scopes given to the guard that decide (not a worker's recorders), conversations
    first: their decisions are returned with the guard's own."""
    deciding: list[ScopeGuard] = []
    if isinstance(conversations, ConversationGuard):
        deciding.append(conversations)
    if isinstance(agent_budgets, AgentBudgetGuard):
        deciding.append(agent_budgets)
    if isinstance(tools, FleetGuard):
        deciding.append(tools)
    return deciding


class Guard:
    """Runs the rules over OTLP requests, keeping per-trace state in `states`.

    `states` is any mutable mapping from hex trace id to TraceState (a dict by default; the
    worker passes a view of its Faust table). Each trace touched by a request is written back
    to `states` once per request. The worker's mapping (streams/decoded_states.py, `DecodedStates`)
    keeps those writes in memory and writes each trace to its table and changelog once per
    commit interval (docs/design.md, "State writes once per commit").
    """

    def __init__(
        self,
        policy: Policy | None = None,
        *,
        states: MutableMapping[str, TraceState] | None = None,
        clock: Callable[[], float] = time.time,
        released: Mapping[str, float] | None = None,
        rules: Iterable[Rule] = RULES,
        observers: Iterable[GuardObserver] = (),
        price_usage: bool = False,
        conversations: ConversationSink | None = None,
        agent_budgets: AgentUsageSink | None = None,
        tools: ToolCallSink | None = None,
    ) -> None:
        """`rules`: the registry's rules by default (the benchmark runs subsets);
        `observers`: told of every call and decision (`add_observer` adds more);
        `price_usage`: price every trace's usage even without a usd budget (replay's page);
        `conversations`: the conversation scope's sink, fed every counted call and usage
        change of traces that name a conversation (spanguard/detection/conversation.py);
        `agent_budgets`: the agent scope's sink, fed every change of a trace's usage
        (spanguard/detection/agent_budget.py); `tools`: the tool scope's sink (fleet.py), fed
        every counted tool call and model call while `fleet` is on; see `_deciding_scopes`."""
        self.policy = policy or Policy()
        self.rules = tuple(rules)
        self._call_rules = [rule for rule in self.rules if isinstance(rule, ToolCallRule)]
        self._token_rules = [rule for rule in self.rules if isinstance(rule, TokenRule)]
        self._agent_rules = [rule for rule in self.rules if isinstance(rule, AgentRule)]
        self._rearmed = frozenset(rule.name for rule in self.rules if rule.rearm_on_release)
        self.observers: list[GuardObserver] = list(observers)
        self._plans: dict[int, tuple[AgentPolicy, _Plan]] = {}
        self._defaults_plan: _Plan | None = None
        # Operators' releases, {trace id: when issued (epoch seconds)}: the worker's
        # connectors/releases.py keeps it filled from the kill topic. A released trace's loop rules
        # count again from a fresh window (see `_apply_release`).
        self.released: Mapping[str, float] = {} if released is None else released
        self.states: MutableMapping[str, TraceState] = {} if states is None else states
        self.clock = clock
        self.stats = GuardStats()
        self._match_keys = self.policy.match_keys
        self._defaults = self.policy.defaults
        # Whether any agent has a policy entry of its own (else one plan for every call).
        self._per_agent = bool(self.policy.rules)
        # Without a token budget anywhere, usage is never read: chat spans yield no event.
        policies = self.policy.entries
        # Usage is priced only where a usd budget (or the caller) asks: a price is a lookup.
        self.conversations = conversations
        conversation_budgets = conversations is not None and any(
            policy.counts_conversation_usage for policy in policies
        )
        wanted = agent_budgets is not None and any(has_agent_budget(p) for p in policies)
        self.agent_budgets = agent_budgets if wanted else None
        self.tools = tools if tools is not None and self.policy.fleet.enabled else None
        self._server, self._model_agent = "", (cast(Any, None), "")  # see _tool_scope_span
        self._deciding = _deciding_scopes(conversations, self.agent_budgets, self.tools)
        self.prices_usage = price_usage or any(
            policy.usd_budget is not None
            or (conversations is not None and policy.conversation.usd_budget is not None)
            or (self.agent_budgets is not None and policy.agent_budget.usd is not None)
            for policy in policies
        )
        self.tracks_tokens = (
            self.prices_usage
            or conversation_budgets
            or self.agent_budgets is not None
            or any(policy.token_budget is not None for policy in policies)
        )
        base = WANTED_KEYS if self.tracks_tokens else WANTED_KEYS - USAGE_KEYS
        if self.prices_usage:
            base = base | PRICE_KEYS
        if conversations is not None:
            base = base | CONVERSATION_KEY_SET
        self._wanted = base | self._match_keys
        self._reading = reading_of(self._wanted)
        self._warned_conversations: set[str] = set()
        self.pricer: Pricer | None = Pricer() if self.prices_usage else None
        # Whether a change of a trace's usage goes anywhere beyond its own budgets.
        hands_on = conversations is not None and conversations.counts_usage
        self._hands_on_usage = hands_on or self.agent_budgets is not None
        self._warned: set[tuple[str, str]] = set()  # (service, scope or UNCARRIED) told once
        self._agent_traces: dict[bytes, None] = {}  # with agents: spans' parents kept

    def add_observer(self, observer: GuardObserver) -> None:
        self.observers.append(observer)

    @property
    def wanted_keys(self) -> frozenset[str]:
        """The span attributes this guard reads (its policy decides: budgets, match keys)."""
        return self._wanted

    def process(self, request: ExportTraceServiceRequest | bytes) -> list[Decision]:
        """Observe every span of `request` in order; return the decisions taken.

        `request` is an ExportTraceServiceRequest or its protobuf bytes (the hot path: bytes
        are parsed once, straight into the lean view of schemas/otlp_view.py). Bytes that are
        not a request raise OtlpDecodeError; spans whose trace id is not 16 bytes are skipped
        and counted in stats.malformed_spans.
        """
        if isinstance(request, ExportTraceServiceRequest):
            return self.process_view(view_of(request))
        return self.process_view(parse_view(request))

    def process_view(self, view: Any) -> list[Decision]:
        """`process` for a request already parsed as a view (schemas/otlp_view.py)."""
        decisions: list[Decision] = []
        touched: dict[str, TraceState] = {}
        reading, match = self._reading, bool(self._match_keys)
        stats = self.stats
        # Traces with agents (raw ids): their every span's parent is kept (AgentTree.add_link).
        no_rules, released, agent_traces = not self._per_agent, self.released, self._agent_traces
        # Protobuf's repeated fields are walked by index: iterating one ends on an IndexError
        # that protobuf formats and Python throws away, once per loop, about once per span.
        all_resource_spans = view.resource_spans
        for resource_index in range(len(all_resource_spans)):
            resource_spans = all_resource_spans[resource_index]
            resource: ResourceInfo | None = None  # read only when an event needs it
            all_scope_spans = resource_spans.scope_spans
            for scope_index in range(len(all_scope_spans)):
                scope_spans = all_scope_spans[scope_index]
                spans = scope_spans.spans
                scope = scope_spans.scope.name
                stats.spans += len(spans)
                for span_index in range(len(spans)):
                    span = spans[span_index]
                    raw_trace_id = span.trace_id
                    if len(raw_trace_id) != 16 or len(span.span_id) != 8:
                        stats.malformed_spans += 1
                        continue
                    if agent_traces and raw_trace_id in agent_traces:
                        self._link_span(raw_trace_id, span, touched)
                    try:
                        event = adapt_read(span, reading, match, scope)
                    # A bad span costs itself, never its neighbours.
                    except Exception as exc:  # noqa: BLE001
                        self._on_bad_span(exc)
                        continue
                    if self.tools is not None:
                        self._server = self._tool_scope_span(span, event, resource_spans)
                    if event is None:
                        continue
                    trace_id = raw_trace_id.hex()
                    state = touched.get(trace_id)
                    if state is None:
                        state = self.states.get(trace_id)
                        if state is not None and released and trace_id in released:
                            self._apply_release(trace_id, state)
                        if state is None or not no_rules:
                            resource = resource or self._resource_of(resource_spans)
                            if state is None:
                                state = TraceState(
                                    shared_text(resource.service), resource.agent_name
                                )
                        touched[trace_id] = state
                    if resource is None and isinstance(event, AgentRun):  # its service
                        resource = self._resource_of(resource_spans)
                    # A LiteLLM proxy span is a tuple: the tool calls its request answered,
                    # then its own usage (conventions/gateway.py, gateway_calls).
                    for one in event if isinstance(event, tuple) else (event,):
                        try:
                            decision = self.observe(trace_id, state, one, resource)
                        # E.g. arguments nested too deep to hash: a bad call costs itself.
                        except Exception as exc:  # noqa: BLE001
                            self._on_bad_span(exc)
                            continue
                        if decision is not None:
                            decisions.append(decision)
        self._take_scopes(decisions)
        now = self.clock()
        for trace_id, state in touched.items():
            state.last_seen = now
            self.states[trace_id] = state
        return decisions

    def _resource_of(self, resource_spans: Any) -> ResourceInfo:
        return resource_info(resource_spans.resource.attributes, self._match_keys)

    def _tool_scope_span(self, span: Any, event: Any, resource_spans: Any) -> str:
        """What the tool scope reads of a span besides its tool calls: the server a tool
        call's span names (returned: `observe` hands the call with it, else ""), and an
        inference span as a call of its model (fleet.py's `model_call`), handed here: a
        provider failing for the fleet is one incident, as a tool is. A chat span is read
        whether or not the guard makes an event of it (without a token budget it does not).
        `_server` keeps the server for `observe`; `_model_agent` the last resource read and its
        agent label."""
        if isinstance(event, ToolCall):
            return server_of(span.attributes)
        tools = self.tools
        call = model_call(span, "", "")  # most spans are none: their ids are not read
        if call is not None and tools is not None:
            call.trace_id = span.trace_id.hex()
            source, label = self._model_agent
            if source is not resource_spans:  # once per resource, not per span
                resource = self._resource_of(resource_spans)
                label = agent_label(resource.service, resource.agent_name)
                self._model_agent = (resource_spans, label)
            call.agent = label
            tools.hand_tool_call(call)
        return ""

    def _link_span(self, raw_trace_id: bytes, span: Any, touched: dict[str, TraceState]) -> None:
        """Keep the parent of a span of a trace with agents, in its agent tree."""
        trace_id = raw_trace_id.hex()
        state = touched.get(trace_id)
        if state is None:
            state = self.states.get(trace_id)
            if state is None:
                return  # evicted: its next agent run starts a tree again
            if self.released and trace_id in self.released:
                self._apply_release(trace_id, state)
            touched[trace_id] = state
        tree = state.agent_tree
        if tree is not None and not tree.add_link(span.span_id, span.parent_span_id):
            self.stats.agent_links_unkept += 1

    def _take_scopes(self, decisions: list[Decision]) -> None:
        """The deciding scopes' decisions, after the request's own: a deciding tool scope
        first hears of the trace-level decisions that named a tool (`loop_signature`)."""
        tools = self.tools
        if decisions and isinstance(tools, FleetGuard):
            tools.observe_decisions(decisions)
        for scope in self._deciding:
            if scope.pending:
                decisions.extend(scope.take())

    def observe(
        self,
        trace_id: str,
        state: TraceState,
        event: ToolCall | TokenUsage | AgentSeen | AgentRun | UncarriedRequest,
        resource: ResourceInfo | None = None,
    ) -> Decision | None:
        """Apply one event to one trace's state (mutated in place).

        `resource` is needed only by a policy with per-agent rules."""
        if isinstance(event, AgentRun):
            return self._on_agent_run(trace_id, state, event, resource)
        if isinstance(event, UncarriedRequest):
            keep = (self._defaults_plan or self._plan(self._defaults)).recent_ids
            if state.recent_span_ids.seen(event.span_id, keep):
                self.stats.duplicate_spans += 1  # exporter retry or Kafka redelivery
            else:
                self._on_uncarried_request(state.service)
            return None
        if event.agent_name and not state.agent_name:
            state.agent_name = event.agent_name
        tree = state.agent_tree
        if tree is not None and tree.unresolved is not None and event.agent_name:
            tree.saw_agent(event.agent_name)  # the agent a nameless transfer handed to
        if event.conversation_id is not None and event.conversation_id != state.conversation_id:
            self._join_conversation(trace_id, state, event.conversation_id)
        user_turn = 0 if isinstance(event, ToolCall) else event.user_turn
        if isinstance(event, AgentSeen) and not user_turn:
            return None
        policy, plan = self._policy_and_plan(state, event, resource)
        if user_turn:
            # The user spoke: what the agent repeats next answers them, not its own loop. The
            # calls made before the model heard it are forgotten (spans come in the order
            # they end: an inference span may end after calls that followed its start), unless
            # the policy keeps them: a harness whose "user" is an automated "continue".
            self.stats.user_turns += 1
            if policy.user_turns == "forget":
                state.forget_calls_before(user_turn)
        if isinstance(event, AgentSeen):
            return None
        limit = plan.recent_ids
        # Remembered when new (the newest `limit` kept, trimmed in bulk).
        if state.recent_span_ids.seen(event.span_id, limit):
            self.stats.duplicate_spans += 1  # exporter retry or Kafka redelivery
            return None
        if isinstance(event, ToolCall):
            if event.call_id is not None:
                call_key = call_id_key(event.call_id)
                recent_calls = state.recent_call_ids
                end_micros = event.end_time_unix_nano // 1000
                ended = recent_calls.note(call_key, end_micros, limit)  # added when new
                if ended is not None:
                    start_micros = event.start_time_unix_nano // 1000
                    if not ended or not start_micros or start_micros < ended:
                        # The same call id on a span that overlaps the counted one (or times
                        # unknown): a partial span of that call. One that starts after it
                        # ended is the call made again (a harness re-issuing it, a model
                        # reusing ids).
                        self.stats.repeated_call_ids += 1
                        return None
                    self.stats.reissued_call_ids += 1
                    recent_calls.remove(call_key)  # kept newest last, for the trim
                    recent_calls.add(call_key, end_micros, limit)
            return self._on_tool_call(trace_id, state, event, policy, plan)
        return self._on_tokens(trace_id, state, event, policy, plan)

    def _join_conversation(self, trace_id: str, state: TraceState, conversation_id: str) -> None:
        """The first conversation a trace's spans name is its; another is counted and told
        once per trace (a span of another thread, or an id set per call)."""
        if state.conversation_id is None:
            state.conversation_id = conversation_id
            return
        self.stats.conversation_conflicts += 1
        if trace_id not in self._warned_conversations and len(self._warned_conversations) < 4096:
            self._warned_conversations.add(trace_id)
            log.warning(
                "trace %s names conversation %.200r after %.200r: the first stands (%d such"
                " spans so far)",
                trace_id,
                conversation_id,
                state.conversation_id,
                self.stats.conversation_conflicts,
            )

    def retract(self, decision: Decision) -> None:
        """Undo the mark of a decision whose signal could not be sent, so it can trip again."""
        if decision.scope is not None:  # a scope's (the agent's, the conversation's): its mark
            for scope in self._deciding:
                if scope.scope == decision.scope.kind:
                    scope.retract(decision)
            return
        mark = Fired(decision.rule, decision.action)
        state = self.states.get(decision.trace_id)
        if state is not None and mark in state.fired:
            state.fired.discard(mark)
            self.states[decision.trace_id] = state

    def _apply_release(self, trace_id: str, state: TraceState) -> None:
        """An operator released the trace (`spanguard release`): its agent may call tools
        again, so the loop rules that killed it are re-armed and count from a fresh window; the
        same loop repeated kills it again. The token budget stays spent: a released trace is
        not killed again for tokens it had already used. Applied once per release."""
        released_at = self.released.get(trace_id, 0.0)
        if released_at <= state.released_at:
            return  # applied already, or older than the one applied
        state.released_at = released_at
        rearmed = {
            mark for mark in state.fired if mark.action == KILL and mark.rule in self._rearmed
        }
        if rearmed:
            state.fired -= rearmed
            state.restart_window()
            self.stats.releases_applied += 1
            log.info(
                "trace %s released by an operator: %s count again",
                trace_id,
                ", ".join(sorted(mark.rule for mark in rearmed)),
            )

    def _on_bad_span(self, exc: Exception) -> None:
        self.stats.malformed_spans += 1
        if self.stats.malformed_spans == 1 or self.stats.malformed_spans % 1000 == 0:
            log.warning(
                "skipped a span the rules cannot read (%s: %.200s); %d so far",
                type(exc).__name__,
                exc,
                self.stats.malformed_spans,
            )

    def evict_idle(self, ttl_seconds: float) -> int:
        """Forget traces not seen for `ttl_seconds`; return how many were evicted."""
        cutoff = self.clock() - ttl_seconds
        idle = [trace_id for trace_id, state in self.states.items() if state.last_seen < cutoff]
        for trace_id in idle:
            del self.states[trace_id]
        conversations = self.conversations
        if isinstance(conversations, ConversationGuard):  # idle as long: forgotten too
            conversations.evict_idle(ttl_seconds)
        return len(idle)

    # -- rules ---------------------------------------------------------------------------

    def _on_tool_call(
        self, trace_id: str, state: TraceState, call: ToolCall, policy: AgentPolicy, plan: _Plan
    ) -> Decision | None:
        """Key the call once, slide the window, let the rules count it, then decide in turn."""
        if policy.tools:
            tool_policy = policy.tool(call.tool_name)
            if tool_policy is not None and tool_policy.exempts(call.arguments):
                self.stats.tool_calls += 1
                self._tell_call(trace_id, state, call, None)
                return None  # the policy exempts this tool: no rule counts it
        digest = call.args_digest
        if digest is None and call.arguments is not MISSING:
            if policy.fold:
                digest = args_hash(
                    call.arguments, policy.volatile_keys, policy.folding(call.tool_name)
                )
            else:
                digest = args_hash(call.arguments, policy.volatile_keys)
        if digest is None and policy.missing_args == "skip":
            self.stats.missing_arguments += 1
            self._warn_missing_arguments(state.service, call.scope)
            if state.agent_tree is not None:
                state.agent_tree.call_without_content()
            self._tell_call(trace_id, state, call, None)
            return None
        result = result_key(
            call.result, call.failed, call.result_digest, policy.volatile_keys, MISSING
        )
        self.stats.tool_calls += 1
        key = (call.tool_name, digest, result)
        for counting in plan.counting:
            counting.count(state, call, key, policy)
        # The call joins the window (_slide, inlined: this runs on every call).
        history = plan.history
        state.window.push(key, history)
        marks = state.window_marks + call_mark(call.span_id, call.end_time_unix_nano)
        if len(marks) > history * MARK_BYTES:  # a mark a call of the window
            marks = marks[len(marks) - history * MARK_BYTES :]
        state.window_marks = marks
        if self.observers or self.conversations is not None:
            self._tell_call(trace_id, state, call, key)
        if self.tools is not None:
            agent = agent_label(state.service, state.agent_name)
            self.tools.hand_tool_call(tool_call(call, result, trace_id, agent, self._server))
        rules = plan.call_rules
        if plan.handoff_rules and (call.handoff or state.agent_tree is not None):
            rules = rules + plan.handoff_rules  # a trace with agents: rare, and short lists
        fired = state.fired
        decision = None
        for rule, wanted in rules:
            if fired and (rule.killed in fired or (wanted == FLAG and rule.flagged in fired)):
                continue  # decided already: once per trace and rule
            trip = rule.check(state, call, key, policy)
            if trip is None:
                continue
            decision = self._fire(
                rule, trip, wanted, trace_id, state, policy, call.span_id, call.end_time_unix_nano
            )
            if decision is not None:
                break
        state.window.memo = None  # the key's entry, packed for the rules: not kept
        return decision

    def _on_agent_run(
        self, trace_id: str, state: TraceState, run: AgentRun, resource: ResourceInfo | None
    ) -> Decision | None:
        """Place an agent's run in the trace's agent tree, then let the agent rules decide."""
        tree = state.agent_tree
        if tree is None:
            tree = state.agent_tree = AgentTree()
        # Its spans' parents are kept from now on (a tree read back from the state too).
        raw_trace_id, agent_traces = _raw_trace_id(trace_id), self._agent_traces
        if raw_trace_id and raw_trace_id not in agent_traces:
            agent_traces[raw_trace_id] = None
            if len(agent_traces) > MAX_AGENT_TRACES:
                del agent_traces[next(iter(agent_traces))]
        if run.by_service and run.agent_name is None and resource is not None:
            # A service's answer to a request (a2a-sdk's): only its service names the agent.
            run.agent_name = resource.service
        if tree.unresolved is not None and run.agent_name:
            tree.saw_agent(run.agent_name)
        started = tree.started
        if not tree.add_run(run, resource.service if resource is not None else None):
            if tree.started == started:
                return None  # placed already: a redelivery
            self.stats.agent_runs_unplaced += 1  # the tree is full (MAX_RUNS): counted only
        if run.by_service and not run.parent_span_id:
            self._on_uncarried_request(state.service)  # nothing above the handler
        elif run.caller_trace_id is not None:
            self._on_linked_run(trace_id, state, run, run.caller_trace_id)
        policy, plan = self._policy_and_plan(state, run, resource)
        fired = state.fired
        for rule, wanted in plan.agent_rules:
            if fired and (rule.killed in fired or (wanted == FLAG and rule.flagged in fired)):
                continue
            trip = rule.check_run(state, run, policy)
            if trip is None:
                continue
            decision = self._fire(
                rule, trip, wanted, trace_id, state, policy, run.span_id, run.end_time_unix_nano
            )
            if decision is not None:
                return decision
        return None

    def _on_tokens(
        self, trace_id: str, state: TraceState, usage: TokenUsage, policy: AgentPolicy, plan: _Plan
    ) -> Decision | None:
        stats = self.stats
        stats.token_events += 1
        if usage.aggregate:
            tokens_before, cost_before = _spent(state)
            # Nested agents' aggregates overlap; the largest stands for the trace.
            if usage.tokens > state.aggregate_tokens:
                state.aggregate_tokens = usage.tokens
            priced = self.pricer is not None and self._price(state, usage, plan)
            tokens_after, cost_after = _spent(state)
        else:
            # An inference span (most usage spans): _spent's arithmetic, inlined. The trace's
            # inference sums stand for it from the first on, the agents' totals no more.
            summed_tokens, summed_cost = state.inference_tokens, state.inference_cost
            tokens_before = summed_tokens if summed_tokens is not None else state.aggregate_tokens
            cost_before = summed_cost if summed_cost is not None else state.aggregate_cost
            state.inference_tokens = tokens_after = (summed_tokens or 0) + usage.tokens
            priced = self.pricer is not None and self._price(state, usage, plan)
            summed_cost = state.inference_cost
            cost_after = summed_cost if summed_cost is not None else state.aggregate_cost
        # What the trace's spend grew by (an agent's total repeats its inference spans: only
        # what the budgets count is added), by whether it has a price.
        added_tokens = tokens_after - tokens_before if tokens_after > tokens_before else 0
        added_cost = cost_after - cost_before if cost_after > cost_before else 0
        if added_tokens:
            if priced:
                stats.tokens_priced += added_tokens
            elif self.pricer is not None:
                stats.tokens_unpriced += added_tokens
            else:
                stats.tokens_not_priced += added_tokens
        if added_cost:
            stats.cost_pico_usd += added_cost
        decision: Decision | None = None
        fired = state.fired
        for rule, wanted in plan.token_rules:
            if fired and (
                rule.killed in fired
                or (wanted == FLAG and rule.flagged in fired)
                or (wanted == PAUSE and rule.paused in fired)  # the operator's answer stands
            ):
                continue
            trip = rule.check_tokens(state, usage, policy)
            if trip is not None:
                decision = self._fire(
                    rule,
                    trip,
                    wanted,
                    trace_id,
                    state,
                    policy,
                    usage.span_id,
                    usage.end_time_unix_nano,
                )
                if decision is not None:
                    break
        if (added_tokens or added_cost) and self._hands_on_usage:
            self._hand_on_usage(trace_id, state, usage, added_tokens, added_cost)
        return decision

    def _hand_on_usage(
        self, trace_id: str, state: TraceState, usage: TokenUsage, tokens: int, cost: int
    ) -> None:
        """What the span added to the trace's tokens and cost, handed to the scopes that count
        it: the trace's conversation (where its scope counts usage), then the agent's rolling
        window. Their decisions wait in their `pending` until the request is done."""
        conversations = self.conversations
        if (
            conversations is not None
            and conversations.counts_usage
            and state.conversation_id is not None
        ):
            conversations.hand_usage(
                ConversationUsage(
                    state.conversation_id,
                    trace_id,
                    usage.span_id,
                    usage.end_time_unix_nano,
                    tokens,
                    cost,
                    state.service,
                    state.agent_name,
                )
            )
        if self.agent_budgets is not None:
            self.agent_budgets.hand_spend(
                state.service,
                state.agent_name,
                trace_id,
                usage.span_id,
                usage.end_time_unix_nano,
                tokens,
                cost,
            )

    def _price(self, state: TraceState, usage: TokenUsage, plan: _Plan) -> bool:
        """Add the span's cost to the trace's: an inference span's to the sum (or its tokens to
        the unpriced ones), an agent's total (only when it names a model) as the largest.
        Whether the span was priced."""
        if usage.aggregate and not usage.priced:
            return False  # an agent's total without a model: its inference spans carry the cost
        assert self.pricer is not None
        cost = self.pricer.cost(usage, plan.prices)
        if cost is None:
            self.stats.unpriced_usage += 1
            if not usage.aggregate:
                state.unpriced_tokens += usage.tokens
            return False
        self.stats.priced_usage += 1
        if usage.aggregate:
            state.aggregate_cost = max(state.aggregate_cost, cost)
        else:
            state.inference_cost = (state.inference_cost or 0) + cost
        return True

    def _plan(self, policy: AgentPolicy) -> _Plan:
        """What `policy` switches on, worked out once per policy entry (not per call)."""
        plan = _Plan(policy.history, max(MIN_RECENT_IDS, 4 * policy.loop.window))
        plan.prices = {model: ModelRates.per_million(dict(rates)) for model, rates in policy.prices}
        for rule in self._call_rules:
            wanted = rule.wanted(policy)
            if wanted != OFF:
                rules = plan.handoff_rules if rule.agents_only else plan.call_rules
                rules.append((rule, FLAG if policy.shadow else wanted))
                if rule.counts:
                    plan.counting.append(rule)
        for token_rule in self._token_rules:
            wanted = token_rule.wanted(policy)
            if wanted != OFF:
                plan.token_rules.append((token_rule, FLAG if policy.shadow else wanted))
        for agent_rule in self._agent_rules:
            wanted = agent_rule.wanted(policy)
            if wanted != OFF:
                plan.agent_rules.append((agent_rule, FLAG if policy.shadow else wanted))
        # Keyed by id (a policy hashes slowly), with the policy kept to check the id is its.
        self._plans[id(policy)] = (policy, plan)
        if policy is self._defaults:
            self._defaults_plan = plan
        return plan

    def _fire(
        self,
        rule: Rule,
        trip: Trip,
        wanted: str,
        trace_id: str,
        state: TraceState,
        policy: AgentPolicy,
        span_id: bytes,
        end_unix_nano: int,
    ) -> Decision | None:
        """The one path from a rule's trip to a decision, the same for every rule."""
        if trip.flag_only:
            if rule.flagged in state.fired:
                return None
            action = FLAG
        elif wanted == FLAG:
            action = FLAG
        elif wanted == DOWNGRADE and rule.downgraded not in state.fired:
            action = DOWNGRADE  # once; the next trip of the rule kills
        elif wanted == PAUSE and rule.paused not in state.fired:
            action = PAUSE  # once: released, the same rule tripping again kills
        else:
            action = KILL
        state.fired.add(Fired(rule.name, action))
        if action != FLAG and rule.restarts_window:
            state.restart_window()  # after a downgrade the agent gets a fresh window
        decision = self._decide(
            trace_id,
            state,
            policy,
            rule.name,
            action,
            trip,
            span_id.hex(),
            _iso_from_ns(end_unix_nano),
        )
        for observer in self.observers:
            observer.on_decision(decision, state)
        return decision

    def _tell_call(
        self, trace_id: str, state: TraceState, call: ToolCall, key: CallKey | None
    ) -> None:
        for observer in self.observers:
            observer.on_tool_call(trace_id, state, call, key)
        conversations = self.conversations
        if conversations is not None and key is not None and state.conversation_id is not None:
            conversations.hand_call(
                ConversationCall(
                    state.conversation_id,
                    trace_id,
                    call.span_id,
                    call.end_time_unix_nano,
                    key,
                    state.service,
                    state.agent_name,
                )
            )

    # -- helpers -------------------------------------------------------------------------

    def _decide(
        self,
        trace_id: str,
        state: TraceState,
        policy: AgentPolicy,
        rule: str,
        action: str,
        trip: Trip,
        span_id: str,
        span_ended_at: str | None,
    ) -> Decision:
        entry, match = self.policy.entry_of(policy)
        pause: Pause | None = None
        if action == "pause":
            until = self.clock() + policy.pause.timeout
            pause = Pause(
                datetime.fromtimestamp(until, UTC).isoformat(timespec="milliseconds"),
                policy.pause.fallback,
            )
        decision = Decision(
            trace_id=trace_id,
            span_id=span_id,
            rule=rule,  # type: ignore[arg-type]
            action=action,  # type: ignore[arg-type]
            reason=trip.reason,
            agent=AgentIdentity(state.service, state.agent_name),
            detected_at=_now_iso(self.clock),
            evidence=trip.evidence,
            spend=trip.spend,
            policy=PolicyInForce(entry, match, policy.severity, policy.autonomous),
            system_message=trip.message if action == DOWNGRADE else None,
            span_ended_at=span_ended_at,
            pause=pause,
            decision_id=(
                decision_id(trace_id, rule, action, state.released_at) if state.released_at else ""
            ),
        )
        self.stats.decisions[(decision.rule, decision.action)] += 1
        return decision

    def _policy_and_plan(
        self,
        state: TraceState,
        event: ToolCall | TokenUsage | AgentSeen | AgentRun,
        resource: ResourceInfo | None,
    ) -> tuple[AgentPolicy, _Plan]:
        """The policy entry for the event's agent and its plan (made once per entry)."""
        if self._per_agent:
            policy = self._policy_for(state, event, resource)
            entry = self._plans.get(id(policy))
            plan = entry[1] if entry is not None and entry[0] is policy else self._plan(policy)
            return policy, plan
        # One policy for every agent: its plan is made once.
        policy = self._defaults
        return policy, self._defaults_plan or self._plan(policy)

    def _policy_for(
        self,
        state: TraceState,
        event: ToolCall | TokenUsage | AgentSeen | AgentRun,
        resource: ResourceInfo | None,
    ) -> AgentPolicy:
        if not self.policy.rules:
            return self.policy.defaults
        attributes = dict(resource.match_attributes) if resource is not None else {}
        if event.match_attributes:
            attributes.update(event.match_attributes)
        # The agent's name is often only on its invoke_agent span: remember it for the trace.
        if state.agent_name is not None:
            attributes.setdefault(AGENT_NAME, state.agent_name)
        attributes.setdefault(SERVICE_NAME, state.service)
        return self.policy.for_attributes(attributes)

    def _first_told(self, service: str, what: str) -> bool:
        """Whether `service` is to be told of `what` now: the first time, while fewer than
        MAX_WARNED were told (service names come from the spans, unbounded)."""
        key = (service, what)
        if key in self._warned or len(self._warned) >= MAX_WARNED:
            return False
        self._warned.add(key)
        return True

    def _on_uncarried_request(self, service: str) -> None:
        """Count a request that came without its caller's trace; tell once per service."""
        self.stats.uncarried_requests += 1
        if not self._first_told(service, UNCARRIED):
            return
        log.warning(
            "service %.200r answers A2A requests that start a trace of their own: their"
            " callers' trace context does not come with them, so each request is decided"
            " alone and a loop between agents that runs through this service is not seen as"
            " one (an agent budget over a window, where set, still stops it); where its"
            " callers are agents, carry the context: OpenTelemetry's httpx instrumentation in the caller"
            " and its Starlette or ASGI instrumentation here (docs/agents.md, 'Multi-agent runs')",
            service,
        )

    def _on_linked_run(
        self, trace_id: str, state: TraceState, run: AgentRun, caller_trace_id: str
    ) -> None:
        """Count an agent run whose trace links to its caller's, and follow the link into the
        conversation scope where one is given (a trace naming no conversation joins its
        caller's); tell once per service."""
        self.stats.linked_runs += 1
        conversations = self.conversations
        if conversations is not None and state.conversation_id is None:
            self._join_callers_conversation(trace_id, state, run, conversations, caller_trace_id)
        if not self._first_told(state.service, LINKED):
            return
        log.warning(
            "service %.200r starts each agent run in a trace of its own, linked to its caller's"
            " span (a span link, not a parent): each run is decided alone by the trace rules,"
            " and a loop between agents that runs through this service is not seen as one by"
            " them (an agent budget over a window, where set, still stops it); with the"
            " conversation scope on, the runs linked to one caller's trace are one conversation,"
            " %s (docs/agents.md, 'Multi-agent runs')",
            state.service,
            linked_conversation("<caller's trace id>"),
        )

    def _join_callers_conversation(
        self,
        trace_id: str,
        state: TraceState,
        run: AgentRun,
        conversations: ConversationSink,
        caller_trace_id: str,
    ) -> None:
        """The trace joins the conversation of the runs linked to its caller's trace. The link
        is on the run's root span, which ends last: the calls its window keeps and the usage
        it counted so far are handed now, in the order they came (the usage under the run's
        span)."""
        conversation_id = state.conversation_id = linked_conversation(caller_trace_id)
        service, agent_name = state.service, state.agent_name
        for key, span_id, end_unix_nano in state.window_entries():
            conversations.hand_call(
                ConversationCall(
                    conversation_id, trace_id, span_id, end_unix_nano, key, service, agent_name
                )
            )
        tokens, cost = state.inference_tokens or 0, state.inference_cost or 0
        if conversations.counts_usage and (tokens or cost):
            conversations.hand_usage(
                ConversationUsage(
                    conversation_id,
                    trace_id,
                    run.span_id,
                    run.end_time_unix_nano,
                    tokens,
                    cost,
                    service,
                    agent_name,
                )
            )

    def _warn_missing_arguments(self, service: str, scope: str) -> None:
        if not self._first_told(service, scope):
            return
        instrumentation, setting = capture_setting(scope)
        log.warning(
            "tool spans of service %.200r from %s (scope %.200r) carry no arguments (capture off or"
            " redacted), so they are not counted for tool_loop; to record them: %s; %s",
            service,
            instrumentation,
            scope,
            setting,
            HASHING_HINT,
        )
