// The shared kill-signal vectors (schemas/testdata/kill-signal-vectors.json): every killswitch
// must reach each verdict, so a record no two languages would read alike is decided alike.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { test } from 'node:test';

import { AgentKilled, AgentPaused, BadSignal, SignalBook, ToolContained, keyId, keyring, readSignal } from '../src/index.js';

const document = JSON.parse(
  readFileSync(new URL('../../../schemas/testdata/kill-signal-vectors.json', import.meta.url), 'utf8'),
);
const now = new Date(document.now);
// A wait that should end on a step of `meanwhile` gets this long before the test calls it stuck.
const SAFETY_TIMEOUT_MS = 10_000;

function bytesOf(vector) {
  if ('value_base64' in vector) return Buffer.from(vector.value_base64, 'base64');
  return Buffer.from(vector.value, 'utf8');
}

function keysOf(vector) {
  return vector.keys === null ? null : keyring(vector.keys.map((name) => document.keys[name]));
}

function verdict(vector) {
  try {
    return ['obey', readSignal(bytesOf(vector), keysOf(vector), now)];
  } catch (error) {
    if (error instanceof BadSignal) return [error.kind, null];
    throw error;
  }
}

test('the key ids are the keys own', () => {
  for (const [name, key] of Object.entries(document.keys)) assert.equal(keyId(key), document.key_ids[name]);
});

for (const vector of document.vectors) {
  test(`vector: ${vector.name}`, () => {
    const [kind, signal] = verdict(vector);
    assert.equal(kind, vector.verdict);
    if (signal !== null) {
      const expected = vector.signal;
      assert.deepEqual(
        {
          kind: signal.kind,
          trace_id: signal.traceId,
          signal_id: signal.signalId,
          rule: signal.rule,
          reason: signal.reason,
          system_message: signal.systemMessage,
          expires_at: signal.expiresAt,
          pause_until: signal.pauseUntil,
          pause_fallback: signal.pauseFallback,
          scope: signal.scope,
          conversation_id: signal.conversationId,
          agent_service: signal.agent.service,
          agent_name: signal.agent.name,
          ...(signal.tool ? { tool: { name: signal.tool.name, server: signal.tool.server } } : {}),
        },
        expected,
      );
    }
  });
}

// How a check or wait ends: [kind, detail], kind 'pass' | 'message' | 'killed' | 'paused'.
function outcomeOf(error, message) {
  if (error instanceof ToolContained) return ['contained', error];
  if (error instanceof AgentKilled) return ['killed', error];
  if (error instanceof AgentPaused) return ['paused', error];
  if (error !== undefined) throw error;
  return message === null ? ['pass', null] : ['message', message];
}

async function settle(promise) {
  try {
    return outcomeOf(undefined, await promise);
  } catch (error) {
    return outcomeOf(error);
  }
}

function assertOutcome([kind, detail], step) {
  const where = JSON.stringify(step);
  if (['pass', 'killed', 'paused', 'contained'].includes(step.expect)) assert.equal(kind, step.expect, where);
  else assert.deepEqual([kind, detail], ['message', step.expect], where);
  if ('reason' in step) assert.equal(detail.reason, step.reason, where);
  if ('until' in step) assert.deepEqual([detail.until, detail.fallback], [step.until, step.fallback], where);
}

// The time is given by the steps, never slept: the book reads this clock.
for (const sequence of document.sequences) {
  test(`sequence: ${sequence.name}`, async () => {
    const keys = keyring(document.keys.current);
    let clock = now;
    const book = new SignalBook(undefined, { clock: () => clock });
    const run = async (step) => {
      if ('clock' in step) {
        clock = new Date(step.clock);
      } else if ('deliver' in step) {
        const record = Buffer.from(sequence.signals[step.deliver], 'utf8');
        assert.equal(book.deliver(readSignal(record, keys, clock)), step.new, JSON.stringify(step));
      } else if ('check' in step) {
        let outcome;
        try {
          outcome = outcomeOf(undefined, book.check(step.check, { conversationId: step.conversation, agent: step.agent }));
        } catch (error) {
          outcome = outcomeOf(error);
        }
        assertOutcome(outcome, step);
      } else if (!('meanwhile' in step)) {
        assertOutcome(await settle(book.wait(step.wait, { timeoutMs: step.timeout * 1000 })), step);
      } else {
        // wait() checks at once and then blocks: the steps below happen while it waits.
        const waiting = settle(book.wait(step.wait, { timeoutMs: SAFETY_TIMEOUT_MS }));
        for (const inner of step.meanwhile) await run(inner);
        assertOutcome(await waiting, step);
      }
    };
    for (const step of sequence.steps) await run(step);
  });
}

// Checks naming the tool about to be called, against tool signals (contains and releases).
for (const sequence of document.tool_sequences) {
  test(`tool sequence: ${sequence.name}`, () => {
    const keys = keyring(document.keys.current);
    let clock = now;
    const book = new SignalBook(undefined, { clock: () => clock });
    let refused = 0;
    for (const step of sequence.steps) {
      if ('clock' in step) {
        clock = new Date(step.clock);
      } else if ('deliver' in step) {
        const record = Buffer.from(sequence.signals[step.deliver], 'utf8');
        assert.equal(book.deliver(readSignal(record, keys, clock)), step.new, JSON.stringify(step));
      } else {
        let outcome;
        try {
          outcome = outcomeOf(undefined, book.check(step.check, { tool: step.tool, server: step.server }));
        } catch (error) {
          outcome = outcomeOf(error);
        }
        assertOutcome(outcome, step);
        if (outcome[0] === 'contained') {
          refused += 1;
          assert.equal(outcome[1].tool, step.tool);
          assert.ok(outcome[1].message.startsWith(`tool ${step.tool} is contained by spanguard`));
        }
      }
    }
    assert.equal(book.toolCallsRefused, refused);
  });
}
