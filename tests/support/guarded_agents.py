"""Real agents guarded by spanguard's adapters, against the real stack.

Each row is a framework with its instrumentation (tests/support/instrumented_agents.py: the
same scripted agents the span fixtures come from) and spanguard's adapter for the framework.
The agent exports OTLP/HTTP to the real Collector, whose kafka exporter feeds the default
`spanguard worker`; the agent's `KillSwitch` reads the worker's signals with the key it reads
from SPANGUARD_SIGNING_KEY_FILE (the stack's own key file, made by `scripts/stack.sh key-file`).

    python -m tests.support.guarded_agents matrix     # every row: calls before the stop, latency
    python -m tests.support.guarded_agents export     # calls before the stop per step time: the
                                                      # SDK's defaults without the adapter's prompt
                                                      # export, with it, and PromptBatchSpanProcessor

Every agent runs in a process of its own (`run` below): instrumentors patch globally.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.support import instrumented_agents as agents
from tests.support.kafka_harness import (
    BOOTSTRAP,
    ROOT,
    Topics,
    WorkerProcess,
    collector_env,
    ensure_broker,
)

MODULE = "tests.support.guarded_agents"
LOOP_CALLS = 15  # the stuck agent's script: the same search, again and again
TRIPS_AT = 3  # the default policy's tool_loop threshold
STEP_DELAY = 0.3  # seconds the scripted model "thinks" per turn

# row -> (its instrumented_agents library, the exception the agent's code sees when the kill
# is caught before a tool call: AgentKilled, or the framework's own with AgentKilled as its
# cause; a kill caught before a model call is AgentKilled itself everywhere but ADK)
ROWS: dict[str, tuple[str, str]] = {
    "langgraph+openinference": ("langgraph-openinference", "AgentKilled"),
    "langgraph+openllmetry": ("langgraph-openllmetry", "AgentKilled"),
    # "Error running tool ...".
    "openai-agents+openinference": ("openai-agents-openinference", "UserError"),
    "openai-agents+otel-bridge": ("openai-agents-otel", "UserError"),
    "pydantic-ai": ("pydantic-ai", "AgentKilled"),
    "smolagents+openinference": ("smolagents-openinference", "AgentKilled"),
    "llama-index+openinference": ("llama-index-openinference", "AgentKilled"),
    # Their OpenTelemetry pins exclude this project's SDK: virtualenvs of their own
    # (`python -m tests.support.instrumented_agents --venv google-adk`).
    "google-adk": ("google-adk", "RuntimeError"),  # "Error in plugin 'spanguard' ..."
    "strands": ("strands", "EventLoopException"),
}
# "sdk-default": the plain BatchSpanProcessor (5 s) + OTLP exporter, as a user sets it up; the
# adapters alone must make it prompt. "prompt": PromptBatchSpanProcessor, installed by hand.
# "sdk-unhelped": the SDK's defaults with the adapter's prompt export switched off, as every
# adapter was before issue 42 (for the `export` table only).
EXPORTS = ("sdk-default", "prompt", "sdk-unhelped")


@dataclass
class Outcome:
    row: str
    scenario: str
    export: str
    step_delay: float
    status: str = "finished"  # "finished" | "killed" | "error"
    calls: int = 0
    exception: list[str] = field(default_factory=list)  # the type, then its causes
    trace_ids: list[str] = field(default_factory=list)
    # Seconds from the end of the call that tripped the rule to the signal in the agent's book.
    stop_latency_s: float | None = None
    unguarded: int = 0
    late_export: int = 0  # checks whose spans the adapter could not make leave in time
    # The spanguard.stop event on the agent's spans (exported in-process too): its action.
    stop_event: str | None = None


# -- one agent, in its own process ---------------------------------------------------------


class PacedScript(agents.Script):
    """The scenario's script, with a model that thinks `step_delay` seconds a turn and the
    time each tool call ended."""

    def __init__(self, calls: list[agents.Call], step_delay: float) -> None:
        super().__init__(calls)
        self.step_delay = step_delay
        self.call_times: list[float] = []

    def next_call(self) -> agents.Call | None:
        time.sleep(self.step_delay)
        return super().next_call()

    def result(self) -> str:
        self.call_times.append(time.monotonic())
        return super().result()


def _provider(endpoint: str, export: str, service: str) -> Any:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from spanguard.killswitch.export import PromptBatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    exporter = OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces")
    processor = (
        PromptBatchSpanProcessor(exporter) if export == "prompt" else BatchSpanProcessor(exporter)
    )
    provider.add_span_processor(processor)
    return provider


def _stop_events(provider: Any) -> Any:
    """The agent's ended spans in memory as well (a SimpleSpanProcessor: an adapter knows it
    exports at once), for the spanguard.stop events the kill left on them."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


