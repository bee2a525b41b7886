"""The fleet view's kernel (spanguard/detection/fleet.py): one broken tool across many agents is
one incident; a healthy fleet, one agent hammering a tool alone, or a tool failing for a few
traces among thousands is none. The corpora and the precision table: tests/support/fleet.py."""

from __future__ import annotations

import pytest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from spanguard.detection.conventions.events import ToolCall
from spanguard.detection.conventions.values import MAX_TEXT_CHARS
from spanguard.detection.fleet import (
    LOOP_SIGNATURE,
    MAX_NAME_CHARS,
    MAX_TRACES,
    OVERFLOW_TOOL,
    RESYNC_EVENTS,
    TOOL_FAILING,
    FleetCall,
    FleetGuard,
    FleetWindow,
    incident_decision,
    incident_trace_id,
    server_of,
    tool_call,
)
from spanguard.detection.fleet_signals import containment_signals
from spanguard.detection.guard import Guard
from spanguard.detection.results import EMPTY, ERROR
from spanguard.schemas.decision import Decision, kill_signals, validate
from spanguard.schemas.policy import FleetPolicy, FleetPolicyError, Policy
from tests.support.fleet import (
    BASE_NS,
    CORPORA,
    SECOND,
    first_crossing,
    model_requests,
    replay,
    synthetic_fleet,
)

POLICY = FleetPolicy(enabled=True)


def call(trace: int, at: float, *, failed: bool = False, tool: str = "search", **kw) -> FleetCall:
    return FleetCall(
        tool=tool,
        server=kw.get("server", ""),
        trace_id=f"trace-{trace}",
        agent=kw.get("agent", f"agent-{trace}"),
        end_time_unix_nano=BASE_NS + int(at * SECOND),
        failed=failed,
        empty=kw.get("empty", False),
    )


def feed(window: FleetWindow, calls: list[FleetCall]) -> list:
    return [found for c in calls if (found := window.observe(c)) is not None]


# The settings ------------------------------------------------------------------------------


def test_the_fleet_is_off_by_default_and_flags():
    policy = FleetPolicy()
    assert (policy.enabled, policy.action, policy.window, policy.step) == (False, "flag", 300, 30)
    assert policy.steps == 10


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"action": "kill"}, "action"),
        ({"min_traces": 0}, "min_traces"),
        ({"min_traces": True}, "min_traces"),
        ({"min_fraction": 0}, "min_fraction"),
        ({"min_fraction": 1.5}, "min_fraction"),
        ({"min_fraction": float("nan")}, "min_fraction"),
        ({"min_fraction": "half"}, "min_fraction"),
        ({"window": 20}, "window"),
        ({"window": 100}, "window"),  # not a whole number of 30-second steps
        ({"step": 0}, "step"),
        ({"max_tools": 0}, "max_tools"),
        ({"recover_after": 0}, "recover_after"),
        ({"loop_traces": 1}, "loop_traces"),
        ({"enabled": "yes"}, "enabled"),
        ({"windw": 300}, "windw"),
    ],
)
def test_a_bad_setting_is_an_error_that_names_it(settings, field):
    with pytest.raises(FleetPolicyError, match=f"^fleet.{field}: ") as raised:
        FleetPolicy.from_mapping(settings)
    assert raised.value.field == field


# What is counted ---------------------------------------------------------------------------


def test_a_tool_call_fails_on_its_span_or_its_error_shaped_result_and_is_empty_on_nothing():
    made = ToolCall(b"12345678", "search", {}, None, None, None, end_time_unix_nano=5)
    assert (tool_call(made, None, "t", "a").failed, tool_call(made, None, "t", "a").empty) == (
        False,
        False,
    )
    assert tool_call(made, ERROR, "t", "a").failed
    assert tool_call(made, EMPTY, "t", "a").empty
    made.failed = True
    assert tool_call(made, "0123456789abcdef", "t", "a").failed


def test_the_server_is_the_mcp_conventions_server_address_and_port():
    assert server_of({"server.address": "mcp.example", "server.port": 443}) == "mcp.example:443"
    assert server_of({"server.address": "mcp.example"}) == "mcp.example"
    assert server_of({"gen_ai.tool.type": "extension"}) == ""
    assert server_of({"server.address": AnyValue(string_value="x")}) == "x"
    assert len(server_of({"server.address": "s" * 10**6})) <= MAX_NAME_CHARS


