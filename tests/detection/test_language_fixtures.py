"""`spanguard replay` on spans real TypeScript and Go agent frameworks emitted (scripted models).

tests/fixtures/instrumentation/<library>/<mode> comes from tests/support/ts_agents/generate.mjs
(node, its own lockfile), tests/support/go_agents (go run, their own go.mod) and
tests/support/java_agents (a JVM, its own pom.xml); `make fixtures`. These tests replay the
checked-in files and need neither node, go nor java; the last three re-run the agents where
they can run.

Per (library, mode) the expected decisions follow from what the mode records:
- `full`: arguments and results: both loops killed at their 3rd call, the empty searches
  flagged as no progress, nothing else;
- `args`: arguments without results: a call whose result is not recorded is the same call,
  so the polled job is a loop too (the documented price of hiding results), and different
  searches cannot be seen to return one same result;
- `none`: no arguments: never a decision, and one warning naming the framework's own setting.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache, partial
from pathlib import Path

import pytest

from tests.detection.test_instrumentation_fixtures import (
    hashed_decisions,
    read_request,
    run_replay,
    scenario_file,
)
from tests.support.instrumented_agents import (
    FIXTURES,
    SCENARIOS,
    generate_go,
    generate_java,
    generate_typescript,
    go_ready,
    java_ready,
    typescript_ready,
)
from tests.support.spans import tool_span_ids_in

AI_SDK_LEGACY_HINT = ("Vercel AI SDK's legacy ai.* spans", "recordOutputs")
OPENINFERENCE_JS_HINT = ("OpenInference JS", "hideInputs")
# library -> (mode -> what it records), and the instrumentation and setting its warning names.
LIBRARIES: dict[str, tuple[dict[str, str], tuple[str, str]]] = {
    # AI SDK 6's own default spans; it tags arguments as model output (recordInputs keeps them).
    "ai-sdk6": (
        {"capture": "full", "inputs-off": "full", "off": "none", "stream": "full"},
        AI_SDK_LEGACY_HINT,
    ),
    # AI SDK 7 through @ai-sdk/otel's OpenTelemetry integration (GenAI conventions).
    "ai-sdk7-genai": (
        {"capture": "full", "off": "none", "outputs-off": "args", "stream": "full"},
        ("@ai-sdk/otel", "recordInputs"),
    ),
    # AI SDK 7 through @ai-sdk/otel's LegacyOpenTelemetry: the ai.* spans, inputs as inputs.
    "ai-sdk7-legacy": (
        {"capture": "full", "off": "none", "stream": "full"},
        ("Vercel AI SDK's legacy ai.* spans", "LegacyOpenTelemetry (AI SDK 7) with recordInputs"),
    ),
    # Mastra's own observability through @mastra/otel-exporter (GenAI conventions).
    "mastra": (
        {"capture": "full", "redacted": "none", "outputs-off": "args"},
        ("Mastra's observability", "hideInput"),
    ),
    # VoltAgent's own observability (keys of its own, conventions/voltagent.py): it records
    # arguments and results whatever is set.
    "voltagent": ({"capture": "full"}, ("VoltAgent", "input")),
    "langgraphjs-openinference": ({"capture": "full", "redacted": "none"}, OPENINFERENCE_JS_HINT),
    "openai-agents-js-openinference": (
        {"capture": "full", "redacted": "none"},
        OPENINFERENCE_JS_HINT,
    ),
    # Go: Genkit's own tracing; it has no setting that turns content off.
    "genkit": ({"capture": "full"}, ("Genkit", "genkit:input")),
    # Java: LangChain4j makes no spans; clients/java's LangChain4jTracing makes them from its
    # listeners and tool hooks (GenAI conventions), content capture on or off.
    "langchain4j": ({"capture": "full", "off": "none"}, ("LangChain4j", "captureContent")),
    # Java: Spring AI's own Micrometer observations through the OpenTelemetry bridge; content
    # only with its ToolCallingContentObservationFilter.
    "spring-ai": (
        {"capture": "full", "off": "none"},
        ("Spring AI", "spring.ai.tools.observations.include-content"),
    ),
}
JAVA = ["langchain4j", "spring-ai"]
TYPESCRIPT = [name for name in LIBRARIES if name not in ("genkit", *JAVA)]
# Genkit keeps a model call's usage inside its genkit:output document only: no budget to check.
WITHOUT_USAGE = frozenset({"genkit"})
# VoltAgent's llm span covers every model call of a run with one call's usage: the run's span,
# ending last, holds the total, so a budget is decided when the run ends.
USAGE_AT_RUN_END = frozenset({"voltagent"})
CASES = [(name, mode) for name, (modes, _) in LIBRARIES.items() for mode in modes]
LOOP = [("tool_loop", "kill", 3)]
# A round of four calls repeated: its first call made a third time with nothing new between,
# at the start of the third round (before the cycle rule's call ending it). A round of eight
# does not fit twice in the loop window: the cycle rule catches it, at its third round's end.
ROUND_4 = [("tool_loop", "kill", 3)]
CYCLE = [("cycle", "kill", 3)]  # hits: the rounds (the default `repeats`)
EXPECTED: dict[str, dict[str, list[tuple[str, str, int]]]] = {
    "full": {
        "loop_volatile": LOOP,
        "loop_identical": LOOP,
        "distinct": [],
        "retry": [],
        "polling": [],
        "no_progress": [("no_progress", "flag", 4)],
        "cycle_4": ROUND_4,
        "cycle_8": CYCLE,
        "round_fresh": [],
        "tests_improving": [],
        "canned_ok": [],
    },
    # Results hidden: a call whose result changes is the same call again. A job polled with
    # nothing between is a loop; the tests re-run after each different fix and read are not
    # (the calls between are new work).
    "args": {
        "loop_volatile": LOOP,
        "loop_identical": LOOP,
        "distinct": [],
        "retry": [],
        "polling": LOOP,
        "no_progress": [],
        "cycle_4": ROUND_4,
        "cycle_8": CYCLE,
        "round_fresh": [],
        "tests_improving": [],
        "canned_ok": [],
    },
    "none": {scenario: [] for scenario in SCENARIOS},
}
# The tool each scenario's loop is about, for the span id of its 3rd call.
LOOP_TOOL = {"loop_volatile": "search_docs", "loop_identical": "search_docs"}
TOOL_NAME_KEYS = (
    "gen_ai.tool.name",
    "tool.name",
    "ai.toolCall.name",
    "genkit:name",
    "spring.ai.tool.definition.name",
)


@cache
def replayed(name: str, mode: str):
    return run_replay(name, mode)


def decided(name: str, mode: str) -> dict[str, list[tuple[str, str, int]]]:
    return {
        scenario: [(d["rule"], d["action"], d["hits"]) for d in records]
        for scenario, records in replayed(name, mode).decisions.items()
    }


def tool_span_ids(name: str, mode: str, scenario: str, tool: str) -> list[str]:
    return tool_span_ids_in(
        read_request(scenario_file(name, mode, scenario)), {tool}, TOOL_NAME_KEYS
    )


def test_every_library_and_mode_has_its_fixtures():
    for name, mode in CASES:
        for scenario in SCENARIOS:
            assert scenario_file(name, mode, scenario).is_file(), (name, mode, scenario)
    on_disk = {
        (path.parent.name, path.name)
        for path in FIXTURES.glob("*/*")
        if path.parent.name in LIBRARIES
    }
    assert on_disk == set(CASES)


def test_expected_against_decided_per_framework_and_scenario(capsys):
    """The whole table at once (printed with -s): every cell must match."""
    rows = []
    mismatches = []
    for name, mode in CASES:
        records = LIBRARIES[name][0][mode]
        got = decided(name, mode)
        for scenario in SCENARIOS:
            expected = EXPECTED[records][scenario]
            rows.append((name, mode, scenario, expected, got[scenario]))
            if got[scenario] != expected:
                mismatches.append((name, mode, scenario, expected, got[scenario]))
    with capsys.disabled():
        print("\nframework | mode | scenario | expected | decided")
        for name, mode, scenario, expected, got in rows:
            show = lambda ds: ", ".join(f"{r}/{a}@{h}" for r, a, h in ds) or "-"  # noqa: E731
            mark = "" if expected == got else "  <-- MISMATCH"
            print(f"{name} | {mode} | {scenario} | {show(expected)} | {show(got)}{mark}")
    assert mismatches == []


@pytest.mark.parametrize(
    ("name", "mode"), [case for case in CASES if LIBRARIES[case[0]][0][case[1]] != "none"]
)
@pytest.mark.parametrize("scenario", sorted(LOOP_TOOL))
def test_a_loop_is_killed_on_the_span_of_its_third_call(name, mode, scenario):
    [decision] = replayed(name, mode).decisions[scenario]
    third = tool_span_ids(name, mode, scenario, LOOP_TOOL[scenario])[2]
    assert decision["span_id"] == third and decision["tool_name"] == "search_docs"


@pytest.mark.parametrize(
    ("name", "mode"), [case for case in CASES if LIBRARIES[case[0]][0][case[1]] == "none"]
)
def test_capture_off_warns_once_naming_the_frameworks_own_setting(name, mode):
    replay = replayed(name, mode)
    warnings = [line for line in replay.stderr.splitlines() if "carry no arguments" in line]
    assert len(warnings) == 1, replay.stderr
    instrumentation, setting = LIBRARIES[name][1]
    assert instrumentation in warnings[0] and setting in warnings[0], warnings[0]
    assert "an unknown instrumentation" not in warnings[0]
    assert "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT" not in warnings[0]


# Each scripted model call reports 120 + 20 tokens; `distinct` makes 12 tool calls and a final
# answer: 13 inference calls, 1,820 tokens in the trace.
PER_CALL = 140
CALLS = len(SCENARIOS["distinct"]) + 1


@pytest.mark.parametrize(
    ("name", "mode"),
    [case for case in CASES if case[1] == "capture" and case[0] not in WITHOUT_USAGE],
)
def test_token_budget_counts_every_inference_call_once(tmp_path, name, mode):
    """Over budget at the 8th call of 13 (1,120 > 1,000); 1,820 stays under 2,000, so neither
    the aggregate the framework writes around the calls nor a nested one is added again."""
    totals = {}
    for budget in (1000, 2000):
        policy = tmp_path / f"policy-{budget}.yaml"
        policy.write_text(f"defaults: {{token_budget: {budget}}}\n")
        records = run_replay(name, mode, policy).decisions["distinct"]
        totals[budget] = [(d["rule"], d["action"], d["tokens"]) for d in records]
    crossing = next(n * PER_CALL for n in range(1, CALLS + 1) if n * PER_CALL > 1000)
    if name in USAGE_AT_RUN_END:
        crossing = CALLS * PER_CALL
    assert totals == {1000: [("token_budget", "kill", crossing)], 2000: []}


def test_langgraphjs_results_are_serialised_tool_messages_with_changing_call_ids():
    """What makes the unwrapping necessary: the fixture carries LangChain.js's ToolMessage."""
    request = read_request(scenario_file("langgraphjs-openinference", "capture", "loop_identical"))
    outputs = [
        json.loads(attribute["value"]["stringValue"])
        for resource in request["resourceSpans"]
        for scope in resource["scopeSpans"]
        for span in scope["spans"]
        for attribute in span.get("attributes", ())
        if attribute["key"] == "output.value" and span["name"] == "search_docs"
    ]
    assert len(outputs) == 6
    assert {output["output"]["id"][-1] for output in outputs} == {"ToolMessage"}
    assert len({output["output"]["kwargs"]["tool_call_id"] for output in outputs}) == 6


