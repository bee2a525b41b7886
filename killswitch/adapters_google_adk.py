"""Google ADK: `Runner(..., plugins=[SpanguardAdkPlugin(switch)])`.

A runner's plugin sees every agent's calls: `before_model_callback` before each model call and
`before_tool_callback` before each tool call. ADK traces through the global tracer provider
and makes its spans current, so the current span's trace is checked; else the one current when
the invocation started (`before_run_callback`, keyed by ADK's invocation id). A tool spanguard
contained is not run: `before_tool_callback` answers for it with `{"error": "tool X is contained
by spanguard: ...; use another tool"}`, which the model reads as the tool's response.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spanguard.killswitch.adapters import Checker, TraceGate
from spanguard.killswitch.signals import ToolContained, current_trace_id

try:
    from google.adk.plugins.base_plugin import BasePlugin
except ImportError as exc:  # pragma: no cover - depends on the extra
    raise ImportError("SpanguardAdkPlugin needs google-adk (`pip install google-adk`)") from exc

__all__ = ["SpanguardAdkPlugin"]


class SpanguardAdkPlugin(TraceGate, BasePlugin):  # BasePlugin calls super().__init__()
    """What a kill raises leaves `runner.run_async(...)` as `AgentKilled`."""

    framework = "Google ADK"

    def __init__(self, checker: Checker, *, trace_id: str | None = None,
                 on_downgrade: Callable[[str], None] | None = None,
                 name: str = "spanguard") -> None:  # fmt: skip
        BasePlugin.__init__(self, name=name)
        TraceGate.__init__(self, checker, trace_id, on_downgrade)

    own_telemetry = "ADK's own (the global tracer provider)"
    setup = (
        "set an SDK TracerProvider as the global one (trace.set_tracer_provider) before the"
        " runner starts"
    )

    def _trace_of(self, invocation_id: str | None) -> str | None:
        current = current_trace_id()
        if current is not None or invocation_id is None:
            return current
        return self.recorded_trace([invocation_id])

    async def before_run_callback(self, *, invocation_context: Any) -> None:
        invocation = getattr(invocation_context, "invocation_id", None)
        if invocation is not None:
            self.remember_run(invocation, None, current_trace_id())
        return None

    async def before_model_callback(self, *, callback_context: Any, llm_request: Any) -> None:
        # Before each model call: a killed run does not pay for another turn.
        await self.check_trace_async(
            self._trace_of(getattr(callback_context, "invocation_id", None))
        )
        return None

    async def before_tool_callback(
        self, *, tool: Any, tool_args: dict[str, Any], tool_context: Any
    ) -> dict[str, Any] | None:
        try:
            await self.check_trace_async(
                self._trace_of(getattr(tool_context, "invocation_id", None)),
                tool=getattr(tool, "name", None),
            )
        except ToolContained as contained:
            return {"error": str(contained)}  # ADK skips the tool and hands this to the model
        return None
