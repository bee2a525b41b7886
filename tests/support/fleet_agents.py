"""A fleet of real LangGraph agents sharing one tool, guarded by spanguard's LangChain adapter,
driven wave by wave from a test (tests/killswitch/test_contain_fleet_kafka.py).

Each agent is LangGraph's prebuilt ReAct agent over a scripted chat model, with OpenInference's
LangChain instrumentation exporting through the OpenTelemetry SDK's default BatchSpanProcessor
and OTLP/HTTP exporter (to the Collector), and a KillSwitch of its own on the kill topic. The
model asks the knowledge base (`search_docs`) first. On its answer it answers; on a failure it
gives up; on spanguard's refusal (the tool contained) it asks the other tool (`web_search`) and
answers with that. So a call of the fallback is the agent taking the other path.

The agents run in this process of their own (the instrumentor patches globally), on commands
read from stdin, one JSON object a line, each answered with one JSON line on stdout:

    {"run": "failing"}    every agent runs once at the same time, `search_docs` raising
    {"run": "healthy"}    the same, `search_docs` answering
    {"await": "contained", "timeout": 60}   when each agent's switch refuses `search_docs`
    {"await": "released", "timeout": 60}    when each agent's switch lets it through again

    python -m tests.support.fleet_agents --endpoint URL --kill-topic TOPIC --agents N
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from tests.support import instrumented_agents as agents
from tests.support.guarded_agents import _provider
from tests.support.kafka_harness import BOOTSTRAP
from tests.support.waiting import raises

PRIMARY = "search_docs"
FALLBACK = "web_search"
SERVICE = "fleet-agent"
QUESTION = "What is the refund policy?"
PRIMARY_ANSWER = "Refunds are accepted within 30 days."
FALLBACK_ANSWER = "The web says: refunds within 30 days."
GAVE_UP = "The knowledge base failed; I cannot answer."
CONTAINED = f"tool {PRIMARY} is contained by spanguard"  # how the refusal reads (signals.py)


@dataclass
class Run:
    """One agent's run: the tools that ran, what the model saw of each, and its answer."""

    agent: int
    trace_ids: list[str] = field(default_factory=list)
    ran: list[str] = field(default_factory=list)  # the tools' bodies that executed
    refused: list[str] = field(default_factory=list)  # calls the adapter refused
    answer: str = ""
    error: str | None = None  # the exception the run ended on (a kill would be one)
    started: float = 0.0
    ended: float = 0.0
    fallback_at: float | None = None  # when the fallback tool ran (epoch seconds)


class RecordingSwitch:
    """The agent's KillSwitch, as the adapter's checker, noting the traces it checked."""

    def __init__(self, switch: Any, run: Run | None = None) -> None:
        self.switch = switch
        self.run = run

    def check(self, trace_id: str, **scope: Any) -> str | None:
        if self.run is not None and trace_id not in self.run.trace_ids:
            self.run.trace_ids.append(trace_id)
        return self.switch.check(trace_id, **scope)

    def check_tool(self, tool: str | None, server: str | None = None) -> None:
        if self.run is not None and tool and contained(self.switch, tool):
            self.run.refused.append(tool)
        self.switch.check_tool(tool, server)

    def note_unguarded(self, where: str, what_to_do: str) -> None:
        self.switch.note_unguarded(where, what_to_do)

    def note_late_export(self, where: str, problem: str) -> None:
        self.switch.note_late_export(where, problem)


def scripted_model() -> Any:
    """A chat model that reads the conversation and asks for the next step (see the module's
    docstring): real LangChain model runs, so the instrumentation sees model calls too."""
    from langchain_core.language_models.chat_models import BaseChatModel
    from langchain_core.messages import AIMessage, ToolMessage
    from langchain_core.outputs import ChatGeneration, ChatResult

    def step(messages: list[Any]) -> AIMessage:
        last = messages[-1]
        if not isinstance(last, ToolMessage):
            return _ask(PRIMARY, len(messages))
        if last.name == PRIMARY and last.status == "error":
            if CONTAINED in str(last.content):
                return _ask(FALLBACK, len(messages))
            return AIMessage(GAVE_UP)
        return AIMessage(str(last.content))

    def _ask(tool: str, turn: int) -> AIMessage:
        call = {"name": tool, "args": {"query": QUESTION}, "id": f"call_{turn}"}
        return AIMessage("", tool_calls=[call])

    class FleetModel(BaseChatModel):
        @property
        def _llm_type(self) -> str:
            return "scripted-fleet-model"

        def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
            return self  # the script knows its tools

        def _generate(self, messages: list[Any], stop: Any = None, run_manager: Any = None,
                      **kwargs: Any) -> ChatResult:  # fmt: skip
            return ChatResult(generations=[ChatGeneration(message=step(messages))])

    return FleetModel()


