"""In-process mode: the detection core as an OpenTelemetry SpanProcessor around an exporter's.

    provider.add_span_processor(GuardingSpanProcessor(BatchSpanProcessor(OTLPSpanExporter())))

Every ended span is encoded with the SDK's own OTLP encoder and run through one shared `Guard`,
the very core the Kafka worker runs, so the rules and their results are the same in both
placements. A decision is delivered into a `SignalBook` (the agent's next `check()` raises
`AgentKilled` or returns the downgrade message, exactly as a signal from Kafka would), handed to
`on_decision`, and recorded as a short `spanguard.decision` span in the same trace, so it
reaches the backend next to the span that tripped it.

Why not mark the tripping span itself: `on_end` receives a `ReadableSpan`, read-only once ended; it
has no `set_attribute` (AttributeError with SDK 1.45), so a processor that marks the span
raises inside `span.end()`, in the agent's own code, and the wrapped processor's `on_end` is never reached:
the span is lost to the exporter. Here nothing raised by the guard escapes `on_end`, the
wrapped processor always gets the span, and the decision travels as a span of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.trace import (
    NonRecordingSpan,
    NoOpTracerProvider,
    ProxyTracerProvider,
    SpanKind,
    Tracer,
    TracerProvider,
)

from spanguard.detection.agent_budget import AgentBudgetGuard
from spanguard.detection.conventions.keys import A2A_SCOPE, AGENT_NAME, SERVICE_NAME
from spanguard.detection.conventions.kinds import is_a2a_handler
from spanguard.detection.conversation import ConversationGuard
from spanguard.detection.guard import Guard
from spanguard.detection.trace_state import TraceState
from spanguard.killswitch.adapters import CountsUnguarded
from spanguard.killswitch.signals import (
    DEFAULT_MAX_TRACES,
    SignalBook,
    current_agent,
    current_trace_id,
)
from spanguard.schemas.decision import AgentIdentity, Decision, kill_signals
from spanguard.schemas.policy import Policy

__all__ = ["DECISION_SPAN_NAME", "INSTRUMENTATION_SCOPE", "GuardingSpanProcessor"]

log = logging.getLogger("spanguard.killswitch")

DECISION_SPAN_NAME = "spanguard.decision"
INSTRUMENTATION_SCOPE = "spanguard.killswitch"
# The adapters' own early exit (adapt_span): a span with none of the wanted attributes and
# another name is no guard event. Testing it before encoding keeps HTTP/DB spans nearly free.
BARE_TOOL_SPAN_NAME = "execute_tool"
MAX_CACHED_RESOURCES = 64
MAX_LOGGED_ERRORS = 10


class _BoundedStates(OrderedDict[str, TraceState]):
    """The Guard's per-trace state, least recently written first, capped at `limit` traces.

    The Guard writes a trace's state back (and sets its last_seen) after each request, so
    moving it to the end on write keeps the order that of last_seen: expiring idle traces
    only looks at the front, and the cap drops the trace idle the longest.
    """

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def __setitem__(self, trace_id: str, state: TraceState) -> None:
        super().__setitem__(trace_id, state)
        self.move_to_end(trace_id)
        while len(self) > self.limit:
            self.popitem(last=False)

    def expire(self, cutoff: float) -> int:
        expired = 0
        while self:
            trace_id, state = next(iter(self.items()))
            if state.last_seen >= cutoff:
                break
            del self[trace_id]
            expired += 1
        return expired


class GuardingSpanProcessor(SpanProcessor, CountsUnguarded):
    """Forwards every call to `inner` and runs each ended span through the detection core.

    - `policy`: the guard policy (defaults when None).
    - `on_decision`: called with each Decision; its exceptions are logged, never raised.
    - `signals`: the SignalBook the agent's `check()` reads (a new one when None; pass the
      Kafka KillSwitch's to have both placements feed one book).
    - `tracer_provider`: where `spanguard.decision` spans are made; the global provider when
      None (looked up at the first decision, so it may be set after this processor is built).
    - `ttl_seconds`, `max_traces`: a trace's state is dropped when its root span ends, after
      `ttl_seconds` without spans (a root that never ends here, e.g. under a remote parent),
      or when `max_traces` traces are open, the idlest first.
    """

    unguarded_counter = "GuardingSpanProcessor.unguarded"

    def __init__(
        self,
        inner: SpanProcessor,
        policy: Policy | None = None,
        on_decision: Callable[[Decision], None] | None = None,
        signals: SignalBook | None = None,
        ttl_seconds: float = 3600,
        max_traces: int = DEFAULT_MAX_TRACES,
        *,
        tracer_provider: TracerProvider | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if max_traces < 1:
            raise ValueError("max_traces must be at least 1")
        self.inner = inner
        self.on_decision = on_decision
        self.signals = signals if signals is not None else SignalBook(max_traces)
        self.ttl_seconds = ttl_seconds
        self._states = _BoundedStates(max_traces)
        # The conversation scope, where the policy asks for it: one process sees every turn
        # of the chats it serves. Its conversations are bounded and expire like traces.
        policy = policy or Policy()
        entries = [policy.defaults, *(rule.policy for rule in policy.rules)]
        self._conversations: _BoundedStates | None = None
        conversations = None
        if any(entry.conversation.enabled for entry in entries):
            self._conversations = _BoundedStates(max_traces)
            conversations = ConversationGuard(
                policy,
                states=self._conversations,  # type: ignore[arg-type]
                clock=clock,
            )
        # The agent scope over time, where the policy gives an agent budget: a crossing with
        # action kill stops every trace of the agent until its window frees.
        agent_budgets = AgentBudgetGuard(policy, clock=clock)
        self.guard = Guard(
            policy,
            states=self._states,
            clock=clock,
            conversations=conversations,
            agent_budgets=agent_budgets if agent_budgets.enabled else None,
        )
        # What the core reads of a span and of its resource (adapt_span, resource_info).
        self._wanted = self.guard.wanted_keys
        self._wanted_resource = {SERVICE_NAME, AGENT_NAME} | self.guard.policy.match_keys
        self._slim_resources: dict[int, tuple[Resource, Resource]] = {}
        # One Guard for every agent thread of the process: its state is not thread-safe.
        self._lock = threading.Lock()
        # Set while this thread runs the guard. The guard logs (a one-time warning, errors),
        # and a logging handler may itself end a span (a log shipper whose HTTP call is
        # traced): that span reaches on_end again on this very thread, with the lock held.
        # It is exported as usual but not guarded, so the thread never waits on its own lock.
        self._busy = threading.local()
        self._tracer_provider = tracer_provider
        self._tracer: Tracer | None = None
        self._warned_no_provider = False
        self.errors = 0
        CountsUnguarded.__init__(self)

    # -- SpanProcessor -------------------------------------------------------------------

    def on_start(self, span: Span, parent_context: context_api.Context | None = None) -> None:
        self.inner.on_start(span, parent_context=parent_context)

    def _on_ending(self, span: Span) -> None:
        self.inner._on_ending(span)

    def on_end(self, span: ReadableSpan) -> None:
        # Runs inside the agent's span.end(): whatever fails here must not reach the agent,
        # and the wrapped processor must get the span all the same.
        if not getattr(self._busy, "active", False):
            self._busy.active = True
            try:
                if not self._is_own(span):
                    self._observe(span)
            # In the agent's span pipeline: logged with its traceback, never raised into the SDK.
            except Exception:  # noqa: BLE001
                self._log_error("guarding an ended span failed; the span is exported as usual")
            finally:
                self._busy.active = False
        try:
            self.inner.on_end(span)
        # In the agent's span pipeline: logged with its traceback, never raised into the SDK.
        except Exception:  # noqa: BLE001
            self._log_error("the wrapped span processor failed in on_end")

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)

    # -- the agent's side ----------------------------------------------------------------

    def check(
        self,
        trace_id: str | None = None,
        conversation_id: str | None = None,
        agent: AgentIdentity | None = None,
        *,
        tool: str | None = None,
        server: str | None = None,
    ) -> str | None:
        """SignalBook.check on `trace_id`, or on the current span's trace, and on the
        conversation and agent given (an agent kill of the agent budget), and on the `tool`
        called (ToolContained). Without a trace (none given, no current span) only those are
        checked, and the call is counted in `unguarded` and warned about once."""
        trace_id = trace_id if trace_id is not None else current_trace_id()
        if agent is None and self.guard.agent_budgets is not None:
            agent = self._agent_of(trace_id)
        self.signals.check_scopes(conversation_id, agent)
        if trace_id is None:
            self.note_unguarded(
                "GuardingSpanProcessor.check()",
                "no trace id given and no OpenTelemetry span is current; check() inside the"
                " agent's span, pass the run's trace id, or use an adapter of"
                " spanguard.killswitch.adapters",
            )
            self.signals.check_tool(tool, server)
            return None
        return self.signals.check(trace_id, tool=tool, server=server)

    def check_tool(self, tool: str | None, server: str | None = None) -> None:
        """Raise ToolContained if `tool` is contained (SignalBook.check_tool)."""
        self.signals.check_tool(tool, server)

    def _agent_of(self, trace_id: str | None) -> AgentIdentity | None:
        """The agent of a trace whose spans this processor has read, else the one a resource
        names (a new trace, before its first span ends): `tracer_provider`'s, else the current
        span's, else the global provider's (current_agent)."""
        state = self._states.get(trace_id) if trace_id is not None else None
        if state is not None:
            return AgentIdentity(state.service, state.agent_name)
        return current_agent(self._tracer_provider)

    def wait(self, trace_id: str | None = None, timeout: float | None = None) -> str | None:
        """SignalBook.wait: while the trace is paused, block until a release or a kill (an
        operator's, through a KillSwitch sharing this `signals` book) or the pause's deadline."""
        trace_id = trace_id if trace_id is not None else current_trace_id()
        if trace_id is None:
            return None
        return self.signals.wait(trace_id, timeout)

    # -- internals -----------------------------------------------------------------------

    @staticmethod
    def _is_own(span: ReadableSpan) -> bool:
        # Our decision spans pass through this very processor: feeding them back to the guard
        # would be noise at best.
        scope = span.instrumentation_scope
        return span.name == DECISION_SPAN_NAME or (
            scope is not None and scope.name == INSTRUMENTATION_SCOPE
        )

    def _observe(self, span: ReadableSpan) -> None:
        span_context = span.context
        if span_context is None:
            return
        # Encoding is pure and per span: done outside the lock, so threads only queue for the
        # core itself.
        data = self._encode(span)
        is_root = span.parent is None
        if data is None and not is_root:
            return  # nothing for the core: no lock taken
        trace_id = format(span_context.trace_id, "032x")
        with self._lock:
            decisions = self.guard.process(data) if data is not None else []
            if is_root:
                # The trace is over in this process: its state goes with it.
                self._states.pop(trace_id, None)
            if self._states:
                self._states.expire(self.guard.clock() - self.ttl_seconds)
            if self._conversations:
                self._conversations.expire(self.guard.clock() - self.ttl_seconds)
        for decision in decisions:
            self._act(decision, span)
        if is_root:
            # Its signals need not be kept for good any more: bounded with other traces'.
            self.signals.trace_ended(trace_id)

    def _encode(self, span: ReadableSpan) -> bytes | None:
        """The span as OTLP bytes for the core, or None when the core would ignore it.

        The real OTLP encoder runs on a copy holding only what the core reads: the wanted
        attributes (the very values, so the very encoding), the events (some conventions put
        arguments there), the instrumentation scope and the resource's service, agent name and
        match keys. On a span with
        the attributes real GenAI instrumentations set, this halves the encoder's cost.
        """
        attributes = span.attributes or {}
        present = self._wanted.intersection(attributes)
        if not present and span.name != BARE_TOOL_SPAN_NAME and not self._a2a_handler(span):
            return None
        slim = ReadableSpan(
            span.name,
            context=span.context,
            parent=span.parent,
            resource=self._slim_resource(span.resource),
            attributes={key: attributes[key] for key in present},
            events=span.events,
            kind=span.kind,
            start_time=span.start_time,
            end_time=span.end_time,
            # The scope says which instrumentation made the span (placeholders, capture hints).
            instrumentation_scope=span.instrumentation_scope,
        )
        return encode_spans([slim]).SerializeToString()

    @staticmethod
    def _a2a_handler(span: ReadableSpan) -> bool:
        """An a2a-sdk handler's span, an agent run though it carries no attribute (adapt.py)."""
        scope = span.instrumentation_scope
        return scope is not None and scope.name == A2A_SCOPE and is_a2a_handler(span.name)

    def _slim_resource(self, resource: Resource) -> Resource:
        # A process has a resource or two: slim each once (keyed by identity, the original
        # kept alive in the entry so its id cannot be reused).
        entry = self._slim_resources.get(id(resource))
        if entry is None:
            if len(self._slim_resources) >= MAX_CACHED_RESOURCES:
                self._slim_resources.clear()
            wanted = self._wanted_resource
            slim = Resource({k: v for k, v in resource.attributes.items() if k in wanted})
            entry = self._slim_resources[id(resource)] = (resource, slim)
        return entry[1]

    def _act(self, decision: Decision, span: ReadableSpan) -> None:
        # Each step on its own: a failing callback must not stop the kill nor the record.
        try:  # a flag is for people only; a conversation kill stops its later traces too
            for signal in kill_signals(decision):
                self.signals.deliver(signal)
        # In the agent's span pipeline: logged with its traceback, never raised into the SDK.
        except Exception:  # noqa: BLE001
            self._log_error("delivering a decision to the signal book failed")
        if self.on_decision is not None:
            try:
                self.on_decision(decision)
            # The user's callback may raise anything: logged with its traceback, never into the SDK.
            except Exception:  # noqa: BLE001
                self._log_error("the on_decision callback raised")
        try:
            self._record(decision, span)
        # In the agent's span pipeline: logged with its traceback, never raised into the SDK.
        except Exception:  # noqa: BLE001
            self._log_error("recording a decision span failed")

    def _record(self, decision: Decision, span: ReadableSpan) -> None:
        """Emit `spanguard.decision` as a child of the span that tripped the rule."""
        tracer = self._decision_tracer()
        if tracer is None:
            return
        parent = trace.set_span_in_context(NonRecordingSpan(span.context))
        # The decision's record keys that become `spanguard.<key>` attributes: its evidence as
        # a kill signal carries it (EVIDENCE_FIELDS); raw tool arguments never do.
        values = {
            "rule": decision.rule,
            "action": decision.action,
            "reason": decision.reason,
            **decision.signal_evidence(),
            "decision_id": decision.decision_id,
        }
        attributes = {f"spanguard.{key}": value for key, value in values.items()}
        attributes["spanguard.agent.service"] = decision.agent.service
        if decision.agent.name is not None:
            attributes["spanguard.agent.name"] = decision.agent.name
        tracer.start_span(
            DECISION_SPAN_NAME, context=parent, kind=SpanKind.INTERNAL, attributes=attributes
        ).end()

    def _decision_tracer(self) -> Tracer | None:
        if self._tracer is not None:
            return self._tracer
        provider = self._tracer_provider or trace.get_tracer_provider()
        if isinstance(provider, ProxyTracerProvider | NoOpTracerProvider):
            # No global provider set (yet): a span made there goes nowhere. Not cached, so
            # decisions are recorded as soon as the application sets one.
            if not self._warned_no_provider:
                self._warned_no_provider = True
                log.warning(
                    "spanguard decisions are not recorded as spans: pass tracer_provider= to"
                    " GuardingSpanProcessor or set the global tracer provider"
                )
            return None
        self._tracer = provider.get_tracer(INSTRUMENTATION_SCOPE)
        return self._tracer

    def _log_error(self, what: str) -> None:
        # A persistent fault would log on every span: the first few in full, then 1 in 1000.
        self.errors += 1
        if self.errors <= MAX_LOGGED_ERRORS or self.errors % 1000 == 0:
            log.exception("%s (error %d)", what, self.errors)
