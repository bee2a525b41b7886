"""What the worker does with one Kafka message, without Kafka: route, detect, or dead-letter.

The worker's span agent (`SpanAgent`, streams/agents/guard_spans.py; streams/app.py builds the
pipeline) feeds each message here and sends what comes back; `spanguard backtest`
(spanguard/detection/backtest.py) drives it over a topic's history. Keeping this Faust-free
lets the tests and the benchmarks drive the same routing.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from spanguard.detection.guard import Guard
from spanguard.detection.slim import slim_part
from spanguard.errors import OtlpDecodeError
from spanguard.outcomes import CountedOutcome
from spanguard.schemas.decision import Decision
from spanguard.schemas.otlp import split_by_trace, split_serialized
from spanguard.schemas.otlp_view import not_a_trace_request, parse_view

__all__ = ["MAX_RECORD_BYTES", "Outcome", "PipelineCount", "SpanPipeline"]

log = logging.getLogger("spanguard.pipeline")

# Every record the worker writes stays under the topics' default max.message.bytes (1 MiB),
# with room for its key and headers.
MAX_RECORD_BYTES = 900_000


class PipelineCount(CountedOutcome):
    """What the pipeline counts: each member names a counter of SpanPipeline."""

    MESSAGES = "messages"  # every message handed to `handle`
    REPARTITIONED = "repartitioned"  # split by trace and handed back for re-keying
    DEAD_LETTERS = "dead_letters"  # bad input, sent (whole or in part) to the dead letters


@dataclass
class Outcome:
    """Decisions taken (possibly none), parts to re-key, and what goes to the dead letters."""

    decisions: list[Decision] = field(default_factory=list)
    repartition: list[tuple[str, bytes]] = field(default_factory=list)  # (trace id, request)
    dead_letter: str | None = None  # the reason
    # The bytes to dead-letter when they are not the whole message: the spans that were bad.
    dead_value: bytes | None = None
    # A root span ended in this message: an agent invocation may be over (goal verifier).
    has_root_span: bool = False


class SpanPipeline:
    def __init__(self, guard: Guard, home: Callable[[str], int] | None = None) -> None:
        self.guard = guard
        # The partition a trace's state lives on (streams/partitioner.py): a repartitioned
        # message whose traces all live on the partition it was read from is decided there.
        self.home = home
        self.messages = 0
        self.repartitioned = 0
        self.dead_letters = 0

    def count(self, outcome: PipelineCount) -> int:
        counted: int = getattr(self, outcome.value)
        return counted

    def handle(
        self, key: bytes | None, value: bytes | None, partition: int | None = None
    ) -> Outcome:
        """One message of the input topic, or of the repartition topic's `partition`.

        A message keyed by the hex trace id of the single trace it holds (what the Collector's
        kafka exporter writes with partition_traces_by_id) is run through the core, and so is
        a repartitioned one whose traces all live on the partition it was read from (`home`):
        the hop packs every trace bound for a partition into one record. Any other message is
        split by trace and handed back for re-keying, so a trace's state lives in exactly one
        partition, and its unkeyed spans all take the same hop, in order. Anything that is not
        an OTLP request is a dead letter.
        """
        self.messages += 1
        if not value:
            return self._dead("empty message: expected an OTLP ExportTraceServiceRequest")
        if not isinstance(value, bytes):
            return self._dead(f"message value is {type(value).__name__}, not bytes")
        try:
            view = parse_view(value)  # the one decode: the guard reads this view
        except OtlpDecodeError as exc:
            return self._dead(str(exc))
        # Parsing is not enough: a metrics request parses too (see schemas/otlp_view.py).
        foreign = not_a_trace_request(value)
        if foreign is not None:
            return self._dead(f"not an OTLP ExportTraceServiceRequest: {foreign}")

        span_trace_ids: list[bytes] = []  # in order: the wire split checks its reading
        has_root_span = False
        for resource_spans in view.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    span_trace_ids.append(span.trace_id)
                    if not span.parent_span_id:
                        has_root_span = True
        trace_ids = set(span_trace_ids)
        if not trace_ids:
            return Outcome()
        bad = [trace_id for trace_id in trace_ids if len(trace_id) != 16]
        if len(bad) == len(trace_ids):
            return self._dead(_bad_trace_id(len(bad[0])))

        keyed = (
            len(trace_ids) == 1 and key is not None and key == next(iter(trace_ids)).hex().encode()
        )
        if keyed or (
            partition is not None
            and self.home is not None
            and not bad
            and all(self.home(trace_id.hex()) == partition for trace_id in trace_ids)
        ):
            try:
                return Outcome(decisions=self.guard.process_view(view), has_root_span=has_root_span)
            except Exception as exc:  # a bug must cost one message, never the partition
                log.exception("detection failed on a message; sent to the dead-letter topic")
                return self._dead(f"internal error in detection: {type(exc).__name__}: {exc}")

        return self._repartition(value, span_trace_ids)

    def _repartition(self, value: bytes, span_trace_ids: list[bytes]) -> Outcome:
        """A message to split: one part per trace, handed back for re-keying; the parts with a
        bad trace id, or too large for a record, are its dead letter."""
        try:
            parts = _split(value, span_trace_ids)
        except DecodeError as exc:
            return self._dead(f"not an OTLP ExportTraceServiceRequest: {exc}")
        self.repartitioned += 1
        outcome = Outcome()
        dead: list[bytes] = []  # serialized requests concatenate into one
        reasons: list[str] = []
        for raw_id, part in parts.items():
            if len(raw_id) != 16:  # only the spans with a bad trace id are dead letters
                reasons.append(_bad_trace_id(len(raw_id)))
                dead.append(part)
                continue
            trace_id, data = raw_id.hex(), part
            if len(data) > MAX_RECORD_BYTES:  # too large for a record: keep what rules read
                with contextlib.suppress(DecodeError):  # unparsable: dead-lettered below
                    request = ExportTraceServiceRequest.FromString(part)
                    data = slim_part(request, self.guard.wanted_keys).SerializeToString()
            if len(data) > MAX_RECORD_BYTES:
                reasons.append(
                    f"the spans of trace {trace_id} hold {len(data)} bytes the rules read,"
                    f" over the {MAX_RECORD_BYTES}-byte limit of a record"
                )
                dead.append(part)
                continue
            outcome.repartition.append((trace_id, data))
        if reasons:
            self.dead_letters += 1
            outcome.dead_letter = "; ".join(dict.fromkeys(reasons))
            outcome.dead_value = b"".join(dead)
        return outcome

    def _dead(self, reason: str) -> Outcome:
        self.dead_letters += 1
        return Outcome(dead_letter=reason)


def _split(value: bytes, span_trace_ids: list[bytes]) -> dict[bytes, bytes]:
    """One serialized request per raw trace id. Cut out of the bytes where the encoding allows
    (split_serialized: a fourth of the time) and each span's trace id reads as protobuf read
    it, else parsed, split and serialized again; the latter without decode_protobuf's id
    checks, since a bad trace id is split off by the caller."""
    parts = split_serialized(value, span_trace_ids)
    if parts is not None:
        return parts
    request = ExportTraceServiceRequest.FromString(value)
    return {
        bytes.fromhex(trace_id): part.SerializeToString()
        for trace_id, part in split_by_trace(request).items()
    }


def _bad_trace_id(length: int) -> str:
    return f"a span has a {length}-byte trace id (OTLP requires 16 bytes)"
