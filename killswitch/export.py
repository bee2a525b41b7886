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

An agent whose owner kept the SDK's defaults is made prompt by its adapter instead:
`ensure_prompt_export(span)` (called by every adapter before each check) adds a
`FlushAfterToolSpans` processor to the span's tracer provider (else the global one), which
asks that provider's batch processors to export 20 ms after a tool or inference span ends,
on a thread of its own. A provider whose processors it does not know (a custom processor, a
no-op provider) is reported instead: the adapters warn once and count it.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter

__all__ = [
    "DEFAULT_FLUSH_AFTER",
    "FlushAfterToolSpans",
    "PromptBatchSpanProcessor",
    "ensure_prompt_export",
    "is_guarded_span",
]

DEFAULT_FLUSH_AFTER = 0.02
# A batch processor exporting at least this often needs no help (OTEL_BSP_SCHEDULE_DELAY=50).
PROMPT_SCHEDULE_DELAY_MILLIS = 100
# The adapters' flushes start at most this often: a healthy agent calling many quick tools
# pays for at most 20 exports a second.
DEFAULT_MIN_INTERVAL = 0.05

# What the guard's rules read (spanguard.detection.conventions.adapt): tool calls and inference.
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


class _DueFlusher:
    """A thread that calls `flush` `flush_after` seconds after `due()` (spans ending meanwhile
    join that flush), and at most once per `min_interval`: off the agent's hot path, where
    `due()` only sets an event."""

    def __init__(
        self, flush: Callable[[], object], flush_after: float, min_interval: float = 0.0
    ) -> None:
        if flush_after < 0:
            raise ValueError("flush_after must be 0 or more seconds")
        self.flush_after = flush_after
        self.min_interval = min_interval
        self.flushes = 0
        self._flush = flush
        self._due = threading.Event()
        self._closing = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="spanguard-prompt-export", daemon=True
        )
        self._thread.start()

    def due(self) -> None:
        self._due.set()

    def _run(self) -> None:
        last = float("-inf")
        while True:
            self._due.wait()
            if self._closing.is_set():
                return
            # Gather the spans that end with this one (the tool's parent step, a sibling call).
            wait = max(self.flush_after, last + self.min_interval - time.monotonic())
            self._closing.wait(wait)
            self._due.clear()
            if self._closing.is_set():
                return
            last = time.monotonic()
            self.flushes += 1
            # An exporter's failure is the SDK's to log; the thread keeps flushing.
            with contextlib.suppress(Exception):
                self._flush()

    def close(self) -> None:
        self._closing.set()
        self._due.set()
        self._thread.join(timeout=5)


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
        self._flusher = _DueFlusher(
            lambda: BatchSpanProcessor.force_flush(self, self.flush_timeout_millis), flush_after
        )

    @property
    def prompt_flushes(self) -> int:
        """Exports started by a tool or inference span."""
        return self._flusher.flushes

    def on_end(self, span: ReadableSpan) -> None:
        super().on_end(span)
        if is_guarded_span(span):
            self._flusher.due()

    def shutdown(self) -> None:
        self._flusher.close()
        super().shutdown()


class FlushAfterToolSpans(SpanProcessor):
    """What an adapter adds to a tracer provider it finds exporting late: after a tool or
    inference span ends, `targets` (the provider's batch processors) are asked to export
    (`force_flush`), `flush_after` seconds later on a thread of its own, at most once per
    `min_interval`. The SDK's batching is otherwise untouched."""

    def __init__(
        self,
        targets: list[SpanProcessor],
        *,
        flush_after: float = DEFAULT_FLUSH_AFTER,
        min_interval: float = DEFAULT_MIN_INTERVAL,
        flush_timeout_millis: int = 10_000,
    ) -> None:
        self.targets = list(targets)
        self._flusher = _DueFlusher(self._flush_targets, flush_after, min_interval)
        self.flush_timeout_millis = flush_timeout_millis

    @property
    def flushes(self) -> int:
        return self._flusher.flushes

    def _flush_targets(self) -> None:
        for target in self.targets:
            target.force_flush(self.flush_timeout_millis)

    def on_end(self, span: ReadableSpan) -> None:
        if is_guarded_span(span):
            self._flusher.due()

    def shutdown(self) -> None:
        self._flusher.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


