"""pydantic-ai: `Agent(model, capabilities=[SpanguardCapability(switch)])` (extra `pydantic-ai`).

A capability's hooks run before each model request and before each tool's execution, inside
the agent run's span when the agent is instrumented (`Agent.instrument_all()` or
`instrument=`): that span's trace is checked. `AgentKilled` leaves `agent.run()` /
`run_sync()` as it is. A tool spanguard contained fails its call with `ToolFailed`: the
model reads "tool X is contained by spanguard: ...; use another tool" and can take another.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spanguard.killswitch.adapters import Checker, TraceGate
from spanguard.killswitch.signals import ToolContained

try:
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.exceptions import ToolFailed
except ImportError as exc:  # pragma: no cover - depends on the extra
    raise ImportError("SpanguardCapability needs `pip install spanguard[pydantic-ai]`") from exc

__all__ = ["SpanguardCapability"]


class SpanguardCapability(AbstractCapability[Any], TraceGate):
    framework = "pydantic-ai"

    def __init__(self, checker: Checker, *, trace_id: str | None = None,
                 on_downgrade: Callable[[str], None] | None = None) -> None:  # fmt: skip
        TraceGate.__init__(self, checker, trace_id, on_downgrade)

    own_telemetry = "pydantic-ai's own (Agent.instrument_all() or instrument=)"
    setup = (
        "instrument the agent (Agent.instrument_all(), or Agent(..., instrument=True)) so"
        " its run has a span"
    )

    async def before_model_request(self, ctx: Any, request_context: Any) -> Any:
        await self.before_tool_async()  # a killed run does not pay for another turn
        return request_context

    async def before_tool_execute(self, ctx: Any, *, call: Any, tool_def: Any, args: Any) -> Any:
        try:
            await self.before_tool_async(tool=getattr(call, "tool_name", None))
        except ToolContained as contained:
            raise ToolFailed(str(contained)) from contained
        return args
