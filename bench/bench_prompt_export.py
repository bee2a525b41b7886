"""`python -m bench.bench_prompt_export`: what the adapters' prompt export costs a healthy agent.

An agent on the OpenTelemetry SDK's defaults (`BatchSpanProcessor`, 5 s, the OTLP/HTTP
exporter) takes steps of one chat span and one tool span, with an adapter's check before each
tool call. Two variants, in the same process, run after run in turn:

- without: the adapter's check alone (the SDK exports every 5 s, or when 512 spans wait);
- with: the adapter as shipped, which adds `FlushAfterToolSpans` to the provider: an export
  20 ms after a tool span ends, at most one every 50 ms, on a thread of its own.

The spans go to a real HTTP endpoint in another process (a sink that answers 200 to every
POST, so the receiver's work is not the agent's). `--think` sets the agent's own work per step
(0: a tight loop of quick tools, the worst case, where the SDK's own queue overflows either
way; a real agent waits on its model for tenths of a second). Prints, per think time, calls per
second of each variant (median of the runs), their ratio, and the exports each made; the last
line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import time
from typing import Any

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult

from spanguard.killswitch import SignalBook
from spanguard.killswitch.adapters import TraceGate

SINK = """
import http.server, sys
class Sink(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *args): pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sink)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


class CountingExporter(OTLPSpanExporter):
    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint=endpoint)
        self.exports = 0

    def export(self, spans: Any) -> SpanExportResult:
        self.exports += 1
        return super().export(spans)


class WithoutPromptExport(TraceGate):
    """The same check, without making the provider's spans leave sooner."""

    def _ensure_export(self, span: Any) -> None:
        return None


def run(
    gate_class: type[TraceGate], endpoint: str, seconds: float, think: float
) -> tuple[float, int]:
    """Calls per second of one healthy agent for `seconds`, and the exports it made."""
    exporter = CountingExporter(endpoint)
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))  # the SDK's defaults
    tracer = provider.get_tracer("healthy-agent")
    gate = gate_class(SignalBook())
    calls = 0
    with tracer.start_as_current_span("invoke_agent support") as run_span:
        trace_id = format(run_span.get_span_context().trace_id, "032x")
        start = time.perf_counter()
        deadline = start + seconds
        while time.perf_counter() < deadline:
            with tracer.start_as_current_span(
                "chat gpt-4o", attributes={"gen_ai.operation.name": "chat"}
            ):
                if think:
                    time.sleep(think)
            gate.check_trace(trace_id)  # before the tool call, as every adapter does
            with tracer.start_as_current_span(
                "execute_tool search_docs",
                attributes={
                    "gen_ai.operation.name": "execute_tool",
                    "gen_ai.tool.name": "search_docs",
                    "gen_ai.tool.call.arguments": json.dumps({"query": f"question {calls}"}),
                },
            ):
                calls += 1
        elapsed = time.perf_counter() - start
    provider.shutdown()
    return calls / elapsed, exporter.exports


def measure(endpoint: str, seconds: float, runs: int, think: float) -> dict[str, Any]:
    """Both variants, run after run in turn; prints and returns the medians and their ratio."""
    rates: dict[str, list[float]] = {"without": [], "with": []}
    exports: dict[str, list[int]] = {"without": [], "with": []}
    for _ in range(runs):
        for name, gate in (("without", WithoutPromptExport), ("with", TraceGate)):
            rate, made = run(gate, endpoint, seconds, think)
            rates[name].append(rate)
            exports[name].append(made)
    without, with_ = (statistics.median(rates[name]) for name in ("without", "with"))
    print(
        f"healthy agent, SDK defaults, {think * 1000:g} ms of work a step,"
        f" median of {runs} runs of {seconds:g} s:"
    )
    for name, rate in (("without", without), ("with", with_)):
        print(
            f"  {name:7} the adapter's prompt export: {rate:10,.1f} calls/s"
            f" ({statistics.median(exports[name]):.0f} exports a run)"
        )
    print(f"  ratio (with / without): {with_ / without:.3f}", flush=True)
    return {
        "think_s": think,
        "calls_per_s_without": round(without, 1),
        "calls_per_s_with": round(with_, 1),
        "ratio": round(with_ / without, 4),
        "runs": {name: [round(r, 1) for r in values] for name, values in rates.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per run")
    parser.add_argument("--runs", type=int, default=5, help="of each variant, in turn")
    parser.add_argument(
        "--think", type=float, nargs="*", default=[0.0, 0.002, 0.02], help="seconds of work a step"
    )
    args = parser.parse_args(argv)
    # The tight loop overflows the SDK's queue with or without the flushes: not the figure.
    logging.getLogger("opentelemetry").setLevel(logging.ERROR)
    sink = subprocess.Popen(
        [sys.executable, "-c", SINK], stdout=subprocess.PIPE, text=True, bufsize=1
    )
    try:
        assert sink.stdout is not None
        endpoint = f"http://127.0.0.1:{sink.stdout.readline().strip()}/v1/traces"
        results = [measure(endpoint, args.seconds, args.runs, think) for think in args.think]
    finally:
        sink.terminate()
        sink.wait()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
