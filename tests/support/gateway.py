"""The real LiteLLM proxy for the gateway tests, with a scripted model and no network.

- `ScriptedModel`: a local OpenAI-compatible chat-completions server whose answer is decided by
  the request alone (stateless, so every agent and retry gets the same script): the scenario is
  the first user message (`loop`: the same search again and again; `healthy`: a new search each
  turn), and the turn is the number of tool results the request carries.
- `OtlpReceiver`: a local OTLP/HTTP endpoint keeping every request it gets (for the fixture of
  what LiteLLM's `otel` callback really emits).
- `Proxy`: `litellm --config ...` as a subprocess of the gateway's own virtualenv
  (`.venv-litellm`, `make gateway-venv`: litellm's pins conflict with constraints.txt), with
  spanguard's guardrail and the `otel` callback exporting OTLP/HTTP where it is told.

    python -m tests.support.gateway fixture    # re-record tests/fixtures/gateway/litellm-otel.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.support.kafka_harness import free_port

ROOT = Path(__file__).resolve().parents[2]
# The gateway's own virtualenv (Makefile target gateway-venv), made with constraints-litellm.txt.
GATEWAY_VENV = Path(os.environ.get("SPANGUARD_GATEWAY_VENV") or ROOT / ".venv-litellm")
FIXTURE = ROOT / "tests" / "fixtures" / "gateway" / "litellm-otel.json"
FIXTURE_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
MODEL = "scripted"
LOOP_CALLS = 15  # the stuck agent's script: the same search, again and again
HEALTHY_CALLS = 12
REFUND = {"query": "refund policy"}
# The proxy refuses to start without a strong master key; the tests' callers send it.
MASTER_KEY = "sk-spanguard-tests-6a0f3c9e1d7b4a2f8e5c0b9d3a7f1e4c"


def litellm_binary() -> Path:
    return GATEWAY_VENV / "bin" / "litellm"


def missing() -> str | None:
    """Why the real proxy cannot run here, or None."""
    if not litellm_binary().exists():
        return f"no LiteLLM proxy at {litellm_binary()}: make gateway-venv"
    return None


# -- the scripted model ----------------------------------------------------------------------


def scripted_reply(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions response to `body`: the scenario's next tool call, or its answer."""
    messages = body.get("messages") or []
    scenario = next(
        (str(m.get("content")) for m in messages if m.get("role") == "user"), "healthy"
    ).strip()
    turn = sum(1 for m in messages if m.get("role") == "tool")
    limit = LOOP_CALLS if scenario == "loop" else HEALTHY_CALLS
    message: dict[str, Any] = {"role": "assistant", "content": None}
    if turn < limit:
        arguments = REFUND if scenario == "loop" else {"query": f"refund rules in region {turn}"}
        message["tool_calls"] = [
            {
                "id": f"call_{uuid.uuid4().hex[:12]}",  # as a real model's: new every time
                "type": "function",
                "function": {"name": "search_docs", "arguments": json.dumps(arguments)},
            }
        ]
        finish = "tool_calls"
    else:
        message["content"] = f"done after {turn} searches"
        finish = "stop"
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model") or MODEL,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 20 + 10 * turn, "completion_tokens": 12, "total_tokens": 0},
    }


class _Handler(BaseHTTPRequestHandler):
    """A request handler that logs nothing, reads a POST's body and answers 200."""

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def ok(self, content_type: str, data: bytes = b"") -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if data:
            self.wfile.write(data)


class _Server:
    """A threaded HTTP server on 127.0.0.1 and a free port, in a daemon thread."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def __enter__(self) -> Any:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class ScriptedModel(_Server):
    def __init__(self) -> None:
        self.requests = 0
        self.bodies: list[dict[str, Any]] = []  # every request the proxy sent on, in order
        outer = self

        class Handler(_Handler):
            def do_POST(self) -> None:
                body = json.loads(self.body() or b"{}")
                outer.requests += 1
                outer.bodies.append(body)
                self.ok("application/json", json.dumps(scripted_reply(body)).encode())

        super().__init__(Handler)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


class OtlpReceiver(_Server):
    """Keeps the body of every OTLP/HTTP trace export (protobuf bytes)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        outer = self

        class Handler(_Handler):
            def do_POST(self) -> None:
                outer.bodies.append(self.body())
                self.ok("application/x-protobuf")

        super().__init__(Handler)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/traces"


