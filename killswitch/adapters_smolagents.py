"""smolagents: `ToolCallingAgent(..., step_callbacks=[SpanguardStepCallback(switch)])` (extra
`smolagents`).

smolagents turns an exception raised inside a tool into an observation for the model and
carries on, so a check inside the tool could never stop the agent. A step callback runs
after each step, before the next step's model call and tool calls, and what it raises leaves
`agent.run()` as it is: the check there is before every tool call but the first step's (which
no signal can precede). Tool calls of one step run together, without a check between them.
The trace is the current span's (OpenInference's smolagents instrumentation makes the run's
span current), else the one recorded at the first step.
"""

from __future__ import annotations

import sys
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

    def instrumentation(self) -> str:
        return INSTRUMENTATION if INSTRUMENTATION in sys.modules else "none active"

    def what_to_do(self) -> str:
        return (
            "call SmolagentsInstrumentor().instrument() (openinference-instrumentation-"
            "smolagents) before the agent runs, run it inside an OpenTelemetry span of your"
            " own, or pass trace_id="
        )

    def __call__(self, memory_step: Any, agent: Any = None, **kwargs: Any) -> None:
        trace_id = current_trace_id()
        run = id(agent) if agent is not None else None
        if trace_id is not None and run is not None:
            self.remember_run(run, None, trace_id)
        elif run is not None:
            trace_id = self.recorded_trace([run])
        self.check_trace(trace_id)