def assert_reproduced(root, names: list[str]) -> None:
    for name in names:
        for mode in LIBRARIES[name][0]:
            fresh = run_replay(name, mode, root=root).decisions
            kept = replayed(name, mode).decisions
            assert hashed_decisions(fresh) == hashed_decisions(kept), (name, mode)


def assert_generator_reproduces(
    language: str, why_not: str | None, generate: Callable[[], None], out: Path, names: list[str]
) -> None:
    """Re-run a language's agents (`generate` writes into `out`): the same decisions and hashes
    as the fixtures of `names`, in every mode they have; skipped where they cannot run."""
    if why_not is not None:
        pytest.skip(f"{language} agents not runnable here: {why_not}")
    generate()
    assert_reproduced(out, names)


def test_the_typescript_generator_reproduces_the_fixtures(tmp_path):
    """Re-run the TypeScript agents (node): the same decisions and hashes in every mode."""
    generate = partial(generate_typescript, tmp_path, TYPESCRIPT)
    assert_generator_reproduces("TypeScript", typescript_ready(), generate, tmp_path, TYPESCRIPT)


def test_the_go_generator_reproduces_the_fixtures(tmp_path):
    """Re-run the Go agents (go run): the same decisions and hashes."""
    generate = partial(generate_go, tmp_path)
    assert_generator_reproduces("Go", go_ready(), generate, tmp_path, ["genkit"])


def test_the_java_generator_reproduces_the_fixtures(tmp_path):
    """Re-run the Java agents (a JVM): the same decisions and hashes in every mode."""
    generate = partial(generate_java, tmp_path)
    assert_generator_reproduces("Java", java_ready(), generate, tmp_path, JAVA)
