// What each trace was told: the agent's check() reads it, the Kafka consumer writes it.
// The same semantics as the Python killswitch's SignalBook (killswitch/signals.py).

export const DEFAULT_MAX_TRACES = 10_000;

/** Thrown by check() in an agent whose trace was killed; carries the signal. */
export class AgentKilled extends Error {
  constructor(signal) {
    super(`spanguard killed trace ${signal.traceId}: ${signal.reason}`);
    this.name = 'AgentKilled';
    this.signal = signal;
    this.traceId = signal.traceId;
    this.reason = signal.reason;
  }
}

function newEntry() {
  return { signalIds: new Set(), kill: null, unread: [] };
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
 * Kill, downgrade and release signals per trace.
 * - deliver(signal) records it; an id already recorded for its trace is a duplicate (false).
 * - check(traceId) throws AgentKilled once a kill is recorded, on that check and every later
 *   one; returns a downgrade's system message exactly once; else null.
 * - a release lifts the trace's kill until a later kill (a new signal id).
 * Memory is bounded by maxTraces per kind of entry; a killed trace this process has checked is
 * never forgotten (until forget()), so other traces' signals cannot push out its kill.
 */
export class SignalBook {
  constructor(maxTraces = DEFAULT_MAX_TRACES) {
    if (maxTraces < 1) throw new RangeError('maxTraces must be at least 1');
    this.maxTraces = maxTraces;
    this.others = new Map(); // traces this process has not checked
    this.watched = new Map(); // traces it checks, not killed
    this.killed = new Map(); // traces it checks, killed
    this.delivered = 0;
    this.duplicates = 0;
  }

  deliver(signal) {
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
    if (entry.signalIds.has(signal.signalId)) {
      this.duplicates += 1;
      return false;
    }
    entry.signalIds.add(signal.signalId);
    this.delivered += 1;
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
      entry.unread.push(signal.systemMessage ?? fallbackMessage(signal));
    }
    return true;
  }

  check(traceId) {
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
    if (entry.kill !== null) throw new AgentKilled(entry.kill);
    return entry.unread.length ? entry.unread.shift() : null;
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
