"""Span fixtures made by the real instrumentation libraries, from scripted agents.

Each library runs real agents of its own framework against a scripted model (no network): the
model asks for the tool calls of a scenario one turn at a time, then answers. The spans come
from the library's own tracing, are collected by the OTel SDK's in-memory exporter and written
as OTLP/JSON (one request per scenario, one trace each), the format `spanguard replay` reads:

    tests/fixtures/instrumentation/<library>/<mode>/<scenario>.json.gz

    python -m tests.support.instrumented_agents                 # every library installed
    python -m tests.support.instrumented_agents --out DIR LIB   # one library, elsewhere

Modes: `capture` (the library's content capture on), `off` (capture off, where the library has
such a setting), `redacted` (its redaction on) and `hashed` (capture on, the spans passed through
spanguard's ArgsHashingSpanProcessor, so only hashes leave); Google ADK adds `legacy` and
`legacy-off` (its schema 1), strands `latest` and `latest-redacted` (its latest conventions).
Every (library, mode) runs in a process of its own: instrumentors patch globally and read their
settings from the environment when they start.

TypeScript frameworks (the Vercel AI SDK 6 and 7, Mastra, VoltAgent, LangGraph.js and the OpenAI Agents
SDK for JS under OpenInference JS) run the same scenarios under node:
tests/support/ts_agents/generate.mjs, with its own package.json and lockfile, and VoltAgent's in
its voltagent/ folder (`--typescript` runs `npm ci` in both first if needed).

    python -m tests.support.instrumented_agents --typescript [LIBRARY...]

A Go agent framework, Genkit for Go, runs them under `go run` (tests/support/go_agents/genkit,
its own go.mod): `--go`.

A Java one, LangChain4j, runs them in a JVM (tests/support/java_agents, its own pom.xml, built by
`make java-agents`): `--java`. LangChain4j makes no spans itself; clients/java's
LangChain4jTracing makes them from its listeners and tool hooks (GenAI conventions), and the
OpenTelemetry Java SDK exports them over OTLP/HTTP to a receiver here.

Google ADK and strands-agents pin OpenTelemetry versions this project's SDK pin excludes, so they
run in a virtualenv of their own, made on demand under ~/.cache/spanguard/fixtures-<library>
(or $SPANGUARD_FIXTURE_VENVS/fixtures-<library>)
(`--venv LIBRARY` makes it: the library's exact pin, and this checkout without dependencies).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gzip
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "instrumentation"
# SPANGUARD_FIXTURE_VENVS: where the virtualenvs of their own live, for a checkout that must
# not share them (each holds one checkout, installed editable).
VENVS = Path(
    os.environ.get("SPANGUARD_FIXTURE_VENVS")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spanguard"
)
TS_AGENTS = ROOT / "tests" / "support" / "ts_agents"
# Its packages, each with a lockfile: VoltAgent's asks for another major of the AI SDK as `ai`.
TS_PACKAGES = (TS_AGENTS, TS_AGENTS / "voltagent")
GO_AGENTS = ROOT / "tests" / "support" / "go_agents"
GO_LIBRARIES = {"genkit": ("capture",)}  # Genkit has no setting that turns content off
JAVA_AGENTS = ROOT / "tests" / "support" / "java_agents"
# off: LangChain4jTracing's captureContent false; Spring AI without its content filter.
JAVA_LIBRARIES = {"langchain4j": ("capture", "off"), "spring-ai": ("capture", "off")}
SERVICE = "scripted-agent"
MODULE = "tests.support.instrumented_agents"


@dataclass(frozen=True)
class Call:
    tool: str
    arguments: dict[str, Any]
    result: str


REFUND = {"query": "refund policy"}
CODING_ROUND = [
    Call("search_docs", {"query": "list src/"}, "main.py util.py"),
    Call("read_doc", {"doc_id": "src/main.py"}, "def main(): ..."),
    Call("search_docs", {"query": "grep TODO"}, "main.py:12 TODO"),
    Call("get_job_status", {"job_id": "run-tests"}, "2 tests failed"),
]
LONG_ROUND = [
    *CODING_ROUND,
    Call("read_doc", {"doc_id": "src/util.py"}, "def helper(): ..."),
    Call("search_docs", {"query": "grep helper"}, "util.py:3 helper"),
    Call("read_doc", {"doc_id": "README.md"}, "# project"),
    Call("get_job_status", {"job_id": "lint"}, "lint: 1 warning"),
]
SCENARIOS: dict[str, list[Call]] = {
    # A stuck agent whose retries carry a fresh request id (a volatile key) each time.
    "loop_volatile": [
        Call("search_docs", {**REFUND, "request_id": f"req-{i}"}, "no results") for i in range(6)
    ],
    "loop_identical": [Call("search_docs", REFUND, "no results") for _ in range(6)],
    # A healthy research agent: 12 different searches, 12 different answers.
    "distinct": [
        Call("search_docs", {"query": f"refund rules in region {i}"}, f"{i + 1} documents found")
        for i in range(12)
    ],
    # One retry after a timeout, then the agent moves on.
    "retry": [
        Call("search_docs", REFUND, "error: timeout"),
        Call("search_docs", REFUND, "2 documents found"),
        Call("read_doc", {"doc_id": "kb-12"}, "Refunds are accepted within 30 days."),
        Call("search_docs", {"query": "refund exceptions"}, "1 document found"),
    ],
    # Waiting for a job: the same call, a result that changes until the job is done.
    "polling": [
        Call("get_job_status", {"job_id": "job-7"}, f"running: {10 * (i + 1)}% done")
        for i in range(8)
    ]
    + [Call("get_job_status", {"job_id": "job-7"}, "done")],
    # Different searches that all come back empty: no progress, though no call repeats.
    "no_progress": [
        Call("search_docs", {"query": query}, "[]")
        for query in ("refund", "refunds", "refund policy", "returns", "money back", "reimburse")
    ],
    # A stuck coding agent going round four calls (list, read, grep, run the tests) with the
    # same arguments and the same results: the round repeats (tool_loop sees its first call a
    # third time with nothing new between at the third round's start, the cycle rule at its end).
    "cycle_4": CODING_ROUND * 4,
    # The same with eight calls in the round, three rounds.
    "cycle_8": LONG_ROUND * 3,
    # A healthy agent going round its tools, each time about something new.
    "round_fresh": [
        call
        for topic in ("exchanges", "shipping", "warranty", "invoices", "returns")
        for call in (
            Call("search_docs", {"query": f"{topic} policy"}, f"3 documents about {topic}"),
            Call("read_doc", {"doc_id": f"kb-{topic}"}, f"The {topic} policy says ..."),
            Call("search_docs", {"query": f"summary of {topic}"}, f"{topic}: summarised"),
        )
    ],
    # A healthy coding agent: a fix, a read, the tests re-run while the failures go down.
    "tests_improving": [
        call
        for failing in (5, 4, 3, 1, 0)
        for call in (
            Call("search_docs", {"query": f"fix failure {failing}"}, f"hint {failing}"),
            Call("read_doc", {"doc_id": f"src/module_{failing}.py"}, f"source {failing}"),
            Call("get_job_status", {"job_id": "run-tests"}, f"{failing} tests failed"),
        )
    ],
    # Different edits, each answered with the same acknowledgement: progress, not a stall.
    "canned_ok": [
        Call("search_docs", {"query": f"apply edit {i}"}, '{"ok": true}') for i in range(6)
    ],
}

TOOL_DOCS = {
    "search_docs": "Search the knowledge base.",
    "read_doc": "Read one document of the knowledge base.",
    "get_job_status": "Status of a background job.",
}
FINAL_ANSWER = "That is all I could find."


class Script:
    """The scenario's calls in order: the model's next request and the tool's next result."""

    def __init__(self, calls: list[Call]) -> None:
        self.calls = calls
        self.turn = 0
        self.results = iter([call.result for call in calls])

    def next_call(self) -> Call | None:
        """The call the model asks for on this turn, None once it should answer."""
        if self.turn >= len(self.calls):
            return None
        call = self.calls[self.turn]
        self.turn += 1
        return call

    def result(self) -> str:
        return next(self.results)