# -- the proxy --------------------------------------------------------------------------------


def proxy_config(model_base_url: str, *, guardrail: bool = True, **guardrail_params: Any) -> str:
    """The proxy's config.yaml: the scripted model, the `otel` callback and (unless
    `guardrail=False`) spanguard's guardrail with `guardrail_params` (docs/agents.md)."""
    lines = [
        "model_list:",
        f"  - model_name: {MODEL}",
        "    litellm_params:",
        f"      model: openai/{MODEL}",
        f"      api_base: {model_base_url}",
        "      api_key: not-a-key",
        "litellm_settings:",
        '  callbacks: ["otel"]',
    ]
    if guardrail:
        lines += [
            "guardrails:",
            "  - guardrail_name: spanguard",
            "    litellm_params:",
            "      guardrail: spanguard.killswitch.gateway.SpanguardGuardrail",
            "      mode: pre_call",
            "      default_on: true",
            *(f"      {key}: {json.dumps(value)}" for key, value in guardrail_params.items()),
        ]
    return "\n".join(lines) + "\n"


@dataclass
class Proxy:
    """`litellm --config CONFIG --port PORT` as a subprocess; its log in `log_path`."""

    config: str
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    process: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.workdir / "litellm.log"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> Proxy:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config_path = self.workdir / "config.yaml"
        config_path.write_text(self.config)
        self.port = free_port()
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LITELLM_"))},
            # No telemetry of its own, no price map fetched from the network.
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_TELEMETRY": "False",
            "OTEL_EXPORTER": "otlp_http",
            "LITELLM_MASTER_KEY": MASTER_KEY,
            **self.env,
        }
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [str(litellm_binary()), "--config", str(config_path), "--host", "127.0.0.1",
                 "--port", str(self.port), "--num_workers", "1"],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"litellm exited {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health/liveliness", timeout=2):
                    return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"litellm not up in {timeout}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 60) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=15)

    def __enter__(self) -> Proxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def chat(
    base_url: str, messages: list[dict[str, Any]], headers: dict[str, str] | None = None,
    *, timeout: float = 60, **body: Any,
) -> tuple[int, dict[str, Any]]:  # fmt: skip
    """POST /v1/chat/completions; (status, the JSON body), an error's too."""
    data = json.dumps({"model": MODEL, "messages": messages, **body}).encode()
    request = urllib.request.Request(
        f"{base_url}/v1/chat/completions",
        data=data,
        headers={
            "Content-Type": "application/json",
            "Authorization": f"Bearer {MASTER_KEY}",
            **(headers or {}),
        },
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        text = error.read()
        try:
            return error.code, json.loads(text)
        except ValueError:
            return error.code, {"raw": text.decode(errors="replace")}


# -- the fixture ------------------------------------------------------------------------------


def record_fixture(out: Path = FIXTURE) -> Path:
    """Four turns of a looping agent through the real proxy (no guardrail), each request with
    a `traceparent` of one trace (as an instrumented agent sends), LiteLLM's own spans as
    OTLP/JSON: three identical tool calls, in the requests that carry their results."""
    from google.protobuf.json_format import MessageToDict
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    with contextlib.ExitStack() as stack:
        model = stack.enter_context(ScriptedModel())
        receiver = stack.enter_context(OtlpReceiver())
        workdir = Path(stack.enter_context(_tempdir()))
        proxy = Proxy(
            proxy_config(model.base_url, guardrail=False),
            workdir,
            env={"OTEL_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50"},
        )
        stack.enter_context(proxy)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "loop"}]
        for turn in range(4):
            headers = {"traceparent": f"00-{FIXTURE_TRACE_ID}-{turn + 1:016x}-01"}
            status, reply = chat(proxy.base_url, messages, headers)
            assert status == 200, reply
            message = reply["choices"][0]["message"]
            messages.append({k: v for k, v in message.items() if v is not None})
            for call in message.get("tool_calls") or []:
                messages.append(
                    {"role": "tool", "tool_call_id": call["id"], "content": "no results"}
                )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _span_count(receiver.bodies) < 4:
            time.sleep(0.2)
        requests = [
            MessageToDict(ExportTraceServiceRequest.FromString(body)) for body in receiver.bodies
        ]
    resource_spans = [rs for request in requests for rs in request.get("resourceSpans", [])]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"resourceSpans": resource_spans}, indent=1, sort_keys=True) + "\n")
    return out


