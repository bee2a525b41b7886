// Why an agent stopped, machine-readable (as killswitch/stop.py in Python and stop.go in Go):
// on obeying a kill, a pause or a downgrade, check() adds an event to the active span,
// `spanguard.stop` (kill, pause) or `spanguard.downgrade`, with the attributes spanguard.rule,
// spanguard.action, spanguard.decision_id, spanguard.scope and spanguard.reason (the shared
// vectors' stop_events keep the three languages alike). An agent run as a process exits with
// EXIT_KILLED (75) and one JSON line on stderr: exitOnStop(fn) does both.

import { createRequire } from 'node:module';

export const STOP_EVENT = 'spanguard.stop';
export const DOWNGRADE_EVENT = 'spanguard.downgrade';
// EX_TEMPFAIL in sysexits.h: the work was not done, and may be retried once an operator releases it.
export const EXIT_KILLED = 75;

let otel = null;
try {
  otel = createRequire(import.meta.url)('@opentelemetry/api');
} catch {
  // no OpenTelemetry in this agent: nothing to record on
}

/** The event's attributes for a signal. */
export function stopAttributes(signal) {
  return {
    'spanguard.rule': signal.rule,
    'spanguard.action': signal.kind,
    'spanguard.decision_id': signal.signalId, // the worker's decision_id (explain reads it)
    'spanguard.scope': signal.scope ?? 'trace',
    'spanguard.reason': signal.reason,
  };
}

export function stopEventName(signal) {
  return signal.kind === 'downgrade' ? DOWNGRADE_EVENT : STOP_EVENT;
}

// Spans already told of a decision: a paused agent re-checks while it waits, one event says it.
const recorded = new WeakMap();

/** Add the stop (or downgrade) event to the active span, once per span and decision; false
 * when no recording span is active. */
export function recordOnActiveSpan(signal) {
  const span = otel?.trace.getActiveSpan();
  if (!span || !span.isRecording()) return false;
  let ids = recorded.get(span);
  if (ids === undefined) recorded.set(span, (ids = new Set()));
  if (ids.has(signal.signalId)) return false;
  ids.add(signal.signalId);
  span.addEvent(stopEventName(signal), stopAttributes(signal));
  return true;
}

/** The AgentKilled or AgentPaused in `error` or its causes (a framework wraps it), else null. */
export function findStop(error) {
  const seen = new Set();
  while (error && typeof error === 'object' && !seen.has(error)) {
    if (error.name === 'AgentKilled' || error.name === 'AgentPaused') return error;
    seen.add(error);
    error = error.cause;
  }
  return null;
}

/** The one-line JSON a stopped agent writes to stderr. */
export function stopReason(stop) {
  return {
    spanguard: 'stopped',
    action: stop.action,
    rule: stop.rule,
    decision_id: stop.decisionId,
    scope: stop.scope,
    trace_id: stop.traceId,
    reason: stop.reason,
  };
}

/** Run `fn`; a guard's stop becomes exit status EXIT_KILLED after one JSON line on stderr.
 * Other errors are thrown unchanged. */
export async function exitOnStop(fn, { exit = process.exit, stderr = process.stderr } = {}) {
  try {
    return await fn();
  } catch (error) {
    const stop = findStop(error);
    if (stop === null) throw error;
    stderr.write(`${JSON.stringify(stopReason(stop))}\n`);
    return exit(EXIT_KILLED);
  }
}
