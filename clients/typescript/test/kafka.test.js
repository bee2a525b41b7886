// The KillSwitch against a real broker: SPANGUARD_TEST_BOOTSTRAP, else scripts/kafka.sh's
// 127.0.0.1:9092 (`make kafka-up`). A topic of its own per run, three partitions.
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { after, before, test } from 'node:test';

import { context, propagation } from '@opentelemetry/api';
import { AsyncLocalStorageContextManager } from '@opentelemetry/context-async-hooks';
import { resourceFromAttributes } from '@opentelemetry/resources';
import { BasicTracerProvider } from '@opentelemetry/sdk-trace-base';
import kafkajs from 'kafkajs';

import { AgentKilled, AgentPaused, KillSwitch, SettingsError, kafkajsSecurity, securityFromEnv, sign } from '../src/index.js';

const { Kafka, logLevel } = kafkajs;
const BOOTSTRAP = process.env.SPANGUARD_TEST_BOOTSTRAP ?? '127.0.0.1:9092';
const KEY = 'typescript-killswitch-test-key-01';
const TOPIC = `ts-killswitch-${randomBytes(4).toString('hex')}`;
const kafka = new Kafka({
  brokers: BOOTSTRAP.split(','),
  clientId: 'spanguard-ts-test',
  logLevel: logLevel.NOTHING,
  ...kafkajsSecurity(securityFromEnv()),
});
const admin = kafka.admin();
const producer = kafka.producer({ allowAutoTopicCreation: false });

const hex = (n) => randomBytes(n).toString('hex');

function signal(traceId, changes = {}) {
  const now = Date.now();
  return {
    schema_version: 2,
    signal_id: hex(16),
    trace_id: traceId,
    kind: 'kill',
    rule: 'tool_loop',
    reason: 'search_docs called 4x in last 4 steps',
    evidence: { span_id: hex(8), tool_name: 'search_docs', hits: 4 },
    agent: { service: 'ts-agent', name: null },
    detected_at: new Date(now).toISOString(),
    expires_at: new Date(now + 3_600_000).toISOString(),
    system_message: null,
    ...changes,
  };
}

async function send(partition, value) {
  await producer.send({ topic: TOPIC, acks: -1, messages: [{ partition, value }] });
}

async function until(condition, what, timeoutMs = 20_000) {
  const deadline = Date.now() + timeoutMs;
  while (!condition()) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}

before(async () => {
  await admin.connect();
  await admin.createTopics({ topics: [{ topic: TOPIC, numPartitions: 3, replicationFactor: 1 }], waitForLeaders: true });
  await producer.connect();
});

after(async () => {
  await producer.disconnect();
  await admin.deleteTopics({ topics: [TOPIC] }).catch(() => {});
  await admin.disconnect();
});

test('refuses to start without a key unless told to obey unsigned signals', () => {
  assert.throws(() => new KillSwitch({ brokers: BOOTSTRAP }), SettingsError);
  assert.throws(() => new KillSwitch({ brokers: BOOTSTRAP, signingKey: KEY, allowUnsigned: true }), SettingsError);
});

test('reads every partition from its end, with no consumer group; bad records cost only themselves', async () => {
  const early = hex(16);
  await send(0, JSON.stringify(sign(signal(early), KEY))); // before start: another process's
  const groupsBefore = (await admin.listGroups()).groups.map((g) => g.groupId).sort();
  const killswitch = await new KillSwitch({ brokers: BOOTSTRAP, topic: TOPIC, signingKey: KEY, log: () => {} }).start();
  try {
    const killed = hex(16);
    const steered = hex(16);
    const junk = [
      Buffer.from([0xff, 0xfe]),
      Buffer.from('not json'),
      Buffer.from('{"a":1,"a":2}'),
      Buffer.from(JSON.stringify(sign(signal(killed, { reason: 'x' }), 'an-other-key-of-enough-length'))),
      Buffer.from(JSON.stringify({ ...sign(signal(killed), KEY), reason: 'tampered' })),
      Buffer.from(JSON.stringify(signal(killed))), // unsigned
      Buffer.from(JSON.stringify(sign(signal(killed, { expires_at: '2020-01-01T00:00:00Z' }), KEY))),
    ];
    for (const [index, value] of junk.entries()) await send(index % 3, value);
    const message = 'You called search_docs 4 times; try something else.';
    await send(1, JSON.stringify(sign(signal(steered, { kind: 'downgrade', system_message: message }), KEY)));
    await send(2, JSON.stringify(sign(signal(killed), KEY)));
    await until(() => killswitch.received === junk.length + 2, 'every record');
    assert.throws(() => killswitch.check(killed), AgentKilled);
    assert.throws(() => killswitch.check(killed), AgentKilled); // remembered
    assert.equal(killswitch.check(steered), message);
    assert.equal(killswitch.check(steered), null); // once
    assert.equal(killswitch.check(early), null); // sent before start: not this process's
    assert.deepEqual(Object.fromEntries(killswitch.ignored), {
      not_utf8: 1,
      not_json: 2,
      unknown_key: 1,
      forged: 1,
      unsigned: 1,
      expired: 1,
    });
    assert.equal(killswitch.malformed, 3);
    assert.equal(killswitch.rejected, 3);
    assert.equal(killswitch.expired, 1);
    const groupsAfter = (await admin.listGroups()).groups.map((g) => g.groupId).sort();
    assert.deepEqual(groupsAfter, groupsBefore);
  } finally {
    await killswitch.close();
  }
});