def knowledge_base_tools(script: Script) -> list[Callable[..., str]]:
    """The three tools as plain functions, for frameworks that read a tool's name, parameters
    and docstring (its TOOL_DOCS entry) from the function itself; each answers what the script
    says."""

    def search_docs(query: str, request_id: str | None = None) -> str:
        return script.result()

    def read_doc(doc_id: str) -> str:
        return script.result()

    def get_job_status(job_id: str) -> str:
        return script.result()

    tools = [search_docs, read_doc, get_job_status]
    for fn in tools:
        fn.__doc__ = TOOL_DOCS[fn.__name__]
    return tools


# -- the libraries -------------------------------------------------------------------------


@dataclass(frozen=True)
class Library:
    """One instrumentation over one framework: how to instrument it, and how to run an agent."""

    name: str
    modules: tuple[str, ...]  # all importable, or the library is skipped
    modes: dict[str, dict[str, str]]  # mode -> environment set before instrumenting
    instrument: Callable[[Any, str], None]  # (tracer provider, mode)
    # (script, adapter): the adapter is spanguard's for the framework, or None
    run: Callable[[Script, Any], None]
    # Non-empty: the exact pins of a virtualenv of its own (its OTel pins exclude ours).
    requirements: tuple[str, ...] = ()

    @property
    def python(self) -> str:
        if not self.requirements:
            return sys.executable
        return str(VENVS / f"fixtures-{self.name}" / "bin" / "python")


def _langchain_tools(script: Script) -> list[Any]:
    from langchain_core.tools import tool

    @tool(description=TOOL_DOCS["search_docs"])
    def search_docs(query: str, request_id: str | None = None) -> str:
        return script.result()

    @tool(description=TOOL_DOCS["read_doc"])
    def read_doc(doc_id: str) -> str:
        return script.result()

    @tool(description=TOOL_DOCS["get_job_status"])
    def get_job_status(job_id: str) -> str:
        return script.result()

    return [search_docs, read_doc, get_job_status]