def test_step_buckets_count_calls_failures_empties_decisions_traces_and_agents():
    window = FleetWindow(POLICY)
    feed(window, [call(1, 0), call(1, 1, failed=True), call(2, 2, empty=True, agent="agent-1")])
    window.observe_decision("search", "", "abc", "trace-1", BASE_NS + 3 * SECOND)
    figures = window.key_figures("search")
    assert figures is not None
    assert {k: figures[k] for k in ("calls", "failures", "empties", "decisions")} == {
        "calls": 3,
        "failures": 1,
        "empties": 1,
        "decisions": 1,
    }
    assert (figures["traces"], figures["agents"], figures["trace_steps"]) == (2, 1, 2)


# One incident per cause ----------------------------------------------------------------------


def test_a_tool_failing_for_many_traces_is_one_incident_until_it_answers_again():
    window = FleetWindow(POLICY)
    opened = feed(window, [call(t, t, failed=True) for t in range(30)])
    assert [(i.rule, i.tool) for i in opened] == [(TOOL_FAILING, "search")]
    [incident] = opened
    assert incident.opened_at_ns == BASE_NS + 7 * SECOND  # the 8th failing trace
    assert incident.figures["failing_traces"] == 8 and len(incident.traces) == 8
    assert incident.dedup_key == f"fleet:tool_failing:search:{incident.opened_step}"
    recovered = feed(window, [call(100 + t, 40 + t) for t in range(3)])
    assert recovered == [incident] and incident.recovered_at_ns == BASE_NS + 42 * SECOND
    assert window.open_incidents() == []
    # The traces that failed before the recovery are not counted again: a new cause is needed.
    assert feed(window, [call(t, 50, failed=True) for t in range(7)]) == []


def test_a_summed_row_is_judged_by_its_last_call_and_counts_every_call():
    """The tool call topic sums a trace's calls of one span message into a row: the calls
    before the last ended before it, so an answer before a failure is no recovery, and a
    failure before an answer is no failing trace."""
    window = FleetWindow(POLICY)
    [incident] = feed(window, [call(t, t, failed=True) for t in range(8)])
    at = BASE_NS + 20 * SECOND
    # Traces that answered once, then failed, in one message each: still failing.
    for trace in range(100, 110):
        assert window.observe_summed("search", "", f"trace-{trace}", "a", at, (2, 1, 0, 1)) == []
    assert window.open_incidents() == [incident]
    figures = window.key_figures("search")
    assert figures is not None
    assert (figures["calls"], figures["failures"], figures["traces"]) == (28, 18, 18)
    # Traces whose last call answered recover it, whatever failed before.
    found = [
        window.observe_summed("search", "", f"trace-{trace}", "a", at, (5, 4, 0, 0))
        for trace in range(200, 203)
    ]
    assert found == [[], [], [incident]] and window.open_incidents() == []
    # Failures before an answer open nothing on a fresh tool.
    fresh = FleetWindow(POLICY)
    rows = [(f"trace-{t}", (3, 2, 0, 0)) for t in range(20)]
    assert [fresh.observe_summed("lookup", "", t, "a", at, row) for t, row in rows] == [[]] * 20
    fresh_figures = fresh.key_figures("lookup")
    assert fresh_figures is not None and fresh_figures["failures"] == 40


def test_a_server_of_its_own_is_a_tool_of_its_own():
    window = FleetWindow(POLICY)
    calls = [call(t, t, failed=True, server="a:1" if t % 2 else "b:2") for t in range(14)]
    assert feed(window, calls) == []  # 7 failing traces on each server
    assert len(feed(window, [call(99, 20, failed=True, server="b:2")])) == 1
    assert [i.server for i in window.open_incidents()] == ["b:2"]


def test_failing_traces_must_be_a_fraction_of_those_calling():
    window = FleetWindow(POLICY)
    feed(window, [call(t, 0) for t in range(100)])
    assert feed(window, [call(100 + t, 1 + t, failed=True) for t in range(60)]) == []
    assert window.key_figures("search")["failures"] == 60


