"""`python -m bench.bench_tool_scope`: what the tool scope costs a worker, in process.

The worker's parts of the tool scope without Kafka or Faust, over the scope phase's corpus
(bench/corpus.py's mix, every span naming its conversation as in bench/bench_scopes.py), in
requests of `--message-spans` spans over many traces, as the repartition hop packs them. Per
request, as the span agent does: the guard with the conversation and agent scopes' recorders
(`SCOPES_POLICY`, bench/bench_pipeline.py's), then each recorder told the request's message.
Every `HOLD_MESSAGES` requests the records are drained, and the tool call rows encoded, as
the span agent sends them; the tool scope agent's side decodes each record and counts its
rows (`WorkerFleet.observe_rows`) into windows kept by the scope's view over a dict, flushed
every `FLUSH_MESSAGES` requests. Run with the tool scope off (no tool call sink) and on, pair
after pair in one process: CPU time per span by part, and the off/on ratio of each pair.
`--profile` prints cProfile's top functions of one run with the tool scope on.
`python scripts/compiled_core.py run -m bench.bench_tool_scope` runs the compiled core.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time
from dataclasses import dataclass

import yaml

from bench.bench_pipeline import SCOPES_POLICY
from bench.bench_scopes import with_conversations
from bench.corpus import build_corpus, corpus_parser
from spanguard.detection.guard import Guard
from spanguard.schemas.policy import Policy
from spanguard.schemas.scope_records import decode_tool_calls, encode_tool_calls
from spanguard.streams.agent_windows import AgentUsageRecorder
from spanguard.streams.conversations import ConversationRecorder
from spanguard.streams.faust_internals import event_context
from spanguard.streams.tool_scope import ToolCallRecorder, WorkerFleet, tool_window_view

HOLD_MESSAGES = 80  # the scope hold's 0.2 s at about 30,000 spans/s
FLUSH_MESSAGES = 400  # the commit interval's 1 s
PARTS = ("guard", "records", "agent", "flush")


@dataclass
class _Message:
    topic: str
    partition: int
    offset: int


class _Event:
    """What the scope's view reads of Faust's current event: its message."""

    def __init__(self, message: _Message) -> None:
        self.message = message


def run(requests: list[bytes], policy: Policy, tools: bool) -> dict[str, float]:
    """One pass over `requests` as the worker takes them; CPU seconds by part."""
    conversations = ConversationRecorder(policy)
    usage = AgentUsageRecorder(policy)
    recorder = ToolCallRecorder() if tools else None
    guard = Guard(policy, conversations=conversations, agent_budgets=usage, tools=recorder)
    windows = tool_window_view(policy.fleet)({}, 60.0, 5000)
    fleet = WorkerFleet(policy, windows, clock=lambda: 1e9)
    spent = dict.fromkeys(PARTS, 0.0)
    clock = time.process_time
    windows.begin_batch()
    for index, data in enumerate(requests):
        message = _Message("spans", index % 8, index)
        start = clock()
        decisions = guard.process(data)
        decided = clock()
        conversations.sourced(message)
        usage.sourced(message)
        if recorder is not None:
            recorder.hand_decisions(decisions)
            recorder.sourced(message)
        spent["guard"] += decided - start
        spent["records"] += clock() - decided
        if index % HOLD_MESSAGES == HOLD_MESSAGES - 1:
            start = clock()
            conversations.drain()
            usage.drain()
            encoded: dict[str, bytes] = {}
            if recorder is not None:
                rows, sources = recorder.drain()
                where = [(f"{m.topic}:{m.partition}", m.offset) for m in sources]
                encoded = encode_tool_calls(rows, where)
            drained = clock()
            for number, (key, value) in enumerate(encoded.items()):
                with event_context(_Event(_Message("tool-calls", number % 2, index))):
                    fleet.observe_rows(*decode_tool_calls(key.encode(), value))
            spent["records"] += drained - start
            spent["agent"] += clock() - drained
        if index % FLUSH_MESSAGES == FLUSH_MESSAGES - 1:
            start = clock()
            windows.flush()
            windows.begin_batch()
            spent["flush"] += clock() - start
    return spent


def main() -> int:
    parser = corpus_parser(__doc__)
    parser.add_argument("--message-spans", type=int, default=75)
    parser.add_argument("--profile", action="store_true")
    parser.set_defaults(traces=3_000, runs=5)
    args = parser.parse_args()
    corpus = build_corpus(args.spans, args.traces, batch_spans=args.message_spans)
    requests = with_conversations(corpus.requests)
    policy = Policy.from_mapping(yaml.safe_load(SCOPES_POLICY))
    if args.profile:
        profiler = cProfile.Profile(time.process_time)
        profiler.runcall(run, requests, policy, True)
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(30)
        return 0
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for _ in range(args.runs):
        for tools in (False, True):
            runs[tools].append(run(requests, policy, tools))
    print(f"corpus: {corpus.spans:,} spans, {len(requests):,} requests; CPU us per span, best run")
    for tools, label in ((False, "tool scope off"), (True, "tool scope on")):
        parts = {part: min(r[part] for r in runs[tools]) for part in PARTS}
        total = min(sum(r.values()) for r in runs[tools])
        print(
            f"{label:<15}: {total / corpus.spans * 1e6:6.2f}  ("
            + ", ".join(f"{part} {parts[part] / corpus.spans * 1e6:.2f}" for part in PARTS)
            + ")"
        )
    ratios = [
        sum(off.values()) / sum(on.values())
        for off, on in zip(runs[False], runs[True], strict=True)
    ]
    print(
        f"off/on CPU ratio: median {statistics.median(ratios):.3f} ("
        + ", ".join(f"{ratio:.3f}" for ratio in ratios)
        + ")"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
