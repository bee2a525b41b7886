"""Span fixtures of agents handing a run to each other, made by the real OpenAI Agents SDK and
its two instrumentations (OpenInference's and OpenTelemetry's), from scripted models.

The scripted model answers each turn, whichever agent asks, with the scenario's next step: a
handoff (the SDK's `transfer_to_<agent>` tool), a tool call, or the final answer. The spans
are written as OTLP/JSON, the format `spanguard replay` reads:

    tests/fixtures/multi_agent/<instrumentation>/<scenario>.json.gz

    python -m tests.support.multi_agents              # both instrumentations
    python -m tests.support.multi_agents --out DIR    # elsewhere

Each instrumentation runs in a process of its own (instrumentors patch the SDK globally).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import subprocess
import sys
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "multi_agent"
SERVICE = "scripted-multi-agent"
AGENTS = ("triage", "billing", "refunds", "shipping")
INSTRUMENTATIONS = ("openinference", "opentelemetry")


@dataclass(frozen=True)
class Step:
    """One model turn: hand the run to `handoff`, call `tool` (with its result), or answer
    (neither: the answer `result`, which ends the asking agent's run)."""

    handoff: str | None = None
    tool: str | None = None
    arguments: dict[str, Any] | None = None
    result: str = "Done."


def work(invoice: str) -> Step:
    return Step(tool="lookup_invoice", arguments={"invoice": invoice}, result=f"{invoice}: 40 USD")


def ask(agent: str, question: str) -> Step:
    """A call of `agent` as a tool (the SDK's `Agent.as_tool`, named `ask_<agent>`)."""
    return Step(tool=f"ask_{agent}", arguments={"input": question})


def answer(text: str) -> Step:
    return Step(result=text)


LEVELS = tuple(f"level_{depth}" for depth in range(1, 7))


def fan_out(workers: int) -> list[Step]:
    """A supervisor asking its worker agent (as a tool) about one invoice after another:
    each worker run answers, then the supervisor asks the next, then sums up."""
    steps = []
    for number in range(1, workers + 1):
        steps += [ask("worker", f"invoice inv-{number}"), answer(f"inv-{number}: 40 USD")]
    return [*steps, answer("All invoices checked.")]


SCENARIOS: dict[str, list[Step]] = {
    # Two agents handing the task back and forth with nothing done between.
    "handoff_pingpong": [Step(handoff="billing"), Step(handoff="triage")] * 4,
    # A healthy chain: each agent does its part and hands on to the next.
    "handoff_chain": [
        Step(handoff="billing"),
        work("inv-1"),
        Step(handoff="refunds"),
        Step(tool="issue_refund", arguments={"invoice": "inv-1"}, result="refund r-1 issued"),
        Step(handoff="shipping"),
        Step(tool="create_label", arguments={"order": "o-1"}, result="label l-1"),
    ],
    # Back and forth, but each visit to billing looks up another invoice: work, not a loop.
    "handoff_with_work": [
        step
        for invoice in ("inv-1", "inv-2", "inv-3", "inv-4")
        for step in (Step(handoff="billing"), work(invoice), Step(handoff="triage"))
    ],
    # Agents calling agents as tools, each one deeper: level_1 asks level_2 ... asks level_6;
    # then each answers the one that asked it.
    "delegation_depth_6": [
        *(ask(LEVELS[depth], "what do we owe?") for depth in range(1, 6)),
        *(answer(f"{level}: 40 USD") for level in reversed(LEVELS)),
    ],
    # A supervisor (the SDK's agents-as-tools manager) asking its worker about 50 invoices.
    "supervisor_fan_out_50": fan_out(50),
    # The same supervisor asking about 5: healthy.
    "fan_out_5": fan_out(5),
}
# The agents each scenario calls as tools: {caller: callee}; the first caller starts the run
# (without any: the handoff agents, triage first).
DELEGATES: dict[str, dict[str, str]] = {
    "delegation_depth_6": dict(pairwise(LEVELS)),
    "supervisor_fan_out_50": {"supervisor": "worker"},
    "fan_out_5": {"supervisor": "worker"},
}
# What the guard's default policy decides on each: (rule, action, the span it trips at,
# 1-based in the order they ended among the spans the rule reads: the handoffs for
# handoff_cycle, the agents' own spans for delegation_depth and agent_fan_out), or nothing.
EXPECTED: dict[str, tuple[str, str, int] | None] = {
    "handoff_pingpong": ("handoff_cycle", "kill", 4),
    "handoff_chain": None,
    "handoff_with_work": None,
    # The 6th level's chain is complete when level_1's span ends: the last agent span.
    "delegation_depth_6": ("delegation_depth", "kill", 6),
    # Agent runs beyond the first, over 20: at the 22nd worker's span (the supervisor's
    # ends last).
    "supervisor_fan_out_50": ("agent_fan_out", "kill", 22),
    "fan_out_5": None,
}


def run(steps: list[Step], delegates: dict[str, str] | None = None) -> None:
    """The OpenAI Agents SDK's Runner over four agents that may hand off to each other, or
    over agents calling agents as tools (`delegates`: {caller: callee})."""
    from agents import Agent, FunctionTool, RunConfig, Runner
    from agents.items import ModelResponse
    from agents.models.interface import Model, ModelProvider
    from agents.usage import Usage
    from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage
    from openai.types.responses.response_output_text import ResponseOutputText

    script = iter(enumerate(steps, start=1))

    class ScriptedModel(Model):
        async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
            usage = Usage(requests=1, input_tokens=100, output_tokens=10, total_tokens=110)
            turn, step = next(script, (0, None))
            if step is None or not (step.handoff or step.tool):
                answer = step.result if step is not None else "Done."
                text = ResponseOutputText(annotations=[], text=answer, type="output_text")
                message = ResponseOutputMessage(
                    id="msg_final", content=[text], role="assistant", status="completed",
                    type="message",
                )  # fmt: skip
                return ModelResponse(output=[message], usage=usage, response_id=None)
            name = f"transfer_to_{step.handoff}" if step.handoff else str(step.tool)
            call = ResponseFunctionToolCall(
                arguments=json.dumps(step.arguments or {}), call_id=f"call_{turn}", name=name,
                type="function_call", id=f"fc_{turn}", status="completed",
            )  # fmt: skip
            return ModelResponse(output=[call], usage=usage, response_id=None)

        def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

    class Provider(ModelProvider):
        def get_model(self, model_name: str | None) -> Model:
            return ScriptedModel()

    results = {
        (step.tool, json.dumps(step.arguments, sort_keys=True)): step.result
        for step in steps
        if step.tool
    }

    def tool(name: str) -> Any:
        async def invoke(context: Any, arguments: str) -> str:
            key = (name, json.dumps(json.loads(arguments or "{}"), sort_keys=True))
            return results.get(key, "")

        return FunctionTool(
            name=name, description=f"The {name.replace('_', ' ')} tool.",
            params_json_schema={"type": "object", "properties": {}, "additionalProperties": True},
            on_invoke_tool=invoke, strict_json_schema=False,
        )  # fmt: skip

    tools = [tool(name) for name in ("lookup_invoice", "issue_refund", "create_label")]
    config = RunConfig(model_provider=Provider())
    if delegates:
        names = dict.fromkeys([*delegates, *delegates.values()])
        agents = {name: Agent(name=name, tools=list(tools)) for name in names}
        for caller, callee in delegates.items():
            agents[caller].tools.append(
                agents[callee].as_tool(
                    tool_name=f"ask_{callee}", tool_description=f"Ask the {callee} agent.",
                    run_config=config, max_turns=100,
                )
            )  # fmt: skip
        first = agents[next(iter(delegates))]
    else:
        agents = {name: Agent(name=name, tools=tools) for name in AGENTS}
        for agent in agents.values():
            agent.handoffs = [other for other in agents.values() if other is not agent]
        first = agents["triage"]
    asyncio.run(Runner.run(first, "I was charged twice.", max_turns=200, run_config=config))


def instrument(instrumentation: str, provider: Any) -> None:
    from agents import set_trace_processors

    set_trace_processors([])  # no upload to the platform's trace backend
    if instrumentation == "openinference":
        from openinference.instrumentation.openai_agents import OpenAIAgentsInstrumentor
    else:
        from opentelemetry.instrumentation.openai_agents import (  # type: ignore[no-redef]
            OpenAIAgentsInstrumentor,
        )
    OpenAIAgentsInstrumentor().instrument(tracer_provider=provider)


def generate_one(instrumentation: str, out: Path) -> list[Path]:
    """Every scenario under one instrumentation, in this process."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from spanguard.schemas.otlp import encode_json_line

    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrument(instrumentation, provider)
    folder = out / instrumentation
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for scenario, steps in SCENARIOS.items():
        exporter.clear()
        run(steps, DELEGATES.get(scenario))
        provider.force_flush()
        path = folder / f"{scenario}.json.gz"
        line = (encode_json_line(encode_spans(exporter.get_finished_spans())) + "\n").encode()
        with path.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as file:
            file.write(line)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=FIXTURES)
    parser.add_argument("--one", choices=INSTRUMENTATIONS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        for path in generate_one(args.one, args.out):
            print(path.relative_to(args.out))
        return 0
    for instrumentation in INSTRUMENTATIONS:
        subprocess.run(
            [sys.executable, "-m", "tests.support.multi_agents", "--one", instrumentation,
             "--out", str(args.out)],
            check=True, cwd=ROOT,
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
