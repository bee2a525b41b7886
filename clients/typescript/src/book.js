// What each trace was told: the agent's check() reads it, the Kafka consumer writes it.
// The same semantics as the Python killswitch's SignalBook (killswitch/signals.py).

import { parseDateTime } from './signal.js';
import { recordOnActiveSpan } from './stop.js';

export const DEFAULT_MAX_TRACES = 10_000;
// Servers remembered per tool name (the least recently told forgotten first).
const MAX_SERVERS_PER_TOOL = 1000;
// A wait re-checks at least this often, so a deadline is met even if the clock jumps.
const WAIT_RECHECK_MS = 1000;

/** Thrown by check() in an agent whose trace was killed; carries the signal. */
export class AgentKilled extends Error {
  constructor(signal) {
    super(`spanguard killed ${describeTarget(signal)}: ${signal.reason}`);
    this.name = 'AgentKilled';
    this.signal = signal;
    this.traceId = signal.traceId;
    this.reason = signal.reason;
    this.scope = signal.scope ?? 'trace'; // 'trace', 'conversation' or 'agent'
    // As the spanguard.stop span event names them (stop.js).
    this.rule = signal.rule;
    this.action = signal.kind;
    this.decisionId = signal.signalId;
  }
}

/**
 * Thrown by a check naming a tool that spanguard contained (a signal of scope 'tool'): the call
 * to that tool is refused, not the agent. An AgentKilled, so code that catches only AgentKilled
 * still stops; a framework hook hands the model its message as the tool's error instead, so the
 * agent can take another path. `tool` and `server` name it.
 */
export class ToolContained extends AgentKilled {
  constructor(signal) {
    super(signal);
    this.name = 'ToolContained';
    this.tool = signal.tool?.name ?? signal.evidence?.tool_name ?? '';
    this.server = signal.tool?.server ?? '';
    this.message = `tool ${this.tool} is contained by spanguard: ${signal.reason}; use another tool`;
    this.scope = 'tool';
    this.action = 'contain';
  }
}

/**
 * Thrown by check() in an agent whose trace is paused: it must wait for an operator's
 * `spanguard release` (go on) or `spanguard kill` (stop), or until `until`, when the policy's
 * `fallback` ('kill' or 'release') applies. wait() does the waiting.
 */
export class AgentPaused extends Error {
  constructor(signal) {
    super(
      `spanguard paused trace ${signal.traceId}: ${signal.reason}; waiting for \`spanguard release\` or \`spanguard kill\` until ${signal.pauseUntil}, then ${signal.pauseFallback}`,
    );
    this.name = 'AgentPaused';
    this.signal = signal;
    this.traceId = signal.traceId;
    this.reason = signal.reason;
    this.until = signal.pauseUntil;
    this.fallback = signal.pauseFallback;
    this.scope = signal.scope ?? 'trace';
    this.rule = signal.rule;
    this.action = 'pause';
    this.decisionId = signal.signalId;
  }
}

function describeTarget(signal) {
  if (signal.scope === 'conversation') return `conversation ${signal.conversationId}`;
  if (signal.scope === 'tool') return `tool ${signal.tool.name}${signal.tool.server ? ` on ${signal.tool.server}` : ''}`;
  if (signal.scope === 'agent') {
    return `agent ${signal.agent.service}${signal.agent.name ? `/${signal.agent.name}` : ' (every agent name)'}`;
  }
  return `trace ${signal.traceId}`;
}

// What a scoped signal stops, as a Map key (the Python book's SignalBook scope_key).
function scopeKey(scope, id, name = '') {
  return JSON.stringify([scope, id, name]);
}

function signalScopeKey(signal) {
  if (signal.scope === 'conversation') return scopeKey('conversation', signal.conversationId);
  return scopeKey('agent', signal.agent.service, signal.agent.name ?? '');
}

/** Whether `later` (an RFC 3339 time) is at or after `earlier`; unreadable: true. */
function atOrAfter(later, earlier) {
  const a = parseDateTime(later);
  const b = parseDateTime(earlier);
  if (a === null || b === null) return true;
  return a.ms > b.ms || (a.ms === b.ms && a.micros >= b.micros);
}

