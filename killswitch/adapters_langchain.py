"""LangChain and LangGraph: `callbacks=[SpanguardCallbackHandler(switch)]` (extra `langchain`).

The trace of a tool call is, in this order: the current OpenTelemetry span's (OpenLLMetry's
instrumentation makes its spans current); the span OpenInference's instrumentation keeps for
the run or its nearest parent (it never makes its spans current during callbacks); the trace
that was current when the run or a parent started (the agent run inside a span of its own).

A tool spanguard contained raises `ToolContained` from `on_tool_start`; LangGraph's ToolNode
turns it into the tool's error message for the model when given the handler's wrapper,
`ToolNode(tools, wrap_tool_call=handler.wrap_tool_call)` (`awrap_tool_call` for async runs), so
the agent reads "tool X is contained by spanguard: ...; use another tool" and can take another
tool.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any
from uuid import UUID

from spanguard.killswitch.adapters import Checker, TraceGate, span_trace_id
from spanguard.killswitch.signals import ToolContained, current_trace_id

try:
    from langchain_core.callbacks import BaseCallbackHandler
    from langchain_core.messages import ToolMessage
except ImportError as exc:  # pragma: no cover - depends on the extra
    raise ImportError("SpanguardCallbackHandler needs `pip install spanguard[langchain]`") from exc

__all__ = ["SpanguardCallbackHandler"]

OPENINFERENCE = "openinference.instrumentation.langchain"
OPENLLMETRY = "opentelemetry.instrumentation.langchain"


def _openinference_tracer() -> Any:
    """OpenInference's LangChain tracer when its instrumentor is active, else None."""
    module = sys.modules.get(OPENINFERENCE)
    if module is None:
        return None
    instrumentor = module.LangChainInstrumentor()  # a singleton
    return getattr(instrumentor, "_tracer", None)


class SpanguardCallbackHandler(BaseCallbackHandler, TraceGate):
    """Checks the run's trace before every tool call (and every chat model call).

    `AgentKilled` propagates out of `invoke` / `ainvoke` as it is (`raise_error`)."""

    framework = "LangChain"
    raise_error = True  # LangChain swallows handler errors unless told otherwise
    # Called in the run's own thread and context, in order: the current span is the run's.
    run_inline = True

    def __init__(self, checker: Checker, *, trace_id: str | None = None,
                 on_downgrade: Callable[[str], None] | None = None) -> None:  # fmt: skip
        BaseCallbackHandler.__init__(self)
        TraceGate.__init__(self, checker, trace_id, on_downgrade)

    # -- where the trace is found ------------------------------------------------------------

    def trace_of(self, run_id: UUID, parent_run_id: UUID | None) -> str | None:
        return self.find(run_id, parent_run_id)[0]

    def find(self, run_id: UUID, parent_run_id: UUID | None) -> tuple[str | None, Any]:
        """The run's trace, and OpenInference's span of the run where no span is current (the
        stop event and the export check go on it)."""
        current = current_trace_id()
        if current is not None:
            return current, None
        chain = self.run_chain(run_id, parent_run_id)
        tracer = _openinference_tracer()
        if tracer is not None:
            for run in chain:
                span = tracer.get_span(run)
                if span is not None and (trace_id := span_trace_id(span)) is not None:
                    return trace_id, span
        return self.recorded_trace(chain), None

    def _check(self, run_id: UUID, parent_run_id: UUID | None, tool: str | None = None) -> None:
        trace_id, span = self.find(run_id, parent_run_id)
        self.check_trace(trace_id, span=span, tool=tool)

    # -- a contained tool, as the tool's error (LangGraph's ToolNode) -----------------------

    def wrap_tool_call(self, request: Any, execute: Callable[[Any], Any]) -> Any:
        """ToolNode's `wrap_tool_call`: a contained tool's call becomes an error ToolMessage."""
        try:
            return execute(request)
        except ToolContained as contained:
            return _refusal(request, contained)

    async def awrap_tool_call(self, request: Any, execute: Callable[[Any], Any]) -> Any:
        """ToolNode's `awrap_tool_call` (async runs)."""
        try:
            return await execute(request)
        except ToolContained as contained:
            return _refusal(request, contained)

    def instrumentation(self) -> str:
        found = [name for name in (OPENINFERENCE, OPENLLMETRY) if name in sys.modules]
        if OPENINFERENCE in found and _openinference_tracer() is None:
            found.remove(OPENINFERENCE)  # imported, never instrumented
        return ", ".join(found) or "none active"

    setup = (
        "call LangChainInstrumentor().instrument() (openinference-instrumentation-langchain"
        " or opentelemetry-instrumentation-langchain) before the agent runs"
    )

    def _start(self, run_id: UUID, parent_run_id: UUID | None) -> None:
        # Remembered now: a tool run later in this run's tree finds the trace through it, even
        # where no span is current by then.
        self.remember_run(run_id, parent_run_id, self.trace_of(run_id, parent_run_id))

    # -- LangChain's callbacks ---------------------------------------------------------------

    def on_chain_start(self, serialized: Any, inputs: Any, *, run_id: UUID,
                       parent_run_id: UUID | None = None, **kwargs: Any) -> None:  # fmt: skip
        self._start(run_id, parent_run_id)

    def on_chat_model_start(self, serialized: Any, messages: Any, *, run_id: UUID,
                            parent_run_id: UUID | None = None, **kwargs: Any) -> None:  # fmt: skip
        # Before each model call too: a killed run does not pay for another turn.
        self._start(run_id, parent_run_id)
        self._check(run_id, parent_run_id)

    def on_llm_start(self, serialized: Any, prompts: Any, *, run_id: UUID,
                     parent_run_id: UUID | None = None, **kwargs: Any) -> None:  # fmt: skip
        self._start(run_id, parent_run_id)
        self._check(run_id, parent_run_id)

    def on_tool_start(self, serialized: Any, input_str: str, *, run_id: UUID,
                      parent_run_id: UUID | None = None, **kwargs: Any) -> None:  # fmt: skip
        self._start(run_id, parent_run_id)
        tool = (serialized or {}).get("name") or kwargs.get("name")
        self._check(run_id, parent_run_id, tool if isinstance(tool, str) else None)

    def on_retriever_start(self, serialized: Any, query: str, *, run_id: UUID,
                           parent_run_id: UUID | None = None, **kwargs: Any) -> None:  # fmt: skip
        self._start(run_id, parent_run_id)

    def _end(self, *args: Any, run_id: UUID, **kwargs: Any) -> None:
        self.forget_run(run_id)

    on_chain_end = on_chain_error = on_llm_end = on_llm_error = _end
    on_tool_end = on_tool_error = on_retriever_end = on_retriever_error = _end


def _refusal(request: Any, contained: ToolContained) -> ToolMessage:
    """The refused call's answer: the model reads why, and that another tool may do."""
    call = request.tool_call
    return ToolMessage(
        content=str(contained), name=call["name"], tool_call_id=call["id"], status="error"
    )
