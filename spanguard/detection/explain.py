"""`spanguard explain`: a trace's decisions, and the evidence behind each, as text for people.

Works on detection records as they are on the topic (dicts, schemas/detection.schema.json),
so a record written by a newer worker with fields this one does not know still explains.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

__all__ = [
    "DEFAULT_ACK_WITHIN",
    "HASH_PREFIX",
    "agent_tree_lines",
    "explain_records",
    "explain_tool_incidents",
    "latency_ms",
    "usd",
]

# Hash prefixes shown: enough to tell the calls of one window apart at a glance.
HASH_PREFIX = 8
# Seconds after its decision a signal without an agent's ack counts as not obeyed.
DEFAULT_ACK_WITHIN = 10.0


def latency_ms(record: dict[str, Any]) -> float | None:
    """Milliseconds from the tripping span's end to the decision, when both are known."""
    ended, detected = record.get("span_ended_at"), record.get("detected_at")
    if not ended or not detected:
        return None
    delta = datetime.fromisoformat(detected) - datetime.fromisoformat(ended)
    return delta.total_seconds() * 1000


def usd(micro: int | None) -> str:
    """Micro-dollars as dollars for people ($0.0123)."""
    return "?" if micro is None else f"${micro / 1e6:,.4f}"


def _clock(iso: str | None) -> str:
    """The time of day of an ISO timestamp, in UTC as it was written, to the microsecond."""
    if not iso:
        return "?"
    return datetime.fromisoformat(iso).strftime("%H:%M:%S.%f")


def _policy(record: dict[str, Any]) -> str:
    entry = record.get("policy_entry")
    if entry is None:
        return "not recorded (a record from before policy entries were kept)"
    match = record.get("policy_match")
    where = f"{entry} (match {', '.join(f'{k}={v}' for k, v in match.items())})" if match else entry
    rule = record.get("rule")
    if rule == "cycle":
        return (
            f"{where}: periods 2 to {record.get('window')}, {record.get('threshold')} repeats,"
            f" action {record.get('action')}"
        )
    if rule == "tool_loop":
        return (
            f"{where}: window {record.get('window')}, threshold {record.get('threshold')},"
            f" action {record.get('action')}"
        )
    if rule == "handoff_cycle":
        return f"{where}: cycles {record.get('threshold')}, action {record.get('action')}"
    if rule == "delegation_depth":
        return f"{where}: max_depth {record.get('threshold')}, action {record.get('action')}"
    if rule == "agent_fan_out":
        return f"{where}: max_sub_agents {record.get('threshold')}, action {record.get('action')}"
    if rule == "token_budget":
        return f"{where}: token budget {record.get('token_budget')}"
    if rule == "cost_budget":
        return f"{where}: budget {usd(record.get('budget_micro_usd'))} per trace"
    if rule == "agent_budget":
        budgets = [
            f"{record['token_budget']} tokens" if record.get("token_budget") else None,
            usd(record["budget_micro_usd"]) if record.get("budget_micro_usd") else None,
        ]
        until = record.get("scope_until")
        return f"{where}: agent budget {' and '.join(b for b in budgets if b)} per window" + (
            f", every trace of the agent refused until {until}" if until else ""
        )
    return where


def _window(record: dict[str, Any]) -> list[str]:
    calls = record.get("calls")
    if not calls:
        return []
    key = (record.get("tool_name"), record.get("args_hash"))
    tool_width = max(len("tool"), *(len(call["tool_name"]) for call in calls))
    period = record.get("period") if record.get("rule") == "cycle" else None
    lines = []
    if period:
        sequence = calls[-period:]
        lines.append(
            f"  repeated sequence ({period} calls, {record.get('hits')}x in a row):"
            f" {' -> '.join(call['tool_name'] for call in sequence)}"
        )
        lines.append(
            f"  calls when it tripped ({len(calls)}, oldest first; [r.c] = round r, call c of"
            " the sequence; > = the span that tripped it):"
        )
    else:
        lines.append(
            f"  window when it tripped ({len(calls)} of {record.get('window')} calls, oldest"
            " first; * = the repeated call, > = the span that tripped it):"
        )
    lines.append(
        f"       #  {'ended (UTC)':<15}  {'tool':<{tool_width}}  {'args':<{HASH_PREFIX}}  span"
    )
    for number, call in enumerate(calls, start=1):
        tripped = call["span_id"] is not None and call["span_id"] == record.get("span_id")
        if period:
            # The calls end with whole rounds: count rounds back from the last call.
            from_end = len(calls) - number
            rounds = (record.get("hits") or 1) - from_end // period
            place = f"[{rounds}.{period - from_end % period}]"
            mark = (">" if tripped else " ") + " "
            suffix = f"  {place}"
        else:
            repeated = (call["tool_name"], call["args_hash"]) == key
            mark = (">" if tripped else " ") + ("*" if repeated else " ")
            suffix = ""
        digest = (call["args_hash"] or "(none)")[:HASH_PREFIX]
        lines.append(
            f"    {mark}{number:>2}  {_clock(call['ended_at']):<15}  "
            f"{call['tool_name']:<{tool_width}}  {digest:<{HASH_PREFIX}}  {call['span_id'] or '?'}"
            + suffix
        )
    return lines