test('a checked trace keeps its kill; an operator release lifts it; a new kill returns', async () => {
  const killswitch = await new KillSwitch({ brokers: BOOTSTRAP, topic: TOPIC, signingKeys: [KEY, 'previous-key-still-accepted-01'], log: () => {} }).start();
  try {
    const trace = hex(16);
    assert.equal(killswitch.check(trace), null);
    const kill = sign(signal(trace), 'previous-key-still-accepted-01'); // rotation: the old key
    await send(0, JSON.stringify(kill));
    await until(() => killswitch.signals.isKilled(trace), 'the kill');
    assert.throws(() => killswitch.check(trace), AgentKilled);
    const release = sign(
      signal(trace, { kind: 'release', rule: 'manual', operator: 'oncall@example.com', reason: 'released', evidence: { span_id: '0'.repeat(16) } }),
      KEY,
    );
    await send(1, JSON.stringify(release));
    await send(2, JSON.stringify(kill)); // redelivered old kill: a duplicate
    await until(() => killswitch.received === 3, 'release and redelivery');
    assert.equal(killswitch.check(trace), null);
    await send(0, JSON.stringify(sign(signal(trace, { reason: 'killed again' }), KEY)));
    await until(() => killswitch.received === 4, 'the second kill');
    assert.throws(() => killswitch.check(trace), /killed again/);
  } finally {
    await killswitch.close();
  }
});

test('a signed pause holds the trace and a forged one is ignored; a signed release ends the wait', async (t) => {
  const killswitch = await new KillSwitch({ brokers: BOOTSTRAP, topic: TOPIC, signingKey: KEY, log: () => {} }).start();
  try {
    const trace = hex(16);
    const other = hex(16);
    assert.equal(killswitch.check(trace), null);
    const pauseUntil = new Date(Date.now() + 600_000).toISOString();
    const paused = (traceId) => signal(traceId, { kind: 'pause', pause_until: pauseUntil, pause_fallback: 'kill' });
    // Signed for a short pause, then stretched: the deadline is inside the signature.
    const stretched = { ...sign(paused(other), KEY), pause_until: '2099-01-01T00:00:00Z' };
    await send(2, JSON.stringify(stretched));
    await send(0, JSON.stringify(sign(paused(trace), KEY)));
    await until(() => killswitch.received === 2, 'the pauses');
    assert.deepEqual(Object.fromEntries(killswitch.ignored), { forged: 1 });
    assert.equal(killswitch.check(other), null);
    assert.throws(() => killswitch.check(trace), (error) => error instanceof AgentPaused && error.until === pauseUntil && error.fallback === 'kill');
    let settled = false;
    const waiting = killswitch.wait(trace, { timeoutMs: 30_000 }).finally(() => {
      settled = true;
    });
    await new Promise((resolve) => setTimeout(resolve, 300));
    assert.equal(settled, false); // still paused: nothing answered yet
    const release = signal(trace, {
      kind: 'release', rule: 'manual', operator: 'oncall@example.com', reason: 'looked fine', evidence: { span_id: '0'.repeat(16) },
    });
    const sentAt = performance.now();
    await send(1, JSON.stringify(sign(release, KEY)));
    assert.equal(await waiting, null);
    t.diagnostic(`the wait returned ${(performance.now() - sentAt).toFixed(1)} ms after the release was sent`);
    assert.equal(killswitch.check(trace), null);
  } finally {
    await killswitch.close();
  }
});