def run_langgraph(script: Script, guard: Any = None) -> None:
    """LangGraph's prebuilt ReAct agent over a scripted LangChain chat model."""
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage
    from langgraph.prebuilt import create_react_agent

    usage = {"input_tokens": 120, "output_tokens": 20, "total_tokens": 140}

    def messages() -> Iterator[AIMessage]:
        while (call := script.next_call()) is not None:
            tool_call = {"name": call.tool, "args": call.arguments, "id": f"call_{script.turn}"}
            yield AIMessage(content="", tool_calls=[tool_call], usage_metadata=usage)
        yield AIMessage(content=FINAL_ANSWER, usage_metadata=usage)

    class ScriptedChatModel(GenericFakeChatModel):
        def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
            return self  # the script already knows which tools it calls

    agent = create_react_agent(ScriptedChatModel(messages=messages()), _langchain_tools(script))
    config: dict[str, Any] = {"recursion_limit": 100}
    if guard is not None:
        config["callbacks"] = [guard]
    agent.invoke({"messages": [("user", "What is the refund policy?")]}, config)


def instrument_openinference_langchain(provider: Any, mode: str) -> None:
    from openinference.instrumentation.langchain import LangChainInstrumentor

    LangChainInstrumentor().instrument(tracer_provider=provider)


def instrument_openllmetry_langchain(provider: Any, mode: str) -> None:
    from opentelemetry.instrumentation.langchain import LangchainInstrumentor

    LangchainInstrumentor().instrument(tracer_provider=provider)


def _openai_agents_tools(script: Script) -> list[Any]:
    from agents import FunctionTool

    def function_tool(name: str, properties: dict[str, Any], required: list[str]) -> Any:
        async def invoke(context: Any, arguments: str) -> str:
            return script.result()

        return FunctionTool(
            name=name,
            description=TOOL_DOCS[name],
            params_json_schema={
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": False,
            },
            on_invoke_tool=invoke,
            strict_json_schema=False,
        )

    text = {"type": "string"}
    return [
        function_tool("search_docs", {"query": text, "request_id": text}, ["query"]),
        function_tool("read_doc", {"doc_id": text}, ["doc_id"]),
        function_tool("get_job_status", {"job_id": text}, ["job_id"]),
    ]


def run_openai_agents(script: Script, guard: Any = None) -> None:
    """The OpenAI Agents SDK's Runner over a scripted Model (the SDK's pluggable interface)."""
    from agents import Agent, RunConfig, Runner

    def next_output() -> Any:
        call = script.next_call()
        if call is None:
            return openai_answer(FINAL_ANSWER)
        return openai_tool_call(script.turn, call.tool, call.arguments)

    provider = scripted_openai_provider(next_output, tokens=(120, 20))
    agent = Agent(name="support", tools=_openai_agents_tools(script))
    asyncio.run(
        Runner.run(
            agent,
            "What is the refund policy?",
            max_turns=100,
            hooks=guard,
            run_config=RunConfig(model_provider=provider),
        )
    )


def scripted_openai_provider(next_output: Callable[[], Any], tokens: tuple[int, int]) -> Any:
    """An OpenAI Agents SDK ModelProvider whose model answers each request with `next_output()`
    (openai_answer or openai_tool_call), at `tokens` (input, output) a request."""
    from agents.items import ModelResponse
    from agents.models.interface import Model, ModelProvider
    from agents.usage import Usage

    class ScriptedModel(Model):
        async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
            usage = Usage(
                requests=1,
                input_tokens=tokens[0],
                output_tokens=tokens[1],
                total_tokens=sum(tokens),
            )
            return ModelResponse(output=[next_output()], usage=usage, response_id=None)

        def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

    class Provider(ModelProvider):
        def get_model(self, model_name: str | None) -> Model:
            return ScriptedModel()

    return Provider()


def openai_answer(text: str) -> Any:
    """The scripted model's final message."""
    from openai.types.responses import ResponseOutputMessage
    from openai.types.responses.response_output_text import ResponseOutputText

    content = [ResponseOutputText(annotations=[], text=text, type="output_text")]
    return ResponseOutputMessage(
        id="msg_final", content=content, role="assistant", status="completed", type="message"
    )


def openai_tool_call(turn: int, name: str, arguments: dict[str, Any]) -> Any:
    """The scripted model's call of tool `name` on `turn`."""
    from openai.types.responses import ResponseFunctionToolCall

    return ResponseFunctionToolCall(
        arguments=json.dumps(arguments),
        call_id=f"call_{turn}",
        name=name,
        type="function_call",
        id=f"fc_{turn}",
        status="completed",
    )


def instrument_openinference_openai_agents(provider: Any, mode: str) -> None:
    from agents import set_trace_processors
    from openinference.instrumentation.openai_agents import OpenAIAgentsInstrumentor

    set_trace_processors([])  # no upload to the platform's trace backend: OpenInference only
    OpenAIAgentsInstrumentor().instrument(tracer_provider=provider)


