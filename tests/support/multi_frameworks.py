"""Span fixtures of multi-agent runs made by LangGraph (a supervisor with two workers), Google
ADK (sub-agents and agents as tools), A2A (two a2a-sdk services), Google ADK agents serving
and calling each other over A2A on localhost and VoltAgent (a supervisor and its sub-agents,
under node: tests/support/ts_agents/voltagent/multi.mjs), each under its own tracing, from
scripted models (no network beyond localhost).

The scripted model answers each turn, whichever agent asks, with the scenario's next step: hand
the run to an agent (the framework's own handoff: langgraph-supervisor's `transfer_to_<agent>`,
ADK's `transfer_to_agent`), call a tool or an agent-as-tool (with its result), or answer. The
spans are written as OTLP/JSON, the format `spanguard replay` reads:

    tests/fixtures/multi_agent/<framework>/<instrumentation>/<scenario>.json.gz

    python -m tests.support.multi_frameworks                        # every framework
    python -m tests.support.multi_frameworks --out DIR [FRAMEWORK]  # elsewhere, or one

Each (framework, instrumentation) runs in a process of its own: instrumentors patch globally,
and Google ADK runs in its virtualenv of its own (its OpenTelemetry pins exclude ours: see
tests/support/instrumented_agents.py, `--venv google-adk`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "multi_agent"
SERVICE = "scripted-multi-agent"
MODULE = "tests.support.multi_frameworks"


@dataclass(frozen=True)
class Step:
    """One model turn: hand the run to `handoff`, call `tool` (a function or an agent-as-tool)
    with `arguments` (answered with `result`), or answer `answer`."""

    handoff: str | None = None
    tool: str | None = None
    arguments: dict[str, Any] | None = None
    result: str = ""
    answer: str | None = None
    # (agent, item) per handoff, all in one turn: a supervisor's parallel handoffs
    fan_out: tuple[tuple[str, str], ...] = ()


def lookup(item: str) -> Step:
    return Step(tool="lookup", arguments={"item": item}, result=f"{item}: 40 USD")


def answer(text: str) -> Step:
    return Step(answer=text)


FINAL = "Done."
NOTHING_NEW = "Nothing to add."


def _supervisor_fan_out(workers: int) -> list[Step]:
    """The supervisor hands `workers` items out at once, alternating its two workers; each
    worker run looks its item up and reports."""
    return [
        Step(fan_out=tuple((("worker_a", "worker_b")[i % 2], f"item-{i}") for i in range(workers)))
    ]


# LangGraph: the supervisor (langgraph-supervisor) and its workers `worker_a`, `worker_b`.
LANGGRAPH_SCENARIOS: dict[str, list[Step]] = {
    # supervisor -> worker_a -> supervisor -> worker_a ..., the worker adding nothing each time.
    "handoff_pingpong": [Step(handoff="worker_a"), answer(NOTHING_NEW)] * 8,
    # A healthy chain: worker_a looks the invoice up, worker_b refunds it, each once.
    "handoff_chain": [
        Step(handoff="worker_a"),
        lookup("inv-1"),
        answer("inv-1: 40 USD"),
        Step(handoff="worker_b"),
        Step(tool="issue_refund", arguments={"invoice": "inv-1"}, result="refund r-1 issued"),
        answer("refund r-1 issued"),
    ],
    # Back and forth, but each visit to worker_a looks up another invoice: work, not a loop.
    "handoff_with_work": [
        step
        for invoice in ("inv-1", "inv-2", "inv-3", "inv-4")
        for step in (Step(handoff="worker_a"), lookup(invoice), answer(f"{invoice}: 40 USD"))
    ],
    # The supervisor fanning out 50 worker runs at once, each on a new item.
    "fan_out_50": _supervisor_fan_out(50),
    "fan_out_5": _supervisor_fan_out(5),
}

ADK_DEPTH = 6  # agents below the root in the delegation chain: a0 -> a1 -> ... -> a6
# Google ADK: sub-agents reached by `transfer_to_agent`, or agents called as tools (AgentTool).
ADK_SCENARIOS: dict[str, list[Step]] = {
    # triage and billing transferring the run to each other, 8 transfers, nothing done between.
    "transfer_pingpong": [Step(handoff="billing"), Step(handoff="triage")] * 4,
    # A healthy chain: billing looks the invoice up, refunds refunds it.
    "transfer_chain": [
        Step(handoff="billing"),
        lookup("inv-1"),
        Step(handoff="refunds"),
        Step(tool="issue_refund", arguments={"invoice": "inv-1"}, result="refund r-1 issued"),
    ],
    # Back and forth, but each visit to billing looks up another invoice: work, not a loop.
    "transfer_with_work": [
        step
        for invoice in ("inv-1", "inv-2", "inv-3", "inv-4")
        for step in (Step(handoff="billing"), lookup(invoice), Step(handoff="triage"))
    ],
    # Each agent calls the next as a tool, six deep; the deepest looks the item up.
    "delegation_depth_6": [
        *(
            Step(tool=f"a{level}", arguments={"request": f"item-1, level {level}"})
            for level in range(1, ADK_DEPTH + 1)
        ),
        lookup("item-1"),
    ],
    # A healthy delegation: a0 asks a1, which asks a2, which looks the item up.
    "delegation_depth_2": [
        Step(tool="a1", arguments={"request": "item-1, level 1"}),
        Step(tool="a2", arguments={"request": "item-1, level 2"}),
        lookup("item-1"),
    ],
}


@dataclass(frozen=True)
class Expect:
    """A decision the guard's default policy makes on a fixture: its rule and action, the
    handoff it names (and which, 1-based among the run's handoffs in the order they ended), or
    the agents it names with the depth or the count of sub-agents."""

    rule: str
    action: str = "kill"
    handoff: str | None = None
    at: int | None = None
    agents: tuple[str, ...] = ()
    depth: int | None = None
    sub_agents: int | None = None
    # The rules of the decisions after it: the fixture's agents run on past the kill.
    then: tuple[str, ...] = ()


PINGPONG = Expect("handoff_cycle", handoff="handoff to worker_a", at=2, agents=("worker_a",) * 2)
ADK_PINGPONG = Expect(
    "handoff_cycle", handoff="handoff to triage", at=4, agents=("billing", "triage") * 2
)
ADK_NESTED_PINGPONG = Expect(
    "handoff_cycle",
    handoff="handoff to billing",
    at=5,
    agents=("triage", "billing") * 2,
    then=("delegation_depth",),
)
DEPTH_6 = Expect("delegation_depth", agents=tuple(f"a{level}" for level in range(1, 7)), depth=6)
# What the guard's default policy decides on each fixture, by (framework, instrumentation,
# scenario); nothing where a fixture is not named. Google ADK without content capture records
# no arguments: a transfer names no agent, the next transfer's agent is the one it handed to,
# so the cycle is known one transfer later. OpenInference's LangGraph agent spans name no agent
# (one per model turn): the subgraph namespace in their `metadata` names it, and one run.
FAN_OUT_50 = Expect("agent_fan_out", agents=("supervisor", "worker_a", "worker_b"), sub_agents=21)
EXPECTED: dict[tuple[str, str, str], Expect] = {
    ("langgraph", "openinference", "handoff_pingpong"): PINGPONG,
    ("langgraph", "openllmetry", "handoff_pingpong"): PINGPONG,
    ("langgraph", "openllmetry", "fan_out_50"): FAN_OUT_50,
    # The agents in the order their first runs ended (the threads').
    ("langgraph", "openinference", "fan_out_50"): replace(
        FAN_OUT_50, agents=("supervisor", "worker_b", "worker_a")
    ),
    ("google_adk", "capture", "transfer_pingpong"): ADK_PINGPONG,
    ("google_adk", "off", "transfer_pingpong"): Expect(
        "handoff_cycle", handoff="handoff to triage", at=5, agents=("billing", "triage") * 2
    ),
    ("google_adk", "capture", "delegation_depth_6"): DEPTH_6,
    ("google_adk", "off", "delegation_depth_6"): DEPTH_6,
    # Over A2A each handoff has two spans of the agent handed to, the caller's RemoteA2aAgent
    # span and the service's own: one run (AgentTree._remote_twin), so the routing ping-pong's
    # 8 host turns and 8 remote answers are 15 sub-agents, under max_sub_agents.
    ("google_adk_a2a", "capture", "routing_pingpong"): ADK_PINGPONG,
    # Without the trace carried, the host's trace still holds its handoffs (and the
    # RemoteA2aAgent runs: 16); each service's request is a trace of its own.
    ("google_adk_a2a", "unpropagated", "routing_pingpong"): ADK_PINGPONG,
    # Without content a transfer names no agent: the host's transfer handed to the remote agent
    # whose spans come next (AgentTree.saw_agent), known at the host's next transfer.
    ("google_adk_a2a", "off", "routing_pingpong"): replace(ADK_PINGPONG, at=5),
    ("google_adk_a2a", "unpropagated_off", "routing_pingpong"): replace(ADK_PINGPONG, at=5),
    # The host's handoff to billing is from another agent: the cycle between the services
    # is complete at the 5th handoff, the 4th between them, while every request is still
    # open; the depth is known as the nested requests end.
    # a2a-sdk's spans name no agent and no call to one: each request a service answers (its
    # handler's span) is a run of the agent its `service.name` names, and the nested requests
    # are agents nested 9 deep, over max_depth at the 6th. No span says whom a service asked,
    # so there is no handoff for handoff_cycle. Each service's spans come together, triage's
    # first: the chain is named as it stood at billing's 2nd run. Not carried across (`sdk`):
    # each request a trace of its own, one run in each, nothing to decide.
    ("a2a", "propagated", "pingpong"): Expect(
        "delegation_depth",
        agents=(*("triage-service",) * 3, "billing-service", "triage-service", "billing-service"),
        depth=6,
    ),
    ("google_adk_a2a", "capture", "pingpong"): ADK_NESTED_PINGPONG,
    # VoltAgent: the supervisor delegating the same task to worker_a, answered the same: its
    # `delegate_task` call made a third time (a delegation is a call and return, no handoff).
    # Its sub-agents run at once in a fan-out, each below a tool span of its own: siblings.
    ("voltagent", "capture", "handoff_pingpong"): Expect("tool_loop", handoff="delegate_task"),
    ("voltagent", "capture", "fan_out_50"): Expect(
        "agent_fan_out", agents=("worker_a", "worker_b"), sub_agents=21
    ),
    ("voltagent", "capture", "delegation_depth_6"): DEPTH_6,
    # Without content, one transfer later.
    ("google_adk_a2a", "off", "pingpong"): replace(ADK_NESTED_PINGPONG, at=6),
}


class Script:
    """The scenario's steps in order, then the final answer forever."""

    def __init__(self, steps: list[Step]) -> None:
        self.steps = steps
        self.turn = 0

    def next_step(self) -> Step:
        self.turn += 1
        if self.turn > len(self.steps):
            return answer(FINAL)
        return self.steps[self.turn - 1]

    def result(self, tool: str, arguments: dict[str, Any]) -> str:
        key = json.dumps(arguments, sort_keys=True)
        for step in self.steps:
            if step.tool == tool and json.dumps(step.arguments, sort_keys=True) == key:
                return step.result
        return ""

    def done(self) -> bool:
        """Every step was taken."""
        return self.turn >= len(self.steps)


# -- LangGraph -------------------------------------------------------------------------------


def run_langgraph(steps: list[Step]) -> Script:
    """langgraph-supervisor's supervisor over two prebuilt ReAct workers, one scripted model;
    a fan-out step is a supervisor graph of LangGraph's own map-reduce (`fan_out_graph`)."""
    import threading

    from langchain_core.language_models.chat_models import BaseChatModel
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.outputs import ChatGeneration, ChatResult
    from langchain_core.tools import tool
    from langgraph.prebuilt import create_react_agent
    from langgraph_supervisor import create_supervisor

    script = Script(steps)
    lock = threading.Lock()  # fanned-out workers ask the model from threads
    fan_out = next((step.fan_out for step in steps if step.fan_out), ())
    usage = {"input_tokens": 120, "output_tokens": 20, "total_tokens": 140}

    def reply(calls: list[dict[str, Any]], text: str = "") -> AIMessage:
        return AIMessage(content=text, tool_calls=calls, usage_metadata=usage)

    def scripted() -> AIMessage:
        with lock:
            step = script.next_step()
            turn = script.turn
        if step.answer is not None:
            return reply([], step.answer)
        name = f"transfer_to_{step.handoff}" if step.handoff else str(step.tool)
        return reply([{"name": name, "args": step.arguments or {}, "id": f"call_{turn}"}])

    def fanned(messages: list[Any]) -> AIMessage:
        """A fan-out's turns, from what each agent is sent: workers run at once, in any order."""
        last = messages[-1]
        if isinstance(last, ToolMessage):  # a worker's lookup came back: it reports
            return reply([], str(last.content))
        if isinstance(last, HumanMessage) and str(last.content).startswith("item-"):
            item = str(last.content)
            return reply([{"name": "lookup", "args": {"item": item}, "id": f"call_{item}"}])
        with lock:
            script.next_step()  # the supervisor's one turn: every handoff at once
        return reply([
            {"name": f"transfer_to_{agent}", "args": {"item": item}, "id": f"call_{item}"}
            for agent, item in fan_out
        ])  # fmt: skip

    class ScriptedChatModel(BaseChatModel):
        @property
        def _llm_type(self) -> str:
            return "scripted"

        def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
            return self  # the script already knows which tools it calls

        def _generate(self, messages: Any, stop: Any = None, run_manager: Any = None,
                      **kwargs: Any) -> ChatResult:  # fmt: skip
            message = fanned(messages) if fan_out else scripted()
            return ChatResult(generations=[ChatGeneration(message=message)])

    @tool(description="Look an item up.")
    def lookup(item: str) -> str:
        return f"{item}: 40 USD" if fan_out else script.result("lookup", {"item": item})

    @tool(description="Refund an invoice.")
    def issue_refund(invoice: str) -> str:
        return script.result("issue_refund", {"invoice": invoice})

    model = ScriptedChatModel()
    workers = [
        create_react_agent(model, [lookup, issue_refund], name=name)
        for name in ("worker_a", "worker_b")
    ]
    user = {"messages": [("user", "I was charged twice.")]}
    config: Any = {"recursion_limit": 1000}
    if fan_out:
        fan_out_graph(create_react_agent(model, [], name="supervisor"), workers).invoke(
            user, config
        )
    else:
        create_supervisor(workers, model=model).compile().invoke(user, config)
    return script


def fan_out_graph(supervisor: Any, workers: list[Any]) -> Any:
    """A supervisor whose handoffs are sent to the workers at once (LangGraph's `Send`): each
    handoff call starts a run of its worker on its item. langgraph-supervisor's own parallel
    handoffs run only one of them (langgraph-supervisor 0.0.31 on langgraph 1.2)."""
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.types import Send

    def hand_out(state: dict[str, Any]) -> list[Any]:
        calls = getattr(state["messages"][-1], "tool_calls", [])
        return [
            Send(
                call["name"].removeprefix("transfer_to_"),
                {"messages": [("user", call["args"]["item"])]},
            )
            for call in calls
        ]

    builder = StateGraph(MessagesState)
    builder.add_node("supervisor", supervisor)
    for worker in workers:
        builder.add_node(worker.name, worker)
        builder.add_edge(worker.name, END)
    builder.add_edge(START, "supervisor")
    builder.add_conditional_edges("supervisor", hand_out, [worker.name for worker in workers])
    return builder.compile()


def instrument_langgraph(instrumentation: str, provider: Any) -> None:
    if instrumentation == "openinference":
        from openinference.instrumentation.langchain import LangChainInstrumentor

        LangChainInstrumentor().instrument(tracer_provider=provider)
    else:
        from opentelemetry.instrumentation.langchain import LangchainInstrumentor

        LangchainInstrumentor().instrument(tracer_provider=provider)


# -- Google ADK ------------------------------------------------------------------------------


def run_google_adk(steps: list[Step]) -> Script:
    """ADK LlmAgents under InMemoryRunner over one scripted BaseLlm: sub-agents for transfers
    (triage -> billing, refunds), agents as tools (AgentTool) for delegation (a0 -> a1 -> ...)."""
    from google.adk.agents import LlmAgent
    from google.adk.runners import InMemoryRunner
    from google.adk.tools.agent_tool import AgentTool

    from tests.support.instrumented_agents import run_adk_turn

    script = Script(steps)

    def lookup(item: str) -> str:
        """Look an item up."""
        return script.result("lookup", {"item": item})

    def issue_refund(invoice: str) -> str:
        """Refund an invoice."""
        return script.result("issue_refund", {"invoice": invoice})

    def agent(name: str, tools: list[Any], sub_agents: list[Any] | None = None) -> Any:
        return LlmAgent(
            name=name, model=scripted_adk_llm(script), description=f"The {name} agent.",
            tools=tools, sub_agents=sub_agents or [],
        )  # fmt: skip

    if any(step.handoff for step in steps):
        helpers = [agent(name, [lookup, issue_refund]) for name in ("billing", "refunds")]
        root = agent("triage", [lookup, issue_refund], helpers)
    else:
        # a0 calls a1 as a tool, a1 calls a2, ...: as deep as the scenario delegates.
        depth = sum(1 for step in steps if str(step.tool).removeprefix("a").isdigit())
        root = agent(f"a{depth}", [lookup])
        for level in range(depth - 1, -1, -1):
            root = agent(f"a{level}", [AgentTool(root)])
    run_adk_turn(InMemoryRunner(agent=root, app_name="support"), "I was charged twice.")
    return script


def instrument_global(instrumentation: str, provider: Any) -> None:
    """ADK traces through the global provider (its tracer is made there)."""
    from opentelemetry import trace

    trace.set_tracer_provider(provider)


# -- A2A -------------------------------------------------------------------------------------

A2A_HOPS = 8  # A2A calls between the two services before one of them answers
A2A_MESSAGE = "I was charged twice."
A2A_SERVICES = ("triage", "billing")


def serve_a2a(name: str, port: int, peer_port: int, out: Path, propagate: bool) -> None:
    """One agent service speaking A2A (a2a-sdk, JSON-RPC over HTTP on localhost) in this
    process, traced by a2a-sdk's own spans (and, with `propagate`, OpenTelemetry's ASGI and
    httpx instrumentations, which carry the trace context between services). On each of its
    first A2A_HOPS / 2 requests it asks its peer the same question, then it answers; its spans
    are written to `out` when it stops (SIGINT)."""
    from a2a.helpers.proto_helpers import new_text_message
    from a2a.server.agent_execution import AgentExecutor
    from a2a.server.request_handlers import DefaultRequestHandler
    from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
    from a2a.server.tasks import InMemoryTaskStore
    from a2a.types import AgentCapabilities, AgentCard, AgentInterface, AgentSkill
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from starlette.applications import Starlette

    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": f"{name}-service"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)  # a2a-sdk traces through the global provider
    if propagate:
        from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor

        HTTPXClientInstrumentor().instrument(tracer_provider=provider)
    asked = 0

    class Agent(AgentExecutor):
        async def execute(self, context: Any, event_queue: Any) -> None:
            nonlocal asked
            asked += 1
            text = "Nothing to add."
            if asked <= A2A_HOPS // 2:
                text = await ask_a2a(f"http://127.0.0.1:{peer_port}", A2A_MESSAGE)
            await event_queue.enqueue_event(new_text_message(text))

        async def cancel(self, context: Any, event_queue: Any) -> None:
            pass

    url = f"http://127.0.0.1:{port}"
    card = AgentCard(
        name=name, description=f"The {name} agent.", version="1.0",
        supported_interfaces=[
            AgentInterface(protocol_binding="JSONRPC", url=url + "/", protocol_version="1.0")
        ],
        capabilities=AgentCapabilities(), default_input_modes=["text"],
        default_output_modes=["text"],
        skills=[AgentSkill(id=name, name=name, description=f"{name} questions", tags=[name])],
    )  # fmt: skip
    handler = DefaultRequestHandler(
        agent_executor=Agent(), task_store=InMemoryTaskStore(), agent_card=card
    )
    app: Any = Starlette(
        routes=[*create_agent_card_routes(card), *create_jsonrpc_routes(handler, rpc_url="/")]
    )
    if propagate:
        from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

        app = OpenTelemetryMiddleware(app, tracer_provider=provider)
    serve_until_stopped(app, port, provider, exporter, out)


def serve_until_stopped(app: Any, port: int, provider: Any, exporter: Any, out: Path) -> None:
    """Serve `app` on localhost until SIGINT, then write the spans it traced to `out`."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    try:
        server.run()
    except KeyboardInterrupt:
        pass  # uvicorn raises the SIGINT it stopped on again once it has stopped
    finally:
        provider.force_flush()
        write_request(exporter.get_finished_spans(), out)


async def ask_a2a(url: str, text: str) -> str:
    """Send `text` to the A2A agent at `url`; its answer's text."""
    from a2a.client import create_client
    from a2a.helpers.proto_helpers import get_message_text, new_text_message
    from a2a.types import SendMessageRequest

    client = await create_client(url)
    answer = ""
    async for event in client.send_message(SendMessageRequest(message=new_text_message(text))):
        if event.HasField("message"):
            answer = get_message_text(event.message)
    return answer


def run_a2a(variant: str, out: Path) -> Path:
    """The two services in processes of their own on localhost; triage's agent asks billing,
    which asks triage back, and so on A2A_HOPS times. Both services' spans, one request."""
    import tempfile

    ports = free_ports(len(A2A_SERVICES))
    with tempfile.TemporaryDirectory() as scratch:
        commands = [
            [sys.executable, "-m", MODULE, "--a2a-serve", name, str(ports[index]),
             str(ports[1 - index]), f"{scratch}/{name}.json.gz", variant]
            for index, name in enumerate(A2A_SERVICES)
        ]  # fmt: skip
        with running(commands, ports):
            asyncio.run(ask_a2a(f"http://127.0.0.1:{ports[1]}", A2A_MESSAGE))
        return merge_requests([Path(scratch) / f"{name}.json.gz" for name in A2A_SERVICES], out)


def merge_requests(paths: list[Path], out: Path) -> Path:
    """One OTLP/JSON request holding every resource of the requests at `paths`."""
    resources = []
    for path in paths:
        resources.extend(json.loads(gzip.decompress(path.read_bytes()))["resourceSpans"])
    out.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps({"resourceSpans": resources}, separators=(",", ":")) + "\n").encode()
    with out.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as file:
        file.write(line)
    return out


