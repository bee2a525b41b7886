"""Precision on runs of real agents: the corpus of tests/fixtures/realruns (recorded runs of
agents nobody here wrote, labelled by hand) and the peers' own loop-detection suites
(tests/fixtures/peer_suites), each run turned into OTLP spans by the OpenTelemetry SDK and
replayed through the guard on the shipped default policy (tests/support/realruns.py).

`pytest -s` prints the table per source and rule. A default changes only with this table
beside it: docs/rules.md holds the figures, and the floors below fail on a regression.
"""

from __future__ import annotations

import gzip
import re
from collections import Counter
from functools import cache

from tests.support.realruns import (
    PEER_SETTINGS,
    PEERS,
    RUNS,
    fleet_line,
    is_agent_call,
    load_labels,
    load_runs,
    needs_label,
    peer_policy,
    precision,
    render,
    replay,
)

REAL_SOURCES = ("swe", "tau-forks")


@cache
def table():
    return precision(list(replay(load_runs())), load_labels())


def test_the_corpus_is_real_runs_of_several_harnesses_and_kinds_of_work():
    runs = load_runs(REAL_SOURCES)
    assert len(runs) >= 1000
    assert len({run.harness for run in runs}) >= 3
    assert {run.kind for run in runs} >= {"service", "coding"}
    assert len({run.run for run in runs}) == len(runs)


def test_every_run_a_rule_decides_on_or_that_repeats_a_call_is_labelled():
    labels = load_labels()
    missing = [
        run.run for run in load_runs(REAL_SOURCES) if needs_label(run) and run.run not in labels
    ]
    assert missing == []
    unlabelled = sorted({run for cell in table().values() for run in cell.unlabelled})
    assert unlabelled == [], (
        "label these runs (python -m tests.support.realruns --blind --show ...)"
    )


def test_labels_name_a_call_of_their_run():
    runs = {run.run: run for run in load_runs(REAL_SOURCES)}
    for run_id, label in load_labels().items():
        assert run_id in runs, run_id
        assert label["verdict"] in ("loop", "healthy") and label["why"], run_id
        if label["verdict"] == "loop":
            assert 1 <= label["stop_at"] <= len(runs[run_id].tool_steps), run_id


def test_the_recorded_runs_hold_no_credentials():
    key = re.compile(
        r"sk-(?:proj-|ant-)?[A-Za-z0-9_\-]{20,}|AKIA[0-9A-Z]{16}|gh[pousr]_[A-Za-z0-9]{30,}"
        r"|AIza[0-9A-Za-z_\-]{35}|hf_[A-Za-z0-9]{30,}|xox[abposr]-[A-Za-z0-9\-]{10,}"
    )
    for path in [*RUNS.glob("*.jsonl.gz"), *PEERS.glob("*.json")]:
        text = (
            gzip.decompress(path.read_bytes()).decode()
            if path.suffix == ".gz"
            else path.read_text()
        )
        assert not key.search(text), path.name


def test_the_real_runs_table(capsys):
    """Kills on healthy runs: none. Flags: at most one in a thousand runs. Loops: caught at
    the call where a person stops them, or the one after."""
    cells = table()
    with capsys.disabled():
        print("\n" + render(cells))
    runs = sum(cells[(source, "any")].runs for source in REAL_SOURCES)
    assert sum(cells[(source, "any")].healthy_kills for source in REAL_SOURCES) == 0
    assert sum(cells[(source, "any")].healthy_flags for source in REAL_SOURCES) * 1000 <= runs
    loops = sum(cells[(source, "any")].loops for source in REAL_SOURCES)
    in_time = sum(cells[(source, "any")].caught_in_time for source in REAL_SOURCES)
    assert loops >= 24
    assert in_time * 24 >= 20 * loops, f"{in_time} of {loops} loops caught in time"


def test_the_recorded_runs_as_one_fleet_open_no_fleet_incident():
    """Issue 44's target: no fleet incident on a healthy corpus. The recorded runs as a fleet
    that ran them at once, every span (tool and model calls) through one guard with the
    fleet rules on at their defaults."""
    line = fleet_line(load_runs(REAL_SOURCES))
    print(line)
    assert line.endswith(": 0 incidents"), line


def test_the_peers_suites():
    """At the shipped defaults: 38 of their 45 stuck cases are caught (at their call or
    before it); the other seven wait for a peer's setting (user turns counted through, a lower
    threshold). Of their not-stuck cases, only Gemini CLI's two (four identical calls with
    nothing between; a round of three calls made three times) are decided: at Gemini CLI's own
    limits they are not (the next test)."""
    cells = table()
    peers = sorted(source for source, rule in cells if source.startswith("peer:") and rule == "any")
    assert len(peers) == 5
    stuck = sum(cells[(peer, "any")].loops for peer in peers)
    caught = sum(
        cells[(peer, "any")].caught_in_time + cells[(peer, "any")].caught_early for peer in peers
    )
    decided_healthy = {peer: cells[(peer, "any")].healthy_kills for peer in peers}
    assert caught >= 37 and stuck == 45, (caught, stuck)
    assert decided_healthy == {peer: 2 if peer == "peer:gemini-cli" else 0 for peer in peers}


