"""OpenAI Agents SDK: `Runner.run(agent, input, hooks=SpanguardRunHooks(switch))` (extra
`openai-agents`).

The trace is the current OpenTelemetry span's (OpenInference's and the OTel GenAI bridge's
processors make theirs current); else the one current when the SDK's trace started
(`on_agent_start`, keyed by the SDK's own trace id).

A tool spanguard contained is refused by a tool input guardrail the hooks add to each function
tool of the agent at its start (`on_agent_start`): the model reads "tool X is contained by
spanguard: ...; use another tool" as the call's result and can take another tool.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spanguard.killswitch.adapters import Checker, TraceGate
from spanguard.killswitch.signals import ToolContained, current_trace_id

try:
    from agents import FunctionTool, RunHooks, ToolGuardrailFunctionOutput, ToolInputGuardrail
    from agents.tracing import get_current_trace
except ImportError as exc:  # pragma: no cover - depends on the extra
    raise ImportError("SpanguardRunHooks needs `pip install spanguard[openai-agents]`") from exc

__all__ = ["SpanguardRunHooks"]

INSTRUMENTATIONS = (
    "openinference.instrumentation.openai_agents",
    "opentelemetry.instrumentation.openai_agents",
)


class SpanguardRunHooks(RunHooks, TraceGate):
    """Checks before each model call and before each tool call.

    A kill before a model call leaves `Runner.run` as `AgentKilled` itself; before a tool call
    (several in one turn) the SDK wraps it in `UserError("Error running tool ...")` whose
    `__cause__` is the `AgentKilled`. A contained tool's call is refused by the guardrail
    (`contain_guardrail`) and the run goes on."""

    framework = "OpenAI Agents SDK"

    def __init__(self, checker: Checker, *, trace_id: str | None = None,
                 on_downgrade: Callable[[str], None] | None = None) -> None:  # fmt: skip
        TraceGate.__init__(self, checker, trace_id, on_downgrade)
        self.contain_guardrail: ToolInputGuardrail[Any] = ToolInputGuardrail(
            guardrail_function=self._refuse_contained, name="spanguard_contained_tool"
        )

    def _refuse_contained(self, data: Any) -> ToolGuardrailFunctionOutput:
        """The guardrail: a contained tool's call is answered with the refusal, not run."""
        try:
            self.check_tool(data.context.tool_name)
        except ToolContained as contained:
            return ToolGuardrailFunctionOutput.reject_content(str(contained))
        return ToolGuardrailFunctionOutput.allow()

    def guard_tools(self, agent: Any) -> None:
        """Add the contain guardrail to each function tool of `agent` (once per tool)."""
        for tool in getattr(agent, "tools", None) or ():
            if not isinstance(tool, FunctionTool):
                continue
            guardrails = tool.tool_input_guardrails
            if guardrails is None:
                tool.tool_input_guardrails = [self.contain_guardrail]
            elif self.contain_guardrail not in guardrails:
                guardrails.append(self.contain_guardrail)

    def _sdk_trace(self) -> str | None:
        trace = get_current_trace()
        return getattr(trace, "trace_id", None) if trace is not None else None

    def trace_of(self) -> str | None:
        current = current_trace_id()
        if current is not None:
            return current
        sdk_trace = self._sdk_trace()
        return self.recorded_trace([sdk_trace]) if sdk_trace is not None else None

    instrumentations = INSTRUMENTATIONS
    setup = (
        "call OpenAIAgentsInstrumentor().instrument() (openinference-instrumentation-openai-"
        "agents or opentelemetry-instrumentation-openai-agents-v2) before Runner.run"
    )

    async def on_agent_start(self, context: Any, agent: Any) -> None:
        self.guard_tools(agent)
        sdk_trace = self._sdk_trace()
        if sdk_trace is not None:
            self.remember_run(sdk_trace, None, current_trace_id())

    async def on_llm_start(
        self, context: Any, agent: Any, system_prompt: Any, input_items: Any
    ) -> None:
        # Before each model call: a killed run stops before it pays for another turn, and the
        # SDK lets AgentKilled out of this hook as it is.
        await self.check_trace_async(self.trace_of())

    async def on_tool_start(self, context: Any, agent: Any, tool: Any) -> None:
        # A tool the guardrail could not cover (not a function tool) is checked here: its
        # ToolContained stops the run as a kill does.
        await self.check_trace_async(self.trace_of(), tool=getattr(tool, "name", None))