def instrument_otel_openai_agents(provider: Any, mode: str) -> None:
    from agents import set_trace_processors
    from opentelemetry.instrumentation.openai_agents import OpenAIAgentsInstrumentor

    set_trace_processors([])  # the OTel GenAI bridge only
    OpenAIAgentsInstrumentor().instrument(tracer_provider=provider)


def instrument_pydantic_ai(provider: Any, mode: str) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.instrumented import InstrumentationSettings

    settings = InstrumentationSettings(tracer_provider=provider, include_content=mode != "off")
    Agent.instrument_all(settings)


def run_pydantic_ai(script: Script, guard: Any = None) -> None:
    """A pydantic-ai Agent over its FunctionModel, the library's own scriptable model."""
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel
    from pydantic_ai.usage import RequestUsage

    def respond(messages: list[Any], info: AgentInfo) -> ModelResponse:
        usage = RequestUsage(input_tokens=120, output_tokens=20)
        call = script.next_call()
        if call is None:
            return ModelResponse(parts=[TextPart(FINAL_ANSWER)], usage=usage)
        part = ToolCallPart(call.tool, call.arguments, tool_call_id=f"call_{script.turn}")
        return ModelResponse(parts=[part], usage=usage)

    capabilities = [guard] if guard is not None else None
    agent = Agent(FunctionModel(respond), name="support", capabilities=capabilities)

    @agent.tool_plain(description=TOOL_DOCS["search_docs"])
    def search_docs(query: str, request_id: str | None = None) -> str:
        return script.result()

    @agent.tool_plain(description=TOOL_DOCS["read_doc"])
    def read_doc(doc_id: str) -> str:
        return script.result()

    @agent.tool_plain(description=TOOL_DOCS["get_job_status"])
    def get_job_status(job_id: str) -> str:
        return script.result()

    agent.run_sync("What is the refund policy?")


def instrument_openinference_smolagents(provider: Any, mode: str) -> None:
    from openinference.instrumentation.smolagents import SmolagentsInstrumentor

    SmolagentsInstrumentor().instrument(tracer_provider=provider)


def run_smolagents(script: Script, guard: Any = None) -> None:
    """smolagents' ToolCallingAgent over a scripted Model; it answers through final_answer."""
    from smolagents import Tool, ToolCallingAgent
    from smolagents.models import (
        ChatMessage,
        ChatMessageToolCall,
        ChatMessageToolCallFunction,
        MessageRole,
        Model,
    )
    from smolagents.monitoring import TokenUsage

    class ScriptedModel(Model):
        def generate(self, messages: Any, **kwargs: Any) -> ChatMessage:
            call = script.next_call()
            name, arguments = (
                ("final_answer", {"answer": FINAL_ANSWER})
                if call is None
                else (call.tool, call.arguments)
            )
            tool_call = ChatMessageToolCall(
                function=ChatMessageToolCallFunction(name=name, arguments=arguments),
                id=f"call_{script.turn}",
                type="function",
            )
            return ChatMessage(
                role=MessageRole.ASSISTANT,
                content="",
                tool_calls=[tool_call],
                token_usage=TokenUsage(input_tokens=120, output_tokens=20),
            )

    def make(tool_name: str, inputs: dict[str, dict[str, Any]]) -> Tool:
        def forward(self: Any, **kwargs: Any) -> str:
            return script.result()

        return type(
            f"{tool_name}_tool",
            (Tool,),
            {
                "name": tool_name,
                "description": TOOL_DOCS[tool_name],
                "inputs": inputs,
                "output_type": "string",
                "forward": forward,
                "skip_forward_signature_validation": True,
            },
        )()

    text = {"type": "string", "description": "text"}
    tools = [
        make("search_docs", {"query": text, "request_id": {**text, "nullable": True}}),
        make("read_doc", {"doc_id": text}),
        make("get_job_status", {"job_id": text}),
    ]
    agent = ToolCallingAgent(
        tools=tools,
        model=ScriptedModel(model_id="scripted"),
        max_steps=50,
        verbosity_level=-1,
        step_callbacks=[guard] if guard is not None else None,
    )
    agent.run("What is the refund policy?")


def instrument_openinference_llama_index(provider: Any, mode: str) -> None:
    from openinference.instrumentation.llama_index import LlamaIndexInstrumentor

    LlamaIndexInstrumentor().instrument(tracer_provider=provider)


