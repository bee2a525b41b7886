"""`spanguard replay` (the real CLI) on spans the real instrumentation libraries emitted.

The files under tests/fixtures/instrumentation come from scripted agents run under each
library's own tracing (tests/support/instrumented_agents.py; the last test re-runs it). Each
(library, mode) is replayed in one CLI run over its six scenario files; decisions are matched
to scenarios by trace id.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from spanguard.schemas.decision import validate
from tests.support.instrumented_agents import FIXTURES, LIBRARIES, SCENARIOS, generate, installed
from tests.support.spans import tool_span_ids_in

CASES = [(name, mode) for name, library in LIBRARIES.items() for mode in library.modes]
# Modes whose spans carry the arguments (or their hash); the others carry none or placeholders.
RECORDED_MODES = frozenset({"capture", "hashed", "legacy", "latest"})
RECORDED = [case for case in CASES if case[1] in RECORDED_MODES]
NOT_RECORDED = [case for case in CASES if case[1] not in RECORDED_MODES]
HEALTHY = ("distinct", "retry", "polling")
LOOPS = ("loop_volatile", "loop_identical")
TOOL_NAME_KEYS = ("gen_ai.tool.name", "tool.name")

# The instrumentation each warning must name, and the exact setting it must give.
CAPTURE_HINTS = {
    "langgraph-openinference": ("OpenInference", "OPENINFERENCE_HIDE_INPUTS"),
    "openai-agents-openinference": ("OpenInference", "OPENINFERENCE_HIDE_INPUTS"),
    "smolagents-openinference": ("OpenInference", "OPENINFERENCE_HIDE_INPUTS"),
    "llama-index-openinference": ("OpenInference", "OPENINFERENCE_HIDE_INPUTS"),
    "langgraph-openllmetry": ("OpenLLMetry", "TRACELOOP_TRACE_CONTENT=true"),
    "openai-agents-otel": (
        "OTel GenAI bridge",
        "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=span_only",
    ),
    "pydantic-ai": ("pydantic-ai", "InstrumentationSettings(include_content=True)"),
    "google-adk": ("Google ADK", "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY"),
    "strands": ("strands-agents", "gen_ai_unredacted_attributes="),
}


@dataclass
class Replay:
    decisions: dict[str, list[dict]]  # scenario -> its decisions, in order
    stderr: str


def scenario_file(name: str, mode: str, scenario: str, root: Path = FIXTURES) -> Path:
    return root / name / mode / f"{scenario}.json.gz"


def read_request(path: Path) -> dict:
    return json.loads(gzip.decompress(path.read_bytes()))


def trace_ids(path: Path) -> set[str]:
    request = read_request(path)
    return {
        span["traceId"]
        for resource in request["resourceSpans"]
        for scope in resource["scopeSpans"]
        for span in scope["spans"]
    }


def hashed_decisions(decisions: dict[str, list[dict]]) -> dict[str, list[tuple]]:
    """Scenario -> (rule, action, hits, args_hash) of each decision: what a fixture's replay
    must reproduce."""
    return {
        s: [(d["rule"], d["action"], d["hits"], d["args_hash"]) for d in ds]
        for s, ds in decisions.items()
    }


def tool_span_ids(path: Path, tool: str) -> list[str]:
    """Span ids of the spans naming `tool`, in the order they started."""
    return tool_span_ids_in(read_request(path), {tool}, TOOL_NAME_KEYS)


def run_replay(name: str, mode: str, policy: Path | None = None, root: Path = FIXTURES) -> Replay:
    files = {scenario: scenario_file(name, mode, scenario, root) for scenario in SCENARIOS}
    command = [sys.executable, "-m", "spanguard.cli", "replay"]
    if policy is not None:
        command += ["--policy", str(policy)]
    result = subprocess.run(
        [*command, *map(str, files.values())], capture_output=True, text=True, check=True
    )
    owner = {trace: scenario for scenario, path in files.items() for trace in trace_ids(path)}
    decisions: dict[str, list[dict]] = {scenario: [] for scenario in SCENARIOS}
    for line in result.stdout.splitlines():
        record = json.loads(line)
        validate(record, "detection")
        decisions[owner[record["trace_id"]]].append(record)
    return Replay(decisions, result.stderr)


@cache
def replayed(name: str, mode: str) -> Replay:
    return run_replay(name, mode)


@pytest.mark.parametrize(("name", "mode"), RECORDED)
@pytest.mark.parametrize("scenario", LOOPS)
def test_a_loop_is_killed_at_its_third_call(name, mode, scenario):
    """With a volatile key changing (request_id) and with identical arguments alike."""
    [decision] = replayed(name, mode).decisions[scenario]
    assert (decision["rule"], decision["action"], decision["hits"]) == ("tool_loop", "kill", 3)
    third = tool_span_ids(scenario_file(name, mode, scenario), "search_docs")[2]
    assert decision["span_id"] == third
    assert decision["tool_name"] == "search_docs" and decision["result_hash"] is not None


@pytest.mark.parametrize(("name", "mode"), RECORDED)
def test_healthy_agents_are_untouched(name, mode):
    """12 distinct calls, a single retry, a job polled until done: no decision at all."""
    decisions = replayed(name, mode).decisions
    assert {scenario: decisions[scenario] for scenario in HEALTHY} == {
        scenario: [] for scenario in HEALTHY
    }


@pytest.mark.parametrize(("name", "mode"), RECORDED)
def test_different_calls_with_one_same_empty_result_are_flagged_as_no_progress(name, mode):
    [decision] = replayed(name, mode).decisions["no_progress"]
    assert (decision["rule"], decision["action"], decision["hits"]) == ("no_progress", "flag", 4)


@pytest.mark.parametrize(("name", "mode"), NOT_RECORDED)
def test_capture_off_or_redacted_never_kills_and_names_the_setting(name, mode):
    """Placeholders and absent arguments are 'not recorded', never arguments all alike."""
    replay = replayed(name, mode)
    assert replay.decisions == {scenario: [] for scenario in SCENARIOS}
    instrumentation, setting = CAPTURE_HINTS[name]
    warnings = [line for line in replay.stderr.splitlines() if "carry no arguments" in line]
    assert len(warnings) == 1, replay.stderr  # one warning per service and scope
    assert instrumentation in warnings[0] and setting in warnings[0]
    assert "ArgsHashingSpanProcessor" in warnings[0]
    summary = replay.stderr.splitlines()[-1]
    assert " 0 tool spans without arguments skipped" not in summary


@pytest.mark.parametrize(("name", "mode"), NOT_RECORDED)
def test_name_only_flags_but_never_kills_without_arguments(tmp_path, name, mode):
    policy = tmp_path / "policy.yaml"
    policy.write_text("defaults: {missing_args: name_only}\n")
    decisions = run_replay(name, mode, policy).decisions
    actions = {record["action"] for records in decisions.values() for record in records}
    assert actions == {"flag"}  # twelve different searches stay alive, whatever is recorded
    for scenario in LOOPS:
        [flag] = decisions[scenario]
        assert flag["rule"] == "tool_loop" and "tool name alone" in flag["reason"]
        assert flag["hits"] == 3


@pytest.mark.parametrize(
    "name", [name for name, library in LIBRARIES.items() if "hashed" in library.modes]
)
def test_hashed_spans_carry_the_same_hash_and_no_arguments(name):
    """ArgsHashingSpanProcessor in the agent: the worker gets the core's own hash, and no
    argument or result text in any attribute or event of any span."""
    captured = replayed(name, "capture").decisions["loop_identical"][0]
    hashed = replayed(name, "hashed").decisions["loop_identical"][0]
    assert hashed["args_hash"] == captured["args_hash"]
    assert hashed["result_hash"] == captured["result_hash"]
    for scenario, calls in SCENARIOS.items():
        path = scenario_file(name, "hashed", scenario)
        assert "spanguard.tool.args_hash" in gzip.decompress(path.read_bytes()).decode()
        # Each call's argument values and result; the shortest ("[]", "done") are too common.
        raw = {call.result for call in calls} | {
            str(v) for c in calls for v in c.arguments.values()
        }
        raw = {text for text in raw if len(text) >= 6} | {"refund"}
        leaks = {
            (span["name"], where, text)
            for span, where, value in span_texts(read_request(path))
            for text in raw
            if text in value
        }
        assert not leaks, f"{scenario}: {sorted(leaks)[:3]}"


def span_texts(request: dict):
    """(span, where, text) for every string in every span's attributes and events."""
    for resource in request["resourceSpans"]:
        for scope in resource["scopeSpans"]:
            for span in scope["spans"]:
                for attribute in span.get("attributes", ()):
                    for text in strings(attribute["value"]):
                        yield span, attribute["key"], text
                for event in span.get("events", ()):
                    for attribute in event.get("attributes", ()):
                        for text in strings(attribute["value"]):
                            yield span, f"{event['name']} event: {attribute['key']}", text


def strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)


@pytest.mark.parametrize(("name", "mode"), [case for case in RECORDED if case[1] == "capture"])
def test_polling_has_its_own_threshold(tmp_path, name, mode):
    policy = tmp_path / "policy.yaml"
    policy.write_text("defaults: {polling: {window: 10, threshold: 6}}\n")
    decisions = run_replay(name, mode, policy).decisions
    # The job's status moves on every call ("10% done", "20% done" ...): however low the
    # threshold, a poll that makes progress is not stopped for its count alone.
    assert decisions["polling"] == []
    assert [d["rule"] for d in decisions["loop_identical"]] == ["tool_loop"]


# Points the libraries' shared virtualenvs at this checkout (pip install -e): under xdist the
# tests that build or install this checkout share one worker.
@pytest.mark.xdist_group("this_checkout_built")
def test_the_generator_reproduces_the_fixtures(tmp_path):
    """Re-run the scripted agents under every installed library (capture mode): same decisions."""
    done = generate(list(LIBRARIES), tmp_path, modes={"capture"})
    missing = [
        name for name, library in LIBRARIES.items() if installed(library) and name not in done
    ]
    assert not missing
    if not done:
        pytest.skip("no instrumentation library installed (extra instrumentation-tests)")
    for name in done:
        fresh = run_replay(name, "capture", root=tmp_path).decisions
        kept = replayed(name, "capture").decisions
        assert hashed_decisions(fresh) == hashed_decisions(kept), name
