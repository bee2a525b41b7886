"""smolagents: `ToolCallingAgent(..., step_callbacks=[SpanguardStepCallback(switch)])` (extra
`smolagents`).

smolagents turns an exception raised inside a tool into an observation for the model and
carries on, so a check inside the tool alone could not stop the agent. A step callback runs
after each step, and what it raises leaves `agent.run()` as it is. So the callback checks
after each step, and at its first call it also puts a check in front of each of the agent's
tools: a tool call of a killed trace does not run (smolagents records the refusal as the
step's error) and the callback after that step raises `AgentKilled`. The first step's tool
calls run before any check (no signal can precede the run's first call).
The trace is the current span's (OpenInference's smolagents instrumentation makes the run's
span current), else the one recorded at the first step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spanguard.killswitch.adapters import Checker, TraceGate
from spanguard.killswitch.signals import current_trace_id

__all__ = ["SpanguardStepCallback"]

INSTRUMENTATION = "openinference.instrumentation.smolagents"


class SpanguardStepCallback(TraceGate):
    framework = "smolagents"

    def __init__(self, checker: Checker, *, trace_id: str | None = None,
                 on_downgrade: Callable[[str], None] | None = None) -> None:  # fmt: skip
        TraceGate.__init__(self, checker, trace_id, on_downgrade)

    instrumentations = (INSTRUMENTATION,)
    setup = (
        "call SmolagentsInstrumentor().instrument() (openinference-instrumentation-"
        "smolagents) before the agent runs"
    )

    def __call__(self, memory_step: Any, agent: Any = None, **kwargs: Any) -> None:
        if agent is not None:
            self._guard_tools(agent)
        self._check(agent)

    def _check(self, agent: Any) -> None:
        trace_id = current_trace_id()
        run = id(agent) if agent is not None else None
        if trace_id is not None and run is not None:
            self.remember_run(run, None, trace_id)
        elif run is not None:
            trace_id = self.recorded_trace([run])
        self.check_trace(trace_id)

    def _guard_tools(self, agent: Any) -> None:
        for tool in getattr(agent, "tools", {}).values():
            if getattr(tool.forward, "_spanguard_guarded", False):
                continue
            forward = tool.forward

            def guarded(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
                self._check(agent)
                return _forward(*args, **kwargs)

            guarded._spanguard_guarded = True  # type: ignore[attr-defined]
            tool.forward = guarded