A2A_VARIANTS = {
    # a2a-sdk's own spans only: each service's spans are traces of their own
    "sdk": False,
    # and OpenTelemetry's httpx (client) and ASGI (server) instrumentations, which carry the
    # W3C trace context from one service to the other
    "propagated": True,
}


# -- Google ADK agents talking A2A -----------------------------------------------------------

# Each agent a service of its own, Google ADK's A2A support on both sides: `to_a2a(agent)`
# serves an LlmAgent, a `RemoteA2aAgent` is the sub-agent an agent transfers to in order to call
# another service. The steps of each agent, by scenario; "host" is the agent the user talks to,
# in a process of its own, the others each a service.
ADK_A2A = "google_adk_a2a"
ADK_A2A_HOST = "host"
ADK_A2A_SCENARIOS: dict[str, dict[str, list[Step]]] = {
    # The host hands the task to billing, which answers that it is triage's; triage answers
    # that it is billing's ...: sequential A2A requests, each ended before the next, 8 handoffs.
    "routing_pingpong": {
        ADK_A2A_HOST: [Step(handoff="billing"), Step(handoff="triage")] * 4,
        "billing": [answer("Not a billing question: ask triage.")] * 4,
        "triage": [answer("A charge: ask billing.")] * 4,
    },
    # Nested: each service transfers to the other before answering, A2A_HOPS times, each
    # request open until the innermost answers.
    "pingpong": {
        ADK_A2A_HOST: [Step(handoff="billing")],
        "billing": [Step(handoff="triage")] * (A2A_HOPS // 2),
        "triage": [Step(handoff="billing")] * (A2A_HOPS // 2),
    },
    # A healthy routing: the host hands each turn to another service, which answers.
    "routing_chain": {
        ADK_A2A_HOST: [Step(handoff="billing"), Step(handoff="refunds"), Step(handoff="shipping")],
        "billing": [answer("inv-1 was charged twice: refunds can return one.")],
        "refunds": [answer("Refund r-1 issued: shipping holds the order.")],
        "shipping": [answer("The order ships tomorrow.")],
    },
    # A healthy chain: billing looks the invoice up and hands to refunds, which refunds it.
    "handoff_chain": {
        ADK_A2A_HOST: [Step(handoff="billing")],
        "billing": [lookup("inv-1"), Step(handoff="refunds")],
        "refunds": [
            Step(tool="issue_refund", arguments={"invoice": "inv-1"}, result="refund r-1 issued")
        ],
    },
}


def adk_a2a_agent(name: str, steps: list[Step], ports: dict[str, int]) -> tuple[Any, Script]:
    """The LlmAgent `name` over its scripted model: tools `lookup` and `issue_refund`, and a
    RemoteA2aAgent sub-agent for each agent its steps hand to (at its service's port)."""
    from google.adk.a2a.agent import RemoteA2aAgent
    from google.adk.agents import LlmAgent

    script = Script(steps)

    def lookup(item: str) -> str:
        """Look an item up."""
        return script.result("lookup", {"item": item})

    def issue_refund(invoice: str) -> str:
        """Refund an invoice."""
        return script.result("issue_refund", {"invoice": invoice})

    peers = dict.fromkeys(step.handoff for step in steps if step.handoff)
    remotes = [
        RemoteA2aAgent(
            name=peer, description=f"The {peer} agent.",
            agent_card=f"http://127.0.0.1:{ports[peer]}/.well-known/agent-card.json",
        )
        for peer in peers
        if peer is not None
    ]  # fmt: skip
    agent = LlmAgent(
        name=name, model=scripted_adk_llm(script), description=f"The {name} agent.",
        tools=[lookup, issue_refund], sub_agents=remotes,
    )  # fmt: skip
    return agent, script


def scripted_adk_llm(script: Script) -> Any:
    """An ADK BaseLlm answering each turn with the script's next step."""
    from google.adk.models.base_llm import BaseLlm
    from google.adk.models.llm_response import LlmResponse
    from google.genai import types

    usage = types.GenerateContentResponseUsageMetadata(
        prompt_token_count=120, candidates_token_count=20, total_token_count=140
    )

    class ScriptedLlm(BaseLlm):
        async def generate_content_async(self, llm_request: Any, stream: bool = False) -> Any:
            step = script.next_step()
            if step.answer is not None:
                part = types.Part(text=step.answer)
            else:
                name, arguments = (
                    ("transfer_to_agent", {"agent_name": step.handoff})
                    if step.handoff
                    else (str(step.tool), step.arguments or {})
                )
                call = types.FunctionCall(name=name, args=arguments, id=f"call_{script.turn}")
                part = types.Part(function_call=call)
            content = types.Content(role="model", parts=[part])
            yield LlmResponse(content=content, usage_metadata=usage)

    return ScriptedLlm(model="scripted")


def propagated() -> bool:
    """Whether the services carry the trace context (ADK_A2A_INSTRUMENTATIONS)."""
    return os.environ.get(A2A_PROPAGATE) != "0"


def traced_service(name: str) -> tuple[Any, Any]:
    """This process's tracer provider (global: ADK and a2a-sdk trace through it) and its
    in-memory exporter; OpenTelemetry's httpx instrumentation carries the trace context out
    on each A2A request (unless not propagated())."""
    from opentelemetry import trace
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": f"{name}-service"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    if propagated():
        HTTPXClientInstrumentor().instrument(tracer_provider=provider)
    return provider, exporter


def serve_adk_a2a(name: str, scenario: str, ports: dict[str, int], out: Path) -> None:
    """Agent `name` of `scenario` served by ADK's `to_a2a` on its port, under OpenTelemetry's
    ASGI instrumentation (the trace context of each request comes in); its spans are written
    to `out` when it stops (SIGINT)."""
    from google.adk.a2a.utils.agent_to_a2a import to_a2a
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

    provider, exporter = traced_service(name)
    agent, script = adk_a2a_agent(name, ADK_A2A_SCENARIOS[scenario][name], ports)
    port = ports[name]
    app: Any = to_a2a(agent, host="127.0.0.1", port=port)
    if propagated():
        app = OpenTelemetryMiddleware(app, tracer_provider=provider)
    serve_until_stopped(app, port, provider, exporter, out)
    if not script.done():
        raise RuntimeError(f"{ADK_A2A}/{scenario}: {name} stopped at step {script.turn}")


def run_adk_a2a_host(scenario: str, ports: dict[str, int], out: Path) -> None:
    """The host agent in this process, one user request handled in one span: a turn per
    handoff (a transfer to a remote agent ends the turn with that agent's answer, which is
    the host's next input) until its script is done; its spans written to `out`."""
    from google.adk.runners import InMemoryRunner
    from google.genai import types
    from opentelemetry import trace

    provider, exporter = traced_service(ADK_A2A_HOST)
    agent, script = adk_a2a_agent(ADK_A2A_HOST, ADK_A2A_SCENARIOS[scenario][ADK_A2A_HOST], ports)
    runner = InMemoryRunner(agent=agent, app_name="support")

    async def turns() -> None:
        session = await runner.session_service.create_session(app_name="support", user_id="u")
        text = A2A_MESSAGE
        while not script.done():
            message = types.Content(role="user", parts=[types.Part(text=text)])
            async for event in runner.run_async(
                user_id="u", session_id=session.id, new_message=message
            ):
                parts = event.content.parts if event.content and event.content.parts else []
                text = next((p.text for p in parts if p.text and not p.thought), text)

    with trace.get_tracer(MODULE).start_as_current_span("support request"):
        asyncio.run(turns())
    provider.force_flush()
    write_request(exporter.get_finished_spans(), out)


def run_adk_a2a(scenario: str, out: Path) -> Path:
    """Every agent of `scenario` but the host as a service in a process of its own on
    localhost, the host in this one; the spans of the host's trace, from every service."""
    import tempfile

    names = [name for name in ADK_A2A_SCENARIOS[scenario] if name != ADK_A2A_HOST]
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    with tempfile.TemporaryDirectory() as scratch:
        files = [Path(scratch) / f"{name}.json.gz" for name in (ADK_A2A_HOST, *names)]
        commands = [
            [sys.executable, "-m", MODULE, "--adk-a2a-serve", name, scenario, json.dumps(ports),
             str(path)]
            for name, path in zip(names, files[1:], strict=True)
        ]  # fmt: skip
        with running(commands, ports.values()):
            run_adk_a2a_host(scenario, ports, files[0])
        return merge_by_end(files, out)


def free_ports(count: int) -> list[int]:
    import socket

    sockets = [socket.socket() for _ in range(count)]
    try:
        for free in sockets:
            free.bind(("127.0.0.1", 0))
        return [free.getsockname()[1] for free in sockets]
    finally:
        for free in sockets:
            free.close()


@contextlib.contextmanager
def running(commands: list[list[str]], ports: Any) -> Iterator[None]:
    """The services started by `commands`, up once each answers on its port (its agent
    card), stopped by SIGINT after the block; a service that failed fails the block."""
    import signal
    import time

    import httpx

    servers = [subprocess.Popen(command, cwd=ROOT) for command in commands]
    try:
        for port in ports:
            for _ in range(600):
                try:
                    httpx.get(f"http://127.0.0.1:{port}/.well-known/agent-card.json")
                    break
                except httpx.TransportError:
                    time.sleep(0.05)
        yield
    finally:
        for server in servers:
            server.send_signal(signal.SIGINT)
        codes = [server.wait(timeout=60) for server in servers]
    if any(codes):
        raise RuntimeError(f"a service failed: exit codes {codes}")


def merge_by_end(paths: list[Path], out: Path) -> Path:
    """One OTLP/JSON request of every service's spans in the order they ended, as the worker
    gets them from services exporting spans as they end (a resource entry for each run of
    spans from one service): of the first request's traces (the host's: the probes each
    service answered before are traces of their own, under the ASGI instrumentation), or all
    where the trace context is not carried."""
    ended = []
    traces = set()
    for path in paths:
        for resource in json.loads(gzip.decompress(path.read_bytes()))["resourceSpans"]:
            for scope in resource["scopeSpans"]:
                for span in scope["spans"]:
                    ended.append((int(span["endTimeUnixNano"]), resource["resource"], scope, span))
                    if path == paths[0] or not propagated():
                        traces.add(span["traceId"])
    entries: list[dict[str, Any]] = []
    for _end, resource, scope, span in sorted(ended, key=lambda item: item[0]):
        if span["traceId"] not in traces:
            continue
        if not entries or entries[-1]["resource"] is not resource:
            entries.append({"resource": resource, "scopeSpans": []})
        scopes = entries[-1]["scopeSpans"]
        if not scopes or scopes[-1]["scope"] != scope["scope"]:
            scopes.append({"scope": scope["scope"], "spans": []})
        scopes[-1]["spans"].append(span)
    out.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps({"resourceSpans": entries}, separators=(",", ":")) + "\n").encode()
    with out.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as file:
        file.write(line)
    return out


# -- the frameworks --------------------------------------------------------------------------


@dataclass(frozen=True)
class Framework:
    name: str
    # instrumentation -> the environment it runs with (content capture on or off)
    instrumentations: dict[str, dict[str, str]]
    scenarios: dict[str, list[Step]]
    instrument: Callable[[str, Any], None]
    run: Callable[[list[Step]], Script]
    side_venv: str | None = None  # the instrumented_agents library whose virtualenv runs it


ADK_CAPTURE = {"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "SPAN_ONLY"}
# Google ADK agents over A2A, with content captured (a transfer names its agent) or not: the
# trace context carried between the services by OpenTelemetry's httpx and ASGI
# instrumentations, or not (ADK carries none of its own: each request a service answers is
# then a trace of its own)
A2A_PROPAGATE = "SPANGUARD_FIXTURE_A2A_PROPAGATE"
ADK_A2A_INSTRUMENTATIONS = {
    "capture": ADK_CAPTURE,
    "off": {},  # ADK 2.x's default: a transfer's arguments not recorded
    "unpropagated": {**ADK_CAPTURE, A2A_PROPAGATE: "0"},
    "unpropagated_off": {A2A_PROPAGATE: "0"},  # ADK's defaults, no HTTP instrumentation
}
FRAMEWORKS: dict[str, Framework] = {
    framework.name: framework
    for framework in (
        Framework(
            "langgraph",
            {"openinference": {}, "openllmetry": {"TRACELOOP_TRACE_CONTENT": "true"}},
            LANGGRAPH_SCENARIOS,
            instrument_langgraph,
            run_langgraph,
        ),
        Framework(
            "google_adk",
            {"capture": ADK_CAPTURE, "off": {}},  # off: ADK 2.x's default, no content
            ADK_SCENARIOS,
            instrument_global,
            run_google_adk,
            side_venv="google-adk",
        ),
    )
}


def write_request(spans: Any, path: Path) -> None:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from spanguard.schemas.otlp import encode_json_line

    path.parent.mkdir(parents=True, exist_ok=True)
    line = (encode_json_line(encode_spans(spans)) + "\n").encode()
    with path.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as file:
        file.write(line)


def generate_one(framework: Framework, instrumentation: str, out: Path) -> list[Path]:
    """Every scenario of `framework` under one instrumentation, in this process."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    framework.instrument(instrumentation, provider)
    written = []
    for scenario, steps in framework.scenarios.items():
        exporter.clear()
        script = framework.run(steps)
        provider.force_flush()
        if not script.done():
            raise RuntimeError(f"{framework.name}/{scenario}: stopped at step {script.turn}")
        # Only the run's trace: OpenLLMetry adds a `create_agent` trace per agent built.
        spans = exporter.get_finished_spans()
        runs = [
            span for span in spans if span.attributes.get("gen_ai.operation.name") != "create_agent"
        ]
        path = out / framework.name / instrumentation / f"{scenario}.json.gz"
        write_request(runs, path)
        written.append(path)
    return written


def python_for(framework: Framework) -> str:
    if framework.side_venv is None:
        return sys.executable
    from tests.support.instrumented_agents import LIBRARIES, installed, use_this_checkout

    library = LIBRARIES[framework.side_venv]
    if not installed(library):
        raise RuntimeError(
            f"{framework.name} runs in {library.python}: make it with "
            f"`python -m tests.support.instrumented_agents --venv {framework.side_venv}`"
        )
    use_this_checkout(library)
    return library.python


A2A = "a2a"
A2A_SCENARIO = "pingpong"
# VoltAgent (TypeScript): a supervisor and its sub-agents (`subAgents`, reached by its
# `delegate_task` tool) under VoltAgent's own observability, made by node from
# tests/support/ts_agents/voltagent/multi.mjs (its scenarios are written there); one variant:
# VoltAgent records content whatever is set.
VOLTAGENT = "voltagent"
VOLTAGENT_VARIANT = "capture"
VOLTAGENT_SCENARIOS = (
    "handoff_pingpong",
    "handoff_chain",
    "handoff_with_work",
    "fan_out_50",
    "fan_out_5",
    "delegation_depth_6",
    "delegation_depth_2",
    "linked_runs_repeat",
    "linked_runs_with_work",
)
VOLTAGENT_AGENTS = ROOT / "tests" / "support" / "ts_agents" / "voltagent"


def run_voltagent(out: Path) -> None:
    """Every VoltAgent scenario, into out/<scenario>.json.gz (`npm ci` first if never done)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        raise RuntimeError("the VoltAgent fixtures need node (>= 20) and npm on PATH")
    if not (VOLTAGENT_AGENTS / "node_modules").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=VOLTAGENT_AGENTS, check=True)
    subprocess.run(["node", "multi.mjs", "--out", str(out)], cwd=VOLTAGENT_AGENTS, check=True)


def generate(names: list[str], out: Path) -> None:
    """Each (framework, instrumentation) in a fresh interpreter."""
    for name in names:
        if name == A2A:
            for variant in A2A_VARIANTS:
                run_a2a(variant, out / A2A / variant / f"{A2A_SCENARIO}.json.gz")
            continue
        if name == VOLTAGENT:
            run_voltagent(out / VOLTAGENT / VOLTAGENT_VARIANT)
            continue
        if name == ADK_A2A:
            python = python_for(FRAMEWORKS["google_adk"])
            for instrumentation, environment in ADK_A2A_INSTRUMENTATIONS.items():
                env = {**os.environ, **environment}
                for scenario in ADK_A2A_SCENARIOS:
                    path = out / ADK_A2A / instrumentation / f"{scenario}.json.gz"
                    command = [python, "-m", MODULE, "--adk-a2a", scenario, str(path)]
                    subprocess.run(command, env=env, check=True, cwd=ROOT)
            continue
        framework = FRAMEWORKS[name]
        python = python_for(framework)
        for instrumentation, environment in framework.instrumentations.items():
            env = {**os.environ, **environment}
            command = [python, "-m", MODULE, "--one", name, instrumentation, "--out", str(out)]
            subprocess.run(command, env=env, check=True, cwd=ROOT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "frameworks",
        nargs="*",
        help=f"default: all ({', '.join(FRAMEWORKS)}, {A2A}, {ADK_A2A}, {VOLTAGENT})",
    )
    parser.add_argument("--out", type=Path, default=FIXTURES)
    parser.add_argument("--one", nargs=2, metavar=("FRAMEWORK", "INSTRUMENTATION"),
                        help=argparse.SUPPRESS)  # fmt: skip
    parser.add_argument("--a2a-serve", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--adk-a2a", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--adk-a2a-serve", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.adk_a2a_serve:
        name, scenario, ports, path = args.adk_a2a_serve
        serve_adk_a2a(name, scenario, json.loads(ports), Path(path))
        return 0
    if args.adk_a2a:
        scenario, path = args.adk_a2a
        print(run_adk_a2a(scenario, Path(path)))
        return 0
    if args.a2a_serve:
        name, port, peer_port, path, variant = args.a2a_serve
        serve_a2a(name, int(port), int(peer_port), Path(path), A2A_VARIANTS[variant])
        return 0
    if args.one:
        name, instrumentation = args.one
        for path in generate_one(FRAMEWORKS[name], instrumentation, args.out):
            print(path.relative_to(args.out))
        return 0
    unknown = set(args.frameworks) - {*FRAMEWORKS, A2A, ADK_A2A, VOLTAGENT}
    if unknown:
        parser.error(f"unknown frameworks: {', '.join(sorted(unknown))}")
    generate(args.frameworks or [*FRAMEWORKS, A2A, ADK_A2A, VOLTAGENT], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