def test_traces_leave_the_window_and_the_tick_decides_when_that_crosses_the_fraction():
    window = FleetWindow(POLICY)
    feed(window, [call(t, 0) for t in range(20)])
    assert feed(window, [call(100 + t, 200, failed=True) for t in range(10)]) == []
    assert window.tick(BASE_NS + 299 * SECOND) == []
    [incident] = window.tick(BASE_NS + 301 * SECOND)  # the healthy traces of step 0 left
    assert incident.figures["traces"] == 10


def test_a_loop_signature_killing_several_traces_is_one_incident():
    window = FleetWindow(POLICY)
    hits = [
        window.observe_decision("search", "", "h1", f"t{n}", BASE_NS + n * SECOND) for n in range(5)
    ]
    assert [i.rule if i else None for i in hits] == [None, None, LOOP_SIGNATURE, None, None]
    assert hits[2].signature == "h1" and hits[2].traces == ["t2", "t1", "t0"]
    # One trace killed over and over, or three different calls: no fleet loop.
    other = FleetWindow(POLICY)
    for n in range(5):
        assert other.observe_decision("fetch", "", "same", "t0", BASE_NS + n * SECOND) is None
        assert other.observe_decision("read", "", f"h{n}", f"t{n}", BASE_NS + n * SECOND) is None


def test_a_loop_incident_recovers_after_a_quiet_window_of_answers():
    window = FleetWindow(POLICY)
    for n in range(3):
        window.observe_decision("search", "", "h1", f"t{n}", BASE_NS + n * SECOND)
    assert feed(window, [call(t, 10 + t) for t in range(5)]) == []  # still within the window
    window.tick(BASE_NS + 400 * SECOND)  # the scope's clock: a quiet fleet is no clock jump
    [recovered] = feed(window, [call(t, 400 + t) for t in range(3)])
    assert recovered.rule == LOOP_SIGNATURE and not recovered.open


# Bad input ------------------------------------------------------------------------------------


def test_tools_past_max_tools_fold_into_an_overflow_bucket_that_never_decides():
    window = FleetWindow(FleetPolicy(enabled=True, max_tools=3))
    calls = [call(t, 1, failed=True, tool=f"tool-{t % 50}") for t in range(2000)]
    assert feed(window, calls) == [] or all(
        i.tool in {"tool-0", "tool-1", "tool-2"} for i in window.incidents
    )
    assert len(window.keys) == 3
    assert window.overflow_calls == 2000 - 3 * 40
    assert window.key_figures(OVERFLOW_TOOL)["calls"] == window.overflow_calls


def test_a_megabyte_tool_name_is_bounded_and_spans_without_a_name_are_not_counted():
    window = FleetWindow(POLICY)
    made = ToolCall(b"12345678", "x" * 10**6, {}, None, None, None)
    assert len(tool_call(made, None, "t", "a").tool) <= MAX_TEXT_CHARS
    assert window.observe(call(1, 0, tool="")) is None
    assert (window.unnamed, window.keys) == (1, {})


def test_clocks_that_jump_are_counted_and_ignored_and_a_moved_clock_is_followed():
    window = FleetWindow(POLICY)
    window.observe(call(1, 0))
    for at in (10**6, -(10**6), 3600):
        assert window.observe(call(2, at, failed=True)) is None
    assert window.clock_jumps == 3 and window.key_figures("search")["calls"] == 1
    for n in range(RESYNC_EVENTS):
        window.observe(call(n, 7200 + n / 100))
    # 61 in a row ahead (the 3 above started the run): the window restarts at the new time.
    assert window.clock_resets == 1 and window.key_figures("search")["calls"] == 4


def test_a_key_remembers_at_most_max_traces():
    window = FleetWindow(POLICY)
    feed(window, [call(t, t / 1000) for t in range(MAX_TRACES + 10)])
    figures = window.key_figures("search")
    assert (figures["traces"], figures["forgotten_traces"]) == (MAX_TRACES, 10)


# Fleets -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet_of_200():
    return synthetic_fleet()


