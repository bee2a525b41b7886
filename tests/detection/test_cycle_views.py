"""A cycle as people see it: `spanguard replay --html` (the real CLI) and `explain` show the
repeated sequence, every round of it highlighted, and the call that completed the last round."""

from __future__ import annotations

import json
import subprocess
import sys

from spanguard.detection.explain import explain_records
from spanguard.schemas.otlp import encode_json_line
from tests.detection.test_cycle import call, round_of
from tests.detection.test_report import Page
from tests.support.spans import AgentRecorder, encode, span_id_of


def test_the_page_and_explain_show_the_repeated_sequence(tmp_path):
    agent = AgentRecorder("coder", "coder")
    opening = call(agent, "read_file", {"path": "TASK.md"}, "fix the tests")
    rounds = [call(agent, *step) for _ in range(4) for step in round_of(4)]
    agent.finish()
    traces = tmp_path / "traces.jsonl"
    traces.write_text("".join(encode_json_line(encode([s])) + "\n" for s in agent.finished()))
    page_file = tmp_path / "report.html"
    # tool_loop switched off: on, it catches a round of 4 calls first (at the 9th call).
    policy = tmp_path / "policy.yaml"
    policy.write_text("defaults: {loop: {enabled: false}}\n")
    command = ["replay", "--policy", str(policy), "--html", str(page_file), str(traces)]
    result = subprocess.run(
        [sys.executable, "-m", "spanguard.cli", *command],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    [record] = [json.loads(line) for line in result.stdout.splitlines()]
    assert (record["rule"], record["action"], record["period"]) == ("cycle", "kill", 4)
    assert record["span_id"] == span_id_of(rounds[11])

    page = Page()
    page.feed(page_file.read_text())
    rows = page.sections[agent.trace_id]
    assert [span for _, span, _ in rows] == [span_id_of(s) for s in (opening, *rounds)]
    classes = [row_classes for row_classes, _, _ in rows]
    # The opening call is not part of the cycle; its three rounds are; the 12th fired.
    assert classes == [set()] + [{"cycle"}] * 11 + [{"fired"}] + [{"after"}] * 4
    notes = [cells[5] for _, _, cells in rows]
    assert notes[1] == "cycle: round 1 of 3, call 1 of 4"
    assert notes[8] == "cycle: round 2 of 3, call 4 of 4"
    assert "cycle fired → kill: a sequence of 4 calls" in notes[12]
    text = page_file.read_text()
    assert "repeated sequence (4 calls, 3x): list_dir → read_file → grep → run_tests" in text

    explained = explain_records(agent.trace_id, [record])
    assert (
        "repeated sequence (4 calls, 3x in a row): list_dir -> read_file -> grep -> run_tests"
        in explained
    )
    assert "policy: defaults: periods 2 to 10, 3 repeats, action kill" in explained
    lines = [line for line in explained.splitlines() if line.rstrip().endswith("]")]
    # The window keeps the last 10 calls: rounds 1 (its last two calls) to 3.
    assert len(lines) == 10
    assert lines[0].endswith("[1.3]") and lines[-1].endswith("[3.4]")
    assert lines[-1].lstrip().startswith(">") and record["span_id"] in lines[-1]