def run_agent(index: int, switch: Any, failing: bool) -> Run:
    """One agent's run, its tools answering (or `search_docs` failing, when `failing`)."""
    from langchain_core.tools import tool
    from langgraph.prebuilt import ToolNode, create_react_agent

    from spanguard.killswitch.adapters_langchain import SpanguardCallbackHandler

    run = Run(index, started=time.time())

    @tool(description="Search the knowledge base.")
    def search_docs(query: str) -> str:
        run.ran.append(PRIMARY)
        if failing:
            raise ConnectionError("docs index: 503 Service Unavailable")
        return PRIMARY_ANSWER

    @tool(description="Search the web.")
    def web_search(query: str) -> str:
        run.ran.append(FALLBACK)
        run.fallback_at = time.time()
        return FALLBACK_ANSWER

    handler = SpanguardCallbackHandler(RecordingSwitch(switch, run))
    tools = ToolNode(
        [search_docs, web_search], wrap_tool_call=handler.wrap_tool_call, handle_tool_errors=True
    )
    agent = create_react_agent(scripted_model(), tools)
    try:
        result = agent.invoke(
            {"messages": [("user", QUESTION)]}, {"callbacks": [handler], "recursion_limit": 20}
        )
        run.answer = str(result["messages"][-1].content)
    except Exception as exc:  # the outcome is reported, whatever it is  # noqa: BLE001
        run.error = f"{type(exc).__name__}: {exc}"
    run.ended = time.time()
    return run


def contained(switch: Any, tool: str = PRIMARY) -> bool:
    from spanguard.killswitch.signals import ToolContained

    return raises(lambda: switch.check_tool(tool), ToolContained)


def await_all(switches: list[Any], wanted: bool, timeout: float) -> list[float | None]:
    """When (epoch seconds) each switch first answered `contained(switch) == wanted`."""
    seen: list[float | None] = [None] * len(switches)
    deadline = time.monotonic() + timeout
    while None in seen and time.monotonic() < deadline:
        for index, switch in enumerate(switches):
            if seen[index] is None and contained(switch) == wanted:
                seen[index] = time.time()
        time.sleep(0.005)
    return seen


def serve(endpoint: str, kill_topic: str, count: int) -> None:
    from spanguard.killswitch.client import KillSwitch

    provider = _provider(endpoint, "sdk-default", SERVICE)
    agents.LIBRARIES["langgraph-openinference"].instrument(provider, "capture")
    # The signing key from SPANGUARD_SIGNING_KEY, as the worker's; acks are not this test's.
    switches = [KillSwitch(BOOTSTRAP, kill_topic, ack_topic=None) for _ in range(count)]
    try:
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            command = json.loads(line)
            if "run" in command:
                failing = [command["run"] == "failing"] * count
                with ThreadPoolExecutor(count) as pool:
                    runs = list(pool.map(run_agent, range(count), switches, failing))
                answer: dict[str, Any] = {"runs": [asdict(run) for run in runs]}
            else:
                wanted = command["await"] == "contained"
                answer = {"seen": await_all(switches, wanted, float(command["timeout"]))}
                answer["received"] = [switch.received for switch in switches]
            print(json.dumps(answer), flush=True)
    finally:
        for switch in switches:
            switch.close()
        provider.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--kill-topic", required=True)
    parser.add_argument("--agents", type=int, default=12)
    args = parser.parse_args(argv)
    serve(args.endpoint, args.kill_topic, args.agents)
    return 0


if __name__ == "__main__":
    sys.exit(main())
