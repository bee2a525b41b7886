"""Hashes instead of content: tool spans leave the agent with `spanguard.tool.args_hash`.

    provider.add_span_processor(ArgsHashingSpanProcessor(BatchSpanProcessor(OTLPSpanExporter())))

For teams that may not ship tool arguments but want exact loop detection. Content capture stays
on in the instrumentation (the hash is made from the arguments), and this processor, wrapped
around the exporter's, hands the exporter a copy of each ended span in which:

- a tool span's arguments and result are replaced by `spanguard.tool.args_hash` and
  `spanguard.tool.result_hash`: the core's own canonical hash (volatile keys removed at every
  depth, NFC, the policy's foldings), read by the core's own adapters, so what the worker
  compares is exactly what it would have computed from the raw values;
- with `strip_content` (the default), the other content attributes the instrumentations write
  (prompts, completions, chain inputs and outputs, message events) are dropped from every span.
  The goal verifier then has nothing to judge: it counts such runs as `no_content`.

Arguments that were not recorded (capture off, a redaction placeholder) get no hash: the
worker sees a call without arguments, as it would have without this processor. If hashing a
span fails, the span still leaves without its content: nothing raw escapes on an error.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Final

from opentelemetry import context as context_api
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import Event, ReadableSpan, Span, SpanProcessor

from spanguard.detection.canonical import args_hash
from spanguard.detection.conventions.adapt import adapt_span
from spanguard.detection.conventions.events import MISSING, ToolCall
from spanguard.detection.conventions.keys import (
    ARGS_HASH_KEY,
    ARGUMENT_KEYS,
    RESULT_HASH_KEY,
    RESULT_KEYS,
    WANTED_KEYS,
)
from spanguard.schemas.otlp_view import parse_view
from spanguard.schemas.policy import Policy

__all__ = ["CONTENT_KEYS", "CONTENT_PREFIXES", "ArgsHashingSpanProcessor"]

log = logging.getLogger("spanguard.killswitch")

# Attributes that carry what was said or passed, per instrumentation (docs/conventions.md names the
# versions read). Tool arguments and results are among them.
CONTENT_KEYS: Final = frozenset(
    {
        *ARGUMENT_KEYS,
        *RESULT_KEYS,
        "gen_ai.input.messages",
        "gen_ai.output.messages",
        "gen_ai.system_instructions",
        "gen_ai.prompt",
        "gen_ai.completion",
        "gen_ai.task.input",  # OpenLLMetry LangChain
        "gen_ai.task.output",
        "traceloop.entity.input",
        "traceloop.entity.output",
        "input.value",  # OpenInference
        "output.value",
        "gcp.vertex.agent.llm_request",  # Google ADK
        "gcp.vertex.agent.llm_response",
        "gcp.vertex.agent.tool_call_args",
        "gcp.vertex.agent.tool_response",
        "pydantic_ai.all_messages",  # pydantic-ai agent runs
        "final_result",
        "tool_arguments",
        "tool_response",
    }
)
CONTENT_PREFIXES: Final = (
    "llm.input_messages.",  # OpenInference, one attribute per message part
    "llm.output_messages.",
    "llm.prompts",
    "gen_ai.prompt.",  # OpenLLMetry's indexed prompts and completions
    "gen_ai.completion.",
    "retrieval.documents.",
    "embedding.embeddings.",
)
# Event attributes that carry content (strands' gen_ai.tool.message, GenAI message events).
# strands 1.62 (telemetry/tracer.py) writes its legacy events with `content` (user, system and
# tool-input messages), `message` (choices) and `tool.result` (the results fed back to the model,
# on the event loop cycle's `gen_ai.choice`); its latest conventions use the gen_ai.* names.
CONTENT_EVENT_KEYS: Final = frozenset(
    {
        "content",
        "message",
        "tool.result",
        "gen_ai.input.messages",
        "gen_ai.output.messages",
        "gen_ai.system_instructions",
        "gen_ai.tool.call.arguments",
        "gen_ai.tool.call.result",
    }
)
TOOL_CONTENT_KEYS: Final = frozenset({*ARGUMENT_KEYS, *RESULT_KEYS})


def _is_content(key: str, keys: frozenset[str], strip_content: bool) -> bool:
    if key in keys:
        return True
    return strip_content and key.startswith(CONTENT_PREFIXES)


def _is_event_content(key: str) -> bool:
    """An event attribute that may carry content: a name events use for it, or any span content name."""
    return key in CONTENT_EVENT_KEYS or _is_content(key, CONTENT_KEYS, strip_content=True)


class ArgsHashingSpanProcessor(SpanProcessor):
    """Forwards every call to `inner`, handing it spans whose tool content is a hash.

    - `policy`: its volatile keys and foldings shape the hash, as the worker's would
      (the defaults when None). Use the policy file the worker reads.
    - `strip_content`: also drop prompts, completions and other content from every span.
    """

    def __init__(
        self, inner: SpanProcessor, policy: Policy | None = None, *, strip_content: bool = True
    ) -> None:
        self.inner = inner
        self.policy = policy or Policy()
        self.strip_content = strip_content
        self._keys = CONTENT_KEYS if strip_content else TOOL_CONTENT_KEYS
        self.errors = 0

    def on_start(self, span: Span, parent_context: context_api.Context | None = None) -> None:
        self.inner.on_start(span, parent_context=parent_context)

    def _on_ending(self, span: Span) -> None:
        self.inner._on_ending(span)

    def on_end(self, span: ReadableSpan) -> None:
        try:
            hashed = self.hashed(span)
        except Exception:
            self.errors += 1
            if self.errors <= 10 or self.errors % 1000 == 0:
                log.exception("hashing a span's tool arguments failed; its content is dropped")
            hashed = self._copy(span, {}, strip_tool_spans=True)
        self.inner.on_end(hashed)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)

    def hashed(self, span: ReadableSpan) -> ReadableSpan:
        """`span` as it may leave: content replaced by hashes (the same span if it has none)."""
        attributes = span.attributes or {}
        has_content = any(_is_content(key, self._keys, self.strip_content) for key in attributes)
        has_events = any(
            _is_event_content(key) for event in span.events for key in event.attributes or {}
        )
        if not has_content and not has_events:
            return span
        digests = self._digests(span)
        if digests is None and not self.strip_content:
            return span  # not a tool span, and other content may stay
        return self._copy(span, digests or {}, strip_tool_spans=False)

    def _digests(self, span: ReadableSpan) -> dict[str, str] | None:
        """The hashes of a tool span's arguments and result; None if it is no tool span."""
        attributes = span.attributes or {}
        present = WANTED_KEYS.intersection(attributes)
        slim = ReadableSpan(
            span.name,
            context=span.context,
            parent=span.parent,
            resource=span.resource,
            attributes={key: attributes[key] for key in present},
            events=span.events,
            instrumentation_scope=span.instrumentation_scope,
            start_time=span.start_time,
            end_time=span.end_time,
        )
        view = parse_view(encode_spans([slim]).SerializeToString())
        scope = span.instrumentation_scope.name if span.instrumentation_scope else ""
        view_span = view.resource_spans[0].scope_spans[0].spans[0]
        call = adapt_span(view_span, WANTED_KEYS, scope=scope)
        if not isinstance(call, ToolCall):
            return None
        policy = self.policy.for_attributes(self._match_attributes(span, attributes))
        digests = {}
        if call.args_digest is not None:
            digests[ARGS_HASH_KEY] = call.args_digest
        elif call.arguments is not MISSING:
            folding = policy.folding(call.tool_name) if policy.fold else frozenset()
            digests[ARGS_HASH_KEY] = args_hash(call.arguments, policy.volatile_keys, folding)
        if call.result_digest is not None:
            digests[RESULT_HASH_KEY] = call.result_digest
        elif call.result is not MISSING:
            digests[RESULT_HASH_KEY] = args_hash(call.result, policy.volatile_keys)
        return digests

    def _match_attributes(self, span: ReadableSpan, attributes: Mapping[str, Any]) -> dict:
        if not self.policy.rules:
            return {}
        wanted = self.policy.match_keys
        merged = {k: str(v) for k, v in span.resource.attributes.items() if k in wanted}
        merged.update((k, str(v)) for k, v in attributes.items() if k in wanted)
        return merged

    def _copy(
        self, span: ReadableSpan, digests: dict[str, str], *, strip_tool_spans: bool
    ) -> ReadableSpan:
        keys = CONTENT_KEYS if strip_tool_spans else self._keys
        strip = self.strip_content or strip_tool_spans
        attributes = {
            key: value
            for key, value in (span.attributes or {}).items()
            if not _is_content(key, keys, strip)
        }
        attributes.update(digests)
        events = [
            Event(
                event.name,
                {k: v for k, v in (event.attributes or {}).items() if not _is_event_content(k)},
                event.timestamp,
            )
            for event in span.events
        ]
        return ReadableSpan(
            span.name,
            context=span.context,
            parent=span.parent,
            resource=span.resource,
            attributes=attributes,
            events=events,
            links=span.links,
            kind=span.kind,
            status=span.status,
            start_time=span.start_time,
            end_time=span.end_time,
            instrumentation_scope=span.instrumentation_scope,
        )
