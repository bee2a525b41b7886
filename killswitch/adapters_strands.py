"""strands: `Agent(..., hooks=[SpanguardHooks(switch)])`.

A hook on `BeforeModelCallEvent` and `BeforeToolCallEvent` checks before each model call and
each tool call. strands traces through the global tracer provider and makes its spans
current, so the current span's trace is checked; else the one current when the invocation
started (`BeforeInvocationEvent`, keyed by the agent). A tool spanguard contained is cancelled
(`BeforeToolCallEvent.cancel_tool`): the model reads "tool X is contained by spanguard: ...;
use another tool" as the tool's error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spanguard.killswitch.adapters import Checker, TraceGate
from spanguard.killswitch.signals import ToolContained, current_trace_id

try:
    from strands.hooks import (
        BeforeInvocationEvent,
        BeforeModelCallEvent,
        BeforeToolCallEvent,
        HookProvider,
        HookRegistry,
    )
except ImportError as exc:  # pragma: no cover - depends on the extra
    raise ImportError("SpanguardHooks needs strands (`pip install strands-agents`)") from exc

__all__ = ["SpanguardHooks"]


class SpanguardHooks(HookProvider, TraceGate):
    framework = "strands"

    def __init__(self, checker: Checker, *, trace_id: str | None = None,
                 on_downgrade: Callable[[str], None] | None = None) -> None:  # fmt: skip
        TraceGate.__init__(self, checker, trace_id, on_downgrade)

    own_telemetry = "strands' own (the global tracer provider)"
    setup = (
        "set an SDK TracerProvider as the global one (trace.set_tracer_provider, or"
        " StrandsTelemetry) before the agent runs"
    )

    def register_hooks(self, registry: HookRegistry, **kwargs: Any) -> None:
        registry.add_callback(BeforeInvocationEvent, self._on_invocation)
        registry.add_callback(BeforeModelCallEvent, self._before_call)
        registry.add_callback(BeforeToolCallEvent, self._before_tool)

    def _on_invocation(self, event: Any) -> None:
        self.remember_run(id(event.agent), None, current_trace_id())

    def _before_call(self, event: Any, tool: str | None = None) -> None:
        trace_id = current_trace_id() or self.recorded_trace([id(event.agent)])
        self.check_trace(trace_id, tool=tool)

    def _before_tool(self, event: Any) -> None:
        tool_use = getattr(event, "tool_use", None) or {}
        try:
            self._before_call(event, tool_use.get("name"))
        except ToolContained as contained:
            if not hasattr(event, "cancel_tool"):  # a strands without cancel_tool: it stops
                raise
            event.cancel_tool = str(contained)
