"""The pipeline benchmark's own arithmetic: the stages of a kill's latency, the profile's parts,
and the corpus's share of looping traces (no broker: the figures they print depend on these)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from bench.bench_pipeline import (
    STATUS_ERROR,
    Latency,
    bursts,
    fleet_corpus,
    fleet_decision_times,
    latency_stages,
    print_flush_overlap,
    rate_target,
)
from bench.corpus import TOOLS, build_corpus
from bench.worker_profile import summarize
from spanguard.detection.fleet import FleetCall

NAMES = ("collector", "hop", "decide", "signal", "total")
ROOT = "/srv/spanguard"
SITE = "/usr/lib/python3.11/site-packages"
TOOL_NAME = "gen_ai.tool.name"


def test_a_kills_stages_add_up_to_its_latency() -> None:
    ended = {"a1": 1_000, "b2": 2_000}
    input_at = {"a1": 1_030, "b2": 2_041}
    hop_at = {"a1": 1_042, "b2": 2_300}
    kills = [("a1", 1_050, 1_055), ("b2", 2_310, 2_318)]
    stages = latency_stages(kills, ended, input_at, hop_at)
    assert [{name: kill[name] for name in NAMES} for kill in stages] == [
        {"collector": 30, "hop": 12, "decide": 8, "signal": 5, "total": 55},
        {"collector": 41, "hop": 259, "decide": 10, "signal": 8, "total": 318},
    ]
    for kill in stages:
        assert kill["collector"] + kill["hop"] + kill["decide"] + kill["signal"] == kill["total"]


def test_a_kill_whose_span_is_missing_from_a_topic_is_left_out() -> None:
    ended = {"a1": 1_000, "b2": 2_000}
    stages = latency_stages(
        [("a1", 1_050, 1_055), ("b2", 2_310, 2_318)],
        ended,
        input_at={"a1": 1_030, "b2": 2_041},
        hop_at={"b2": 2_300},  # a1's repartition record was not read
    )
    assert [kill["total"] for kill in stages] == [318]


def test_a_packed_records_kill_has_no_hop() -> None:
    stages = latency_stages(
        [("a1", 1_050, 1_055)], {"a1": 1_000}, input_at={"a1": 1_030}, hop_at={}, packed=True
    )
    assert [{name: kill[name] for name in NAMES} for kill in stages] == [
        {"collector": 30, "hop": 0, "decide": 20, "signal": 5, "total": 55}
    ]


def test_the_profile_puts_each_sample_in_its_most_specific_part(tmp_path: Path) -> None:
    batch = f"guard_batch ({ROOT}/streams/agents/guard_spans.py:140)"
    decide = f"SpanAgent.decide ({ROOT}/streams/agents/guard_spans.py:170)"
    handle = f"SpanPipeline.handle ({ROOT}/spanguard/detection/pipeline.py:120)"
    raw = tmp_path / "raw.txt"
    raw.write_text(
        "\n".join(
            [
                # the core inside the pipeline: the core's
                f"{batch};{decide};{handle};Guard.process_view ({ROOT}/spanguard/detection/guard.py:300)"
                f";args_hash ({ROOT}/spanguard/detection/canonical.py:80) 6",
                # the pipeline splitting an input record
                f"{batch};{decide};{handle};split_by_trace ({ROOT}/schemas/otlp.py:170) 3",
                # the flush writing through Faust's table: the flush's
                f"{batch};WriteBack.flush ({ROOT}/streams/write_back.py:160);flush ({ROOT}/streams/"
                f"decoded_states.py:100);send_changelog ({SITE}/faust/tables/base.py:400) 2",
                f"_fetch ({SITE}/aiokafka/consumer/fetcher.py:500) 4",
                f"EpollSelector.select ({SITE}/selectors.py:468) 5",  # waiting: left out
                f"emit ({SITE}/logging/__init__.py:1100) 5",
            ]
        )
        + "\n"
    )
    summary = summarize(raw)
    assert (summary.samples, summary.idle) == (20, 5)
    shares = dict(summary.shares)
    assert shares["detection core (guard, rules)"] == 6 / 20
    assert shares["split by trace (Collector batches)"] == 3 / 20
    assert shares["state flush: encode, table write, changelog send"] == 2 / 20
    assert shares["aiokafka consumer: fetch, decode"] == 4 / 20
    assert shares["other"] == 5 / 20
    assert summary.top_frames[0] == ("args_hash (detection/canonical.py)", 6 / 20)
    # By stage: the split is the batch's decode, the flush is state.
    assert dict(summary.stages) == {
        "state": 2 / 20,
        "rules": 6 / 20,
        "decode": 3 / 20,
        "produce": 0.0,
        "fetch": 4 / 20,
        "other": 5 / 20,
    }


def test_the_latency_corpus_can_loop_more_traces() -> None:
    few = build_corpus(4_000, 100, per_trace=True, message_spans=(1, 3), seed=8)
    many = build_corpus(4_000, 100, per_trace=True, message_spans=(1, 3), seed=8, loop_every=4)
    assert len(few.looping_traces) == 5
    assert len(many.looping_traces) == 25


def test_changelog_records_close_together_make_one_flush() -> None:
    times = [1_000, 1_010, 1_040, 1_200, 1_230, 2_000]
    assert bursts(times, gap=50) == [(1_000, 1_040, 3), (1_200, 1_230, 2), (2_000, 2_000, 1)]


def test_a_kill_counts_as_waiting_on_a_flush_that_ran_while_it_was_on_its_way() -> None:
    flushes = [(1_000, 1_100, 900), (2_000, 2_050, 800)]
    kills = [
        {"input": 950, "detected": 1_300, "total": 400},  # the first flush ran meanwhile
        {"input": 1_500, "detected": 1_560, "total": 90},  # between flushes
        {"input": 1_090, "detected": 1_120, "total": 60},  # during the first flush's tail
        {"input": 2_060, "detected": 2_100, "total": 50},  # after the second
    ]
    share = print_flush_overlap(kills, flushes)
    assert share == {"slowest_tenth": 1.0, "rest": 1 / 3}


def test_the_fleet_corpus_breaks_one_fresh_tool_a_segment_from_its_first_third() -> None:
    rate, segment_s = 1_000.0, 3.0
    mix = {"per_trace": True, "message_spans": (1, 3)}
    requests, failing = fleet_corpus(rate, segment_s, 2, mix)
    assert failing == [f"{TOOLS[0]}-0", f"{TOOLS[1]}-1"]
    spans = 0
    errors: dict[str, list[float]] = {}
    for data in requests:
        at = spans / rate
        for resource_spans in ExportTraceServiceRequest.FromString(data).resource_spans:
            for span in resource_spans.scope_spans[0].spans:
                spans += 1
                names = [a.value.string_value for a in span.attributes if a.key == TOOL_NAME]
                if names and span.status.code == STATUS_ERROR:
                    errors.setdefault(names[0], []).append(at)
                if names:  # every tool call names its segment's fresh key
                    assert names[0].endswith(f"-{min(int(at // segment_s), 1)}")
    assert sorted(errors) == sorted(failing)
    assert min(errors[failing[0]]) >= segment_s / 3
    assert max(errors[failing[0]]) < segment_s
    assert min(errors[failing[1]]) >= segment_s + segment_s / 3


def _incident(tool: str, ended_ms: int, rule: str = "tool_failing", action: str = "flag") -> bytes:
    ended = datetime.fromtimestamp(ended_ms / 1000, UTC).isoformat(timespec="milliseconds")
    record = {"scope": "tool", "tool": tool, "rule": rule, "action": action}
    record["decision_id"] = f"{tool}:{rule}:{action}"
    return json.dumps({**record, "span_ended_at": ended}).encode()


def test_a_fleet_incidents_decision_time_runs_from_its_crossing_spans_arrival() -> None:
    crossed = 1_800_000_000_000  # ms
    crossings = {
        "search_web-0": FleetCall("search_web-0", "", "t1", "a", crossed * 1_000_000, True, False)
    }
    records = [
        {"value": _incident("search_web-0", crossed), "timestamp_ms": crossed + 240},
        # The same incident's record taken again: counted once, at its first append.
        {"value": _incident("search_web-0", crossed), "timestamp_ms": crossed + 900},
        {"value": _incident("search_web-0", crossed, action="recovered"), "timestamp_ms": 0},
        {"value": _incident("run_sql-0", crossed, rule="loop_signature"), "timestamp_ms": 0},
        {"value": _incident("fetch_url-1", crossed + 5), "timestamp_ms": crossed + 9_000},
    ]
    tools = ["search_web-0", "fetch_url-1"]
    # fetch_url-1's incident opened, but the oracle saw it never cross: not timed.
    assert fleet_decision_times(records, crossings, tools) == ([240], 2, 1, 1)


def test_a_latency_run_that_could_not_post_its_rate_is_not_judged_at_it() -> None:
    cores = {"others": 0.0}
    reached = Latency(40.0, 80.0, 90.0, 10, 10, 9_800.0, cores, rate=10_000.0)
    short = Latency(40.0, 80.0, 90.0, 10, 10, 6_100.0, cores, rate=10_000.0)
    assert rate_target(reached) == "met (80 ms over 10 kills)"
    assert rate_target(short).startswith("NOT REACHED (offered 10,000 spans/s, posted 6,100;")
