"""Spans that leave in time: a BatchSpanProcessor that exports promptly after tool and
inference spans (extra `inprocess`, or any OpenTelemetry SDK).

The guard sees a tool call only once its span reaches the Collector. The SDK's
`BatchSpanProcessor` waits up to 5 s (`OTEL_BSP_SCHEDULE_DELAY`) before it exports: an agent
taking 0.3 s a step makes about 15 more tool calls before the worker even sees the loop. A
short schedule delay fixes that at the cost of an export every few milliseconds for every
span of every agent. `PromptBatchSpanProcessor` keeps the SDK's batching for everything else
and flushes the batch `flush_after` seconds (default 20 ms, to gather the spans that end
together) after a tool or inference span ends:

    from spanguard.killswitch.export import PromptBatchSpanProcessor

    provider.add_span_processor(PromptBatchSpanProcessor(OTLPSpanExporter()))
"""

from __future__ import annotations

import threading
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

__all__ = ["DEFAULT_FLUSH_AFTER", "PromptBatchSpanProcessor", "is_guarded_span"]

DEFAULT_FLUSH_AFTER = 0.02

# What the guard's rules read (spanguard.detection.conventions): tool calls and inference.
_TOOL_OR_INFERENCE_OPERATIONS = frozenset(
    {"execute_tool", "chat", "text_completion", "generate_content", "embeddings"}
)
_OPENINFERENCE_KINDS = frozenset({"TOOL", "LLM", "EMBEDDING"})
_TRACELOOP_KINDS = frozenset({"tool"})
_TRACELOOP_REQUEST_TYPES = frozenset({"chat", "completion", "embedding"})


def is_guarded_span(span: ReadableSpan) -> bool:
    """A tool call or an inference span, in any instrumentation the guard reads."""
    attributes: Any = span.attributes or {}
    if attributes.get("gen_ai.operation.name") in _TOOL_OR_INFERENCE_OPERATIONS:
        return True
    if attributes.get("openinference.span.kind") in _OPENINFERENCE_KINDS:
        return True
    if attributes.get("traceloop.span.kind") in _TRACELOOP_KINDS:
        return True
    if attributes.get("llm.request.type") in _TRACELOOP_REQUEST_TYPES:
        return True
    name = span.name
    # pydantic-ai and strands name their tool spans but set no operation name.
    return name == "execute_tool" or (
        "gen_ai.tool.name" in attributes
        and (name.startswith("execute_tool ") or name == "running tool")
    )


class PromptBatchSpanProcessor(BatchSpanProcessor):
    """The SDK's BatchSpanProcessor (same arguments, same batching and queue), plus a flush
    `flush_after` seconds after a tool or inference span ends, so the guard sees the call
    within a few tens of milliseconds instead of up to the schedule delay.

    Spans ending while a flush is pending join it: a burst of calls costs one export."""

    def __init__(
        self,
        span_exporter: SpanExporter,
        *,
        flush_after: float = DEFAULT_FLUSH_AFTER,
        flush_timeout_millis: int = 10_000,
        **batch_options: Any,
    ) -> None:
        if flush_after < 0:
            raise ValueError("flush_after must be 0 or more seconds")
        super().__init__(span_exporter, **batch_options)
        self.flush_after = flush_after
        self.flush_timeout_millis = flush_timeout_millis
        self.prompt_flushes = 0  # exports started by a tool or inference span
        self._due = threading.Event()
        self._closing = threading.Event()
        self._flusher = threading.Thread(
            target=self._flush_when_due, name="spanguard-prompt-export", daemon=True
        )
        self._flusher.start()

    def on_end(self, span: ReadableSpan) -> None:
        super().on_end(span)
        if is_guarded_span(span):
            self._due.set()

    def _flush_when_due(self) -> None:
        while True:
            self._due.wait()
            if self._closing.is_set():
                return
            # Gather the spans that end with this one (the tool's parent step, a sibling call).
            self._closing.wait(self.flush_after)
            self._due.clear()
            if self._closing.is_set():
                return
            self.prompt_flushes += 1
            super().force_flush(self.flush_timeout_millis)

    def shutdown(self) -> None:
        self._closing.set()
        self._due.set()
        self._flusher.join(timeout=5)
        super().shutdown()