def _span_count(bodies: list[bytes]) -> int:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    return sum(
        1
        for body in bodies
        for rs in ExportTraceServiceRequest.FromString(body).resource_spans
        for ss in rs.scope_spans
        for span in ss.spans
        if span.name == "litellm_request"
    )


@contextlib.contextmanager
def _tempdir() -> Iterator[str]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="spanguard-gateway-") as tmp:
        yield tmp


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("fixture",))
    args = parser.parse_args(argv)
    if args.command == "fixture":
        print(record_fixture())
    return 0


if __name__ == "__main__":
    sys.exit(main())


# -- agents calling through the proxy -----------------------------------------------------------


@dataclass
class AgentRun:
    """What one agent did through the proxy."""

    scenario: str
    calls: int = 0  # tool calls it ran
    status: str = "finished"  # "finished" | "refused" | "error"
    refusal_status: int | None = None
    refusal: dict[str, Any] | None = None  # the error body the agent got
    refused_at: float | None = None  # time.time() of the refusal
    trace_id: str | None = None


def run_agent(
    base_url: str,
    scenario: str,
    *,
    step_delay: float = 0.3,
    endpoint: str | None = None,
    run_id: str | None = None,
    trace_id: str | None = None,
    service: str = "gateway-agent",
    max_calls: int = LOOP_CALLS + 2,
) -> AgentRun:
    """An agent loop over the proxy: ask the model, run the tool calls it asks for (each takes
    `step_delay` s and answers "no results" for the loop, something new otherwise), until the
    model answers or the proxy refuses.

    `endpoint`: instrumented, the OpenTelemetry SDK's defaults (BatchSpanProcessor, OTLP/HTTP
    there), an `invoke_agent` span and an `execute_tool` span per call (GenAI conventions, the
    model's call id), and the W3C `traceparent` of its span on each model call; no spanguard
    adapter. Else no instrumentation at all: `run_id` (if any) as `x-spanguard-run`, and
    `trace_id` (if any) as a bare traceparent."""
    run = AgentRun(scenario)
    provider = tracer = None
    if endpoint is not None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        tracer = provider.get_tracer("tests.gateway-agent")
    messages: list[dict[str, Any]] = [{"role": "user", "content": scenario}]
    with contextlib.ExitStack() as stack:
        if tracer is not None:
            root = stack.enter_context(
                tracer.start_as_current_span(
                    "invoke_agent", attributes={"gen_ai.operation.name": "invoke_agent"}
                )
            )
            run.trace_id = format(root.get_span_context().trace_id, "032x")
        elif trace_id is not None:
            run.trace_id = trace_id
        while run.calls < max_calls:
            headers: dict[str, str] = {}
            if tracer is not None:
                from opentelemetry.propagate import inject

                inject(headers)
            elif trace_id is not None:
                headers["traceparent"] = f"00-{trace_id}-{os.urandom(8).hex()}-01"
            if run_id is not None:
                headers["x-spanguard-run"] = run_id
            status, reply = chat(base_url, messages, headers)
            if status != 200:
                run.refused_at = time.time()
                run.status = "refused" if status in (403, 423) else "error"
                run.refusal_status, run.refusal = status, reply
                break
            message = reply["choices"][0]["message"]
            asked = message.get("tool_calls") or []
            if not asked:
                break
            messages.append({"role": "assistant", "content": None, "tool_calls": asked})
            for call in asked:
                arguments = json.loads(call["function"]["arguments"])
                result = "no results" if scenario == "loop" else f"found {arguments['query']}"
                if tracer is not None:
                    with tracer.start_as_current_span(
                        f"execute_tool {call['function']['name']}",
                        attributes={
                            "gen_ai.operation.name": "execute_tool",
                            "gen_ai.tool.name": call["function"]["name"],
                            "gen_ai.tool.call.id": call["id"],
                            "gen_ai.tool.call.arguments": call["function"]["arguments"],
                            "gen_ai.tool.call.result": result,
                        },
                    ):
                        time.sleep(step_delay)
                else:
                    time.sleep(step_delay)
                run.calls += 1
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    if provider is not None:
        provider.shutdown()
    return run
