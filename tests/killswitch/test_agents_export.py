"""PromptBatchSpanProcessor: tool and inference spans leave at once, the rest is batched."""

from __future__ import annotations

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
