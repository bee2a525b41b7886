"""Multi-agent runs made by LangGraph (langgraph-supervisor, under OpenInference and
OpenLLMetry), Google ADK (sub-agents and agents as tools), A2A (two services, a2a-sdk),
Google ADK agents as services talking A2A (the trace carried across them or not) and VoltAgent
(a supervisor and its sub-agents, TypeScript), from scripted models (tests/fixtures/multi_agent/<framework>, made by tests/support/
multi_frameworks.py), replayed by `spanguard replay` on the shipped defaults.

Each fixture's agent tree is read here the way the conventions name agents (an `invoke_agent`
span's `gen_ai.agent.name`, OpenInference's AGENT kind, a2a-sdk's request handler named by its
service), so what each framework really shows of its agents is on record: names, nesting, how
many."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from functools import cache
from pathlib import Path

import pytest

from spanguard.detection.conventions.keys import (
    A2A_HANDLER_CLASSES,
    A2A_HANDLER_METHODS,
    A2A_SCOPE,
    AGENT_NAME,
    OPENINFERENCE_KIND,
    OPERATION,
    SERVICE_NAME,
)
from tests.support.multi_frameworks import (
    A2A,
    A2A_HOPS,
    A2A_SCENARIO,
    A2A_SERVICES,
    A2A_VARIANTS,
    ADK_A2A,
    ADK_A2A_HOST,
    ADK_A2A_INSTRUMENTATIONS,
    ADK_A2A_SCENARIOS,
    EXPECTED,
    FIXTURES,
    FRAMEWORKS,
    VOLTAGENT,
    VOLTAGENT_SCENARIOS,
    VOLTAGENT_VARIANT,
)
from tests.support.recorded_runs import replay_decisions, resources, spans

RUNS = (
    [
        (framework.name, instrumentation, scenario)
        for framework in FRAMEWORKS.values()
        for instrumentation in framework.instrumentations
        for scenario in framework.scenarios
    ]
    + [(A2A, variant, A2A_SCENARIO) for variant in A2A_VARIANTS]
    + [
        (ADK_A2A, instrumentation, scenario)
        for instrumentation in ADK_A2A_INSTRUMENTATIONS
        for scenario in ADK_A2A_SCENARIOS
    ]
    + [(VOLTAGENT, VOLTAGENT_VARIANT, scenario) for scenario in VOLTAGENT_SCENARIOS]
)


def path_of(root: Path, framework: str, instrumentation: str, scenario: str) -> Path:
    return root / framework / instrumentation / f"{scenario}.json.gz"


def attributes(span: dict) -> dict[str, dict]:
    return {attribute["key"]: attribute["value"] for attribute in span.get("attributes", ())}


@cache
def replayed(root: Path, framework: str, instrumentation: str) -> dict[str, list[dict]]:
    """Every scenario of one (framework, instrumentation) in one `spanguard replay`."""
    return replay_decisions(
        {
            scenario: path_of(root, framework, instrumentation, scenario)
            for name, inst, scenario in RUNS
            if (name, inst) == (framework, instrumentation)
        }
    )


def handoffs(path: Path) -> list[dict]:
    """The run's handoff spans (LangGraph's `transfer_to_<agent>` tools, ADK's
    `transfer_to_agent`), in the order they ended."""
    found = [
        span
        for span in spans(path)
        if "transfer_to_" in span["name"] and not span["name"].startswith("goto")
    ]
    return sorted(found, key=lambda span: int(span["endTimeUnixNano"]))


@pytest.mark.parametrize(("framework", "instrumentation", "scenario"), RUNS)
def test_each_scenario_is_decided_as_expected(framework, instrumentation, scenario):
    decisions = replayed(FIXTURES, framework, instrumentation)[scenario]
    expected = EXPECTED.get((framework, instrumentation, scenario))
    if expected is None:
        assert decisions == []
        return
    # One decision: LangGraph runs a fan-out's workers in threads, one inside another's time,
    # and the spans between them (each worker's graph node) say they are siblings, not nested.
    # Then those of agents running on past the kill, where a fixture's do.
    decision, *later = decisions
    assert tuple(d["rule"] for d in later) == expected.then
    assert (decision["rule"], decision["action"]) == (expected.rule, expected.action)
    assert tuple(decision.get("agents", ())) == expected.agents
    assert decision.get("depth") == expected.depth
    assert decision.get("sub_agents") == expected.sub_agents
    assert decision["tool_name"] == expected.handoff
    if expected.at is not None:
        # The handoff it trips at: the `at`-th of the run, in the order they ended.
        path = path_of(FIXTURES, framework, instrumentation, scenario)
        assert decision["span_id"] == handoffs(path)[expected.at - 1]["spanId"]


def a2a_handler_runs(path: Path) -> dict[str, str]:
    """{span id: its service} of the a2a-sdk request handler spans that are agent runs."""
    found = {}
    for resource in resources(path):
        service = next(
            attribute["value"]["stringValue"]
            for attribute in resource["resource"]["attributes"]
            if attribute["key"] == SERVICE_NAME
        )
        for scope in resource["scopeSpans"]:
            if scope["scope"]["name"] != A2A_SCOPE:
                continue
            for span in scope["spans"]:
                handler, method = span["name"].rsplit(".", 2)[-2:]
                if handler in A2A_HANDLER_CLASSES and method in A2A_HANDLER_METHODS:
                    found[span["spanId"]] = service
    return found


def agent_tree(path: Path) -> tuple[Counter[str | None], int, int]:
    """The agents a fixture holds as the conventions name them: (how many spans of each agent
    name, None where the span names none; the deepest nesting of agent spans; how many agent
    spans are inside another's). An a2a-sdk handler's run is named by its service."""
    every = spans(path)
    by_id = {span["spanId"]: span for span in every}
    agents: dict[str, str | None] = dict(a2a_handler_runs(path))
    for span in every:
        values = attributes(span)
        operation = values.get(OPERATION, {}).get("stringValue")
        kind = values.get(OPENINFERENCE_KIND, {}).get("stringValue")
        if operation == "invoke_agent" or kind == "AGENT":
            agents[span["spanId"]] = values.get(AGENT_NAME, {}).get("stringValue")
        elif values.get("entity.type", {}).get("stringValue") == "agent" and (
            "span.type" not in values
        ):  # VoltAgent's run: a sub-agent named by `subagent.name`
            name = values.get("subagent.name") or values["entity.name"]
            agents[span["spanId"]] = name["stringValue"]
    depths = []
    for span_id in agents:
        depth, parent = 1, by_id[span_id].get("parentSpanId")
        while parent in by_id:
            depth += parent in agents
            parent = by_id[parent].get("parentSpanId")
        depths.append(depth)
    return Counter(agents.values()), max(depths, default=0), sum(d > 1 for d in depths)


# (agent spans by name, deepest nesting, agent spans inside another's) per fixture.
# OpenLLMetry: `invoke_agent LangGraph` for the outer graph (and again around the supervisor's),
# then one per agent run. OpenInference's LangChain instrumentation: an AGENT span per model
# turn of a ReAct agent (named `agent`) and per worker run langgraph-supervisor starts
# (`call_agent`), none naming the agent (its name is only the graph node's, in `metadata`).
# Google ADK: `transfer_to_agent` starts the next agent beside the first (no nesting), an
# agent called as a tool runs inside the caller's span.
ROUTED = {"host": 3, "billing": 2, "refunds": 2, "shipping": 2}
TREES = {
    ("langgraph", "openinference", "handoff_pingpong"): ({None: 25}, 2, 8),
    ("langgraph", "openinference", "handoff_chain"): ({None: 9}, 2, 4),
    ("langgraph", "openinference", "handoff_with_work"): ({None: 17}, 2, 8),
    ("langgraph", "openinference", "fan_out_50"): ({None: 101}, 1, 0),
    ("langgraph", "openinference", "fan_out_5"): ({None: 11}, 1, 0),
    ("langgraph", "openllmetry", "handoff_pingpong"): (
        {"LangGraph": 2, "supervisor": 9, "worker_a": 8}, 3, 18,
    ),
    ("langgraph", "openllmetry", "handoff_chain"): (
        {"LangGraph": 2, "supervisor": 3, "worker_a": 1, "worker_b": 1}, 3, 6,
    ),
    ("langgraph", "openllmetry", "handoff_with_work"): (
        {"LangGraph": 2, "supervisor": 5, "worker_a": 4}, 3, 10,
    ),
    ("langgraph", "openllmetry", "fan_out_50"): (
        {"LangGraph": 2, "supervisor": 1, "worker_a": 25, "worker_b": 25}, 3, 52,
    ),
    ("langgraph", "openllmetry", "fan_out_5"): (
        {"LangGraph": 2, "supervisor": 1, "worker_a": 3, "worker_b": 2}, 3, 7,
    ),
    **{
        ("google_adk", capture, scenario): tree
        for capture in ("capture", "off")
        for scenario, tree in {
            "transfer_pingpong": ({"triage": 5, "billing": 4}, 1, 0),
            "transfer_chain": ({"triage": 1, "billing": 1, "refunds": 1}, 1, 0),
            "transfer_with_work": ({"triage": 5, "billing": 4}, 1, 0),
            "delegation_depth_6": ({f"a{level}": 1 for level in range(7)}, 7, 6),
            "delegation_depth_2": ({"a0": 1, "a1": 1, "a2": 1}, 3, 2),
            # A run per ask, each the root of a trace of its own.
            "linked_runs_repeat": ({"billing": 6}, 1, 0),
            "linked_runs_with_work": ({"billing": 4}, 1, 0),
        }.items()
    },
    # a2a-sdk: a run per request a service answers (its handler's span, named by the service);
    # carried across, the 9 nested requests are 9 runs nested in one another.
    (A2A, "sdk", A2A_SCENARIO): ({"billing-service": 5, "triage-service": 4}, 1, 0),
    (A2A, "propagated", A2A_SCENARIO): ({"billing-service": 5, "triage-service": 4}, 9, 8),
    # Google ADK over A2A: a host turn per handoff; each remote agent twice per request, the
    # caller's RemoteA2aAgent span beside the agent handing to it and the service's own span
    # inside that (the trace context carried by the httpx and ASGI instrumentations).
    (ADK_A2A, "capture", "routing_pingpong"): ({"host": 8, "billing": 8, "triage": 8}, 2, 8),
    (ADK_A2A, "capture", "pingpong"): ({"host": 1, "billing": 10, "triage": 8}, 10, 17),
    (ADK_A2A, "capture", "handoff_chain"): ({"host": 1, "billing": 2, "refunds": 2}, 3, 3),
    (ADK_A2A, "capture", "routing_chain"): (ROUTED, 2, 3),
    (ADK_A2A, "off", "routing_pingpong"): ({"host": 8, "billing": 8, "triage": 8}, 2, 8),
    (ADK_A2A, "off", "routing_chain"): (ROUTED, 2, 3),
    (ADK_A2A, "off", "pingpong"): ({"host": 1, "billing": 10, "triage": 8}, 10, 17),
    (ADK_A2A, "off", "handoff_chain"): ({"host": 1, "billing": 2, "refunds": 2}, 3, 3),
    # Not propagated: each request a service answers a trace of its own, nothing nested.
    (ADK_A2A, "unpropagated", "routing_pingpong"): ({"host": 8, "billing": 8, "triage": 8}, 1, 0),
    (ADK_A2A, "unpropagated", "pingpong"): ({"host": 1, "billing": 10, "triage": 8}, 1, 0),
    (ADK_A2A, "unpropagated", "handoff_chain"): ({"host": 1, "billing": 2, "refunds": 2}, 1, 0),
    (ADK_A2A, "unpropagated", "routing_chain"): (ROUTED, 1, 0),
    (ADK_A2A, "unpropagated_off", "routing_pingpong"): (
        {"host": 8, "billing": 8, "triage": 8}, 1, 0
    ),
    (ADK_A2A, "unpropagated_off", "routing_chain"): (ROUTED, 1, 0),
    (ADK_A2A, "unpropagated_off", "pingpong"): ({"host": 1, "billing": 10, "triage": 8}, 1, 0),
    (ADK_A2A, "unpropagated_off", "handoff_chain"): (
        {"host": 1, "billing": 2, "refunds": 2}, 1, 0
    ),
    # VoltAgent: the supervisor's run holds each sub-agent's, below its `delegate_task` span.
    **{
        (VOLTAGENT, VOLTAGENT_VARIANT, scenario): tree
        for scenario, tree in {
            "handoff_pingpong": ({"supervisor": 1, "worker_a": 8}, 2, 8),
            "handoff_chain": ({"supervisor": 1, "worker_a": 1, "worker_b": 1}, 2, 2),
            "handoff_with_work": ({"supervisor": 1, "worker_a": 4}, 2, 4),
            "fan_out_50": ({"supervisor": 1, "worker_a": 25, "worker_b": 25}, 2, 50),
            "fan_out_5": ({"supervisor": 1, "worker_a": 3, "worker_b": 2}, 2, 5),
            "delegation_depth_6": ({f"a{level}": 1 for level in range(7)}, 7, 6),
            "delegation_depth_2": ({"a0": 1, "a1": 1, "a2": 1}, 3, 2),
            # A run per ask, each the root of a trace of its own.
            "linked_runs_repeat": ({"billing": 6}, 1, 0),
            "linked_runs_with_work": ({"billing": 4}, 1, 0),
        }.items()
    },
}  # fmt: skip


@pytest.mark.parametrize(("framework", "instrumentation", "scenario"), RUNS)
def test_the_agent_tree_each_fixture_holds(framework, instrumentation, scenario):
    names, depth, inside = agent_tree(path_of(FIXTURES, framework, instrumentation, scenario))
    assert (dict(names), depth, inside) == TREES[(framework, instrumentation, scenario)]


def test_a2a_carries_the_trace_only_through_http_instrumentation():
    """a2a-sdk 1.3's own spans carry no attribute, no link and no trace context: each request a
    service answers is a trace of its own. With OpenTelemetry's httpx and ASGI
    instrumentations the W3C context crosses: the whole ping-pong is one trace."""
    sdk = path_of(FIXTURES, A2A, "sdk", A2A_SCENARIO)
    answered = [
        span for span in spans(sdk) if span["name"].endswith("JsonRpcDispatcher.handle_requests")
    ]
    assert len(answered) == A2A_HOPS + 1  # billing asked first, then back and forth
    assert len({span["traceId"] for span in answered}) == A2A_HOPS + 1
    assert all(not span.get("parentSpanId") for span in answered)
    assert all(not span.get("links") and not span.get("attributes") for span in spans(sdk))
    services = {
        attribute["value"]["stringValue"]
        for resource in resources(sdk)
        for attribute in resource["resource"]["attributes"]
        if attribute["key"] == "service.name"
    }
    assert services == {f"{name}-service" for name in A2A_SERVICES}

    propagated = path_of(FIXTURES, A2A, "propagated", A2A_SCENARIO)
    answered = [
        span
        for span in spans(propagated)
        if span["name"].endswith("JsonRpcDispatcher.handle_requests")
    ]
    assert len(answered) == A2A_HOPS + 1
    assert len({span["traceId"] for span in answered}) == 1


@pytest.mark.parametrize("instrumentation", ["capture", "off"])
@pytest.mark.parametrize("scenario", ADK_A2A_SCENARIOS)
def test_adk_over_a2a_is_one_trace_across_the_services(scenario, instrumentation):
    """The host's and every service's spans of one request share the host's trace: the
    httpx instrumentation carries the context out of the caller (RemoteA2aAgent's A2A
    client), the ASGI one into the service (`to_a2a`'s app); no span has a link."""
    path = path_of(FIXTURES, ADK_A2A, instrumentation, scenario)
    assert len({span["traceId"] for span in spans(path)}) == 1
    assert not any(span.get("links") for span in spans(path))
    services = {
        attribute["value"]["stringValue"]
        for resource in resources(path)
        for attribute in resource["resource"]["attributes"]
        if attribute["key"] == "service.name"
    }
    assert services == {f"{name}-service" for name in ADK_A2A_SCENARIOS[scenario]}
    assert ADK_A2A_HOST in ADK_A2A_SCENARIOS[scenario]


@pytest.mark.parametrize("instrumentation", ["unpropagated", "unpropagated_off"])
@pytest.mark.parametrize("scenario", ADK_A2A_SCENARIOS)
def test_adk_over_a2a_without_the_trace_carried_is_a_trace_per_request(scenario, instrumentation):
    """Without the httpx and ASGI instrumentations neither ADK nor a2a-sdk carries the trace
    context, or links a service's trace to its caller's: each request a service answers is a
    trace of its own, and its agent runs in it."""
    path = path_of(FIXTURES, ADK_A2A, instrumentation, scenario)
    every = spans(path)
    ids = {span["spanId"] for span in every}
    answered = [
        span for span in every if span["name"].endswith("JsonRpcDispatcher.handle_requests")
    ]
    assert all(span.get("parentSpanId") not in ids for span in answered)
    assert len({span["traceId"] for span in answered}) == len(answered) > 0
    host = {span["traceId"] for span in every if span["name"] == "support request"}
    assert len(host) == 1 and not host & {span["traceId"] for span in answered}
    assert not any(span.get("links") for span in every)


def summary(decision: dict) -> tuple:
    """What a regenerated fixture must decide again; the agents as a set: a fan-out's workers
    start in whatever order their threads run."""
    fields = ("rule", "action", "tool_name", "hits", "depth", "sub_agents")
    return (*(decision.get(key) for key in fields), sorted(decision.get("agents") or ()))


# Google ADK's row points its shared virtualenv at this checkout (pip install -e): under xdist
# the tests that build or install this checkout share one worker.
@pytest.mark.xdist_group("this_checkout_built")
@pytest.mark.parametrize("framework", [*FRAMEWORKS, A2A, ADK_A2A, VOLTAGENT])
def test_the_fixtures_are_what_the_libraries_emit_now(framework, tmp_path):
    """Made again from the installed libraries: the same decisions, the same agent trees."""
    if framework == VOLTAGENT:
        from tests.support.instrumented_agents import typescript_ready

        why_not = typescript_ready()
        if why_not is not None:
            pytest.skip(f"VoltAgent's agents not runnable here: {why_not}")
    if framework in ("google_adk", ADK_A2A):
        from tests.support.instrumented_agents import LIBRARIES, installed, make_venv

        library = LIBRARIES["google-adk"]
        if not installed(library):
            pytest.skip(
                "Google ADK's virtualenv: python -m tests.support.instrumented_agents --venv google-adk"
            )
        modules = ["a2a", "opentelemetry.instrumentation.asgi"] if framework == ADK_A2A else []
        if not installed_in(library.python, modules):
            make_venv(library)  # made before A2A was among its requirements: brought up to date
    subprocess.run(
        [sys.executable, "-m", "tests.support.multi_frameworks", framework, "--out", str(tmp_path)],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    for name, instrumentation, scenario in RUNS:
        if name != framework:
            continue
        fresh = replayed(tmp_path, name, instrumentation)[scenario]
        kept = replayed(FIXTURES, name, instrumentation)[scenario]
        assert [summary(d) for d in fresh] == [summary(d) for d in kept]
        tree = agent_tree(path_of(tmp_path, name, instrumentation, scenario))
        assert tree == agent_tree(path_of(FIXTURES, name, instrumentation, scenario))


def installed_in(python: str, modules: list[str]) -> bool:
    """Whether `python` imports every one of `modules` (a virtualenv made before they were
    among its requirements lacks them)."""
    if not modules:
        return True
    check = subprocess.run([python, "-c", "import " + ", ".join(modules)], capture_output=True)
    return check.returncode == 0


@pytest.mark.parametrize(
    ("instrumentation", "named"),
    [("capture", True), ("off", False), ("unpropagated", True), ("unpropagated_off", False)],
)
def test_adk_over_a2a_transfers_name_their_agent_only_with_content(instrumentation, named):
    """ADK's default records no tool arguments: a transfer then names no agent, and the guard
    works out whom it handed to from the spans that follow it (AgentTree.saw_agent)."""
    path = path_of(FIXTURES, ADK_A2A, instrumentation, "routing_chain")
    transfers = handoffs(path)
    assert len(transfers) == 3
    arguments = [attributes(span).get("gen_ai.tool.call.arguments") for span in transfers]
    if named:
        assert [json.loads(a["stringValue"])["agent_name"] for a in arguments] == [
            "billing", "refunds", "shipping"
        ]  # fmt: skip
    else:
        assert arguments == [None, None, None]


UNCARRIED_TOLD = "answers A2A requests that start a trace of their own"
NOT_CARRIED = {(A2A, "sdk"), (ADK_A2A, "unpropagated"), (ADK_A2A, "unpropagated_off")}


@pytest.mark.parametrize(
    ("framework", "instrumentation", "scenario"),
    [(A2A, variant, A2A_SCENARIO) for variant in A2A_VARIANTS]
    + [(ADK_A2A, instrumentation, "pingpong") for instrumentation in ADK_A2A_INSTRUMENTATIONS],
)
def test_requests_without_their_callers_trace_are_counted_and_told_once_per_service(
    framework, instrumentation, scenario
):
    """What the guard cannot join it says: each request a service answered in a trace of its
    own is counted, and each such service is named once, on the shipped defaults."""
    path = path_of(FIXTURES, framework, instrumentation, scenario)
    started: Counter[str] = Counter()  # service: the requests that started a trace there
    for resource in resources(path):
        [service] = [
            attribute["value"]["stringValue"]
            for attribute in resource["resource"]["attributes"]
            if attribute["key"] == SERVICE_NAME
        ]
        for scope_spans in resource["scopeSpans"]:
            for span in scope_spans["spans"]:
                if span["name"].endswith("JsonRpcDispatcher.handle_requests") and not span.get(
                    "parentSpanId"
                ):
                    started[service] += 1
    assert bool(started) == ((framework, instrumentation) in NOT_CARRIED)
    result = subprocess.run(
        [sys.executable, "-m", "spanguard.cli", "replay", str(path)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    told = [line for line in result.stderr.splitlines() if UNCARRIED_TOLD in line]
    assert sorted(line.split("service '")[1].split("'")[0] for line in told) == sorted(started)
    counted = f"{sum(started.values()):,} A2A requests without their caller's trace"
    assert (counted in result.stderr) == bool(started)


LINKED_TOLD = "starts each agent run in a trace of its own, linked to its caller's span"


@pytest.mark.parametrize("framework", sorted({name for name, _inst, _scenario in RUNS}))
def test_runs_linked_to_their_callers_trace_are_counted_and_told_once_per_service(framework):
    """VoltAgent starts each run in a trace of its own linked to the span current when it
    started (the fixtures' request span): counted and told (on the shipped defaults, with the
    conversation scope off, not followed). No other framework's fixture links a run to another
    trace."""
    paths = [
        path_of(FIXTURES, name, instrumentation, scenario)
        for name, instrumentation, scenario in RUNS
        if name == framework
    ]
    linked = 0  # root agent runs with a link to another trace, read from the fixtures
    for path in paths:
        for span in spans(path):
            values = attributes(span)
            run = values.get("entity.type", {}).get("stringValue") == "agent"
            run = run or values.get(OPERATION, {}).get("stringValue") == "invoke_agent"
            if run and not span.get("parentSpanId"):
                linked += any(link["traceId"] != span["traceId"] for link in span.get("links", ()))
    assert bool(linked) == (framework == VOLTAGENT)
    result = subprocess.run(
        [sys.executable, "-m", "spanguard.cli", "replay", *map(str, paths)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    told = [line for line in result.stderr.splitlines() if LINKED_TOLD in line]
    assert len(told) == (1 if linked else 0), told
    counted = f"{linked:,} agent runs linked to their caller's trace"
    assert (counted in result.stderr) == bool(linked), result.stderr[-2000:]
