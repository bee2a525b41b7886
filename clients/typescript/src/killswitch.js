// The agent side: a background reader of agent-kill-signals and a check() before each step.
//
//   const killswitch = await new KillSwitch({ brokers: ['kafka:9092'],
//     signingKey: process.env.SPANGUARD_SIGNING_KEY }).start();
//   const message = killswitch.check(traceId); // throws AgentKilled once the trace is killed
//   // AgentPaused: await killswitch.wait(traceId) until an operator's release or kill
//
// Every process reads every partition of the topic itself, from the end offsets resolved when
// start() returns, with no consumer group (no rebalance, no commits): signals before it started
// are about other processes' traces. Any record is read through readSignal; a bad one is counted
// in `ignored` (by kind), logged once per kind, and costs only itself: the reader never stops.
// Signals are obeyed only when signed with one of the agent's keys (signingKey, or signingKeys
// [new, old] while the worker's key is rotated) and not past their expires_at; allowUnsigned
// obeys unsigned ones instead (anyone who can write the topic can then stop the agent).

import { createRequire } from 'node:module';

import kafkajs from 'kafkajs';

import { DEFAULT_MAX_TRACES, SignalBook, ToolContained } from './book.js';
import { kafkajsSecurity, securityFromEnv } from './security.js';
import { BadSignal, MALFORMED_KINDS, REJECTED_KINDS, keyring, readSignal } from './signal.js';

const { Kafka, logLevel: LOG_LEVEL } = kafkajs;
const READ_COMMITTED = 1;
const FETCH_WAIT_MS = 50;
const RETRY_PAUSE_MS = 1000;

let otel = null;
try {
  otel = createRequire(import.meta.url)('@opentelemetry/api');
} catch {
  // no OpenTelemetry in this agent: check() needs an explicit trace id
}

/** The 32-hex trace id of the active OpenTelemetry span, or null. */
export function currentTraceId() {
  const span = otel?.trace.getActiveSpan();
  if (!span) return null;
  const context = span.spanContext();
  return otel.isSpanContextValid(context) ? context.traceId : null;
}

// Where a process's conversation is named in OpenTelemetry baggage, first present wins.
const CONVERSATION_BAGGAGE_KEYS = ['gen_ai.conversation.id', 'session.id'];

/** The conversation named in the active OpenTelemetry baggage, or null. */
export function currentConversationId() {
  const bag = otel?.propagation.getBaggage(otel.context.active());
  for (const name of CONVERSATION_BAGGAGE_KEYS) {
    const value = bag?.getEntry(name)?.value;
    if (value) return value;
  }
  return null;
}

/** The agent an OpenTelemetry resource names: service.name, with gen_ai.agent.name when set;
 * null without a service.name. Takes a Resource of @opentelemetry/resources (or anything with
 * its `attributes`). */
export function agentOf(resource) {
  const attributes = resource?.attributes ?? {};
  const service = attributes['service.name'];
  if (typeof service !== 'string' || !service) return null;
  const name = attributes['gen_ai.agent.name'];
  return { service, name: typeof name === 'string' && name ? name : null };
}

/** The agent the resource of the active span names (an SDK span carries its provider's
 * resource), or null. */
export function currentAgent() {
  return agentOf(otel?.trace.getActiveSpan()?.resource);
}

/** 'SERVICE/NAME' or 'SERVICE' (every agent name of the service) as {service, name}. */
export function parseAgent(text) {
  const slash = text.indexOf('/');
  const service = slash < 0 ? text : text.slice(0, slash);
  const name = slash < 0 ? '' : text.slice(slash + 1);
  if (!service) throw new SettingsError(`${JSON.stringify(text)} names no service: SERVICE or SERVICE/NAME`);
  return { service, name: name || null };
}

export class SettingsError extends Error {}

