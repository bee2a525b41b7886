"""What the framework adapters share; each adapter lives in the module named for its framework
(`spanguard.killswitch.adapters_<framework>`), so importing one needs only that framework.

| adapter | module | framework | hook | extra |
|---|---|---|---|---|
| `SpanguardCallbackHandler` | `adapters_langchain` | LangChain / LangGraph | callback `on_tool_start` (and `on_chat_model_start`) | `langchain` |
| `SpanguardRunHooks` | `adapters_openai_agents` | OpenAI Agents SDK | `RunHooks.on_llm_start` / `on_tool_start` | `openai-agents` |
| `SpanguardCapability` | `adapters_pydantic_ai` | pydantic-ai | capability `before_tool_execute` | `pydantic-ai` |
| `SpanguardStepCallback` | `adapters_smolagents` | smolagents | `step_callbacks` (after each step, before the next) | `smolagents` |
| `guard_llama_index_agent` | `adapters_llama_index` | llama-index workflow agents | the agent's tool step | `llama-index` |
| `SpanguardAdkPlugin` | `adapters_google_adk` | Google ADK | runner plugin `before_model_callback` / `before_tool_callback` | (google-adk) |
| `SpanguardHooks` | `adapters_strands` | strands | hooks `BeforeModelCallEvent` / `BeforeToolCallEvent` | (strands-agents) |

Each takes anything with `check(trace_id) -> str | None` (a `KillSwitch`, a `SignalBook`, a
`GuardingSpanProcessor`) and finds the trace to check, in this order: a fixed `trace_id=`; the
current OpenTelemetry span; the framework's run (LangChain's `run_id` and its parents, with the
span OpenInference keeps per run, which it never makes current; the Agents SDK's trace); the
trace that was current when the run started. Where none is found, the tool call is not
guarded: the adapter says so once, loudly (a warning naming the framework, the
instrumentation it found and what to do), and counts it in `adapter.unguarded` and in the
`KillSwitch`'s `unguarded`. Never a silent skip.

Before each check the adapter makes the run's spans leave in time: it adds a
`FlushAfterToolSpans` to the tracer provider of the run's span (else the global one) when that
provider batches with the SDK's defaults (`ensure_prompt_export`, killswitch/export.py), so a
looping agent is stopped by its 4th or 5th call without its owner changing the provider. A
provider it cannot make prompt (a processor it does not know, no SDK provider) is warned about
once, loudly, and counted in `adapter.late_export` and the `KillSwitch`'s `late_export`.

A kill, pause or downgrade obeyed is recorded on the run's span (`spanguard.stop` /
`spanguard.downgrade`, killswitch/stop.py), also where that span is not current (OpenInference's
LangChain spans).

`AgentKilled` propagates out of the hook; what the agent's code then sees is documented per
framework in docs/agents.md. A call to a tool spanguard contained (a signal of scope tool) is
checked by name (`check_tool`, where the checker has it) after the trace, and its
`ToolContained` is not a stop: each adapter hands the model its message as the tool's error
(docs/killswitch-clients.md, "A contained tool: refused, the agent goes on"), and the agent can
take another tool. A downgrade's system message goes to `on_downgrade` (or waits in
`pending_messages` for the agent to inject it). A paused trace waits in the checker's `wait()`
(in a thread, for the async hooks) until an operator's release or kill, or the pause's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Protocol

from spanguard.killswitch.signals import AgentPaused, current_trace_id
from spanguard.schemas.decision import AgentIdentity

__all__ = ["Checker", "TraceGate"]

log = logging.getLogger("spanguard.killswitch")

# Runs remembered per adapter: their parent and the trace seen at their start.
MAX_RUNS = 10_000


class Checker(Protocol):
    """What an adapter checks before a tool call: a KillSwitch, a SignalBook or a
    GuardingSpanProcessor (each takes the scope as these keywords)."""

    def check(
        self,
        trace_id: str,
        *,
        conversation_id: str | None = ...,
        agent: AgentIdentity | None = ...,
    ) -> str | None: ...


class TraceGate:
    """What every adapter shares: the check, the downgrade message, the unguarded count, and
    the traces recorded per run of the framework."""

    framework = "this framework"
    # Named by the unguarded warning: the instrumentation modules this framework's spans come
    # from (those imported are "found"), or `own_telemetry` where the framework makes its own
    # spans; and how the user gives the run a trace (`setup`, then the ways every adapter shares).
    instrumentations: tuple[str, ...] = ()
    own_telemetry: str | None = None
    setup = "instrument the framework with OpenTelemetry before the agent runs"

    def __init__(
        self,
        checker: Checker,
        trace_id: str | None = None,
        on_downgrade: Callable[[str], None] | None = None,
        *,
        conversation_id: str | None = None,
        agent: AgentIdentity | None = None,
    ) -> None:
        self.checker = checker
        self.trace_id = trace_id
        # Passed to every check, so a conversation or agent kill stops this run too (a
        # KillSwitch otherwise reads them from OpenTelemetry baggage and resource).
        self.scope: dict[str, Any] = {
            name: value
            for name, value in (("conversation_id", conversation_id), ("agent", agent))
            if value is not None
        }
        self.on_downgrade = on_downgrade
        self.pending_messages: list[str] = []
        self.unguarded = 0
        self._warned = False
        # Checks whose spans may reach the guard late (see ensure_prompt_export).
        self.late_export = 0
        self._late_warned = False
        self._runs_lock = threading.Lock()
        # run id -> (parent run id, trace id seen at the run's start)
        self._runs: OrderedDict[Hashable, tuple[Hashable | None, str | None]] = OrderedDict()

    # -- the runs of the framework -----------------------------------------------------------

    def remember_run(
        self, run_id: Hashable, parent_id: Hashable | None, trace_id: str | None
    ) -> None:
        with self._runs_lock:
            self._runs[run_id] = (parent_id, trace_id)
            self._runs.move_to_end(run_id)
            while len(self._runs) > MAX_RUNS:
                self._runs.popitem(last=False)

    def forget_run(self, run_id: Hashable) -> None:
        with self._runs_lock:
            self._runs.pop(run_id, None)

    def run_chain(self, run_id: Hashable, parent_id: Hashable | None = None) -> list[Hashable]:
        """`run_id` and its ancestors, nearest first (`parent_id` where `run_id` is not
        remembered yet; bounded and cycle-safe)."""
        chain: list[Hashable] = []
        current: Hashable | None = run_id
        with self._runs_lock:
            while current is not None and current not in chain and len(chain) < 1000:
                chain.append(current)
                entry = self._runs.get(current)
                current = entry[0] if entry else parent_id
                parent_id = None
        return chain

    def recorded_trace(self, chain: list[Hashable]) -> str | None:
        with self._runs_lock:
            for run_id in chain:
                entry = self._runs.get(run_id)
                if entry is not None and entry[1] is not None:
                    return entry[1]
        return None

    # -- the check ---------------------------------------------------------------------------

    def instrumentation(self) -> str:
        """The OpenTelemetry instrumentation found for this framework (for the warning)."""
        if self.own_telemetry is not None:
            return self.own_telemetry
        if not self.instrumentations:
            return "none found"
        return ", ".join(name for name in self.instrumentations if name in sys.modules) or (
            "none active"
        )

    def what_to_do(self) -> str:
        return f"{self.setup}, run it inside an OpenTelemetry span of your own, or pass trace_id="

    def check_trace(
        self, trace_id: str | None, wait: bool = True, span: Any = None, tool: str | None = None
    ) -> None:
        """Check `trace_id` (raises AgentKilled); None: count and report an unguarded call.
        A paused trace waits here (`wait=False`: AgentPaused is raised instead). `span`: the
        run's span where it is not the current one (the stop event goes on it). `tool`: the
        tool about to be called, checked after the trace (raises ToolContained)."""
        self._ensure_export(span)
        trace_id = self.trace_id or trace_id
        if trace_id is None:
            self._report_unguarded()
            self.check_tool(tool)
            return
        with _current(span):
            message = self._check_or_wait(trace_id, wait)  # raises AgentKilled
        if message is not None:
            if self.on_downgrade is not None:
                self.on_downgrade(message)
            else:
                self.pending_messages.append(message)
        self.check_tool(tool)

    def check_tool(self, tool: str | None) -> None:
        """Raise ToolContained if the checker says `tool` is contained (a checker without
        `check_tool` contains nothing)."""
        check = getattr(self.checker, "check_tool", None)
        if tool and callable(check):
            check(tool)

    async def check_trace_async(
        self, trace_id: str | None, span: Any = None, tool: str | None = None
    ) -> None:
        """check_trace() for async hooks: a pause waits in a thread, not on the event loop."""
        try:
            self.check_trace(trace_id, wait=False, span=span, tool=tool)
        except AgentPaused:
            await asyncio.to_thread(self.check_trace, trace_id, True, span, tool)

    def _ensure_export(self, span: Any) -> None:
        """Make the run's spans leave in time, or say once, loudly, that they may not."""
        problem = _prompt_export(span if span is not None else _current_span())
        if problem is None:
            return
        self.late_export += 1
        where = f"{type(self).__name__} ({self.framework})"
        note = getattr(self.checker, "note_late_export", None)
        if callable(note):  # a KillSwitch: counted there too, warned once per switch
            note(where, problem)
        elif not self._late_warned:
            log.warning(late_export_warning(where, problem, ".late_export"))
        self._late_warned = True

    def _check_or_wait(self, trace_id: str, wait: bool) -> str | None:
        """check(); a paused trace waits in the checker's `wait` for an operator's answer or
        the pause's deadline. A checker without `wait` lets AgentPaused out: the run stops."""
        try:
            return self.checker.check(trace_id, **self.scope)
        except AgentPaused:
            waiting = getattr(self.checker, "wait", None)
            if waiting is None or not wait:
                raise
            return waiting(trace_id)

    def before_tool(self, wait: bool = True, tool: str | None = None) -> None:
        """Check the current span's trace (the adapters with no run of their own), and `tool`."""
        self.check_trace(current_trace_id(), wait, tool=tool)

    async def before_tool_async(self, tool: str | None = None) -> None:
        """before_tool() for async hooks: the current span is read on the event loop."""
        await self.check_trace_async(current_trace_id(), tool=tool)

    def _report_unguarded(self) -> None:
        self.unguarded += 1
        where = (
            f"{type(self).__name__} ({self.framework}, instrumentation: {self.instrumentation()})"
        )
        note = getattr(self.checker, "note_unguarded", None)
        if callable(note):  # a KillSwitch: counted there too, and warned once per adapter
            note(where, self.what_to_do())
        elif not self._warned:
            log.warning(unguarded_warning(where, self.what_to_do(), ".unguarded"))
        self._warned = True


