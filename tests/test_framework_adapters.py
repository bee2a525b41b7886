"""The LangChain and OpenAI Agents SDK adapters, with the real frameworks."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from spanguard.killswitch import AgentKilled, SignalBook
from spanguard.schemas.decision import AgentIdentity, Decision, KillSignal


def signal(trace_id: str, action: str = "kill", message: str | None = None) -> KillSignal:
    return KillSignal.from_decision(
        Decision(
            trace_id=trace_id,
            span_id="00f067aa0ba902b7",
            rule="tool_loop",
            action=action,  # type: ignore[arg-type]
            reason="search_docs called 4x in last 4 steps",
            agent=AgentIdentity("support-bot"),
            detected_at="2026-12-02T15:00:00.000+00:00",
            system_message=message,
        )
    )


def test_langchain_tool_call_is_stopped_once_the_trace_is_killed():
    pytest.importorskip("langchain_core")
    from langchain_core.tools import tool

    from spanguard.killswitch.adapters import SpanguardCallbackHandler

    calls: list[str] = []

    @tool
    def search_docs(query: str) -> str:
        """Search the knowledge base."""
        calls.append(query)
        return ""

    book, trace_id = SignalBook(), uuid.uuid4().hex
    handler = SpanguardCallbackHandler(book, trace_id=trace_id)
    config = {"callbacks": [handler]}
    assert search_docs.invoke({"query": "refund policy"}, config=config) == ""
    book.deliver(signal(trace_id, "downgrade", "Try a different approach."))
    search_docs.invoke({"query": "refund policy"}, config=config)
    assert handler.pending_messages == ["Try a different approach."]
    book.deliver(signal(trace_id))
    with pytest.raises(AgentKilled):
        search_docs.invoke({"query": "refund policy"}, config=config)
    assert calls == ["refund policy", "refund policy"]  # the killed call never ran


def test_openai_agents_run_hooks_stop_the_tool():
    pytest.importorskip("agents")
    from agents import Agent, FunctionTool, RunContextWrapper

    from spanguard.killswitch.adapters import SpanguardRunHooks

    async def run_search(context, arguments: str) -> str:
        return json.loads(arguments)["query"]

    search = FunctionTool(
        name="search_docs",
        description="Search the knowledge base.",
        params_json_schema={
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
            "additionalProperties": False,
        },
        on_invoke_tool=run_search,
    )
    agent = Agent(name="support", tools=[search])
    book, trace_id = SignalBook(), uuid.uuid4().hex
    downgrades: list[str] = []
    hooks = SpanguardRunHooks(book, trace_id=trace_id, on_downgrade=downgrades.append)
    context = RunContextWrapper(context=None)

    asyncio.run(hooks.on_tool_start(context, agent, search))
    book.deliver(signal(trace_id, "downgrade", "Stop and report."))
    asyncio.run(hooks.on_tool_start(context, agent, search))
    assert downgrades == ["Stop and report."]
    book.deliver(signal(trace_id))
    with pytest.raises(AgentKilled):
        asyncio.run(hooks.on_tool_start(context, agent, search))
