// The shared kill-signal vectors (schemas/testdata/kill-signal-vectors.json): every killswitch
// must reach each verdict, so a record no two languages would read alike is decided alike.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { test } from 'node:test';

import { AgentKilled, BadSignal, SignalBook, keyId, keyring, readSignal } from '../src/index.js';

const document = JSON.parse(
  readFileSync(new URL('../../../schemas/testdata/kill-signal-vectors.json', import.meta.url), 'utf8'),
);
const now = new Date(document.now);

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
        },
        expected,
      );
    }
  });
}

for (const sequence of document.sequences) {
  test(`sequence: ${sequence.name}`, () => {
    const keys = keyring(document.keys.current);
    const book = new SignalBook();
    for (const step of sequence.steps) {
      if ('deliver' in step) {
        const record = Buffer.from(sequence.signals[step.deliver], 'utf8');
        assert.equal(book.deliver(readSignal(record, keys, now)), step.new, JSON.stringify(step));
      } else if (step.expect === 'killed') {
        assert.throws(() => book.check(step.check), AgentKilled);
      } else {
        assert.equal(book.check(step.check), step.expect === 'pass' ? null : step.expect, JSON.stringify(step));
      }
    }
  });
}