// The Cluster kafkajs builds for its own consumers, with the client's brokers, TLS and SASL:
// the low-level fetch by partition that the kill topic needs (kafkajs's public consumer always
// joins a group). kafkajs 2.2.4 is pinned; its Kafka class keeps the factory under this symbol.
function createCluster(kafka) {
  const symbol = Object.getOwnPropertySymbols(kafka).find(
    (s) => s.description === 'private:Kafka:createCluster',
  );
  if (symbol === undefined) throw new Error('this kafkajs version has no cluster factory: pin kafkajs 2.2.4');
  return kafka[symbol]({ metadataMaxAge: 300_000, allowAutoTopicCreation: false, isolationLevel: READ_COMMITTED });
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

export class KillSwitch {
  /**
   * @param {object} options
   * @param {string[]|string} options.brokers bootstrap servers, host:port
   * @param {string} [options.topic='agent-kill-signals']
   * @param {string|Uint8Array} [options.signingKey] the worker's SPANGUARD_SIGNING_KEY
   * @param {Array<string|Uint8Array>} [options.signingKeys] several, while rotating
   * @param {boolean} [options.allowUnsigned=false] INSECURE: obey unsigned signals
   * @param {SignalBook} [options.signals] a book shared with other readers
   * @param {object} [options.security] TLS/SASL (default: SPANGUARD_KAFKA_* from the environment)
   * @param {() => Date} [options.clock] decides expiry (and pause deadlines, in its own book)
   * @param {(line: string) => void} [options.log] where warnings go (default console.warn)
   * @param {string} [options.conversationId] this process's conversation, for every check
   * @param {object|string} [options.agent] this process's agent, {service, name} or 'SERVICE[/NAME]'
   * @param {object} [options.resource] the resource the agent's TracerProvider was built with
   *   (@opentelemetry/resources): its service.name and gen_ai.agent.name name the agent when
   *   neither the check nor `agent` does; without it, the active span's resource is read
   */
  constructor({
    brokers,
    topic = 'agent-kill-signals',
    signingKey,
    signingKeys = [],
    allowUnsigned = false,
    signals,
    security,
    clock,
    log,
    clientId = 'spanguard-killswitch',
    conversationId,
    agent,
    resource,
  }) {
    const keys = [...(signingKey ? [signingKey] : []), ...signingKeys];
    if (keys.length && allowUnsigned) throw new SettingsError('give signing keys or allowUnsigned: true, not both');
    if (!keys.length && !allowUnsigned) {
      throw new SettingsError(
        "no signing key: pass signingKey (the worker's SPANGUARD_SIGNING_KEY), or allowUnsigned: true to obey unsigned signals (insecure)",
      );
    }
    this.topic = topic;
    this.keys = keys.length ? keyring(keys) : null;
    this.clock = clock ?? (() => new Date());
    this.signals = signals ?? new SignalBook(DEFAULT_MAX_TRACES, { clock: this.clock });
    this.log = log ?? ((line) => console.warn(line));
    this.containedWarned = new Set(); // the tools whose refused call was logged
    // The process's conversation and agent ({service, name}, or 'SERVICE[/NAME]'), when it has
    // one of each; a check's own win (see scope()).
    this.conversationId = conversationId ?? null;
    this.agent = typeof agent === 'string' ? parseAgent(agent) : (agent ?? null);
    this.resourceAgent = agentOf(resource);
    this.received = 0;
    this.ignored = new Map();
    // Checks that found no trace to check: tool calls nothing guarded (warned once per place).
    this.unguarded = 0;
    this.unguardedWarned = new Set();
    this.kafka = new Kafka({
      brokers: typeof brokers === 'string' ? brokers.split(',') : brokers,
      clientId,
      ...kafkajsSecurity(security ?? securityFromEnv()),
      logLevel: LOG_LEVEL.NOTHING,
      retry: { retries: 2 },
    });
    this.cluster = null;
    this.positions = new Map(); // partition -> next offset (BigInt)
    this.running = false;
    this.loop = null;
  }

  /** Connect, position every partition at its end offset, and start reading. */
  async start({ timeoutMs = 30_000 } = {}) {
    const deadline = Date.now() + timeoutMs;
    this.cluster = createCluster(this.kafka);
    for (;;) {
      try {
        await this.cluster.connect();
        await this.cluster.addTargetTopic(this.topic);
        await this.resolveEnds();
        break;
      } catch (error) {
        // A refused password or certificate is final; a topic still being created is not.
        const settling = error.retriable || /UNKNOWN_TOPIC|LEADER_NOT_AVAILABLE|NOT_LEADER/.test(String(error.type));
        if (!settling || Date.now() > deadline) {
          await this.cluster.disconnect().catch(() => {});
          throw error;
        }
        await sleep(200);
      }
    }
    this.running = true;
    this.loop = this.run();
    return this;
  }

  async resolveEnds() {
    const partitions = this.cluster.findTopicPartitionMetadata(this.topic).map((p) => p.partitionId);
    if (!partitions.length) throw Object.assign(new Error(`topic ${this.topic} not found`), { retriable: true });
    const [offsets] = await this.cluster.fetchTopicsOffset([
      { topic: this.topic, partitions: partitions.map((partition) => ({ partition })), fromBeginning: false },
    ]);
    for (const { partition, offset } of offsets.partitions) {
      if (!this.positions.has(partition)) this.positions.set(partition, BigInt(offset));
    }
  }

  /** Throw AgentKilled if the trace (default: the active span's), its conversation or its
   * agent was killed; ToolContained (an AgentKilled) if `given.tool` (on `given.server`;
   * absent: whichever) is contained; return a downgrade's system message once; else null.
   * Reads memory only: never waits on Kafka. With no trace (none given, no active span) only
   * the scope and the tool are checked, and the call is counted in `unguarded` and warned
   * about once. */
  check(traceId = currentTraceId(), given = {}) {
    const scope = { ...this.scope(given), tool: given.tool, server: given.server };
    try {
      if (!traceId) {
        this.signals.checkScopes(scope); // a scope kill stops the call: it is not unguarded
        this.noteUnguarded(
          'KillSwitch.check()',
          "no trace id given and no OpenTelemetry span is active; pass the run's trace id, check() inside the agent's span, or use guardTools / spanguardCallbackHandler",
        );
        this.signals.checkTool(scope.tool, scope.server);
        return null;
      }
      return this.signals.check(traceId, scope);
    } catch (error) {
      if (error instanceof ToolContained) this.noteContained(error);
      throw error;
    }
  }

  /** Throw ToolContained if `tool` (on `server`; absent: whichever) is contained. */
  checkTool(tool, server = null) {
    try {
      this.signals.checkTool(tool, server);
    } catch (error) {
      if (error instanceof ToolContained) this.noteContained(error);
      throw error;
    }
  }

  // The first refused call to each tool is logged; the rest are counted in the book.
  noteContained(contained) {
    const key = JSON.stringify([contained.tool, contained.server]);
    if (this.containedWarned.has(key) || this.containedWarned.size >= this.signals.maxTraces) return;
    this.containedWarned.add(key);
    this.log(
      `spanguard killswitch: ${contained.message} (rule ${contained.rule}, signal ${contained.decisionId}); further calls to it are counted in signals.toolCallsRefused, not logged`,
    );
  }

  /** Count a tool call that could not be checked (no trace found); warn once per `where`.
   * Never silent: an agent that cannot be told its trace was killed is not guarded. */
  noteUnguarded(where, whatToDo) {
    this.unguarded += 1;
    if (this.unguardedWarned.has(where)) return;
    this.unguardedWarned.add(where);
    this.log(
      `spanguard killswitch: ${where} found no trace to check, so this tool call is NOT guarded: ${whatToDo} (further ones are counted in KillSwitch.unguarded, not logged)`,
    );
  }

  /** The conversation and agent a check stands for, each from the first source that names it:
   * given, the switch's own, then the active OpenTelemetry baggage (gen_ai.conversation.id,
   * then session.id) for the conversation, and the switch's `resource`, else the active span's,
   * for the agent (taken whole from one source). */
  scope({ conversationId, agent } = {}) {
    return {
      conversationId: conversationId || this.conversationId || currentConversationId(),
      agent:
        (typeof agent === 'string' ? parseAgent(agent) : agent) ||
        this.agent ||
        this.resourceAgent ||
        currentAgent(),
    };
  }

  /** check(), and while the trace is paused (AgentPaused), wait for an operator's release
   * (resolves: go on) or kill (rejects with AgentKilled), or the pause's deadline, when the
   * policy's fallback applies. Options: timeoutMs, signal (an AbortSignal). See SignalBook.wait. */
  async wait(traceId = currentTraceId(), options = {}) {
    if (!traceId) return null;
    return this.signals.wait(traceId, options);
  }

  get malformed() {
    return [...this.ignored].reduce((sum, [kind, n]) => sum + (MALFORMED_KINDS.has(kind) ? n : 0), 0);
  }

  get rejected() {
    return [...this.ignored].reduce((sum, [kind, n]) => sum + (REJECTED_KINDS.has(kind) ? n : 0), 0);
  }

  get expired() {
    return this.ignored.get('expired') ?? 0;
  }

  async close() {
    this.running = false;
    await this.loop?.catch(() => {});
    await this.cluster?.disconnect().catch(() => {});
  }

  async run() {
    while (this.running) {
      try {
        await this.fetchOnce();
      } catch (error) {
        // Leaders moved, a broker restarted, new partitions: refresh and go on, never stop.
        this.ignore(new BadSignal('consumer_error', String(error?.message ?? error)));
        await sleep(RETRY_PAUSE_MS);
        await this.cluster.refreshMetadata().catch(() => {});
        await this.resolveEnds().catch(() => {});
      }
    }
  }

  async fetchOnce() {
    const partitions = [...this.positions.keys()];
    const byLeader = this.cluster.findLeaderForPartitions(this.topic, partitions);
    await Promise.all(
      Object.entries(byLeader).map(async ([nodeId, leaderPartitions]) => {
        const broker = await this.cluster.findBroker({ nodeId });
        const response = await broker.fetch({
          replicaId: -1,
          isolationLevel: READ_COMMITTED,
          maxWaitTime: FETCH_WAIT_MS,
          minBytes: 1,
          maxBytes: 10 * 1024 * 1024,
          topics: [
            {
              topic: this.topic,
              partitions: leaderPartitions.map((partition) => ({
                partition,
                fetchOffset: String(this.positions.get(partition)),
                maxBytes: 1024 * 1024,
              })),
            },
          ],
        });
        for (const topic of response.responses) {
          for (const part of topic.partitions) {
            if (part.errorCode) throw new Error(`fetch error ${part.errorCode} on partition ${part.partition}`);
            this.deliverAll(part.partition, part.messages);
          }
        }
      }),
    );
  }

  deliverAll(partition, messages) {
    let next = this.positions.get(partition);
    for (const message of messages) {
      const offset = BigInt(message.offset);
      if (offset < next) continue; // a batch starts before the position
      next = offset + 1n;
      if (message.isControlRecord) continue;
      this.accept(message.value);
    }
    this.positions.set(partition, next);
  }

  accept(value) {
    try {
      this.signals.deliver(readSignal(value, this.keys, this.clock()));
    } catch (error) {
      this.ignore(error instanceof BadSignal ? error : new BadSignal('internal', `${error?.name}: ${error?.message}`));
    } finally {
      // Counted once the record is dealt with: what was read is already in the book or ignored.
      this.received += 1;
    }
  }

  ignore(bad) {
    const count = (this.ignored.get(bad.kind) ?? 0) + 1;
    this.ignored.set(bad.kind, count);
    if (count === 1) {
      this.log(
        `spanguard killswitch: ignored a kill-signal record (${bad.kind}): ${bad.detail}; further ones of this kind are counted in KillSwitch.ignored, not logged`,
      );
    }
  }
}