def test_a_fleet_of_200_agents_whose_tool_breaks_at_minute_2_is_one_incident(fleet_of_200):
    calls = fleet_of_200
    window = FleetWindow(POLICY)
    changed = feed(window, calls)
    opened = [i for i in changed if i.recovered_at_ns == 0 or i.opened_at_ns]
    assert len({id(i) for i in opened}) == 1
    [incident] = window.incidents
    assert (incident.rule, incident.tool) == (TOOL_FAILING, "search_docs")
    crossing = first_crossing(calls, "search_docs", POLICY)
    assert crossing is not None and incident.opened_at_ns == crossing.end_time_unix_nano
    # Decided on the span that crossed: well within one step of it.
    assert incident.opened_at_ns - crossing.end_time_unix_nano < POLICY.step * SECOND
    assert BASE_NS + 120 * SECOND < incident.opened_at_ns < BASE_NS + 240 * SECOND
    assert incident.figures["agents"] > 100 and len(incident.agents) == 20
    assert BASE_NS + 360 * SECOND <= incident.recovered_at_ns < BASE_NS + 390 * SECOND


def test_one_agent_hammering_a_failing_tool_alone_is_no_fleet_incident(fleet_of_200):
    hammer = [call(10**6, 120 + n / 10, failed=True, tool="search_docs") for n in range(900)]
    window = FleetWindow(POLICY)
    healthy = [c for c in fleet_of_200 if not c.failed]
    assert feed(window, sorted([*healthy, *hammer], key=lambda c: c.end_time_unix_nano)) == []
    assert window.observe_decision("search_docs", "", "h", "trace-1000000", BASE_NS) is None
    assert window.incidents == []


def test_a_tool_failing_for_a_few_traces_among_thousands_is_no_incident():
    calls = synthetic_fleet(agents=3000, spans=60_000, fails=(0, 0))
    assert len({c.trace_id for c in calls if c.tool == "search_docs"}) > 1500
    failing = sorted({c.trace_id for c in calls if c.tool == "search_docs"})[:40]
    for c in calls:
        if c.tool == "search_docs" and c.trace_id in failing:
            c.failed = True
    window = FleetWindow(POLICY)
    assert feed(window, calls) == [] and window.incidents == []


# The precision table ----------------------------------------------------------------------------


@pytest.mark.parametrize("corpus", list(CORPORA))
def test_healthy_corpora_replayed_as_one_fleet_open_no_incident_at_the_defaults(corpus):
    run = replay(corpus, CORPORA[corpus](), POLICY)
    assert run.tool_calls > 500
    if corpus.startswith("bench corpus as shipped"):
        # Its one trace in twenty loops on one call, search_docs("refund policy"): a fleet
        # loop by construction, and one incident, not one per trace.
        assert [(i.rule, i.tool) for i in run.incidents] == [(LOOP_SIGNATURE, "search_docs")]
    else:
        assert run.incidents == []


# The incident as a decision record --------------------------------------------------------


def test_an_incident_is_a_tool_scoped_decision_that_round_trips_and_the_schema_accepts(
    fleet_of_200,
):
    window = FleetWindow(POLICY)
    feed(window, fleet_of_200)
    [incident] = window.incidents
    recovered = incident_decision(incident, POLICY)
    assert recovered.action == "recovered"
    incident.recovered_at_ns = 0  # as it was when it opened
    opened = incident_decision(incident, POLICY)
    assert (opened.rule, opened.action, opened.scope_kind) == (TOOL_FAILING, "flag", "tool")
    assert opened.scope is not None and opened.scope.tool == "search_docs"
    assert len(opened.scope.trace_ids or []) == 20 and len(opened.evidence.agents or []) == 20
    assert opened.evidence.hits == incident.figures["failing_traces"]
    assert (opened.evidence.tool_name, opened.evidence.window) == ("search_docs", 300)
    for decision in (opened, recovered):
        record = decision.to_dict()
        validate(record, "detection")
        assert Decision.from_json(decision.to_json()) == decision
        assert (record["scope"], record["tool"]) == ("tool", "search_docs")
        assert kill_signals(decision) == []  # containment is a signal of its own
    # One incident, one trace id, and a decision id per record; the same after a crash.
    assert opened.trace_id == recovered.trace_id == incident_trace_id(incident)
    assert opened.decision_id != recovered.decision_id
    assert incident_decision(incident, POLICY).decision_id == opened.decision_id
    contained = incident_decision(incident, FleetPolicy(enabled=True, action="contain"))
    assert contained.action == "contain" and contained.decision_id != opened.decision_id
    shadowed = incident_decision(
        incident, contained_policy := FleetPolicy(action="contain"), shadow=True
    )
    assert shadowed.action == "flag" and contained_policy.action == "contain"