function newEntry() {
  // pause: the pause signal while the trace waits for an operator (see AgentPaused)
  return { signalIds: new Set(), kill: null, unread: [], pause: null };
}

/** Milliseconds from `now` (a Date) to the RFC 3339 `moment`; 0 or less once it has come. */
function msUntil(moment, now) {
  const at = parseDateTime(moment);
  if (at === null) return 0;
  return at.ms - now.getTime() + at.micros / 1000;
}

// A Map keeps insertion order: re-inserting moves a trace to the most recent end.
function touch(map, key, entry) {
  map.delete(key);
  map.set(key, entry);
}

function trim(map, limit) {
  while (map.size > limit) map.delete(map.keys().next().value);
}

function fallbackMessage(signal) {
  return `spanguard: ${signal.reason}. Try a different approach or stop and report what you found.`;
}

/**
 * Kill, downgrade, release and pause signals per trace.
 * - deliver(signal) records it; an id already recorded for its trace is a duplicate (false).
 * - check(traceId) throws AgentKilled once a kill is recorded, on that check and every later
 *   one; returns a downgrade's system message exactly once; else null.
 * - a release lifts the trace's kill until a later kill (a new signal id).
 * - a pause makes check() throw AgentPaused until a release (go on) or a kill, or until its
 *   pauseUntil, when its fallback applies (kill: killed; release: go on); a later pause of the
 *   trace replaces it; a pause of a killed trace leaves the kill. wait() blocks through it.
 * Memory is bounded by maxTraces per kind of entry; a killed trace this process has checked is
 * never forgotten (until forget()), so other traces' signals cannot push out its kill.
 * `clock` (default: the system time) decides when a pause's deadline has come.
 */
export class SignalBook {
  constructor(maxTraces = DEFAULT_MAX_TRACES, { clock } = {}) {
    if (maxTraces < 1) throw new RangeError('maxTraces must be at least 1');
    this.maxTraces = maxTraces;
    this.clock = clock ?? (() => new Date());
    this.wakers = new Set(); // wait()s blocked on a pause, woken by any delivery
    this.others = new Map(); // traces this process has not checked
    this.watched = new Map(); // traces it checks, not killed
    this.killed = new Map(); // traces it checks, killed
    this.scopes = new Map(); // conversations and agents under a kill (or released), by scopeKey
    // tool name -> {signalIds, byServer: Map(server -> the newest signal of the tool there)}
    this.tools = new Map();
    this.delivered = 0;
    this.duplicates = 0;
    this.toolCallsRefused = 0; // calls refused because their tool was contained
    this.refusedByTool = new Map(); // JSON [name, server] -> calls refused
  }

  deliver(signal) {
    if (signal.scope === 'tool') return this.deliverTool(signal);
    if (signal.scope === 'conversation' || signal.scope === 'agent') return this.deliverScoped(signal);
    const traceId = signal.traceId.toLowerCase();
    let entry = this.killed.get(traceId) ?? this.watched.get(traceId);
    if (entry === undefined) {
      entry = this.others.get(traceId);
      if (entry === undefined) {
        entry = newEntry();
        this.others.set(traceId, entry);
        trim(this.others, this.maxTraces);
      } else {
        touch(this.others, traceId, entry);
      }
    }
    if (!this.firstDelivery(entry, signal)) return false;
    if (signal.kind === 'pause') {
      if (entry.kill === null) entry.pause = signal;
      return true;
    }
    if (signal.kind === 'release' || signal.kind === 'kill') entry.pause = null; // the answer
    if (signal.kind === 'release') {
      entry.kill = null;
      if (this.killed.has(traceId)) {
        this.killed.delete(traceId);
        this.watched.set(traceId, entry);
        trim(this.watched, this.maxTraces);
      }
    } else if (signal.kind === 'kill') {
      if (entry.kill === null) entry.kill = signal; // the first kill's reason is the one seen
      if (this.watched.has(traceId)) {
        this.watched.delete(traceId);
        this.killed.set(traceId, entry);
      }
    } else {
      // With its signal: the downgrade's span event names the decision.
      entry.unread.push({ message: signal.systemMessage ?? fallbackMessage(signal), signal });
    }
    return true;
  }

