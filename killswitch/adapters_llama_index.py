"""llama-index agents (FunctionAgent, ReActAgent, ...): `guard_llama_index_agent(agent, switch)`
(extra `llama-index`).

llama-index turns an exception raised inside a tool into an error result for the model and
carries on, and its instrumentation events swallow what their handlers raise: neither can
stop the agent. The agent's tool step calls `_call_tool`; the guard checks there, before the
tool, and what it raises fails the workflow: `await agent.run(...)` raises the `AgentKilled`.
`_call_tool` is the workflow agent's own method (llama-index-core 0.14), not a published hook.
A tool spanguard contained is not called: the step gets an error ToolOutput ("tool X is
contained by spanguard: ...; use another tool") as for a tool that raised, and the model can
take another tool.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spanguard.killswitch.adapters import Checker, TraceGate
from spanguard.killswitch.signals import ToolContained

__all__ = ["SpanguardLlamaIndexGuard", "guard_llama_index_agent"]

INSTRUMENTATION = "openinference.instrumentation.llama_index"


class SpanguardLlamaIndexGuard(TraceGate):
    framework = "llama-index"

    instrumentations = (INSTRUMENTATION,)
    setup = (
        "call LlamaIndexInstrumentor().instrument() (openinference-instrumentation-"
        "llama-index) before the agent runs"
    )


def guard_llama_index_agent(agent: Any, checker: Checker, *, trace_id: str | None = None,
                            on_downgrade: Callable[[str], None] | None = None) -> SpanguardLlamaIndexGuard:  # fmt: skip
    """Check before each of `agent`'s tool calls; returns the guard (its `unguarded` count)."""
    guard = SpanguardLlamaIndexGuard(checker, trace_id, on_downgrade)
    call_tool = agent._call_tool  # the bound method of the agent's class

    async def guarded_call_tool(ctx: Any, tool: Any, tool_input: dict) -> Any:
        name = tool.metadata.get_name()
        try:
            # Outside _call_tool's own try: AgentKilled fails the step.
            await guard.before_tool_async(tool=name)
        except ToolContained as contained:
            from llama_index.core.tools import ToolOutput

            refusal = str(contained)
            return ToolOutput(content=refusal, tool_name=name, raw_input=tool_input,
                              raw_output=refusal, is_error=True)  # fmt: skip
        return await call_tool(ctx, tool, tool_input)

    object.__setattr__(agent, "_call_tool", guarded_call_tool)  # a pydantic model: no setattr
    return guard