def _adapter(library: str, switch: Any) -> Any:
    # Each adapter's module imports its framework, so only the one asked for is imported.
    framework = library.split("-")[0]
    if framework == "langgraph":
        from spanguard.killswitch.adapters_langchain import SpanguardCallbackHandler

        return SpanguardCallbackHandler(switch)
    if framework == "openai":
        from spanguard.killswitch.adapters_openai_agents import SpanguardRunHooks

        return SpanguardRunHooks(switch)
    if framework == "pydantic":
        from spanguard.killswitch.adapters_pydantic_ai import SpanguardCapability

        return SpanguardCapability(switch)
    if framework == "smolagents":
        from spanguard.killswitch.adapters_smolagents import SpanguardStepCallback

        return SpanguardStepCallback(switch)
    if framework == "llama":
        from spanguard.killswitch.adapters_llama_index import guard_llama_index_agent

        return lambda agent: guard_llama_index_agent(agent, switch)
    if framework == "google":
        from spanguard.killswitch.adapters_google_adk import SpanguardAdkPlugin

        return SpanguardAdkPlugin(switch)
    if framework == "strands":
        from spanguard.killswitch.adapters_strands import SpanguardHooks

        return SpanguardHooks(switch)
    raise ValueError(f"no adapter for {library}")


class SeenTraces:
    """The switch the adapter checks, recording which traces it checked."""

    def __init__(self, switch: Any) -> None:
        self.switch = switch
        self.trace_ids: list[str] = []

    def check(self, trace_id: str) -> str | None:
        if trace_id not in self.trace_ids:
            self.trace_ids.append(trace_id)
        return self.switch.check(trace_id)

    def note_unguarded(self, where: str, what_to_do: str) -> None:
        self.switch.note_unguarded(where, what_to_do)

    def note_late_export(self, where: str, problem: str) -> None:
        self.switch.note_late_export(where, problem)


def run(row: str, scenario: str, *, endpoint: str, kill_topic: str, ack_topic: str,
        step_delay: float, export: str) -> Outcome:  # fmt: skip
    """One agent of `row` through `scenario` ("loop" or "healthy"), guarded."""
    from spanguard.killswitch import AgentKilled
    from spanguard.killswitch.client import KillSwitch

    library = agents.LIBRARIES[ROWS[row][0]]
    provider = _provider(endpoint, export, f"{row}-{scenario}")
    in_memory = _stop_events(provider)
    if export == "sdk-unhelped":
        from spanguard.killswitch import adapters

        adapters._prompt_export = lambda span: None  # this process is this one agent
    library.instrument(provider, "capture")
    # The key from SPANGUARD_SIGNING_KEY_FILE: the variable the worker reads.
    switch = KillSwitch(BOOTSTRAP, kill_topic, ack_topic=ack_topic)
    seen = SeenTraces(switch)
    calls = (
        [agents.Call("search_docs", agents.REFUND, "no results")] * LOOP_CALLS
        if scenario == "loop"
        else agents.SCENARIOS["distinct"]
    )
    script = PacedScript(calls, step_delay)
    outcome = Outcome(row, scenario, export, step_delay)
    arrived: list[float] = []
    done = threading.Event()

    def watch() -> None:  # when the kill reached the agent's book, whatever the agent does
        while not done.is_set() and not arrived:
            if any(switch.signals.is_killed(t) for t in list(seen.trace_ids)):
                arrived.append(time.monotonic())
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        library.run(script, _adapter(library.name, seen))
    except Exception as exc:  # whatever the agent raised is the outcome recorded  # noqa: BLE001
        outcome.exception = _chain(exc)
        killed = any(isinstance(e, AgentKilled) for e in _chain_objects(exc))
        outcome.status = "killed" if killed else "error"
    finally:
        done.set()
        watcher.join()
        provider.shutdown()
        switch.close()
    outcome.calls = len(script.call_times)
    outcome.trace_ids = seen.trace_ids
    outcome.unguarded = switch.unguarded
    outcome.late_export = switch.late_export
    outcome.stop_event = next(
        (
            str((event.attributes or {}).get("spanguard.action"))
            for span in in_memory.get_finished_spans()
            for event in span.events
            if event.name == "spanguard.stop"
        ),
        None,
    )
    if arrived and len(script.call_times) >= TRIPS_AT:
        outcome.stop_latency_s = round(arrived[0] - script.call_times[TRIPS_AT - 1], 3)
    return outcome


