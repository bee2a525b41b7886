"""CPU per span of the worker's pipeline on Collector batches, outside Kafka and Faust.

The Collector's batches as the shipped configuration writes them (one record holding about
630 spans, a ResourceSpans per SDK export of 1 to 3 spans of one trace), split by trace the
two ways the worker can (the wire split it takes, protobuf's parse-regroup-serialize it falls
back on), then the pipeline on the whole batch and on the packed records of the repartition
hop, decided in place. Times are CPU time of this process, best of `--runs`: other load on a
shared machine barely moves them. The last line is one JSON object.

    python -m bench.bench_split
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from bench.corpus import build_corpus
from spanguard.detection.guard import Guard
from spanguard.detection.pipeline import SpanPipeline
from spanguard.schemas.otlp import split_by_trace, split_serialized
from spanguard.schemas.otlp_view import parse_view
from spanguard.streams.partitioner import collector_partition

# Corpus requests (one trace, 1-3 spans each) per Collector batch: about 630 spans.
EXPORTS_PER_BATCH = 315


def per_span(records: list, spans: int, call: Callable[..., object], runs: int) -> float:
    """Microseconds of CPU per span, best of `runs` passes over `records`."""
    best = float("inf")
    for _ in range(runs):
        started = time.process_time()
        for record in records:
            call(*record) if isinstance(record, tuple) else call(record)
        best = min(best, time.process_time() - started)
    return best / spans * 1e6


def protobuf_split(data: bytes) -> list[bytes]:
    parts = split_by_trace(ExportTraceServiceRequest.FromString(data))
    return [part.SerializeToString() for part in parts.values()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spans", type=int, default=64_000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    corpus = build_corpus(args.spans, 1_000, per_trace=True, message_spans=(1, 3), seed=11)
    batches = [
        b"".join(corpus.requests[at : at + EXPORTS_PER_BATCH])
        for at in range(0, len(corpus.requests), EXPORTS_PER_BATCH)
    ]

    def home(trace_id: str) -> int:
        return collector_partition(trace_id.encode(), args.partitions)

    packs: dict[int, list[bytes]] = {}
    for batch in batches:  # the repartition hop's records: a batch's traces per partition
        by_partition: dict[int, list[bytes]] = {}
        for trace_id, part in SpanPipeline(Guard(), home=home).handle(None, batch).repartition:
            by_partition.setdefault(home(trace_id), []).append(part)
        for partition, parts in by_partition.items():
            packs.setdefault(partition, []).append(b"".join(parts))
    packed = [(None, pack, partition) for partition, chunk in packs.items() for pack in chunk]
    spans, runs = corpus.spans, args.runs
    figures = {
        "parse_view_us": per_span(batches, spans, parse_view, runs),
        "protobuf_split_us": per_span(batches, spans, protobuf_split, runs),
        "wire_split_us": per_span(batches, spans, split_serialized, runs),
        "pipeline_batch_us": per_span(
            [(None, batch, None) for batch in batches],
            spans,
            SpanPipeline(Guard(), home=home).handle,
            runs,
        ),
        # One guard across the runs: its states warm, as a worker's are.
        "pipeline_packs_us": per_span(packed, spans, SpanPipeline(Guard(), home=home).handle, runs),
    }
    print(
        f"{len(batches)} Collector batches of {spans / len(batches):.0f} spans, {len(packed)}"
        f" packed records; CPU per span, best of {runs}:"
    )
    for name, value in figures.items():
        print(f"  {name:20} {value:6.2f} us")
    print(json.dumps({name: round(value, 2) for name, value in figures.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
