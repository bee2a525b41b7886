"""Thin framework adapters that call `check()` before each tool call.

- `SpanguardCallbackHandler`: a LangChain callback handler (extra `langchain`).
- `SpanguardRunHooks`: OpenAI Agents SDK run hooks (extra `openai-agents`).

Each takes anything with `check(trace_id) -> str | None` (a `KillSwitch`, a `SignalBook`, a
`GuardingSpanProcessor`) and, optionally, a fixed trace id; by default the trace of the current
OpenTelemetry span. `AgentKilled` propagates out of the tool call; a downgrade's system message
goes to `on_downgrade` (or waits in `pending_messages` for the agent to inject it). A paused
trace waits in the checker's `wait()` (in a thread, for the async hooks) until an operator's
release or kill, or the pause's deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from spanguard.killswitch.signals import AgentPaused, current_trace_id

__all__ = ["Checker", "SpanguardCallbackHandler", "SpanguardRunHooks"]  # noqa: F822 - built lazily


class Checker(Protocol):
    def check(self, trace_id: str) -> str | None: ...


class _Gate:
    def __init__(
        self,
        checker: Checker,
        trace_id: str | None,
        on_downgrade: Callable[[str], None] | None,
    ) -> None:
        self.checker = checker
        self.trace_id = trace_id
        self.on_downgrade = on_downgrade
        self.pending_messages: list[str] = []

    def before_tool(self, wait: bool = True) -> None:
        trace_id = self.trace_id or current_trace_id()
        if trace_id is None:
            return
        message = self._check(trace_id, wait)  # raises AgentKilled
        if message is None:
            return
        if self.on_downgrade is not None:
            self.on_downgrade(message)
        else:
            self.pending_messages.append(message)

    def _check(self, trace_id: str, wait: bool) -> str | None:
        """check(); a paused trace waits here (the checker's `wait`) for an operator's answer
        or the pause's deadline. A checker without `wait` lets AgentPaused out: the run stops."""
        try:
            return self.checker.check(trace_id)
        except AgentPaused:
            waiting = getattr(self.checker, "wait", None)
            if waiting is None or not wait:
                raise
            return waiting(trace_id)

    async def before_tool_async(self) -> None:
        """before_tool() for async hooks: a pause waits in a thread, not on the event loop."""
        try:
            self.before_tool(wait=False)
        except AgentPaused:
            await asyncio.to_thread(self.before_tool)


def _langchain_base() -> type:
    try:
        from langchain_core.callbacks import BaseCallbackHandler
    except ImportError as exc:  # pragma: no cover - depends on the extra
        raise ImportError(
            "SpanguardCallbackHandler needs `pip install spanguard[langchain]`"
        ) from exc
    return BaseCallbackHandler


def _agents_base() -> type:
    try:
        from agents import RunHooks
    except ImportError as exc:  # pragma: no cover - depends on the extra
        raise ImportError("SpanguardRunHooks needs `pip install spanguard[openai-agents]`") from exc
    return RunHooks


def __getattr__(name: str) -> Any:
    # Classes are built on first use, so importing this module needs neither framework.
    if name == "SpanguardCallbackHandler":
        base = _langchain_base()

        class SpanguardCallbackHandler(base, _Gate):  # type: ignore[misc, valid-type]
            """LangChain: `callbacks=[SpanguardCallbackHandler(switch)]`."""

            raise_error = True  # LangChain swallows handler errors unless told otherwise

            def __init__(self, checker: Checker, *, trace_id: str | None = None,
                         on_downgrade: Callable[[str], None] | None = None) -> None:  # fmt: skip
                base.__init__(self)
                _Gate.__init__(self, checker, trace_id, on_downgrade)

            def on_tool_start(
                self, serialized: dict[str, Any], input_str: str, **kwargs: Any
            ) -> None:
                self.before_tool()

        globals()[name] = SpanguardCallbackHandler
        return SpanguardCallbackHandler
    if name == "SpanguardRunHooks":
        base = _agents_base()

        class SpanguardRunHooks(base, _Gate):  # type: ignore[misc, valid-type]
            """OpenAI Agents SDK: `Runner.run(agent, input, hooks=SpanguardRunHooks(switch))`.

            Checks before each model call and before each tool call."""

            def __init__(self, checker: Checker, *, trace_id: str | None = None,
                         on_downgrade: Callable[[str], None] | None = None) -> None:  # fmt: skip
                _Gate.__init__(self, checker, trace_id, on_downgrade)

            async def on_llm_start(
                self, context: Any, agent: Any, system_prompt: Any, input_items: Any
            ) -> None:
                # Before each model call: a killed run stops before it pays for another turn,
                # and the SDK lets AgentKilled out of this hook as it is.
                await self.before_tool_async()

            async def on_tool_start(self, context: Any, agent: Any, tool: Any) -> None:
                # Several tool calls in one turn: the SDK wraps what this raises in a
                # UserError("Error running tool ...") whose __cause__ is the AgentKilled.
                await self.before_tool_async()

        globals()[name] = SpanguardRunHooks
        return SpanguardRunHooks
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
