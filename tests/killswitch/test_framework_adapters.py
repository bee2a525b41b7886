"""The LangChain and OpenAI Agents SDK adapters, with the real frameworks."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from spanguard.killswitch import AgentKilled, SignalBook
from tests.support.spans import kill_signal

signal = kill_signal


def query_tool(name: str, description: str, run: Callable[[Any, str], Awaitable[str]]):
    """An OpenAI Agents SDK FunctionTool of one string argument, `query`, run by `run`."""
    from agents import FunctionTool

    return FunctionTool(
        name=name,
        description=description,
        params_json_schema={
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
            "additionalProperties": False,
        },
        on_invoke_tool=run,
    )


def search_tool(calls: list[str]):
    """The OpenAI Agents SDK FunctionTool the demo's support agent keeps calling."""

    async def run_search(context, arguments: str) -> str:
        calls.append(arguments)
        return "no results"

    return query_tool("search_docs", "Search the knowledge base.", run_search)


def test_langchain_tool_call_is_stopped_once_the_trace_is_killed():
    pytest.importorskip("langchain_core")
    from langchain_core.tools import tool

    from spanguard.killswitch.adapters_langchain import SpanguardCallbackHandler

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
    from agents import Agent, RunContextWrapper

    from spanguard.killswitch.adapters_openai_agents import SpanguardRunHooks

    search = search_tool([])
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


def test_openai_agents_runner_is_stopped_before_its_next_model_call():
    """A real Runner.run with a scripted model (the SDK's pluggable Model interface) that asks
    for the same search every turn, as a stuck agent does."""
    pytest.importorskip("agents")
    from agents import Agent, RunConfig, Runner
    from agents.items import ModelResponse
    from agents.models.interface import Model, ModelProvider
    from agents.usage import Usage
    from openai.types.responses import ResponseFunctionToolCall

    from spanguard.killswitch.adapters_openai_agents import SpanguardRunHooks

    class StuckModel(Model):
        turns = 0

        async def get_response(self, *args, **kwargs) -> ModelResponse:
            self.turns += 1
            call = ResponseFunctionToolCall(
                arguments=json.dumps({"query": "refund policy"}),
                call_id=f"call_{self.turns}",
                name="search_docs",
                type="function_call",
                id=f"fc_{self.turns}",
                status="completed",
            )
            return ModelResponse(output=[call], usage=Usage(), response_id=None)

        def stream_response(self, *args, **kwargs):
            raise NotImplementedError

    class Provider(ModelProvider):
        def __init__(self, model: Model) -> None:
            self.model = model

        def get_model(self, model_name):
            return self.model

    calls: list[str] = []
    search = search_tool(calls)
    book, trace_id = SignalBook(), uuid.uuid4().hex

    class Hooks(SpanguardRunHooks):
        async def on_tool_end(self, context, agent, tool, result) -> None:
            if len(calls) == 3:  # the pipeline's kill arrives after the 3rd identical call
                book.deliver(signal(trace_id))

    model = StuckModel()
    with pytest.raises(AgentKilled):
        asyncio.run(
            Runner.run(
                Agent(name="support", tools=[search]),
                "What is the refund policy?",
                hooks=Hooks(book, trace_id=trace_id),
                max_turns=20,
                run_config=RunConfig(model_provider=Provider(model), tracing_disabled=True),
            )
        )
    assert len(calls) == 3 and model.turns == 3  # no fourth model call, no fourth search