def unguarded_warning(where: str, what_to_do: str, counter: str) -> str:
    """The one warning about a tool call no check could guard: where, and the fix."""
    return (
        f"spanguard killswitch: {where} found no trace to check, so this tool call is NOT"
        f" guarded: {what_to_do} (further ones are counted in {counter}, not logged)"
    )


EXPORT_ADVICE = (
    "add spanguard.killswitch.export.PromptBatchSpanProcessor(exporter) to the tracer provider"
    " instead of BatchSpanProcessor, or set OTEL_BSP_SCHEDULE_DELAY=50"
)


def late_export_warning(where: str, problem: str, counter: str) -> str:
    """The one warning about spans that may leave late: the setting and the fix."""
    return (
        f"spanguard killswitch: {where}: {problem}. With the SDK's BatchSpanProcessor defaults"
        " (OTEL_BSP_SCHEDULE_DELAY, 5000 ms) a looping agent at 0.3 s a step makes about 15"
        f" calls before the guard sees the loop. Fix: {EXPORT_ADVICE} (further ones are counted"
        f" in {counter}, not logged)"
    )


def _prompt_export(span: Any) -> str | None:
    try:
        from spanguard.killswitch.export import ensure_prompt_export
    except ImportError:  # no OpenTelemetry SDK in this process
        return "the OpenTelemetry SDK is not installed: the agent's spans may never reach the guard"
    return ensure_prompt_export(span)


def _current_span() -> Any:
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    return trace.get_current_span()


@contextlib.contextmanager
def _current(span: Any) -> Iterator[None]:
    """`span` made current for the check (its stop event goes on it), where it is not already."""
    if span is None or _current_span() is span:
        yield
        return
    from opentelemetry import trace

    with trace.use_span(
        span, end_on_exit=False, record_exception=False, set_status_on_exception=False
    ):
        yield


def span_trace_id(span: Any) -> str | None:
    """The 32-hex trace id of an OpenTelemetry span, None if it has no valid context."""
    try:
        context = span.get_span_context()
    # Any span object an SDK hands over: no trace id, never a failure in the agent.
    except Exception:  # noqa: BLE001
        return None
    if not context.is_valid:
        return None
    return format(context.trace_id, "032x")
