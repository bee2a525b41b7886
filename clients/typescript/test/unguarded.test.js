// A check that finds no trace to check (no trace id given, no active span): the guard cannot
// act on the trace, so it says so once and counts it. The shared cases of
// schemas/testdata/kill-signal-vectors.json (unguarded_checks) through a KillSwitch that is not
// started (its book fed directly), then the hooks. No context manager is registered here, so
// no span is ever active.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { test } from 'node:test';

import { AgentKilled, KillSwitch, SignalBook, guardTools, keyring, readSignal, spanguardCallbackHandler } from '../src/index.js';

const document = JSON.parse(
  readFileSync(new URL('../../../schemas/testdata/kill-signal-vectors.json', import.meta.url), 'utf8'),
);
const now = new Date(document.now);
const keys = keyring(document.keys.current);

function unstarted(lines, options = {}) {
  return new KillSwitch({
    brokers: ['127.0.0.1:9'], // never contacted: the switch is not started
    signingKey: document.keys.current,
    clock: () => now,
    log: (line) => lines.push(line),
    ...options,
  });
}

function outcome(call) {
  try {
    return call() === null ? 'pass' : 'message';
  } catch (error) {
    if (error instanceof AgentKilled) return 'killed';
    throw error;
  }
}

test('the vectors hold unguarded checks', () => {
  assert.ok(document.unguarded_checks.length >= 1);
});

for (const sequence of document.unguarded_checks) {
  test(`unguarded checks: ${sequence.name}`, () => {
    const lines = [];
    const killswitch = unstarted(lines);
    for (const [index, step] of sequence.steps.entries()) {
      const where = `step ${index}: ${JSON.stringify(step)}`;
      if ('deliver' in step) {
        const signal = readSignal(Buffer.from(sequence.signals[step.deliver], 'utf8'), keys, now);
        assert.equal(killswitch.signals.deliver(signal), step.new, where);
        continue;
      }
      const scope = { conversationId: step.conversation, agent: step.agent ?? undefined };
      assert.equal(outcome(() => killswitch.check(step.check, scope)), step.expect, where);
      assert.deepEqual([killswitch.unguarded, lines.length], [step.unguarded, step.warnings], where);
    }
    if (lines.length) assert.match(lines[0], /KillSwitch\.check\(\) found no trace to check, so this tool call is NOT guarded/);
  });
}

test('check() with no argument outside any span is unguarded too', () => {
  const lines = [];
  const killswitch = unstarted(lines);
  assert.equal(killswitch.check(), null);
  assert.equal(killswitch.check(undefined, { conversationId: 'conv-1' }), null);
  assert.deepEqual([killswitch.unguarded, lines.length], [2, 1]);
});

const tools = (ran) => ({
  search_docs: { description: 'search', execute: async (input) => ran.push(input) },
  no_execute: { description: 'a tool the model runs elsewhere' },
});

test('guardTools with no trace: the tool runs, counted in the hook and the switch, warned once', async () => {
  const lines = [];
  const killswitch = unstarted(lines);
  const ran = [];
  const guarded = guardTools(tools(ran), killswitch);
  await guarded.search_docs.execute({ query: 'a' });
  await guarded.search_docs.execute({ query: 'b' });
  assert.equal(ran.length, 2);
  assert.equal(guarded.unguarded, 2);
  assert.equal(killswitch.unguarded, 2);
  assert.equal(lines.length, 1);
  assert.match(lines[0], /guardTools \(Vercel AI SDK tools\) found no trace to check, so this tool call is NOT guarded/);
  assert.deepEqual(Object.keys(guarded), ['search_docs', 'no_execute']); // the count is not a tool

  // Another hook on the same switch warns once in its own words.
  const handler = await spanguardCallbackHandler(killswitch);
  await handler.handleToolStart();
  assert.equal(handler.unguarded, 1);
  assert.equal(killswitch.unguarded, 3);
  assert.equal(lines.length, 2);
  assert.match(lines[1], /spanguardCallbackHandler/);

  // A hook given the trace is guarded: nothing counted.
  const withTrace = guardTools(tools(ran), killswitch, { traceId: 'ab'.repeat(16) });
  await withTrace.search_docs.execute({ query: 'c' });
  assert.deepEqual([withTrace.unguarded, killswitch.unguarded, lines.length], [0, 3, 2]);
});

test('a hook on a SignalBook with no trace warns once through console.warn', async (t) => {
  const warned = t.mock.method(console, 'warn', () => {});
  const guarded = guardTools(tools([]), new SignalBook());
  await guarded.search_docs.execute({});
  await guarded.search_docs.execute({});
  assert.equal(guarded.unguarded, 2);
  assert.equal(warned.mock.callCount(), 1);
  assert.match(warned.mock.calls[0].arguments[0], /NOT guarded: run the agent inside an OpenTelemetry span/);
});

test("the hooks pass their options' conversation and agent to every check", async () => {
  const conversationKill = document.unguarded_checks[0].signals.conversation_kill;
  const book = new SignalBook(undefined, { clock: () => now });
  book.deliver(readSignal(Buffer.from(conversationKill, 'utf8'), keys, now));
  const conversation = JSON.parse(conversationKill).conversation_id;
  const traceId = 'cd'.repeat(16);
  const ran = [];
  await guardTools(tools(ran), book, { traceId, conversationId: 'another' }).search_docs.execute({});
  assert.equal(ran.length, 1);
  await assert.rejects(
    async () => guardTools(tools(ran), book, { traceId, conversationId: conversation }).search_docs.execute({}),
    (error) => error instanceof AgentKilled && error.scope === 'conversation',
  );
  const handler = await spanguardCallbackHandler(book, { traceId, conversationId: conversation });
  assert.throws(() => handler.handleToolStart(), AgentKilled);
  assert.equal(ran.length, 1);
});