def run_offline(row: str) -> Outcome:
    """The looping agent of `row` with no Kafka: spans in memory, and the kill delivered to a
    SignalBook for the trace of the spans exported so far when the 3rd call runs (as the
    worker would). The adapter stops the agent only if it checks that trace."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from spanguard.killswitch import AgentKilled, SignalBook
    from tests.support.spans import kill_signal

    library = agents.LIBRARIES[ROWS[row][0]]
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    library.instrument(provider, "capture")
    book = SignalBook()
    seen = SeenTraces(book)
    adapter = _adapter(library.name, seen)

    class KilledAtTheTrip(PacedScript):
        def result(self) -> str:
            if len(self.call_times) == TRIPS_AT - 1:  # this is the call that trips the rule
                traces = {span.context.trace_id for span in exporter.get_finished_spans()}
                for trace in traces:
                    book.deliver(kill_signal(format(trace, "032x")))
            return super().result()

    script = KilledAtTheTrip(
        [agents.Call("search_docs", agents.REFUND, "no results")] * LOOP_CALLS, 0
    )
    outcome = Outcome(row, "loop", "in-memory", 0.0)
    try:
        library.run(script, adapter)
    except Exception as exc:  # whatever the agent raised is the outcome recorded  # noqa: BLE001
        outcome.exception = _chain(exc)
        killed = any(isinstance(e, AgentKilled) for e in _chain_objects(exc))
        outcome.status = "killed" if killed else "error"
    provider.force_flush()
    outcome.calls = len(script.call_times)
    outcome.trace_ids = seen.trace_ids
    outcome.unguarded = adapter.unguarded if hasattr(adapter, "unguarded") else 0
    return outcome


def _chain_objects(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _chain(exc: BaseException) -> list[str]:
    return [type(e).__name__ for e in _chain_objects(exc)]


# -- the stack and the rows, from the parent process -----------------------------------------


@dataclass
class Stack:
    topics: Topics
    endpoint: str
    key_file: str
    worker: WorkerProcess


@contextlib.contextmanager
def stack(workdir: Path) -> Iterator[Stack]:
    """The Collector and the default worker on fresh topics, signing with the stack's own key
    file (`scripts/stack.sh key-file` under `workdir`)."""
    ensure_broker()
    topics = Topics()
    key_file = subprocess.run(
        [str(ROOT / "scripts" / "stack.sh"), "key-file"],
        env={**_without_keys(os.environ), "SPANGUARD_STACK_DIR": str(workdir / "stack")},
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    collector_environment, http_port = collector_env(
        BOOTSTRAP, topics.input, workdir / "collector", OTELCOL_METRICS_LEVEL="none"
    )
    worker = WorkerProcess(
        topics, workdir / "worker", env={**_key_env(key_file), "SPANGUARD_SIGNING_KEY": ""}
    ).start()
    collector = [str(ROOT / "scripts" / "collector.sh")]
    try:
        subprocess.run([*collector, "up"], env=collector_environment, check=True, timeout=900)
        yield Stack(topics, f"http://127.0.0.1:{http_port}", key_file, worker)
    finally:
        subprocess.run([*collector, "down"], env=collector_environment, timeout=60)
        worker.stop()
        topics.delete()


def _without_keys(env: Any) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith("SPANGUARD_SIGNING_KEY")}


def _key_env(key_file: str) -> dict[str, str]:
    return {"SPANGUARD_SIGNING_KEY_FILE": key_file}


def missing(row: str) -> str | None:
    """Why `row` cannot run here (its framework or, in a virtualenv of its own, what the
    matrix needs there is not installed), or None."""
    library = agents.LIBRARIES[ROWS[row][0]]
    if not agents.installed(library):
        return f"{library.name} is not installed (the instrumentation-tests extra, or its venv)"
    if library.requirements:
        check = "import confluent_kafka, opentelemetry.exporter.otlp.proto.http"
        if subprocess.run([library.python, "-c", check], capture_output=True).returncode != 0:
            return (
                f"{library.python} lacks the matrix's clients: python -m"
                f" tests.support.instrumented_agents --venv {library.name}"
            )
    return None


def run_row(stack: Stack, row: str, scenario: str, *, step_delay: float = STEP_DELAY,
            export: str = "sdk-default", timeout: float = 120) -> Outcome:  # fmt: skip
    """`run` in a fresh interpreter (the library's instrumentation patches globally)."""
    library = agents.LIBRARIES[ROWS[row][0]]
    env = {
        **_without_keys(os.environ),
        **_key_env(stack.key_file),
        **library.modes["capture"],
        "PYTHONPATH": str(ROOT),
    }
    command = [library.python, "-m", MODULE, "run", row, scenario,
               "--endpoint", stack.endpoint, "--kill-topic", stack.topics.kills,
               "--ack-topic", stack.topics.acks,
               "--step-delay", str(step_delay), "--export", export]  # fmt: skip
    result = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    if result.returncode != 0:
        raise RuntimeError(f"{row}/{scenario} exited {result.returncode}:\n{result.stderr[-3000:]}")
    return Outcome(**json.loads(result.stdout.strip().splitlines()[-1]))


def explain(stack: Stack, trace_id: str, timeout: float = 20) -> str:
    """`spanguard explain TRACE_ID` on the stack's detections topic (exit 1 if none)."""
    result = subprocess.run(
        [sys.executable, "-m", "spanguard.cli", "explain", trace_id, "--bootstrap", BOOTSTRAP,
         "--detections-topic", stack.topics.detections, "--ack-topic", stack.topics.acks,
         "--timeout", str(timeout)],
        capture_output=True, text=True, timeout=timeout + 30,
        env={**_without_keys(os.environ), **_key_env(stack.key_file)},  # checks the acks' keys
    )  # fmt: skip
    return result.stdout if result.returncode == 0 else ""


def format_rows(outcomes: list[Outcome]) -> str:
    lines = [
        f"{'row':30} {'scenario':8} {'export':12} {'step s':>6} {'status':8} {'calls':>5}"
        f" {'stop latency':>12} {'event':5}  exception"
    ]
    for o in outcomes:
        latency = f"{o.stop_latency_s * 1000:.0f} ms" if o.stop_latency_s is not None else "-"
        lines.append(
            f"{o.row:30} {o.scenario:8} {o.export:12} {o.step_delay:6.1f} {o.status:8}"
            f" {o.calls:5d} {latency:>12} {o.stop_event or '-':5}  {' <- '.join(o.exception) or '-'}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("run", help=argparse.SUPPRESS)
    one.add_argument("row", choices=ROWS)
    one.add_argument("scenario", choices=("loop", "healthy"))
    one.add_argument("--endpoint", required=True)
    one.add_argument("--kill-topic", required=True)
    one.add_argument("--ack-topic", required=True)
    one.add_argument("--step-delay", type=float, default=STEP_DELAY)
    one.add_argument("--export", choices=EXPORTS, default="sdk-default")
    offline = sub.add_parser("offline", help=argparse.SUPPRESS)
    offline.add_argument("row", choices=ROWS)
    matrix = sub.add_parser("matrix", help="every row against the real stack")
    matrix.add_argument("rows", nargs="*", help=f"default: all ({', '.join(ROWS)})")
    export = sub.add_parser("export", help="calls before the stop: SDK defaults vs. spanguard's")
    export.add_argument("--row", default="langgraph+openllmetry", choices=ROWS)
    export.add_argument("--steps", type=float, nargs="*", default=[0.1, 0.3, 1.0])
    args = parser.parse_args(argv)
    if args.command == "run":
        outcome = run(args.row, args.scenario, endpoint=args.endpoint, kill_topic=args.kill_topic,
                      ack_topic=args.ack_topic, step_delay=args.step_delay, export=args.export)  # fmt: skip
        print(json.dumps(asdict(outcome)))
        return 0
    if args.command == "offline":
        print(json.dumps(asdict(run_offline(args.row))))
        return 0
    outcomes = []
    with tempfile.TemporaryDirectory() as tmp, stack(Path(tmp)) as running:
        if args.command == "matrix":
            for row in args.rows or list(ROWS):
                for scenario in ("loop", "healthy"):
                    outcomes.append(run_row(running, row, scenario))
                    print(format_rows(outcomes[-1:]).splitlines()[1], flush=True)
        else:
            for step in args.steps:
                for how in ("sdk-unhelped", "sdk-default", "prompt"):
                    outcomes.append(run_row(running, args.row, "loop", step_delay=step, export=how))
                    print(format_rows(outcomes[-1:]).splitlines()[1], flush=True)
    print(format_rows(outcomes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