  // A signal id seen before on this entry is a duplicate (counted, not applied); a new one
  // is counted and wakes the waiters.
  firstDelivery(entry, signal) {
    if (entry.signalIds.has(signal.signalId)) {
      this.duplicates += 1;
      return false;
    }
    entry.signalIds.add(signal.signalId);
    this.delivered += 1;
    this.wakeWaiters();
    return true;
  }

  deliverScoped(signal) {
    const key = signalScopeKey(signal);
    const entry = this.scopes.get(key) ?? { signalIds: new Set(), kill: null };
    touch(this.scopes, key, entry);
    trim(this.scopes, this.maxTraces);
    if (!this.firstDelivery(entry, signal)) return false;
    if (signal.kind === 'release') {
      if (entry.kill !== null && atOrAfter(signal.detectedAt, entry.kill.detectedAt)) entry.kill = null;
    } else if (signal.kind === 'kill') {
      // The longest-lasting kill of the scope holds.
      if (entry.kill === null || !atOrAfter(entry.kill.expiresAt, signal.expiresAt)) entry.kill = signal;
    }
    return true;
  }

  // The newest signal of a tool on a server (by detectedAt) holds: a contain or a release.
  deliverTool(signal) {
    const { name, server } = signal.tool;
    const entry = this.tools.get(name) ?? { signalIds: new Set(), byServer: new Map() };
    touch(this.tools, name, entry);
    trim(this.tools, this.maxTraces);
    if (!this.firstDelivery(entry, signal)) return false;
    const newest = entry.byServer.get(server);
    if (newest === undefined || atOrAfter(signal.detectedAt, newest.detectedAt)) {
      touch(entry.byServer, server, signal);
      trim(entry.byServer, MAX_SERVERS_PER_TOOL);
    }
    return true;
  }

  /** The contain in force for `tool` on `server` (or one naming no server); `server`
   * undefined or null: the caller does not know it, a contain on any server holds. */
  contained(tool, server = null) {
    const entry = this.tools.get(tool);
    if (entry === undefined) return null;
    const candidates = server === null || server === undefined
      ? [...entry.byServer.values()]
      : [entry.byServer.get(server), entry.byServer.get('')].filter((signal) => signal !== undefined);
    const now = this.clock();
    return candidates.find((signal) => signal.kind === 'kill' && msUntil(signal.expiresAt, now) > 0) ?? null;
  }

  /** Throw ToolContained if `tool` is contained (see contained()); no tool checks nothing. */
  checkTool(tool, server = null) {
    if (!tool || this.tools.size === 0) return;
    const signal = this.contained(tool, server);
    if (signal === null) return;
    this.toolCallsRefused += 1;
    const key = JSON.stringify([tool, server ?? '']);
    if (this.refusedByTool.has(key) || this.refusedByTool.size < this.maxTraces) {
      this.refusedByTool.set(key, (this.refusedByTool.get(key) ?? 0) + 1);
    }
    throw new ToolContained(signal);
  }

  /** Throw AgentKilled if the conversation or the agent ({service, name}: that name, or a
   * kill naming every agent of the service) is under a kill not expired nor released. */
  checkScopes({ conversationId, agent } = {}) {
    if (this.scopes.size === 0) return;
    const keys = [];
    if (conversationId) keys.push(scopeKey('conversation', conversationId));
    if (agent?.service) {
      keys.push(scopeKey('agent', agent.service, agent.name ?? ''));
      if (agent.name) keys.push(scopeKey('agent', agent.service));
    }
    for (const key of keys) {
      const entry = this.scopes.get(key);
      if (entry === undefined || entry.kill === null) continue;
      if (msUntil(entry.kill.expiresAt, this.clock()) <= 0) {
        entry.kill = null; // its window freed: the scope goes on
        continue;
      }
      recordOnActiveSpan(entry.kill);
      throw new AgentKilled(entry.kill);
    }
  }