def agent_tree_lines(record: dict[str, Any]) -> list[str]:
    """The agents a multi-agent decision names, drawn: the chain nested one in another
    (delegation_depth), the handoffs in order (handoff_cycle), the agents started
    (agent_fan_out)."""
    agents = record.get("agents")
    if not agents:
        return []
    rule = record.get("rule")
    if rule == "delegation_depth":
        lines = [
            f"  agent tree (the deepest chain, {record.get('depth')} agents, outermost first):"
        ]
        lines.append(f"    {agents[0]}")
        lines.extend(
            f"    {'   ' * (depth - 1)}└─ {name}" for depth, name in enumerate(agents[1:], 1)
        )
        return lines
    if rule == "handoff_cycle":
        return [
            f"  handoffs (oldest first, {record.get('hits')}x the same round):",
            "    " + " -> ".join(f"handoff to {name}" for name in agents),
        ]
    if rule == "agent_fan_out":
        lines = [f"  agent tree ({record.get('sub_agents')} agent runs beyond the first):"]
        lines.extend(f"    ├─ {name}" for name in agents[:-1])
        lines.append(f"    └─ {agents[-1]}")
        return lines
    return [f"  agents: {', '.join(agents)}"]


def _acknowledged(
    record: dict[str, Any], acks: list[dict[str, Any]], now: datetime, within: float
) -> list[str]:
    """Whether an agent obeyed the decision's signal: its acks (`_signature` set by the reader:
    valid, unchecked without a key, or why it is not trusted)."""
    signal_id = record.get("decision_id")
    lines, obeyed = [], []
    for ack in acks:
        if ack.get("signal_id") != signal_id:
            continue
        signature = ack.get("_signature", "unchecked")
        if signature in ("valid", "unchecked"):
            obeyed.append(ack)
        else:
            lines.append(f"  ack from {ack.get('process')} ignored: signature {signature}")
    detected = record.get("detected_at")
    if obeyed:
        first = min(obeyed, key=lambda ack: str(ack.get("obeyed_at")))
        line = f"  obeyed: by {first.get('process')} at {_clock(first.get('obeyed_at'))}"
        if detected and first.get("obeyed_at"):
            after = datetime.fromisoformat(first["obeyed_at"]) - datetime.fromisoformat(detected)
            line += f" ({after.total_seconds() * 1000:.0f} ms after the decision)"
        if len(obeyed) > 1:
            line += f", and {len(obeyed) - 1} more ack(s)"
        if first.get("_signature") == "unchecked":
            line += " (ack signature not checked: no signing key here)"
        return [*lines, line]
    age = (now - datetime.fromisoformat(detected)).total_seconds() if detected else None
    if age is None or age > within:
        lines.append(
            f"  not obeyed: no agent acknowledged it within {within:.0f} s (no agent running the"
            " trace saw it, or none obeyed)"
        )
    else:
        lines.append(f"  not acknowledged yet ({age:.1f} s after the decision)")
    return lines


