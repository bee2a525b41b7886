"""`spanguard replay --html FILE`: the page's content, read back with an HTML parser."""

from __future__ import annotations

import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

from spanguard.schemas.otlp import encode_json_line
from tests.support.spans import AgentRecorder, encode, span_id_of

REFUND = {"query": "refund policy, order 4417"}
ODD_TOOL = "<img src=x onerror=alert(1)>"


class Page(HTMLParser):
    """Sections (one per trace) with their table rows: (classes, span id, cell texts)."""

    def __init__(self) -> None:
        super().__init__()
        self.sections: dict[str, list[tuple[set[str], str, list[str]]]] = {}
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self._section: str | None = None
        self._row: tuple[set[str], str, list[str]] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        self.tags.append((tag, attributes))
        if tag == "section":
            self._section = (attributes.get("id") or "").removeprefix("trace-")
            self.sections[self._section] = []
        elif tag == "tr" and self._section and attributes.get("data-span"):
            classes = set((attributes.get("class") or "").split())
            self._row = (classes, attributes["data-span"] or "", [])
        elif tag == "td" and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._row is not None and self._cell is not None:
            self._row[2].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row is not None:
            assert self._section is not None
            self.sections[self._section].append(self._row)
            self._row = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def test_the_page_has_a_timeline_per_tripped_trace(tmp_path: Path) -> None:
    looper = AgentRecorder("support-bot", "support")
    calls = []
    for step in range(2):
        calls.append(looper.tool("search_docs", REFUND))
        # A page that answers nothing: no new work between the searches.
        calls.append(looper.tool(ODD_TOOL, {"page": step}, result=""))
    calls.append(looper.tool("search_docs", REFUND))  # the 3rd identical search: the kill
    calls.append(looper.tool("search_docs", REFUND))  # after the kill
    looper.finish()

    spender = AgentRecorder("ticket-bot", "tickets")
    lookups = []
    for ticket in range(3):
        spender.chat(40_000, 1_000)  # the third crosses the 100k budget, before lookup 3
        lookups.append(spender.tool("lookup_ticket", {"id": ticket}))
    spender.finish()

    research = AgentRecorder("research-assistant")
    for step in range(20):
        research.tool("search_web", {"q": f"topic {step}"})
    research.finish()

    traces = tmp_path / "traces.jsonl"
    spans = looper.finished() + spender.finished() + research.finished()
    traces.write_text("".join(encode_json_line(encode([s])) + "\n" for s in spans))
    policy = tmp_path / "policy.yaml"
    policy.write_text("agents:\n  - match: {service.name: ticket-bot}\n    token_budget: 100000\n")
    page_file = tmp_path / "report.html"
    result = subprocess.run(
        [sys.executable, "-m", "spanguard.cli", "replay", "--policy", str(policy),
         "--html", str(page_file), str(traces)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"wrote {page_file} (2 tripped traces)" in result.stderr
    assert len(result.stdout.splitlines()) == 2  # the JSON decisions are still printed

    text = page_file.read_text()
    page = Page()
    page.feed(text)
    # One section per tripped trace, in the order they tripped; the calm trace has none.
    assert list(page.sections) == [looper.trace_id, spender.trace_id]
    assert research.trace_id not in text

    # The looper: every call in order; the repeated key highlighted, the 3rd search fired,
    # the call after it marked; the other tool's name escaped, its calls not highlighted.
    rows = page.sections[looper.trace_id]
    assert [span for _, span, _ in rows] == [span_id_of(s) for s in calls]
    assert [cells[2] for _, _, cells in rows] == [
        c.name.removeprefix("execute_tool ") for c in calls
    ]
    classes = [row_classes for row_classes, _, _ in rows]
    assert classes == [{"repeated"}, set()] * 2 + [{"fired"}, {"after"}]
    fired_cells = rows[4][2]
    assert "tool_loop fired → kill: search_docs called 3x in last 5 steps" in fired_cells[5]
    assert len({cells[3] for _, _, cells in rows[0:5:2]}) == 1  # one hash prefix, 8 hex digits
    assert len(rows[0][2][3]) == 8 and rows[0][2][3] != rows[1][2][3]
    assert ODD_TOOL not in text and "&lt;img src=x onerror=alert(1)&gt;" in text
    assert "policy defaults · window 10, threshold 3" in text

    # The budget: a marker row after the second lookup (the 3rd chat crossed the budget).
    rows = page.sections[spender.trace_id]
    marker = [span_id_of(s) for s in spender.finished() if s.name.startswith("chat")][2]
    assert [span for _, span, _ in rows] == [
        span_id_of(lookups[0]),
        span_id_of(lookups[1]),
        marker,
        span_id_of(lookups[2]),
    ]
    assert [row_classes for row_classes, _, _ in rows] == [set(), set(), {"marker"}, {"after"}]
    assert "token_budget fired → kill: 123000 tokens used, over the budget of 100000" in text
    assert "policy agents.0 (service.name=ticket-bot)" in text

    # Self-contained and private: nothing loaded, no script, no raw arguments.
    assert not [tag for tag, attrs in page.tags if tag in ("script", "link", "iframe", "img")]
    assert not [attrs for _, attrs in page.tags if "src" in attrs or "href" in attrs]
    assert "refund policy" not in text and "order 4417" not in text