def run_llama_index(script: Script, guard: Any = None) -> None:
    """llama-index's FunctionAgent over its MockFunctionCallingLLM, scripted turn by turn."""
    from llama_index.core.agent.workflow import FunctionAgent
    from llama_index.core.base.llms.types import ChatMessage, MessageRole, ToolCallBlock
    from llama_index.core.llms.mock import MockFunctionCallingLLM
    from llama_index.core.tools import FunctionTool

    def respond(messages: Any, **kwargs: Any) -> ChatMessage:
        call = script.next_call()
        if call is None:
            return ChatMessage(role=MessageRole.ASSISTANT, content=FINAL_ANSWER)
        block = ToolCallBlock(
            tool_call_id=f"call_{script.turn}", tool_name=call.tool, tool_kwargs=call.arguments
        )
        return ChatMessage(role=MessageRole.ASSISTANT, blocks=[block])

    tools = [
        FunctionTool.from_defaults(fn=fn, name=fn.__name__, description=TOOL_DOCS[fn.__name__])
        for fn in knowledge_base_tools(script)
    ]
    llm = MockFunctionCallingLLM(response_generator=respond)
    agent = FunctionAgent(tools=tools, llm=llm, name="support")
    if guard is not None:
        guard(agent)

    async def run() -> None:
        await agent.run("What is the refund policy?", max_iterations=100)

    asyncio.run(run())


def instrument_global_provider(provider: Any, mode: str) -> None:
    """Google ADK and strands trace through the global provider (their tracer is made there)."""
    from opentelemetry import trace

    trace.set_tracer_provider(provider)


def run_google_adk(script: Script, guard: Any = None) -> None:
    """A Google ADK LlmAgent under InMemoryRunner, over a scripted BaseLlm."""
    from google.adk.agents import LlmAgent
    from google.adk.models.base_llm import BaseLlm
    from google.adk.models.llm_response import LlmResponse
    from google.adk.runners import InMemoryRunner
    from google.genai import types

    usage = types.GenerateContentResponseUsageMetadata(
        prompt_token_count=120, candidates_token_count=20, total_token_count=140
    )

    class ScriptedLlm(BaseLlm):
        async def generate_content_async(self, llm_request: Any, stream: bool = False) -> Any:
            call = script.next_call()
            if call is None:
                part = types.Part(text=FINAL_ANSWER)
            else:
                function_call = types.FunctionCall(
                    name=call.tool, args=call.arguments, id=f"call_{script.turn}"
                )
                part = types.Part(function_call=function_call)
            content = types.Content(role="model", parts=[part])
            yield LlmResponse(content=content, usage_metadata=usage)

    agent = LlmAgent(
        name="support", model=ScriptedLlm(model="scripted"), tools=knowledge_base_tools(script)
    )
    plugins = [guard] if guard is not None else None
    runner = InMemoryRunner(agent=agent, app_name="support", plugins=plugins)
    run_adk_turn(runner, "What is the refund policy?")


def run_adk_turn(runner: Any, question: str) -> None:
    """One user question through an ADK runner (app "support"), in a new session, to its end."""
    from google.genai import types

    async def run() -> None:
        session = await runner.session_service.create_session(app_name="support", user_id="u")
        message = types.Content(role="user", parts=[types.Part(text=question)])
        async for _ in runner.run_async(user_id="u", session_id=session.id, new_message=message):
            pass

    asyncio.run(run())