def test_the_peers_suites_on_settings_like_theirs(capsys):
    """On the settings docs/rules.md gives for an agent like each peer ("Settings like a
    peer's"), every in-remit stuck case is caught at the peer's call or before it, and no
    not-stuck case is decided."""
    runs = [run for run in load_runs(PEER_SETTINGS) if run.in_remit]
    cells = precision(list(replay(runs, policy_of=peer_policy)), load_labels())
    with capsys.disabled():
        print("\n" + render(cells))
    peers = sorted(PEER_SETTINGS)
    assert sum(cells[(peer, "any")].loops for peer in peers) == 45
    for peer in peers:
        cell = cells[(peer, "any")]
        assert cell.missed == cell.caught_late == 0, peer
        assert cell.healthy_kills == cell.healthy_flags == 0, peer


def test_downgrade_first_spares_the_coding_loops_that_escape_and_still_kills_the_stuck():
    """`action: downgrade` on the coding runs (docs/rules.md, "Kill or downgrade first"): the
    loops an agent left on its own and then resolved its task are downgraded, not killed; the
    loops it never left are still killed a few calls after the downgrade (on recorded runs the
    agent never read the downgrade's message, so this is the least it does)."""
    from spanguard.schemas.policy import Policy

    labels = load_labels()
    runs = [run for run in load_runs(["swe"]) if labels.get(run.run, {}).get("verdict")]
    policy = Policy.from_mapping({"defaults": {"action": "downgrade"}})
    outcomes = Counter()
    for found in replay(runs, policy):
        label = labels[found.run.run]
        actions = {action for _rule, action, _at in found.decisions}
        if label["verdict"] == "healthy":
            assert not actions, found.run.run
            continue
        kind = "escaped" if label.get("escaped") else "stuck"
        killed = "kill" in actions
        outcomes[(kind, found.run.outcome, killed)] += 1
    escaped_resolved = (
        outcomes[("escaped", "success", False)] + outcomes[("escaped", "success", True)]
    )
    assert escaped_resolved >= 5
    assert outcomes[("escaped", "success", True)] <= 1
    stuck = sum(count for (kind, _, _), count in outcomes.items() if kind == "stuck")
    stuck_killed = sum(
        count for (kind, _, killed), count in outcomes.items() if kind == "stuck" and killed
    )
    assert stuck_killed * 4 >= stuck * 3, (stuck_killed, stuck)


def test_calls_a_user_device_made_are_not_the_agents_spans():
    """tau2's user simulator calls tools on its own phone (`user:` steps): not the agent's."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    from tests.support.realruns import to_request

    runs = [
        run
        for run in load_runs(["tau-forks"])
        if any(step["type"] == "tool" and not is_agent_call(step) for step in run.steps)
    ]
    assert runs
    for run in runs[:20]:
        request, calls = to_request(run)
        names = [
            span.name
            for resource in ExportTraceServiceRequest.FromString(request).resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]
        assert not any("user:" in name for name in names)
        assert len(calls) == len(run.tool_steps) == sum(n.startswith("execute_tool") for n in names)


def test_hostile_runs_are_decided_in_bounded_state_and_never_raise():
    """Thousands of calls, results of megabytes that are not JSON, one call id on hundreds of
    calls, spans out of order: decided, and the trace's state stays bounded."""
    from spanguard.detection.guard import Guard
    from spanguard.schemas.otlp_view import parse_view
    from tests.support.realruns import Run, to_request

    steps = [{"type": "user", "text": "go"}]
    for index in range(3000):
        steps.append({"type": "model", "text": ""})
        steps.append(
            {
                "type": "tool",
                "name": "search",
                "id": "call_0" if index % 7 else None,
                "arguments": {"q": str(index % 50)},
                "result": ("x" * 2_000_000 + "\\u0000{") if index % 500 == 0 else f"r{index % 9}",
                "error": index % 11 == 0,
            }
        )
    run = Run("hostile", "hostile", "hostile", "service", None, steps)
    request, _calls = to_request(run)
    view = parse_view(request)
    spans = view.resource_spans[0].scope_spans[0].spans
    reordered = list(spans)[::-1]  # the ends arrive last first
    del spans[:]
    spans.extend(reordered)
    guard = Guard()
    decisions = guard.process_view(view)
    assert guard.stats.malformed_spans == 0 and guard.stats.tool_calls > 0
    [state] = guard.states.values()
    assert len(state.window) <= 10 and len(state.recent_call_ids) <= 50
    assert all(decision.trace_id == next(iter(guard.states)) for decision in decisions)
