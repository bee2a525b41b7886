"""A contained tool (a signal of scope tool): its calls are refused, the agent goes on.

The book and the KillSwitch on their own, then the real frameworks: a LangGraph agent and an
OpenAI Agents SDK Runner, each driven by a scripted model, whose search tool is contained; the
model reads the refusal as the tool's result, takes its other tool and finishes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pickle
import uuid

import pytest

from spanguard.killswitch import AgentKilled, SignalBook, ToolContained
from spanguard.killswitch.client import KillSwitch
from spanguard.schemas.decision import keyring, read_signal, sign
from tests.support.spans import kill_signal
from tests.support.spans import tool_contain as contain

REFUSAL = "tool search_docs is contained by spanguard"


def test_the_signal_is_valid_signed_and_reads_back():
    key = b"k" * 32
    signal = contain(server="docs-mcp")
    record = sign(signal.to_dict(), key)
    read = read_signal(json.dumps(record).encode(), keyring(key))
    assert read == signal
    assert read.scope_key() == ("tool", "search_docs", "docs-mcp")
    assert read.topic_key() == b"tool:docs-mcp/search_docs"
    assert read.describe_target() == "tool search_docs on docs-mcp"
    with pytest.raises(ValueError):
        contain(tool="")
    with pytest.raises(ValueError):
        contain(tool="t" * 201)


def test_a_contain_refuses_that_tool_only_and_a_check_without_a_tool_passes(caplog):
    book, trace_id = SignalBook(), uuid.uuid4().hex
    assert book.deliver(contain())
    caplog.set_level(logging.WARNING, logger="spanguard.killswitch")
    for _ in range(3):
        with pytest.raises(ToolContained) as refused:
            book.check(trace_id, tool="search_docs")
    assert isinstance(refused.value, AgentKilled)  # code that catches AgentKilled still stops
    assert str(refused.value).startswith(REFUSAL) and str(refused.value).endswith("another tool")
    assert (refused.value.tool, refused.value.scope, refused.value.action) == (
        "search_docs",
        "tool",
        "contain",
    )
    assert pickle.loads(pickle.dumps(refused.value)).tool == "search_docs"
    assert book.check(trace_id, tool="web_search") is None
    assert book.check(trace_id) is None
    assert book.tool_calls_refused == 3
    assert book.refused_by_tool[("search_docs", "")] == 3
    assert len([r for r in caplog.records if "is contained" in r.getMessage()]) == 1


def test_the_newest_signal_of_a_tool_holds_and_a_contain_lapses_at_its_expiry():
    book = SignalBook()
    book.deliver(contain(detected=0))
    book.deliver(contain(kind="release", detected=-5))  # issued before the contain
    assert book.contained("search_docs") is not None
    book.deliver(contain(kind="release", detected=1))
    assert book.contained("search_docs") is None
    book.deliver(contain(detected=2, minutes=-1))  # already expired
    assert book.contained("search_docs") is None
    book.check_tool("search_docs")


def test_a_kill_of_the_trace_comes_before_a_contain_and_a_downgrade_waits_for_a_passing_call():
    book, trace_id = SignalBook(), uuid.uuid4().hex
    book.deliver(contain())
    book.deliver(kill_signal(trace_id, "downgrade", "Try another way."))
    with pytest.raises(ToolContained):
        book.check(trace_id, tool="search_docs")
    assert book.check(trace_id, tool="web_search") == "Try another way."
    book.deliver(kill_signal(trace_id))
    with pytest.raises(AgentKilled) as killed:
        book.check(trace_id, tool="search_docs")
    assert not isinstance(killed.value, ToolContained)


def test_the_kill_switch_checks_the_tool_with_or_without_a_trace():
    switch = KillSwitch("127.0.0.1:9", allow_unsigned=True, start=False, ack_topic=None)
    try:
        switch.signals.deliver(contain(server="docs-mcp"))
        with pytest.raises(ToolContained):
            switch.check(uuid.uuid4().hex, tool="search_docs")
        with pytest.raises(ToolContained):
            switch.check(tool="search_docs", server="docs-mcp")  # no trace: still refused
        assert switch.check(tool="search_docs", server="other-mcp") is None
        with pytest.raises(ToolContained):
            switch.check_tool("search_docs")
    finally:
        switch.close()


# -- the real frameworks --------------------------------------------------------------------


def test_a_langgraph_agent_whose_tool_is_contained_takes_its_other_tool_and_finishes():
    pytest.importorskip("langgraph")
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    from spanguard.killswitch.adapters_langchain import SpanguardCallbackHandler

    calls: list[str] = []

    @tool
    def search_docs(query: str) -> str:
        """Search the knowledge base."""
        calls.append("search_docs")
        return "no results"

    @tool
    def web_search(query: str) -> str:
        """Search the web."""
        calls.append("web_search")
        return "refunds within 30 days"

    def model(state: MessagesState) -> dict:
        """A scripted model: the knowledge base first; on its error, the web; then answer."""
        last = state["messages"][-1]
        if isinstance(last, HumanMessage):
            call = {"name": "search_docs", "args": {"query": "refunds"}, "id": "c1"}
            return {"messages": [AIMessage("", tool_calls=[call])]}
        assert isinstance(last, ToolMessage)
        if last.name == "search_docs":
            assert last.status == "error" and last.content.startswith(REFUSAL)
            call = {"name": "web_search", "args": {"query": "refunds"}, "id": "c2"}
            return {"messages": [AIMessage("", tool_calls=[call])]}
        return {"messages": [AIMessage(f"Answer: {last.content}")]}

    book, trace_id = SignalBook(), uuid.uuid4().hex
    book.deliver(contain())
    handler = SpanguardCallbackHandler(book, trace_id=trace_id)
    graph = StateGraph(MessagesState)
    graph.add_node("model", model)
    graph.add_node(
        "tools", ToolNode([search_docs, web_search], wrap_tool_call=handler.wrap_tool_call)
    )
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    result = graph.compile().invoke(
        {"messages": [HumanMessage("What is the refund policy?")]}, {"callbacks": [handler]}
    )
    assert result["messages"][-1].content == "Answer: refunds within 30 days"
    assert calls == ["web_search"]  # the contained tool never ran
    assert book.tool_calls_refused == 1
    assert END  # the graph ended on the model's answer


def test_an_openai_agents_run_whose_tool_is_contained_takes_its_other_tool_and_finishes():
    pytest.importorskip("agents")
    from agents import Agent, FunctionTool, RunConfig, Runner
    from agents.items import ModelResponse
    from agents.models.interface import Model, ModelProvider
    from agents.usage import Usage
    from openai.types.responses import (
        ResponseFunctionToolCall,
        ResponseOutputMessage,
        ResponseOutputText,
    )

    from spanguard.killswitch.adapters_openai_agents import SpanguardRunHooks

    calls: list[str] = []

    def function_tool(name: str, answer: str) -> FunctionTool:
        async def run(context, arguments: str) -> str:
            calls.append(name)
            return answer

        return FunctionTool(
            name=name,
            description=f"{name} for the query.",
            params_json_schema={
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
                "additionalProperties": False,
            },
            on_invoke_tool=run,
        )

    def call(name: str, turn: int) -> ResponseFunctionToolCall:
        return ResponseFunctionToolCall(
            arguments=json.dumps({"query": "refunds"}),
            call_id=f"call_{turn}",
            name=name,
            type="function_call",
            id=f"fc_{turn}",
            status="completed",
        )

    class ScriptedModel(Model):
        """The knowledge base first; on its refusal, the web; then the answer."""

        seen: list[str] = []

        async def get_response(self, system_instructions, input, *args, **kwargs):
            outputs = [
                item["output"]
                for item in (input if isinstance(input, list) else [])
                if isinstance(item, dict) and item.get("type") == "function_call_output"
            ]
            self.seen = [str(output) for output in outputs]
            if not outputs:
                output = [call("search_docs", 1)]
            elif len(outputs) == 1:
                assert self.seen[0].startswith(REFUSAL), self.seen
                output = [call("web_search", 2)]
            else:
                text = ResponseOutputText(
                    text=f"Answer: {self.seen[-1]}", type="output_text", annotations=[]
                )
                output = [
                    ResponseOutputMessage(
                        id="msg_1",
                        content=[text],
                        role="assistant",
                        status="completed",
                        type="message",
                    )
                ]
            return ModelResponse(output=output, usage=Usage(), response_id=None)

        def stream_response(self, *args, **kwargs):
            raise NotImplementedError

    class Provider(ModelProvider):
        def get_model(self, model_name):
            return ScriptedModel()

    book, trace_id = SignalBook(), uuid.uuid4().hex
    book.deliver(contain())
    tools = [
        function_tool("search_docs", "no results"),
        function_tool("web_search", "refunds within 30 days"),
    ]
    result = asyncio.run(
        Runner.run(
            Agent(name="support", tools=tools),
            "What is the refund policy?",
            hooks=SpanguardRunHooks(book, trace_id=trace_id),
            max_turns=5,
            run_config=RunConfig(model_provider=Provider(), tracing_disabled=True),
        )
    )
    assert result.final_output == "Answer: refunds within 30 days"
    assert calls == ["web_search"]  # the contained tool never ran
    assert book.tool_calls_refused == 1


def test_a_pydantic_ai_agent_whose_tool_is_contained_takes_its_other_tool_and_finishes():
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    from spanguard.killswitch.adapters_pydantic_ai import SpanguardCapability

    calls: list[str] = []

    def scripted(messages: list, info: AgentInfo) -> ModelResponse:
        """The knowledge base first; on its failure, the web; then the answer."""
        answers = [
            str(getattr(part, "content", ""))
            for message in messages
            for part in message.parts
            if part.part_kind in ("tool-return", "retry-prompt")
        ]
        if not answers:
            return ModelResponse(parts=[ToolCallPart("search_docs", {"query": "refunds"})])
        if len(answers) == 1:
            assert REFUSAL in answers[0], answers
            return ModelResponse(parts=[ToolCallPart("web_search", {"query": "refunds"})])
        return ModelResponse(parts=[TextPart(f"Answer: {answers[-1]}")])

    book, trace_id = SignalBook(), uuid.uuid4().hex
    book.deliver(contain())
    agent = Agent(
        FunctionModel(scripted), capabilities=[SpanguardCapability(book, trace_id=trace_id)]
    )

    @agent.tool_plain
    def search_docs(query: str) -> str:
        """Search the knowledge base."""
        calls.append("search_docs")
        return "no results"

    @agent.tool_plain
    def web_search(query: str) -> str:
        """Search the web."""
        calls.append("web_search")
        return "refunds within 30 days"

    result = agent.run_sync("What is the refund policy?")
    assert result.output == "Answer: refunds within 30 days"
    assert calls == ["web_search"]
    assert book.tool_calls_refused == 1


def test_a_llama_index_agent_whose_tool_is_contained_takes_its_other_tool_and_finishes():
    pytest.importorskip("llama_index.core")
    from llama_index.core.agent.workflow import FunctionAgent
    from llama_index.core.base.llms.types import ChatMessage, MessageRole, ToolCallBlock
    from llama_index.core.llms.mock import MockFunctionCallingLLM
    from llama_index.core.tools import FunctionTool

    from spanguard.killswitch.adapters_llama_index import guard_llama_index_agent

    calls: list[str] = []
    seen: list[str] = []

    def respond(messages, **kwargs) -> ChatMessage:
        """The knowledge base first; on its error, the web; then the answer."""
        tool_results = [str(m.content) for m in messages if m.role == MessageRole.TOOL]
        seen[:] = tool_results
        if not tool_results:
            name = "search_docs"
        elif len(tool_results) == 1:
            assert tool_results[0].startswith(REFUSAL), tool_results
            name = "web_search"
        else:
            return ChatMessage(role=MessageRole.ASSISTANT, content=f"Answer: {tool_results[-1]}")
        block = ToolCallBlock(
            tool_call_id=f"call_{len(tool_results)}", tool_name=name, tool_kwargs={"query": "q"}
        )
        return ChatMessage(role=MessageRole.ASSISTANT, blocks=[block])

    def search_docs(query: str) -> str:
        """Search the knowledge base."""
        calls.append("search_docs")
        return "no results"

    def web_search(query: str) -> str:
        """Search the web."""
        calls.append("web_search")
        return "refunds within 30 days"

    tools = [FunctionTool.from_defaults(fn=fn) for fn in (search_docs, web_search)]
    agent = FunctionAgent(
        tools=tools, llm=MockFunctionCallingLLM(response_generator=respond), name="support"
    )
    book, trace_id = SignalBook(), uuid.uuid4().hex
    book.deliver(contain())
    guard_llama_index_agent(agent, book, trace_id=trace_id)

    async def run() -> object:
        return await agent.run("What is the refund policy?", max_iterations=10)

    result = asyncio.run(run())
    assert "refunds within 30 days" in str(result)
    assert calls == ["web_search"]
    assert book.tool_calls_refused == 1