# -- what the adapters call: make the spans of the provider they run under leave in time ----

# The provider's multi span processor -> (its processor count when looked at, what is wrong
# or None). Looked at again when processors are added.
_looked_at: weakref.WeakKeyDictionary[Any, tuple[int, str | None]] = weakref.WeakKeyDictionary()
_looked_at_lock = threading.Lock()


def _multi_processor(span: Any) -> Any:
    """The SDK multi span processor of `span`'s provider, else of the global provider."""
    for candidate in (span, getattr(span, "__wrapped__", None)):
        processor = getattr(candidate, "_span_processor", None)
        if processor is not None:
            return processor
    from opentelemetry import trace

    return getattr(trace.get_tracer_provider(), "_active_span_processor", None)


def _is_prompt_batch(processor: BatchSpanProcessor) -> bool:
    if isinstance(processor, PromptBatchSpanProcessor):
        return True
    inner = getattr(processor, "_batch_processor", processor)  # SDK 1.33+ keeps it inside
    delay = getattr(inner, "_schedule_delay_millis", None)
    if delay is None:
        delay = getattr(processor, "schedule_delay_millis", None)  # older SDKs
    return isinstance(delay, int | float) and delay <= PROMPT_SCHEDULE_DELAY_MILLIS


def _classify(processors: tuple[Any, ...]) -> tuple[list[Any], list[str], bool]:
    """(processors to flush, names of processors not known to export promptly, whether ours
    is installed). A wrapper (GuardingSpanProcessor, ArgsHashingSpanProcessor: `.inner`) is
    judged by what it wraps and flushed as a whole."""
    slow: list[Any] = []
    unknown: list[str] = []
    installed = False
    for processor in processors:
        if isinstance(processor, FlushAfterToolSpans):
            installed = True
            continue
        inner = processor
        while isinstance(getattr(inner, "inner", None), SpanProcessor):
            inner = inner.inner
        if isinstance(inner, SimpleSpanProcessor):
            continue  # exports as each span ends
        if isinstance(inner, BatchSpanProcessor):
            if not _is_prompt_batch(inner):
                slow.append(processor)
            continue
        unknown.append(type(inner).__name__)
    return slow, unknown, installed


def ensure_prompt_export(span: Any = None) -> str | None:
    """Make the spans of `span`'s tracer provider (else the global one's) leave within tens of
    milliseconds of a tool or inference span's end; None when they do, else what stands in
    the way (for the adapter's warning). Cheap when called before every tool call: a provider
    is looked at again only when its processors change."""
    multi = _multi_processor(span)
    processors = getattr(multi, "_span_processors", None)
    if (
        multi is None
        or not isinstance(processors, tuple)
        or not hasattr(multi, "add_span_processor")
    ):
        return (
            "no OpenTelemetry SDK tracer provider was found (the global one is"
            f" {_provider_name()}): the agent's spans may never reach the guard"
        )
    with _looked_at_lock:
        seen = _looked_at.get(multi)
        if seen is not None and seen[0] == len(processors):
            return seen[1]
        slow, unknown, installed = _classify(processors)
        if slow and not installed:
            multi.add_span_processor(FlushAfterToolSpans(slow))
        problem = None
        if unknown:
            problem = (
                f"the tracer provider's span processor(s) {', '.join(unknown)} are not known to"
                " export promptly, so the guard may see this agent's tool calls late"
            )
        _looked_at[multi] = (len(multi._span_processors), problem)
        return problem


def _provider_name() -> str:
    from opentelemetry import trace

    return type(trace.get_tracer_provider()).__name__
