"""Why an agent stopped, machine-readable: on its span, on its exception, in its exit status.

- On obeying a kill, a pause or a downgrade, `check()` records a span event on the agent's
  current span: `spanguard.stop` (kill, pause) or `spanguard.downgrade`, with the attributes
  `spanguard.rule`, `spanguard.action`, `spanguard.decision_id`, `spanguard.scope` and
  `spanguard.reason` (the same names and values in the TypeScript and Go clients: the shared
  vectors' `stop_events`). The trace itself then shows why it ended.
- `AgentKilled` and `AgentPaused` carry the same fields as attributes (`rule`, `action`,
  `decision_id`, `scope`, `reason`).
- An agent run as a process exits with `EXIT_KILLED` (75) when the guard stopped it, and writes
  one line of JSON (`stop_reason`) to stderr; `exit_on_stop()` does both:

      from spanguard.killswitch.stop import exit_on_stop

      with exit_on_stop():
          agent.invoke(...)
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, TextIO

from spanguard.schemas.decision import KillSignal

__all__ = [
    "DOWNGRADE_EVENT",
    "EXIT_KILLED",
    "STOP_EVENT",
    "exit_on_stop",
    "find_stop",
    "record_on_current_span",
    "stop_attributes",
    "stop_reason",
]

STOP_EVENT = "spanguard.stop"
DOWNGRADE_EVENT = "spanguard.downgrade"
# EX_TEMPFAIL in sysexits.h: the work was not done, and may be retried once an operator
# releases it. Chosen to stay clear of 1 (any error), 2 (usage) and 126-255 (the shell's).
EXIT_KILLED = 75

# (span id, decision id) already recorded: a paused agent re-checks every second while it
# waits, and one event per span says it.
_MAX_RECORDED = 10_000
_recorded: OrderedDict[tuple[int, int, str], None] = OrderedDict()
_recorded_lock = threading.Lock()


def stop_attributes(signal: KillSignal) -> dict[str, str]:
    """The event's attributes: what stopped or steered the agent, and where to read more."""
    return {
        "spanguard.rule": str(signal.rule),
        "spanguard.action": str(signal.kind),
        "spanguard.decision_id": signal.signal_id,  # the worker's decision_id (explain reads it)
        "spanguard.scope": signal.stops,
        "spanguard.reason": signal.reason,
    }


def event_name(signal: KillSignal) -> str:
    return DOWNGRADE_EVENT if signal.kind == "downgrade" else STOP_EVENT


def record_on_current_span(signal: KillSignal) -> bool:
    """Add the stop (or downgrade) event to the current OpenTelemetry span, once per span and
    decision; False when no recording span is current (no OpenTelemetry, no span)."""
    try:
        from opentelemetry import trace
    except ImportError:
        return False
    span = trace.get_current_span()
    if not span.is_recording():
        return False
    context = span.get_span_context()
    key = (context.trace_id, context.span_id, signal.signal_id)
    with _recorded_lock:
        if key in _recorded:
            return False
        _recorded[key] = None
        while len(_recorded) > _MAX_RECORDED:
            _recorded.popitem(last=False)
    span.add_event(event_name(signal), stop_attributes(signal))
    return True


def find_stop(error: BaseException | None) -> Any:
    """The AgentKilled or AgentPaused in `error` or its causes (frameworks wrap it: the Agents
    SDK's UserError, ADK's RuntimeError, strands' EventLoopException), else None."""
    from spanguard.killswitch.signals import AgentKilled, AgentPaused

    seen: list[BaseException] = []
    while error is not None and error not in seen:
        if isinstance(error, AgentKilled | AgentPaused):
            return error
        seen.append(error)
        error = error.__cause__ or error.__context__
    return None


def stop_reason(stop: Any) -> dict[str, Any]:
    """The one-line JSON a stopped agent writes to stderr (an AgentKilled or AgentPaused)."""
    return {
        "spanguard": "stopped",
        "action": stop.action,
        "rule": stop.rule,
        "decision_id": stop.decision_id,
        "scope": stop.scope,
        "trace_id": stop.trace_id,
        "reason": stop.reason,
    }


@contextlib.contextmanager
def exit_on_stop(stderr: TextIO | None = None) -> Iterator[None]:
    """Turn a guard's stop (AgentKilled, or AgentPaused let out, alone or as a framework
    error's cause) into `sys.exit(EXIT_KILLED)` after one JSON line on stderr. Any other
    exception passes through unchanged."""
    try:
        yield
    except Exception as error:
        stop = find_stop(error)
        if stop is None:
            raise
        out = stderr if stderr is not None else sys.stderr
        out.write(json.dumps(stop_reason(stop), separators=(",", ":")) + "\n")
        out.flush()
        raise SystemExit(EXIT_KILLED) from error