  /** `scope`: {conversationId, agent} of the trace, when it has them (see checkScopes), and
   * {tool, server} of the call: after the trace's kill or pause, a contained tool throws
   * ToolContained (a downgrade's message then waits for the next check). */
  check(traceId, scope = {}) {
    this.checkScopes(scope);
    const id = traceId.toLowerCase();
    let entry = this.killed.get(id);
    if (entry === undefined) {
      entry = this.watched.get(id);
      if (entry !== undefined) {
        touch(this.watched, id, entry);
      } else {
        // From now on this process checks the trace: its signals are its agent's.
        entry = this.others.get(id) ?? newEntry();
        this.others.delete(id);
        if (entry.kill === null) {
          this.watched.set(id, entry);
          trim(this.watched, this.maxTraces);
        }
      }
      if (entry.kill !== null) {
        this.watched.delete(id);
        this.killed.set(id, entry);
      }
    }
    if (entry.pause !== null && entry.kill === null) {
      this.pauseOver(id, entry);
      if (entry.pause !== null) {
        recordOnActiveSpan(entry.pause);
        throw new AgentPaused(entry.pause);
      }
    }
    if (entry.kill !== null) {
      recordOnActiveSpan(entry.kill);
      throw new AgentKilled(entry.kill);
    }
    this.checkTool(scope.tool, scope.server);
    if (!entry.unread.length) return null;
    const { message, signal } = entry.unread.shift();
    recordOnActiveSpan(signal);
    return message;
  }

  /**
   * check(), and while the trace is paused, wait until an operator answers: a release resolves
   * (the agent goes on, with what check() then returns), a kill rejects with AgentKilled;
   * unanswered at the pause's pauseUntil, its fallback applies (kill rejects, release
   * resolves). With `timeoutMs`, or once `signal` (an AbortSignal) aborts, it rejects with
   * AgentPaused again. Waiting never blocks the event loop: Kafka keeps being read meanwhile.
   */
  async wait(traceId, { timeoutMs, signal } = {}) {
    const deadline = timeoutMs === undefined || timeoutMs === null ? null : performance.now() + timeoutMs;
    for (;;) {
      let paused;
      try {
        return this.check(traceId);
      } catch (error) {
        if (!(error instanceof AgentPaused)) throw error;
        paused = error;
      }
      let left = Math.min(msUntil(paused.until, this.clock()), WAIT_RECHECK_MS);
      if (deadline !== null) {
        if (performance.now() >= deadline) throw paused;
        left = Math.min(left, deadline - performance.now());
      }
      if (signal?.aborted) throw paused;
      await new Promise((resolve) => {
        const wake = () => {
          clearTimeout(timer);
          this.wakers.delete(wake);
          signal?.removeEventListener('abort', wake);
          resolve();
        };
        const timer = setTimeout(wake, Math.max(0, left));
        this.wakers.add(wake);
        signal?.addEventListener('abort', wake, { once: true });
      });
    }
  }

  wakeWaiters() {
    for (const wake of [...this.wakers]) wake();
  }

  /** Past its pauseUntil with no answer: the policy's fallback applies. */
  pauseOver(traceId, entry) {
    const pause = entry.pause;
    if (msUntil(pause.pauseUntil, this.clock()) > 0) return;
    entry.pause = null;
    if (pause.pauseFallback === 'kill') {
      entry.kill = Object.freeze({
        ...pause,
        kind: 'kill',
        reason: `${pause.reason}; paused with no answer by ${pause.pauseUntil}: the policy's fallback kills`,
      });
      this.watched.delete(traceId);
      this.killed.set(traceId, entry);
    }
  }

  isKilled(traceId) {
    const id = traceId.toLowerCase();
    if (this.killed.has(id)) return true;
    const entry = this.watched.get(id) ?? this.others.get(id);
    return entry !== undefined && entry.kill !== null;
  }

  forget(traceId) {
    const id = traceId.toLowerCase();
    this.others.delete(id);
    this.watched.delete(id);
    this.killed.delete(id);
  }

  get trackedTraces() {
    return this.others.size + this.watched.size + this.killed.size;
  }
}
