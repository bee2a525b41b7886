"""PromptBatchSpanProcessor: tool and inference spans leave at once, the rest is batched."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from spanguard.killswitch.export import PromptBatchSpanProcessor
from tests.support.waiting import wait_until


class CountingExporter(InMemorySpanExporter):
    def __init__(self) -> None:
        super().__init__()
        self.exports: list[tuple[float, int]] = []

    def export(self, spans) -> SpanExportResult:
        self.exports.append((time.monotonic(), len(spans)))
        return super().export(spans)


@pytest.fixture
def exported():
    exporter = CountingExporter()
    provider = TracerProvider()
    # The SDK's default 5 s schedule delay: only the prompt flush can export in time.
    processor = PromptBatchSpanProcessor(exporter, schedule_delay_millis=5000)
    provider.add_span_processor(processor)
    yield provider.get_tracer("test"), exporter, processor
    provider.shutdown()


@pytest.mark.parametrize(
    "attributes",
    [
        {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "search_docs"},
        {"gen_ai.operation.name": "chat"},
        {"openinference.span.kind": "TOOL"},
        {"openinference.span.kind": "LLM"},
        {"traceloop.span.kind": "tool"},
        {"llm.request.type": "chat"},
    ],
)
def test_a_tool_or_inference_span_leaves_at_once_not_after_the_schedule_delay(exported, attributes):
    tracer, exporter, processor = exported
    with tracer.start_as_current_span("invoke_agent support"):
        with tracer.start_as_current_span("plan"):  # ends first, waits for the flush
            pass
        start = time.monotonic()
        with tracer.start_as_current_span("step", attributes=attributes):
            pass
    waiting = time.monotonic()
    wait_until(lambda: len(exporter.get_finished_spans()) >= 2, timeout=5, interval=0.002)
    assert time.monotonic() - waiting < 0.5  # 20 ms + an export here; tolerant of a loaded machine
    assert exporter.exports[0][0] - start < 0.5
    # The waiting span, the tool span and the agent span (ended meanwhile): one export.
    assert len(exporter.exports) == 1 and exporter.exports[0][1] >= 2, exporter.exports
    assert processor.prompt_flushes == 1


def test_other_spans_wait_for_the_batch(exported):
    tracer, exporter, processor = exported
    with tracer.start_as_current_span("invoke_agent support"), tracer.start_as_current_span("plan"):
        pass
    time.sleep(0.3)
    assert exporter.get_finished_spans() == () and processor.prompt_flushes == 0


def test_a_burst_of_tool_spans_costs_one_export(exported):
    tracer, exporter, _ = exported
    for call in range(10):
        with tracer.start_as_current_span(
            "execute_tool search_docs",
            attributes={"gen_ai.operation.name": "execute_tool", "gen_ai.tool.call.id": str(call)},
        ):
            pass
    wait_until(lambda: len(exporter.get_finished_spans()) == 10, timeout=5, interval=0.002)
    assert len(exporter.exports) <= 2, exporter.exports


def test_flush_after_must_not_be_negative():
    with pytest.raises(ValueError, match="flush_after"):
        PromptBatchSpanProcessor(InMemorySpanExporter(), flush_after=-1)


# -- the adapters on the SDK's defaults: ensure_prompt_export --------------------------------


def _sdk_default_provider(exporter):
    """A provider as a user sets it up: the SDK's BatchSpanProcessor with its 5 s delay."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def test_an_adapters_check_makes_the_sdk_defaults_export_after_each_tool_span():
    from spanguard.killswitch import SignalBook
    from spanguard.killswitch.adapters import TraceGate

    exporter = CountingExporter()
    provider = _sdk_default_provider(exporter)
    tracer = provider.get_tracer("agent")
    gate = TraceGate(SignalBook())
    try:
        with tracer.start_as_current_span("invoke_agent") as run:
            trace_id = format(run.get_span_context().trace_id, "032x")
            gate.check_trace(trace_id)  # before the first tool call
            gate.check_trace(trace_id)  # looked at once: no second flusher
            ended = time.monotonic()
            with tracer.start_as_current_span(
                "execute_tool search_docs", attributes={"gen_ai.operation.name": "execute_tool"}
            ):
                pass
            wait_until(lambda: exporter.get_finished_spans(), timeout=3, interval=0.002)
            # The SDK alone would wait 5 s; 20 ms + an export here, loose for a loaded machine.
            assert exporter.exports[0][0] - ended < 1.0
        assert gate.late_export == 0
        flushers = [
            p
            for p in provider._active_span_processor._span_processors
            if type(p).__name__ == "FlushAfterToolSpans"
        ]
        assert len(flushers) == 1 and flushers[0].flushes >= 1
    finally:
        provider.shutdown()


def test_a_provider_the_adapter_cannot_make_prompt_is_warned_about_once_and_counted(caplog):
    import logging

    from opentelemetry.sdk.trace import SpanProcessor

    from spanguard.killswitch.adapters import TraceGate
    from spanguard.killswitch.client import KillSwitch

    class ShipsSomewhere(SpanProcessor):  # a vendor's processor: nothing says when it exports
        pass

    provider = TracerProvider()
    provider.add_span_processor(ShipsSomewhere())
    switch = KillSwitch("127.0.0.1:1", signing_key="k" * 32, start=False)
    gate = TraceGate(switch)
    tracer = provider.get_tracer("agent")
    with (
        caplog.at_level(logging.WARNING, logger="spanguard.killswitch"),
        tracer.start_as_current_span("invoke_agent") as run,
    ):
        trace_id = format(run.get_span_context().trace_id, "032x")
        for _ in range(3):
            gate.check_trace(trace_id)
    assert gate.late_export == 3 and switch.late_export == 3
    warnings = [r.getMessage() for r in caplog.records if "late" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "ShipsSomewhere" in warnings[0] and "OTEL_BSP_SCHEDULE_DELAY" in warnings[0]
    assert "PromptBatchSpanProcessor" in warnings[0] and "KillSwitch.late_export" in warnings[0]
    provider.shutdown()


def test_no_sdk_provider_is_warned_about_too():
    """A no-op provider (none set): the adapter cannot make spans leave, and says so."""
    code = (
        "from spanguard.killswitch.export import ensure_prompt_export;"
        "print(ensure_prompt_export(None))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "no OpenTelemetry SDK tracer provider" in result.stdout, result.stderr
    assert "ProxyTracerProvider" in result.stdout


def test_prompt_and_simple_processors_need_no_help():
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    from spanguard.killswitch.export import ensure_prompt_export

    exporter = InMemorySpanExporter()
    for processor in (
        PromptBatchSpanProcessor(exporter),
        SimpleSpanProcessor(exporter),
        BatchSpanProcessor(exporter, schedule_delay_millis=50),  # OTEL_BSP_SCHEDULE_DELAY=50
    ):
        provider = TracerProvider()
        provider.add_span_processor(processor)
        with provider.get_tracer("agent").start_as_current_span("run") as span:
            assert ensure_prompt_export(span) is None
        assert len(provider._active_span_processor._span_processors) == 1  # nothing added
        provider.shutdown()
