"""The demo's two agents, for real: OpenTelemetry SDK spans over OTLP, a KillSwitch on Kafka.

    python -m spanguard.cli.demo agent research   # 80 distinct tool calls, then a final answer
    python -m spanguard.cli.demo agent support    # its vector index returns nothing: it loops
    python -m spanguard.cli.demo run              # `make demo`: the stack, both agents, the verdict

No LLM is involved: each agent's "model" is a small script that picks its next tool call the
way a real one would (the support agent retries the same search when it comes back empty).
Everything else is real: spans from the SDK with GenAI attributes, exported over OTLP/HTTP to
the Collector, the worker's kill signal read by `KillSwitch`, and `check()` before each call.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from spanguard.config.settings import WorkerSettings

__all__ = ["AgentResult", "main"]

RESEARCH_TOOLS = ("search_web", "fetch_pdf", "summarize", "follow_citation")


@dataclass
class AgentResult:
    agent: str
    status: str  # "finished" | "killed" | "gave_up"
    calls: int
    reason: str | None = None
    trace_id: str | None = None
    # Seconds from the end of the call that tripped the threshold to the signal's arrival.
    kill_latency_s: float | None = None


def _tracer(service: str, endpoint: str) -> tuple[Any, Any]:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    exporter = OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces")
    # A short export delay: a span waiting in the agent is detection latency.
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=50))
    return provider, provider.get_tracer("spanguard.demo")


def run_agent(kind: str, *, endpoint: str, bootstrap: str, kill_topic: str,
              signing_key: bytes | None, step_delay: float, max_calls: int) -> AgentResult:  # fmt: skip
    from spanguard.killswitch import AgentKilled
    from spanguard.killswitch.client import KillSwitch

    service, agent_name = {
        "research": ("research-assistant", "deep-researcher"),
        "support": ("support-bot", "support-agent"),
    }[kind]
    provider, tracer = _tracer(service, endpoint)
    # Signed unless the worker was told otherwise (SPANGUARD_ALLOW_UNSIGNED): the same setting
    # lets this agent obey unsigned signals.
    switch = KillSwitch(
        bootstrap, kill_topic, signing_key=signing_key, allow_unsigned=signing_key is None
    )
    result = AgentResult(agent=agent_name, status="gave_up", calls=0)
    tripped_at: float | None = None
    try:
        with tracer.start_as_current_span(
            f"invoke_agent {agent_name}",
            attributes={"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": agent_name},
        ) as root:
            result.trace_id = format(root.get_span_context().trace_id, "032x")
            for step in range(max_calls if kind == "support" else 80):
                message = switch.check()  # raises AgentKilled
                if message:
                    _say(agent_name, f"downgraded: {message}")
                tool, arguments = _next_call(kind, step)
                _record_step(tracer, step, tool, arguments)
                result.calls += 1
                if kind == "support":
                    _say(
                        agent_name,
                        f"call {result.calls}: {tool}({arguments['query']!r}) -> no results",
                    )
                    if result.calls == 3:  # the default loop.threshold: this call trips it
                        tripped_at = time.monotonic()
                elif result.calls % 10 == 0:
                    _say(
                        agent_name,
                        f"call {result.calls}: {tool} ... ({result.calls} distinct calls)",
                    )
                # The model "thinks" between calls; watch for the signal meanwhile.
                deadline = time.monotonic() + step_delay
                while time.monotonic() < deadline:
                    if (
                        tripped_at is not None
                        and result.kill_latency_s is None
                        and (switch.signals.is_killed(result.trace_id))
                    ):
                        result.kill_latency_s = time.monotonic() - tripped_at
                    time.sleep(0.005)
            if kind == "research":
                result.status = "finished"
                _say(agent_name, f"finished: wrote the memo after {result.calls} calls")
    except AgentKilled as killed:
        result.status, result.reason = "killed", killed.reason
        _say(agent_name, f"KILLED before call {result.calls + 1}: {killed.reason}")
    finally:
        provider.shutdown()
        switch.close()
    return result


def _record_step(tracer: Any, step: int, tool: str, arguments: dict[str, Any]) -> None:
    """One step's spans: the model's chat call, then the tool call it chose."""
    with tracer.start_as_current_span(
        "chat gpt-4o",
        attributes={
            "gen_ai.operation.name": "chat",
            "gen_ai.request.model": "gpt-4o",
            "gen_ai.usage.input_tokens": 800 + 40 * step,
            "gen_ai.usage.output_tokens": 60,
        },
    ):
        pass
    with tracer.start_as_current_span(
        f"execute_tool {tool}",
        attributes={
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": tool,
            "gen_ai.tool.call.id": f"call_{step}",
            "gen_ai.tool.call.arguments": json.dumps(arguments),
        },
    ):
        pass


def _next_call(kind: str, step: int) -> tuple[str, dict[str, Any]]:
    if kind == "support":
        # A stale embedding index: every search is empty, so the agent tries again.
        return "search_docs", {"query": "refund policy", "request_id": f"req-{step}"}
    return RESEARCH_TOOLS[step % len(RESEARCH_TOOLS)], {"query": f"agent loops, angle {step}"}


def _say(agent: str, text: str) -> None:
    print(f"[{agent}] {text}", flush=True)


# -- the whole demo ------------------------------------------------------------------------


def run_demo(root: Path, step_delay: float) -> int:
    stack = root / "scripts" / "stack.sh"
    started = subprocess.run([str(stack), "status"], capture_output=True).returncode != 0
    try:
        if started:
            print("demo: starting the stack (Kafka, topics, Collector, worker)...", flush=True)
            subprocess.run([str(stack), "up"], check=True)
        else:
            print("demo: using the stack that is already running", flush=True)
        results = _run_both_agents(step_delay, _agent_env(stack))
    finally:
        if started:
            print("demo: stopping the stack it started", flush=True)
            subprocess.run([str(stack), "down"], check=False)
    support = results.get("support")
    research = results.get("research")
    ok = (
        support is not None
        and support.status == "killed"
        and research is not None
        and research.status == "finished"
    )
    if support is not None and support.kill_latency_s is not None:
        print(
            f"demo: the kill signal reached the support agent {support.kill_latency_s * 1000:.0f} ms"
            " after its 3rd identical call",
            flush=True,
        )
    summary_support = (
        f"{support.agent} killed after {support.calls} calls ({support.reason})"
        if support and support.status == "killed"
        else f"support-agent NOT killed ({support.status if support else 'no result'})"
    )
    summary_research = (
        f"{research.agent} finished {research.calls} calls"
        if research and research.status == "finished"
        else f"deep-researcher did NOT finish ({research.status if research else 'no result'})"
    )
    print(f"demo: {summary_support}; {summary_research}", flush=True)
    return 0 if ok else 1


def _agent_env(stack: Path) -> dict[str, str]:
    """The agents trust the worker's key: the one given in the environment, else the stack's
    own (scripts/stack.sh key-file)."""
    env = dict(os.environ)
    if not (env.get("SPANGUARD_SIGNING_KEY") or env.get("SPANGUARD_SIGNING_KEY_FILE")):
        key_file = subprocess.run(
            [str(stack), "key-file"], capture_output=True, text=True, check=True
        ).stdout.strip()
        env["SPANGUARD_SIGNING_KEY_FILE"] = key_file
    return env


def _run_both_agents(step_delay: float, env: dict[str, str]) -> dict[str, AgentResult]:
    results: dict[str, AgentResult] = {}

    def one(kind: str) -> None:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "spanguard.cli.demo",
                "agent",
                kind,
                "--step-delay",
                str(step_delay),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("{"):
                results[kind] = AgentResult(**json.loads(line))
            else:
                print(line, end="", flush=True)
        process.wait()

    threads = [threading.Thread(target=one, args=(kind,)) for kind in ("research", "support")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spanguard.cli.demo", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    agent = commands.add_parser("agent", help="run one demo agent")
    agent.add_argument("kind", choices=["research", "support"])
    agent.add_argument(
        "--otlp-endpoint",
        default=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318"),
    )
    # The worker's own settings (flags aside): the agents read the signals it writes.
    worker = WorkerSettings.from_sources({})
    agent.add_argument("--bootstrap", default=worker.bootstrap)
    agent.add_argument("--kill-topic", default=worker.kill_topic)
    agent.add_argument("--step-delay", type=float, default=0.3, help="seconds the model 'thinks'")
    agent.add_argument("--max-calls", type=int, default=40, help="the support agent's give-up")
    run = commands.add_parser("run", help="the whole demo (what `make demo` runs)")
    run.add_argument("--step-delay", type=float, default=0.3)
    args = parser.parse_args(argv)

    if args.command == "run":
        return run_demo(Path(__file__).resolve().parent.parent, args.step_delay)
    from spanguard.errors import KafkaConnectError, KafkaSecurityError

    try:
        result = run_agent(
            args.kind,
            endpoint=args.otlp_endpoint,
            bootstrap=args.bootstrap,
            kill_topic=args.kill_topic,
            signing_key=worker.kill_signing_key(),
            step_delay=args.step_delay,
            max_calls=args.max_calls,
        )
    except KafkaSecurityError as exc:  # SPANGUARD_KAFKA_* settings that cannot work together
        print(f"spanguard.cli.demo: bad setting: {exc}", file=sys.stderr)
        return 2
    except KafkaConnectError as exc:  # the killswitch could not reach or enter the cluster
        print(f"spanguard.cli.demo: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(asdict(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