def run_strands(script: Script, guard: Any = None) -> None:
    """A strands Agent over a scripted Model streaming the library's own events."""
    from strands import Agent, tool
    from strands.models import Model

    class ScriptedModel(Model):
        def update_config(self, **model_config: Any) -> None:
            pass

        def get_config(self) -> Any:
            return {}

        def structured_output(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

        async def stream(self, *args: Any, **kwargs: Any) -> Any:
            call = script.next_call()
            yield {"messageStart": {"role": "assistant"}}
            if call is None:
                yield {"contentBlockDelta": {"delta": {"text": FINAL_ANSWER}}}
                yield {"contentBlockStop": {}}
                yield {"messageStop": {"stopReason": "end_turn"}}
            else:
                start = {"toolUse": {"toolUseId": f"call_{script.turn}", "name": call.tool}}
                yield {"contentBlockStart": {"start": start}}
                delta = {"toolUse": {"input": json.dumps(call.arguments)}}
                yield {"contentBlockDelta": {"delta": delta}}
                yield {"contentBlockStop": {}}
                yield {"messageStop": {"stopReason": "tool_use"}}
            usage = {"inputTokens": 120, "outputTokens": 20, "totalTokens": 140}
            yield {"metadata": {"usage": usage, "metrics": {"latencyMs": 1}}}

    agent = Agent(
        model=ScriptedModel(),
        tools=[tool(fn) for fn in knowledge_base_tools(script)],
        name="support",
        callback_handler=None,
        hooks=[guard] if guard is not None else None,
    )
    agent("What is the refund policy?")


HIDE_INPUTS = {"OPENINFERENCE_HIDE_INPUTS": "true"}
ADK_CAPTURE = {"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "SPAN_ONLY"}
ADK_LEGACY = {"ADK_TELEMETRY_SCHEMA_VERSION_OPT_IN": "1"}
STRANDS_LATEST = "gen_ai_latest_experimental"
STRANDS_REDACT = "gen_ai_unredacted_attributes="  # the token with an empty list: redact all
CONTENT_SETTINGS = frozenset(
    {
        "OPENINFERENCE_HIDE_INPUTS",
        "OPENINFERENCE_HIDE_OUTPUTS",
        "TRACELOOP_TRACE_CONTENT",
        "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT",
        "ADK_TELEMETRY_SCHEMA_VERSION_OPT_IN",
        "ADK_CAPTURE_MESSAGE_CONTENT_IN_SPANS",
        "OTEL_SEMCONV_STABILITY_OPT_IN",
        "OTEL_INSTRUMENTATION_OPENAI_AGENTS_CAPTURE_CONTENT",
    }
)
# confluent-kafka: the KillSwitch of the guarded-agent matrix (tests/support/guarded_agents.py).
SIDE_VENV_COMMON = ("pyyaml==6.0.4", "jsonschema==4.26.0", "confluent-kafka==2.16.1")
LIBRARIES: dict[str, Library] = {
    library.name: library
    for library in (
        Library(
            "langgraph-openinference",
            ("langgraph", "openinference.instrumentation.langchain"),
            {"capture": {}, "redacted": HIDE_INPUTS, "hashed": {}},
            instrument_openinference_langchain,
            run_langgraph,
        ),
        Library(
            "langgraph-openllmetry",
            ("langgraph", "opentelemetry.instrumentation.langchain"),
            {
                "capture": {"TRACELOOP_TRACE_CONTENT": "true"},
                "off": {"TRACELOOP_TRACE_CONTENT": "false"},
                "hashed": {"TRACELOOP_TRACE_CONTENT": "true"},
            },
            instrument_openllmetry_langchain,
            run_langgraph,
        ),
        Library(
            "openai-agents-openinference",
            ("agents", "openinference.instrumentation.openai_agents"),
            {"capture": {}, "redacted": HIDE_INPUTS, "hashed": {}},
            instrument_openinference_openai_agents,
            run_openai_agents,
        ),
        Library(
            "openai-agents-otel",
            ("agents", "opentelemetry.instrumentation.openai_agents"),
            {
                "capture": {},  # its default: span_and_event
                "off": {"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "false"},
                "hashed": {},
            },
            instrument_otel_openai_agents,
            run_openai_agents,
        ),
        Library(
            "pydantic-ai",
            ("pydantic_ai",),
            {"capture": {}, "off": {}, "hashed": {}},
            instrument_pydantic_ai,
            run_pydantic_ai,
        ),
        Library(
            "smolagents-openinference",
            ("smolagents", "openinference.instrumentation.smolagents"),
            {"capture": {}, "redacted": HIDE_INPUTS, "hashed": {}},
            instrument_openinference_smolagents,
            run_smolagents,
        ),
        Library(
            "llama-index-openinference",
            ("llama_index.core", "openinference.instrumentation.llama_index"),
            {"capture": {}, "redacted": HIDE_INPUTS, "hashed": {}},
            instrument_openinference_llama_index,
            run_llama_index,
        ),
        Library(
            "google-adk",
            ("google.adk",),
            {
                "capture": ADK_CAPTURE,
                "off": {},  # ADK 2.x's default: no content on spans
                "legacy": ADK_LEGACY,  # schema 1 records arguments by default
                "legacy-off": {**ADK_LEGACY, "ADK_CAPTURE_MESSAGE_CONTENT_IN_SPANS": "false"},
                "hashed": ADK_CAPTURE,
            },
            instrument_global_provider,
            run_google_adk,
            (
                "google-adk==2.13.0",
                "opentelemetry-exporter-otlp-proto-common==1.44.0",
                "opentelemetry-exporter-otlp-proto-http==1.44.0",  # the guarded-agent matrix
                # ADK's agents talking A2A (tests/support/multi_frameworks.py), the trace
                # context carried between the services
                "a2a-sdk[http-server]==1.3.0",
                "opentelemetry-instrumentation-asgi==0.65b0",
                "opentelemetry-instrumentation-httpx==0.65b0",
            ),
        ),
        Library(
            "strands",
            ("strands",),
            {
                "capture": {},
                "redacted": {"OTEL_SEMCONV_STABILITY_OPT_IN": STRANDS_REDACT},
                "latest": {"OTEL_SEMCONV_STABILITY_OPT_IN": STRANDS_LATEST},
                "latest-redacted": {
                    "OTEL_SEMCONV_STABILITY_OPT_IN": f"{STRANDS_LATEST},{STRANDS_REDACT}"
                },
                "hashed": {},
            },
            instrument_global_provider,
            run_strands,
            (
                "strands-agents==1.62.0",
                "opentelemetry-exporter-otlp-proto-common==1.45.1",
                "opentelemetry-exporter-otlp-proto-http==1.45.1",
            ),
        ),
    )
}


# -- running and writing -------------------------------------------------------------------


def scenarios_json() -> str:
    """SCENARIOS as the other languages' agents read them: name -> [call, ...]."""
    return json.dumps(
        {name: [dataclasses.asdict(call) for call in calls] for name, calls in SCENARIOS.items()}
    )


def write_fixture(folder: Path, scenario: str, request: Any) -> Path:
    """One scenario's OTLP request as its fixture: one JSON line, gzipped with deterministic
    bytes (LangGraph's chain spans repeat the whole conversation, a megabyte per scenario)."""
    from spanguard.schemas.otlp import encode_json_line

    path = folder / f"{scenario}.json.gz"
    line = (encode_json_line(request) + "\n").encode()
    with path.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as file:
        file.write(line)
    return path


def generate_one(library: Library, mode: str, out: Path) -> list[Path]:
    """Run every scenario of `library` in `mode` in this process; write one file per scenario."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE}))
    processor: Any = SimpleSpanProcessor(exporter)
    if mode == "hashed":
        from spanguard.killswitch.hashing import ArgsHashingSpanProcessor

        processor = ArgsHashingSpanProcessor(processor)
    provider.add_span_processor(processor)
    library.instrument(provider, mode)

    folder = out / library.name / mode
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for scenario, calls in SCENARIOS.items():
        exporter.clear()
        script = Script(calls)
        library.run(script, None)
        provider.force_flush()
        if script.turn != len(calls):
            raise RuntimeError(
                f"{library.name}/{scenario}: the agent stopped at call {script.turn}"
            )
        # Usually one trace; OpenLLMetry adds a `create_agent` trace when the graph is built.
        spans = exporter.get_finished_spans()
        written.append(write_fixture(folder, scenario, encode_spans(spans)))
    return written


def installed(library: Library) -> bool:
    if library.requirements:
        if not Path(library.python).exists():
            return False
        check = "import " + ", ".join(library.modules)
        return subprocess.run([library.python, "-c", check], capture_output=True).returncode == 0
    from importlib.util import find_spec

    try:
        return all(find_spec(module) is not None for module in library.modules)
    except ModuleNotFoundError:
        return False


def use_this_checkout(library: Library) -> None:
    """A virtualenv of its own holds one checkout, installed editable: the last that made it.
    Point it at this one (no dependencies, seconds) if it holds another, else its agents would
    run another checkout's code, or none if that checkout is gone."""
    # spanguard.schemas is mapped by the editable install alone (it is not under spanguard/
    # in the tree); asked from / so the working directory cannot answer instead.
    where = (
        "import pathlib, spanguard.schemas as s; print(pathlib.Path(s.__file__).resolve().parent)"
    )
    found = subprocess.run(
        [library.python, "-c", where], capture_output=True, text=True, cwd="/", check=False
    )
    if found.returncode == 0 and Path(found.stdout.strip()) == (ROOT / "schemas").resolve():
        return
    print(
        f"{library.name}: its virtualenv holds another checkout; installing this one",
        file=sys.stderr,
    )
    install_this_checkout(library)


def install_this_checkout(library: Library) -> None:
    """This checkout, editable and without dependencies, into the library's virtualenv."""
    pip = [library.python, "-m", "pip", "install", "--quiet", "--no-deps", "-e", str(ROOT)]
    subprocess.run(pip, check=True)


def make_venv(library: Library) -> None:
    """The library's own virtualenv: its exact pins, and this checkout (no dependencies)."""
    venv = Path(library.python).parents[1]
    if not venv.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [library.python, "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, *library.requirements, *SIDE_VENV_COMMON], check=True)
    install_this_checkout(library)


def generate(names: list[str], out: Path, modes: set[str] | None = None) -> dict[str, list[str]]:
    """Each (library, mode) in a fresh interpreter; returns {library: modes written}.

    `modes` limits the modes run (default: every mode of each library)."""
    done: dict[str, list[str]] = {}
    for name in names:
        library = LIBRARIES[name]
        if not installed(library):
            print(f"{name}: not installed, skipped", file=sys.stderr)
            continue
        if library.requirements:
            use_this_checkout(library)
        for mode, environment in library.modes.items():
            if modes is not None and mode not in modes:
                continue
            # The mode alone decides capture: a setting left in the caller's environment must not.
            env = {k: v for k, v in os.environ.items() if k not in CONTENT_SETTINGS}
            env.update(environment)
            command = [library.python, "-m", MODULE, "--one", name, mode, "--out", str(out)]
            subprocess.run(command, env=env, check=True, cwd=ROOT)
            done.setdefault(name, []).append(mode)
    return done


def typescript_ready() -> str | None:
    """None when the TypeScript agents can run here, else why not (one line)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        return "node and npm are not on PATH"
    for package in TS_PACKAGES:
        if not (package / "node_modules").is_dir():
            return f"{package}/node_modules is missing (run `npm ci` there)"
    return None


def generate_typescript(out: Path, names: list[str] | None = None) -> None:
    """Run the TypeScript agents (node) over SCENARIOS; `npm ci` first when never installed."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        raise RuntimeError("the TypeScript fixtures need node (>= 20) and npm on PATH")
    for package in TS_PACKAGES:
        if not (package / "node_modules").is_dir():
            subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=package, check=True)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
        file.write(scenarios_json())
    try:
        command = ["node", "generate.mjs", "--scenarios", file.name, "--out", str(out)]
        subprocess.run([*command, *(names or [])], cwd=TS_AGENTS, check=True)
    finally:
        os.unlink(file.name)


def go_ready() -> str | None:
    """None when the Go agents can run here, else why not (one line)."""
    return None if shutil.which("go") else "go is not on PATH"


def generate_go(out: Path) -> None:
    """Run the Go agents over SCENARIOS; each scenario's OTLP request becomes its JSON fixture."""
    from spanguard.schemas.otlp import decode_protobuf

    if shutil.which("go") is None:
        raise RuntimeError("the Go fixtures need go on PATH")
    with tempfile.TemporaryDirectory() as scratch:
        scenario_file = Path(scratch) / "scenarios.json"
        scenario_file.write_text(scenarios_json())
        for name, modes in GO_LIBRARIES.items():
            command = ["go", "run", ".", "-scenarios", str(scenario_file), "-out", scratch]
            subprocess.run(command, cwd=GO_AGENTS / name, check=True)
            for mode in modes:
                folder = out / name / mode
                folder.mkdir(parents=True, exist_ok=True)
                for scenario in SCENARIOS:
                    raw = (Path(scratch) / name / mode / f"{scenario}.pb").read_bytes()
                    write_fixture(folder, scenario, decode_protobuf(raw))


def java_ready() -> str | None:
    """None when the Java agents are built here, else why not (one line)."""
    if shutil.which("java") is None:
        return "java is not on PATH"
    if not (JAVA_AGENTS / "target" / "lib").is_dir():
        return f"{JAVA_AGENTS}/target/lib is missing (run `make java-agents`)"
    return None


def java_command(*args: str) -> list[str]:
    """The Java agents' command line (tests/support/java_agents, built by `make java-agents`)."""
    classpath = os.pathsep.join(
        [str(JAVA_AGENTS / "target" / "classes"), str(JAVA_AGENTS / "target" / "lib" / "*")]
    )
    return ["java", "-cp", classpath, "dev.spanguard.agents.Main", *args]


class _OtlpSink(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint that keeps every protobuf request body it is sent."""

    bodies: list[bytes]

    def do_POST(self) -> None:
        self.bodies.append(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def generate_java(out: Path) -> None:
    """Run the Java agents over SCENARIOS per mode; each scenario's trace becomes its fixture."""
    from spanguard.schemas.otlp import decode_protobuf, split_by_trace

    why_not = java_ready()
    if why_not is not None:
        raise RuntimeError(f"the Java fixtures need the Java agents: {why_not}")
    with tempfile.TemporaryDirectory() as scratch:
        scenario_file = Path(scratch) / "scenarios.json"
        scenario_file.write_text(scenarios_json())
        for name, modes in JAVA_LIBRARIES.items():
            for mode in modes:
                bodies: list[bytes] = []
                handler = type("Sink", (_OtlpSink,), {"bodies": bodies})
                server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
                thread = threading.Thread(target=server.serve_forever, daemon=True)
                thread.start()
                try:
                    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
                    command = java_command("fixtures", "--scenarios", str(scenario_file),
                                           "--mode", mode, "--endpoint", endpoint,
                                           "--library", name)  # fmt: skip
                    done = subprocess.run(command, capture_output=True, text=True, check=True)
                finally:
                    server.shutdown()
                    server.server_close()
                traces = {
                    line["scenario"]: line["trace_id"]
                    for line in map(json.loads, done.stdout.splitlines())
                }
                parts: dict[str, list[Any]] = {}
                for body in bodies:
                    for trace_id, part in split_by_trace(decode_protobuf(body)).items():
                        parts.setdefault(trace_id, []).append(part)
                folder = out / name / mode
                folder.mkdir(parents=True, exist_ok=True)
                for scenario in SCENARIOS:
                    request = parts[traces[scenario]][0]
                    for more in parts[traces[scenario]][1:]:
                        request.resource_spans.extend(more.resource_spans)
                    write_fixture(folder, scenario, request)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("libraries", nargs="*", help=f"default: all ({', '.join(LIBRARIES)})")
    parser.add_argument("--out", type=Path, default=FIXTURES)
    parser.add_argument("--one", nargs=2, metavar=("LIBRARY", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--venv", metavar="LIBRARY", help="make LIBRARY's own virtualenv")
    parser.add_argument(
        "--typescript", action="store_true", help="the TypeScript frameworks' agents (node)"
    )
    parser.add_argument("--go", action="store_true", help="the Go frameworks' agents (go run)")
    parser.add_argument("--java", action="store_true", help="the Java frameworks' agents (a JVM)")
    args = parser.parse_args(argv)
    if args.java:
        generate_java(args.out)
        return 0
    if args.go:
        generate_go(args.out)
        return 0
    if args.typescript:
        generate_typescript(args.out, args.libraries)
        return 0
    if args.venv:
        make_venv(LIBRARIES[args.venv])
        return 0
    if args.one:
        name, mode = args.one
        generate_one(LIBRARIES[name], mode, args.out)
        return 0
    unknown = set(args.libraries) - set(LIBRARIES)
    if unknown:
        parser.error(f"unknown libraries: {', '.join(sorted(unknown))}")
    done = generate(args.libraries or list(LIBRARIES), args.out)
    for name, modes in done.items():
        print(f"{name}: {', '.join(modes)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