def _one(record: dict[str, Any], number: int, total: int) -> list[str]:
    agent = record.get("agent") or {}
    rule, action = record.get("rule"), record.get("action")
    if rule == "manual":  # an operator's kill or release: no rule, no span, no policy
        return [
            f"decision {number} of {total}: manual -> {action}, issued {record.get('detected_at')}"
            f" by operator {record.get('operator')}",
            f"  reason: {record.get('reason')}",
            f"  signal: {action} sent to the agent (signal_id {record.get('decision_id')})",
        ]
    lines = [
        f"decision {number} of {total}: {rule} -> {action}, detected {record.get('detected_at')}",
        f"  reason: {record.get('reason')}",
        f"  agent: service {agent.get('service')}"
        + (f", name {agent['name']}" if agent.get("name") else ""),
        f"  policy: {_policy(record)}",
    ]
    if record.get("scope") == "conversation":
        lines.append(
            f"  scope: conversation {record.get('conversation_id')}, the evidence across"
            f" {record.get('traces')} of its traces (this trace's span completed it)"
        )
    tripped = f"  tripped by span {record.get('span_id')}"
    if record.get("tool_name"):
        digest = (record.get("args_hash") or "(none)")[:HASH_PREFIX]
        tripped += f" ({record['tool_name']}, args {digest}, {record.get('hits')} hits)"
    if record.get("tokens") is not None or record.get("cost_micro_usd") is not None:
        spend = [f"{record['tokens']} tokens"] if record.get("tokens") is not None else []
        if record.get("cost_micro_usd") is not None:
            spend.append(usd(record["cost_micro_usd"]))
        if record.get("unpriced_tokens"):
            spend.append(
                f"{record['unpriced_tokens']} tokens of models without a price not included"
            )
        tripped += f" ({', '.join(spend)})"
    if record.get("span_ended_at"):
        tripped += f", which ended {record['span_ended_at']}"
        delay = latency_ms(record)
        if delay is not None:
            tripped += f" ({delay:.0f} ms before the decision)"
    lines.append(tripped)
    lines.extend(_window(record))
    lines.extend(agent_tree_lines(record))
    if action in ("kill", "downgrade"):
        lines.append(
            f"  signal: {action} sent to the agent (signal_id {record.get('decision_id')})"
        )
        if record.get("scope") == "conversation" and record.get("scope_until"):
            lines.append(
                f"  and to every later trace of conversation {record.get('conversation_id')}"
                f" until {record['scope_until']} (or an operator's release)"
            )
    else:
        lines.append("  signal: none (a flag is recorded and notified, the agent goes on)")
    if record.get("system_message"):
        lines.append(f"  system message: {record['system_message']}")
    if record.get("confidence") is not None:
        lines.append(f"  judge confidence: {record['confidence']}")
    return lines


def explain_records(
    trace_id: str,
    records: list[dict[str, Any]],
    acks: list[dict[str, Any]] | None = None,
    *,
    now: datetime | None = None,
    ack_within: float = DEFAULT_ACK_WITHIN,
) -> str:
    """The text `spanguard explain` prints for `records` (one trace's, in topic order), and,
    with the agents' `acks` of the trace, whether each kill or downgrade was obeyed."""
    ordered = sorted(records, key=lambda r: str(r.get("detected_at") or ""))
    lines = [f"trace {trace_id}: {len(ordered)} decision{'s' if len(ordered) != 1 else ''}"]
    now = now or datetime.now(UTC)
    for number, record in enumerate(ordered, start=1):
        lines.append("")
        lines.extend(_one(record, number, len(ordered)))
        if acks is not None and record.get("action") in ("kill", "downgrade"):
            lines.extend(_acknowledged(record, acks, now, ack_within))
    return "\n".join(lines) + "\n"


# `spanguard explain --tool`: a tool's fleet incidents -----------------------------------------


def _incident_lines(opened: dict[str, Any], closed: dict[str, Any] | None) -> list[str]:
    at = f" at {opened['server']}" if opened.get("server") else ""
    state = f"recovered {closed.get('detected_at')}" if closed else "OPEN"
    lines = [
        f"incident {opened.get('trace_id')}: {opened.get('rule')} on {opened.get('tool')}{at}"
        f" -> {opened.get('action')}, {state}",
        f"  opened   {opened.get('detected_at')}: {opened.get('reason')}",
        f"  figures  {opened.get('hits')} traces hit of {opened.get('traces')} that called it,"
        f" {opened.get('steps')} calls, window {opened.get('window')} s",
    ]
    if opened.get("args_hash"):
        lines.append(f"  args     {str(opened['args_hash'])[:HASH_PREFIX]}")
    traces = opened.get("trace_ids") or []
    agents = opened.get("agents") or []
    lines.append(f"  traces   ({len(traces)} listed) {' '.join(traces) or '-'}")
    lines.append(f"  agents   ({len(agents)} listed) {', '.join(agents) or '-'}")
    if closed:
        lines.append(f"  closed   {closed.get('reason')}")
    return lines


def explain_tool_incidents(tool: str, records: list[dict[str, Any]]) -> str:
    """A tool's fleet incidents (scope "tool" records, in topic order): each with its figures,
    the traces and agents it hit, and whether it is open or recovered; open ones first."""
    opened: dict[str, dict[str, Any]] = {}
    closed: dict[str, dict[str, Any]] = {}
    for record in records:
        incident = str(record.get("trace_id"))
        if record.get("action") == "recovered":
            closed[incident] = record
        else:
            opened.setdefault(incident, record)
    if not opened:
        return f"no fleet incident on {tool} in the detections topic\n"
    ordered = sorted(opened, key=lambda i: (i in closed, str(opened[i].get("detected_at"))))
    still = sum(1 for i in opened if i not in closed)
    lines = [f"{tool}: {len(opened)} fleet incident(s), {still} open", ""]
    for incident in ordered:
        lines += _incident_lines(opened[incident], closed.get(incident))
        lines.append("")
    return "\n".join(lines)
