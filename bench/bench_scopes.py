"""`python -m bench.bench_scopes`: what money and the conversation scope cost the core.

The corpus of `make bench` (bench/corpus.py: 30% tool spans, 40% chat spans naming gpt-4o with
usage, the rest other spans), with a `gen_ai.conversation.id` on every span, six traces to a
conversation. Three guards run over it, pair after pair on one core (CPU time, best of runs):
(1) a token budget, the base; (2) also a usd budget per trace (every chat span priced from
genai-prices' database); (3) also the conversation scope (tool_loop, cycle and a conversation
token and usd budget over every conversation's calls and usage). Prints spans/s and each
one's ratio to the base; the last line is one JSON object.
"""

from __future__ import annotations

import json
import statistics

from bench.bench_core import _best
from bench.corpus import build_corpus, corpus_parser
from spanguard.detection.conversation import ConversationGuard
from spanguard.detection.guard import Guard
from spanguard.schemas.otlp import ExportTraceServiceRequest
from spanguard.schemas.policy import Policy

TRACES_PER_CONVERSATION = 6


def with_conversations(requests: list[bytes], prefix: str = "conv") -> list[bytes]:
    """The same requests, every span naming its trace's conversation (`prefix`-N)."""
    numbers: dict[bytes, int] = {}
    out = []
    for data in requests:
        request = ExportTraceServiceRequest.FromString(data)
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    number = numbers.setdefault(span.trace_id, len(numbers))
                    kv = span.attributes.add()
                    kv.key = "gen_ai.conversation.id"
                    kv.value.string_value = f"{prefix}-{number // TRACES_PER_CONVERSATION}"
        out.append(request.SerializeToString())
    return out


def main() -> int:
    args = corpus_parser(__doc__).parse_args()
    corpus = build_corpus(args.spans, args.traces)
    requests = with_conversations(corpus.requests)
    huge = 10**9
    base = Policy.from_mapping({"defaults": {"token_budget": huge}})
    money = Policy.from_mapping({"defaults": {"token_budget": huge, "usd_budget": huge}})
    scoped = Policy.from_mapping(
        {
            "defaults": {
                "token_budget": huge,
                "usd_budget": huge,
                "conversation": {"enabled": True, "token_budget": huge, "usd_budget": huge},
            }
        }
    )

    def run(policy: Policy, conversations: bool) -> Guard:
        guard = Guard(policy, conversations=ConversationGuard(policy) if conversations else None)
        for data in requests:
            guard.process(data)
        return guard

    times: dict[str, list[float]] = {"base": [], "money": [], "scopes": []}
    for _ in range(args.runs):
        times["base"].append(_best(1, lambda: run(base, False)))
        times["money"].append(_best(1, lambda: run(money, False)))
        times["scopes"].append(_best(1, lambda: run(scoped, True)))
    rates = {name: corpus.spans / min(values) for name, values in times.items()}
    ratios = {
        name: statistics.median(b / t for b, t in zip(times["base"], values, strict=True))
        for name, values in times.items()
    }
    guard = run(scoped, True)
    assert isinstance(guard.conversations, ConversationGuard)
    print(
        f"corpus: {corpus.spans:,} spans over {args.traces:,} traces,"
        f" {TRACES_PER_CONVERSATION} traces a conversation"
    )
    for name, label in (
        ("base", "token budget (base)"),
        ("money", "+ usd budget per trace"),
        ("scopes", "+ conversation scope"),
    ):
        print(f"{label:<26}: {rates[name]:10,.0f} spans/s  ({ratios[name]:.3f} of base)")
    print(
        f"priced usage spans: {guard.stats.priced_usage:,}, unpriced: {guard.stats.unpriced_usage:,};"
        f" conversations: {len(guard.conversations.states):,},"
        f" calls seen by the scope: {guard.conversations.calls:,}"
    )
    print(
        json.dumps(
            {
                "spans_per_s": {k: round(v) for k, v in rates.items()},
                "ratio_to_base": {k: round(v, 3) for k, v in ratios.items()},
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
