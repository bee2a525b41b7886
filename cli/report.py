"""The HTML pages of `spanguard replay --html` and `spanguard backtest --html`: one
self-contained page each, a timeline per tripped (or changed) trace.

For owners who would rather look than read: each trace that tripped a rule gets its tool calls
in order (tool name, a hash prefix, span id, time since the first call), the repeated key
highlighted (for a cycle: every round of its repeated sequence), and a marker where the rule
fired. The calls come from a guard observer (`spanguard.detection.timelines.Timelines`): the
keys are the guard's own. The page has no script and loads nothing: one file to attach to a
ticket. Arguments appear only as hash prefixes, as everywhere else.

Rendering lives here, in the CLI that writes the pages, not in the detection kernel.
"""

from __future__ import annotations

import html
from collections import defaultdict
from collections.abc import Callable, Mapping
from datetime import UTC, datetime

from spanguard.detection.backtest import BacktestReport, iso_time
from spanguard.detection.explain import HASH_PREFIX, usd
from spanguard.detection.guard import GuardStats
from spanguard.detection.pricing import micro_usd
from spanguard.detection.timelines import Call, Timeline, Timelines
from spanguard.detection.trace_state import TraceState
from spanguard.schemas.decision import Decision

__all__ = ["STYLE", "decision_box", "render_backtest_html", "render_html", "trace_section"]