test('a conversation kill and an agent kill stop new traces of their scope only, until released', async () => {
  const conversation = `conv-${hex(4)}`;
  const killswitch = await new KillSwitch({
    brokers: BOOTSTRAP, topic: TOPIC, signingKey: KEY, log: () => {}, agent: 'ts-agent/triage',
  }).start();
  try {
    const scoped = (changes) => signal('0'.repeat(32), { rule: 'manual', operator: 'alice', evidence: { span_id: '0'.repeat(16) }, ...changes });
    const killConversation = scoped({ scope: 'conversation', conversation_id: conversation, reason: 'refund loop' });
    const killAgent = scoped({ scope: 'agent', agent: { service: 'ts-agent', name: 'triage' }, reason: 'spend' });
    await send(0, JSON.stringify(sign(killConversation, KEY)));
    await send(1, JSON.stringify(sign(killAgent, KEY)));
    await until(() => killswitch.received >= 2, 'the scoped kills');
    // The switch's own agent (ts-agent/triage) is killed for every trace...
    assert.throws(() => killswitch.check(hex(16)), (error) => error instanceof AgentKilled && error.scope === 'agent');
    // ... another agent's trace in the conversation is killed by the conversation kill ...
    const billing = { service: 'ts-agent', name: 'billing' };
    assert.throws(() => killswitch.check(hex(16), { conversationId: conversation, agent: billing }), (error) => error.scope === 'conversation');
    // ... and another agent outside it goes on.
    assert.equal(killswitch.check(hex(16), { conversationId: 'another', agent: billing }), null);
    const release = (kill) => ({ ...kill, kind: 'release', signal_id: hex(16), detected_at: new Date(Date.now() + 1000).toISOString() });
    await send(2, JSON.stringify(sign(release(killConversation), KEY)));
    await send(0, JSON.stringify(sign(release(killAgent), KEY)));
    await until(() => killswitch.received >= 4, 'the releases');
    assert.equal(killswitch.check(hex(16), { conversationId: conversation }), null);
  } finally {
    await killswitch.close();
  }
});

test('a check in an agent span finds its conversation in the baggage and its agent in the resource', async () => {
  // What an instrumented agent has: a context manager, a provider with its resource, baggage.
  context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable());
  const resource = resourceFromAttributes({ 'service.name': 'ts-otel-agent', 'gen_ai.agent.name': 'triage' });
  const tracer = new BasicTracerProvider({ resource }).getTracer('test');
  const killswitch = await new KillSwitch({ brokers: BOOTSTRAP, topic: TOPIC, signingKey: KEY, log: () => {}, resource }).start();
  const inConversation = (id, fn) =>
    context.with(propagation.setBaggage(context.active(), propagation.createBaggage({ 'gen_ai.conversation.id': { value: id } })), () =>
      tracer.startActiveSpan('invoke_agent triage', (span) => {
        try {
          return fn();
        } finally {
          span.end();
        }
      }),
    );
  try {
    const conversation = `conv-${hex(4)}`;
    const scoped = (changes) => signal('0'.repeat(32), { rule: 'manual', operator: 'alice', evidence: { span_id: '0'.repeat(16) }, ...changes });
    assert.equal(inConversation(conversation, () => killswitch.check()), null);
    await send(0, JSON.stringify(sign(scoped({ scope: 'conversation', conversation_id: conversation }), KEY)));
    await until(() => killswitch.received >= 1, 'the conversation kill');
    assert.throws(() => inConversation(conversation, () => killswitch.check()), (error) => error instanceof AgentKilled && error.scope === 'conversation');
    assert.equal(inConversation('another', () => killswitch.check()), null);
    await send(1, JSON.stringify(sign(scoped({ scope: 'agent', agent: { service: 'ts-otel-agent', name: null } }), KEY)));
    await until(() => killswitch.received >= 2, 'the agent kill');
    // Every agent of the service: this one, named by its resource, in any conversation.
    assert.throws(() => inConversation('another', () => killswitch.check()), (error) => error instanceof AgentKilled && error.scope === 'agent');
  } finally {
    await killswitch.close();
  }
});