def test_a_loop_signature_incident_names_its_arguments_and_the_server():
    window = FleetWindow(POLICY)
    found = [
        window.observe_decision(
            "lookup", "mcp.example:443", "00112233445566ff", f"{n:032x}", BASE_NS
        )
        for n in range(POLICY.loop_traces)
    ]
    incident = found[-1]
    assert incident is not None and incident.rule == LOOP_SIGNATURE
    decision = incident_decision(incident, POLICY)
    record = decision.to_dict()
    validate(record, "detection")
    assert (record["args_hash"], record["server"], record["hits"]) == (
        "00112233445566ff",
        "mcp.example:443",
        POLICY.loop_traces,
    )
    assert record["trace_ids"] == [f"{n:032x}" for n in reversed(range(POLICY.loop_traces))]
    assert "traces" not in record  # no call of the tool counted: no distinct traces
    assert Decision.from_dict(record) == decision


def test_a_trace_decision_has_none_of_the_tool_scope_keys():
    record = Decision.from_json(
        '{"trace_id":"' + "1" * 32 + '","span_id":"' + "2" * 16 + '","rule":"tool_loop",'
        '"action":"kill","reason":"r","agent":{"service":"s","name":null},'
        '"detected_at":"2026-01-01T00:00:00.000+00:00","schema_version":1,'
        '"decision_id":"' + "3" * 32 + '"}'
    ).to_dict()
    assert not {"tool", "server", "trace_ids", "agents", "scope"} & record.keys()


def test_failures_that_arrive_after_the_recovery_but_ended_before_it_open_no_second_incident():
    window = FleetWindow(POLICY)
    feed(window, [call(trace, 1 + trace / 10, failed=True) for trace in range(10)])
    recovered = feed(window, [call(100 + n, 20 + n) for n in range(POLICY.recover_after)])
    assert [i.recovered_at_ns > 0 for i in recovered] == [True]
    # Another partition's rows, minutes behind: failed calls of the incident, not a new one.
    assert feed(window, [call(200 + t, 10 + t / 10, failed=True) for t in range(20)]) == []
    assert len(window.incidents) == 1
    assert [i.rule for i in feed(window, [call(300 + t, 30, failed=True) for t in range(20)])] == [
        TOOL_FAILING
    ]


# Model calls, through the trace guard ---------------------------------------------------------


def test_the_guard_hands_inference_spans_to_the_tool_scope_as_calls_of_their_model():
    policy = Policy.from_mapping({"fleet": {"enabled": True}})
    guard = Guard(policy, tools=FleetGuard(policy))
    decided = [d for r in model_requests(POLICY.min_traces + 2, True) for d in guard.process(r)]
    [incident] = decided  # the provider down for the fleet: one incident, not one per trace
    assert (incident.rule, incident.action, incident.scope_kind) == (TOOL_FAILING, "flag", "tool")
    assert incident.scope is not None and incident.scope.tool == "model:openai/gpt-4o"
    assert incident.evidence.hits == POLICY.min_traces
    assert incident.evidence.agents == ["support-agent"]
    # Healthy model calls, and the same failing ones with the fleet off, decide nothing.
    healthy = Guard(policy, tools=FleetGuard(policy))
    assert [d for r in model_requests(20, False) for d in healthy.process(r)] == []
    off = Guard(Policy(), tools=FleetGuard(Policy()))
    assert [d for r in model_requests(20, True) for d in off.process(r)] == []


def test_a_model_incident_flags_and_sends_no_signal_under_a_containing_policy():
    policy = Policy.from_mapping({"fleet": {"enabled": True, "action": "contain"}})
    guard = Guard(policy, tools=FleetGuard(policy))
    [incident] = [d for r in model_requests(12, True) for d in guard.process(r)]
    assert incident.action == "flag"  # no client checks a model as a tool: nothing to contain
    assert containment_signals(incident, policy.fleet) == []