STYLE = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#1f2328}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:28px 0 4px}
.meta{color:#59636e;margin:0 0 8px} code{font:12px ui-monospace,SFMono-Regular,Menlo,monospace}
.decision{border-left:4px solid #cf222e;background:#fff5f5;padding:6px 10px;margin:6px 0}
.decision.flag{border-color:#9a6700;background:#fff8c5}
.decision.downgrade{border-color:#bc4c00;background:#fff1e5}
table{border-collapse:collapse;margin-top:8px} th,td{padding:2px 10px;text-align:left}
th{border-bottom:1px solid #d1d9e0;font-weight:600} td.n{text-align:right;color:#59636e}
tr.repeated td{background:#ffebe9} tr.cycle td{background:#ffebe9;border-top:1px dotted #cf222e} tr.fired td{background:#ff8182;font-weight:600}
tr.skipped td,tr.after td{color:#8c959f} tr.marker td{background:#fff8c5;font-style:italic}
svg{display:block;margin:8px 0} .legend span{margin-right:14px}
.dot{display:inline-block;width:10px;height:10px;border-radius:50%;vertical-align:middle}
"""

COLOR_REPEATED, COLOR_OTHER, COLOR_FIRED, COLOR_SKIPPED = "#cf222e", "#8c959f", "#82071e", "#d1d9e0"


def _iso(unix_nano: int) -> str:
    if unix_nano <= 0:
        return "?"
    return datetime.fromtimestamp(unix_nano / 1e9, UTC).isoformat(timespec="microseconds")


def _offset(call: Call, start: int) -> str:
    if call.ended_unix_nano <= 0 or start <= 0:
        return "?"
    return f"+{(call.ended_unix_nano - start) / 1e6:,.1f} ms"


def _strip(
    calls: list[Call], is_repeated: Callable[[Call], bool], fired: set[str], between: set[int]
) -> str:
    """An SVG strip, one dot per call in order; the repeated key red, a rule's firing marked
    (on its call, or `between` calls when it fired on another span, e.g. a token budget)."""
    pad, height = 10, 46
    step = max(2.0, min(14.0, 1000 / max(len(calls), 1)))  # long traces stay a page wide
    width = round(pad * 2 + step * max(len(calls) - 1, 1))
    parts = [
        f'<svg width="{width}" height="{height}" role="img" aria-label="tool calls in order">',
        f'<line x1="{pad}" y1="28" x2="{width - pad}" y2="28" stroke="#d1d9e0"/>',
    ]
    for seen in sorted(between):  # after `seen` calls: halfway to the next dot
        x = pad + (seen - 0.5) * step
        parts.append(
            f'<line x1="{x:.1f}" y1="4" x2="{x:.1f}" y2="42" stroke="{COLOR_FIRED}"'
            ' stroke-width="2"/>'
        )
    for index, call in enumerate(calls):
        x = round(pad + index * step, 1)
        if call.span_id in fired:
            color, radius = COLOR_FIRED, 6
            parts.append(f'<line x1="{x}" y1="4" x2="{x}" y2="42" stroke="{COLOR_FIRED}"/>')
        elif not call.counted:
            color, radius = COLOR_SKIPPED, 4
        else:
            color, radius = (COLOR_REPEATED, 5) if is_repeated(call) else (COLOR_OTHER, 4)
        title = html.escape(f"#{index + 1} {call.tool_name} {call.args_hash or ''}")
        parts.append(
            f'<circle cx="{x}" cy="28" r="{radius}" fill="{color}"><title>{title}</title></circle>'
        )
    parts.append("</svg>")
    return "".join(parts)


def decision_box(decision: Decision) -> str:
    e = html.escape
    details = [f"<b>{e(decision.rule)} → {e(decision.action)}</b>: {e(decision.reason)}"]
    policy, evidence, spend = decision.policy, decision.evidence, decision.spend
    if policy.entry:
        where = policy.entry
        if policy.match:
            where += " (" + ", ".join(f"{k}={v}" for k, v in policy.match.items()) + ")"
        details.append(f"policy {e(where)}")
    if decision.rule == "tool_loop":
        details.append(f"window {evidence.window}, threshold {evidence.threshold}")
    if decision.rule == "cycle" and evidence.calls and evidence.period:
        sequence = " → ".join(call["tool_name"] for call in evidence.calls[-evidence.period :])
        details.append(
            f"repeated sequence ({evidence.period} calls, {evidence.hits}x): {e(sequence)}"
        )
    if evidence.agents:
        joiner = " → " if decision.rule != "agent_fan_out" else ", "
        details.append(f"agents: {e(joiner.join(evidence.agents))}")
    if spend.token_budget is not None:
        details.append(f"budget {spend.token_budget}, used {spend.tokens}")
    if spend.budget_micro_usd is not None:
        details.append(f"budget {usd(spend.budget_micro_usd)}, spent {usd(spend.cost_micro_usd)}")
    details.append(f"span <code>{e(decision.span_id)}</code> at {e(decision.detected_at)}")
    return f'<div class="decision {e(decision.action)}">{" · ".join(details)}</div>'


def _spend(state: TraceState | None) -> str:
    """The trace's tokens and cost, as the guard counted them (" · ..." or nothing)."""
    if state is None:
        return ""
    tokens = (
        state.inference_tokens if state.inference_tokens is not None else state.aggregate_tokens
    )
    text = f" · {tokens:,} tokens" if tokens else ""
    cost = state.inference_cost if state.inference_cost is not None else state.aggregate_cost
    if cost or state.inference_cost is not None:
        text += f" · {usd(micro_usd(cost))}"
    if state.unpriced_tokens:
        text += f" ({state.unpriced_tokens:,} tokens of models without a price not included)"
    return text


def _agent_tree(state: TraceState | None) -> str:
    """The trace's agents, each run under the run it ran inside (nothing for one agent)."""
    tree = state.agent_tree if state is not None else None
    if tree is None or len(tree.runs) < 2:
        return ""
    lines = [f"{'   ' * depth}{'└─ ' if depth else ''}{name}" for depth, name in tree.levels()]
    more = f" ({tree.dropped} more runs not placed)" if tree.dropped else ""
    return (
        f'<p class="meta">agent tree: {tree.started} runs, {tree.deepest} deep{more}</p>'
        f'<pre class="agents">{html.escape(chr(10).join(lines))}</pre>'
    )


def trace_section(trace_id: str, timeline: Timeline, state: TraceState | None = None) -> str:
    e = html.escape
    keys = {
        (d.evidence.tool_name, d.evidence.args_hash)
        for d, _ in timeline.decisions
        if d.rule == "tool_loop"
    }
    fired = {d.span_id: d for d, _ in timeline.decisions}
    markers: dict[int, list[Decision]] = defaultdict(list)
    call_spans = {c.span_id for c in timeline.calls}
    for decision, seen in timeline.decisions:
        if decision.span_id not in call_spans:
            markers[seen].append(decision)  # fired on a span that is not a tool call

    calls = timeline.calls
    cycle_notes = _cycle_notes(timeline)
    in_cycle = {id(calls[index - 1]) for index in cycle_notes}

    def is_repeated(call: Call) -> bool:
        if id(call) in in_cycle:
            return True
        return call.counted and (call.tool_name, call.args_hash) in keys

    start = next((c.ended_unix_nano for c in calls if c.ended_unix_nano > 0), 0)
    agent = f" · agent {e(timeline.agent_name)}" if timeline.agent_name else ""
    out = [
        f'<section class="trace" id="trace-{e(trace_id)}">',
        f"<h2>{e(timeline.service)}{agent}</h2>",
        f'<p class="meta">trace <code>{e(trace_id)}</code> · {len(calls)} tool calls'
        + (f" (and {timeline.dropped} more not shown)" if timeline.dropped else "")
        + f" · first call ended {e(_iso(start))}{e(_spend(state))}</p>",
        *(decision_box(d) for d, _ in timeline.decisions),
        _agent_tree(state),
        _strip(calls, is_repeated, set(fired), set(markers)),
        '<p class="legend"><span><i class="dot" style="background:#cf222e"></i> the repeated'
        ' call</span><span><i class="dot" style="background:#82071e"></i> where the rule'
        ' fired</span><span><i class="dot" style="background:#8c959f"></i> other calls</span>'
        '<span><i class="dot" style="background:#d1d9e0"></i> not counted (no arguments'
        " recorded)</span></p>",
        "<table><thead><tr><th>#</th><th>ended</th><th>tool</th><th>args</th><th>span</th>"
        "<th></th></tr></thead><tbody>",
    ]
    killed = False
    for decision in markers.get(0, []):  # fired before the first tool call
        out.append(_marker_row(decision))
        killed = killed or decision.action == "kill"
    for index, call in enumerate(calls, start=1):
        classes, note = [], ""
        if call.span_id in fired:
            decision = fired[call.span_id]
            classes.append("fired")
            note = f"{decision.rule} fired → {decision.action}: {decision.reason}"
            killed = killed or decision.action == "kill"
        elif killed:
            classes.append("after")
            note = "after the kill: an agent obeying its killswitch stops before this call"
        elif not call.counted:
            classes.append("skipped")
            note = "not counted: no arguments recorded, or a tool the policy exempts"
        elif index in cycle_notes:
            classes.append("cycle")
            note = cycle_notes[index]
        elif is_repeated(call):
            classes.append("repeated")
        digest = (call.args_hash or "(none)")[:HASH_PREFIX]
        out.append(
            f'<tr class="{" ".join(classes)}" data-span="{e(call.span_id)}">'
            f'<td class="n">{index}</td><td>{e(_offset(call, start))}</td>'
            f"<td>{e(call.tool_name)}</td><td><code>{e(digest)}</code></td>"
            f"<td><code>{e(call.span_id)}</code></td><td>{e(note)}</td></tr>"
        )
        for decision in markers.get(index, []):
            out.append(_marker_row(decision))
            killed = killed or decision.action == "kill"
    out.append("</tbody></table></section>")
    return "\n".join(out)


def _cycle_notes(timeline: Timeline) -> dict[int, str]:
    """Row number (1-based) -> its place in a cycle that tripped: the calls of every round, up
    to the call that completed the last one."""
    notes: dict[int, str] = {}
    positions = {call.span_id: index for index, call in enumerate(timeline.calls, start=1)}
    for decision, _ in timeline.decisions:
        period = decision.evidence.period
        if decision.rule != "cycle" or not period or decision.span_id not in positions:
            continue
        rounds = decision.evidence.hits or 1
        last = positions[decision.span_id]
        first = max(last - period * rounds + 1, 1)
        for index in range(first, last + 1):
            step = (index - first) % period + 1
            round_ = (index - first) // period + 1
            notes[index] = f"cycle: round {round_} of {rounds}, call {step} of {period}"
    return notes


def _marker_row(decision: Decision) -> str:
    e = html.escape
    return (
        f'<tr class="marker" data-span="{e(decision.span_id)}"><td class="n">·</td><td></td>'
        f'<td colspan="3">span <code>{e(decision.span_id)}</code></td>'
        f"<td>{e(decision.rule)} fired → {e(decision.action)}: {e(decision.reason)}</td></tr>"
    )


def render_html(
    timelines: Timelines,
    stats: GuardStats,
    sources: list[str],
    states: Mapping[str, TraceState] | None = None,
) -> str:
    """The page: a header, then one section per tripped trace (with its tokens and cost when
    the guard's `states` are given)."""
    e = html.escape
    tripped = timelines.tripped()
    states = states or {}
    sections = [
        trace_section(trace_id, timeline, states.get(trace_id))
        for trace_id, timeline in tripped.items()
    ]
    if not sections:
        sections = ["<p>No trace tripped a rule.</p>"]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>spanguard replay: {len(tripped)} tripped traces</title>"
        f"<style>{STYLE}</style></head><body>\n"
        f"<h1>spanguard replay: {len(tripped)} tripped trace{'s' if len(tripped) != 1 else ''}"
        "</h1>\n"
        f'<p class="meta">{stats.spans:,} spans, {stats.tool_calls:,} tool calls counted,'
        f" {sum(stats.decisions.values())} decisions · from {e(', '.join(sources))}</p>\n"
        + "\n".join(sections)
        + "\n</body></html>\n"
    )


# -- the backtest page ------------------------------------------------------------------------


def render_backtest_html(report: BacktestReport) -> str:
    """`--html`: the replay page's style, one section per changed trace kept: what changed,
    the trace's tool calls with the new policy's decisions, and the current policy's."""
    e = html.escape
    sections = []
    for trace in report.kept:
        changes = [
            f'<div class="decision {e(v.action)}"><b>{sign} {e(v.rule)} → {e(v.action)}</b>'
            f" under the {which} policy only: {e(v.reason)} (at {e(iso_time(v.at))})</div>"
            for sign, which, verdicts in (
                ("added", "new", trace.added),
                ("removed", "current", trace.removed),
            )
            for v in verdicts
        ]
        timeline = trace.timeline or Timeline(service=trace.service, agent_name=trace.agent_name)
        current = trace.current_decisions
        sections.append(
            f'<div class="changed">{"".join(changes)}'
            + trace_section(trace.trace_id, timeline)
            + (
                '<p class="meta">under the current policy:</p>'
                + "".join(decision_box(d) for d in current)
                if current
                else '<p class="meta">under the current policy: no decision</p>'
            )
            + "</div>"
        )
    if not sections:
        sections = ["<p>No trace is decided differently.</p>"]
    title = (
        f"spanguard backtest: {report.added} decisions added, {report.removed} removed"
        f" in {report.changed_traces} traces"
    )
    more = (
        f" ({report.changed_traces - len(report.kept)} more changed traces not shown)"
        if report.changed_traces > len(report.kept)
        else ""
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{e(title)}</title><style>{STYLE}</style></head><body>\n"
        f"<h1>{e(title)}</h1>\n"
        f'<p class="meta">{e(report.new_policy)} against {e(report.current_policy)} ·'
        f" {report.records:,} records, {report.spans:,} spans, {report.traces:,} traces{e(more)}</p>\n"
        + "\n".join(sections)
        + "\n</body></html>\n"
    )
