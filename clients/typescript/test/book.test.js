// SignalBook.wait's own options (the shared vectors cover what ends a wait): a timeout or an
// aborted AbortSignal gives up with AgentPaused, and an unpaused trace never waits.
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { AgentPaused, SignalBook } from '../src/index.js';

const TRACE = 'cd'.repeat(16);

function paused() {
  const book = new SignalBook();
  book.deliver({
    signalId: 'pause-1',
    traceId: TRACE,
    kind: 'pause',
    rule: 'token_budget',
    reason: 'over budget',
    pauseUntil: new Date(Date.now() + 600_000).toISOString(),
    pauseFallback: 'kill',
  });
  return book;
}

test('a wait on a trace that is not paused returns at once', async () => {
  assert.equal(await new SignalBook().wait(TRACE), null);
});

test('a wait gives up with AgentPaused after timeoutMs', async () => {
  const book = paused();
  const started = performance.now();
  await assert.rejects(book.wait(TRACE, { timeoutMs: 150 }), AgentPaused);
  const elapsed = performance.now() - started;
  assert.ok(elapsed >= 140 && elapsed < 5_000, `gave up after ${elapsed} ms`);
  assert.equal(book.wakers.size, 0); // nothing left behind
});

test('a wait gives up with AgentPaused once its AbortSignal aborts', async () => {
  const book = paused();
  const controller = new AbortController();
  const waiting = book.wait(TRACE, { signal: controller.signal });
  setTimeout(() => controller.abort(), 50);
  await assert.rejects(waiting, (error) => error instanceof AgentPaused && error.fallback === 'kill');
  assert.equal(book.wakers.size, 0);
  await assert.rejects(book.wait(TRACE, { signal: controller.signal }), AgentPaused); // already aborted
});
