// The stop reason, machine-readable: the span event a kill, pause or downgrade leaves on the
// active span (the shared vectors' stop_events, alike in Python and Go), the fields of
// AgentKilled / AgentPaused, and exitOnStop's exit status. The real SDK, its in-memory exporter.
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { test } from 'node:test';

import { context } from '@opentelemetry/api';
import { AsyncLocalStorageContextManager } from '@opentelemetry/context-async-hooks';
import { BasicTracerProvider, InMemorySpanExporter, SimpleSpanProcessor } from '@opentelemetry/sdk-trace-base';

import { AgentKilled, AgentPaused, EXIT_KILLED, SignalBook, exitOnStop, keyring, readSignal } from '../src/index.js';

context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable());

const document = JSON.parse(
  readFileSync(new URL('../../../schemas/testdata/kill-signal-vectors.json', import.meta.url), 'utf8'),
);
const now = new Date(document.now);
const keys = keyring(document.keys.current);

function inMemory() {
  const exporter = new InMemorySpanExporter();
  const provider = new BasicTracerProvider({ spanProcessors: [new SimpleSpanProcessor(exporter)] });
  return { tracer: provider.getTracer('agent'), exporter };
}

function eventsOf(exporter, name) {
  const [span] = exporter.getFinishedSpans().filter((s) => s.name === name);
  return span.events.map((e) => ({ name: e.name, attributes: e.attributes }));
}

test('the vectors hold stop events', () => {
  assert.ok(document.stop_events.length >= 3);
});

for (const c of document.stop_events) {
  test(`stop events: ${c.name}`, () => {
    const { tracer, exporter } = inMemory();
    const book = new SignalBook(undefined, { clock: () => now });
    book.deliver(readSignal(Buffer.from(c.signal, 'utf8'), keys, now));
    tracer.startActiveSpan('step', (span) => {
      for (let i = 0; i < 2; i += 1) {
        // the same check again adds no second event
        try {
          const message = book.check(c.check.trace, { conversationId: c.check.conversation });
          if (message !== null) assert.equal(c.expect, 'message');
        } catch (error) {
          if (!(error instanceof AgentKilled)) throw error;
          assert.equal(c.expect, 'killed');
          const a = c.event.attributes;
          assert.deepEqual(
            [error.rule, error.action, error.decisionId, error.scope, error.reason],
            [a['spanguard.rule'], a['spanguard.action'], a['spanguard.decision_id'], a['spanguard.scope'], a['spanguard.reason']],
          );
        }
      }
      span.end();
    });
    assert.deepEqual(eventsOf(exporter, 'step'), [c.event]);
  });
}

test('a pause is a spanguard.stop event once, and AgentPaused carries its fields', () => {
  const { tracer, exporter } = inMemory();
  const book = new SignalBook();
  const until = new Date(Date.now() + 60_000).toISOString();
  const pause = {
    signalId: '5'.repeat(32), traceId: 'a'.repeat(32), kind: 'pause', rule: 'tool_loop',
    reason: 'search_docs called 4x', pauseUntil: until, pauseFallback: 'kill',
    expiresAt: new Date(Date.now() + 3_600_000).toISOString(), detectedAt: new Date().toISOString(),
  };
  book.deliver(pause);
  let paused = null;
  tracer.startActiveSpan('step', (span) => {
    for (let i = 0; i < 3; i += 1) {
      try {
        book.check(pause.traceId);
      } catch (error) {
        paused = error;
      }
    }
    span.end();
  });
  assert.ok(paused instanceof AgentPaused);
  assert.deepEqual([paused.action, paused.rule, paused.decisionId, paused.scope], ['pause', 'tool_loop', pause.signalId, 'trace']);
  const events = eventsOf(exporter, 'step');
  assert.equal(events.length, 1);
  assert.equal(events[0].name, 'spanguard.stop');
  assert.equal(events[0].attributes['spanguard.action'], 'pause');
});

test('exitOnStop: a stop (also as a cause) exits 75 with one JSON line; other errors pass', async () => {
  const kill = readSignal(Buffer.from(document.stop_events[0].signal, 'utf8'), keys, now);
  const written = [];
  const exited = [];
  const options = { exit: (code) => exited.push(code), stderr: { write: (text) => written.push(text) } };
  await exitOnStop(() => {
    throw new Error('Error running tool', { cause: new AgentKilled(kill) });
  }, options);
  assert.deepEqual(exited, [EXIT_KILLED]);
  assert.equal(EXIT_KILLED, 75);
  const reason = JSON.parse(written.join(''));
  assert.deepEqual(reason, {
    spanguard: 'stopped', action: 'kill', rule: 'tool_loop', decision_id: kill.signalId,
    scope: 'trace', trace_id: kill.traceId, reason: kill.reason,
  });
  await assert.rejects(exitOnStop(() => { throw new TypeError('a bug'); }, options), TypeError);
  assert.equal(await exitOnStop(async () => 'done', options), 'done');
});

test('an agent process stopped by the guard exits 75', () => {
  const code = `
    import { AgentKilled, exitOnStop, readSignal, keyring } from './src/index.js';
    const d = ${JSON.stringify({ signal: document.stop_events[0].signal, key: document.keys.current, now: document.now })};
    const s = readSignal(Buffer.from(d.signal), keyring(d.key), new Date(d.now));
    await exitOnStop(() => { throw new AgentKilled(s); });`;
  const result = spawnSync(process.execPath, ['--input-type=module', '-e', code], {
    cwd: new URL('..', import.meta.url), encoding: 'utf8',
  });
  assert.equal(result.status, 75, result.stderr);
  assert.equal(JSON.parse(result.stderr.trim()).rule, 'tool_loop');
});
