// Where a check finds its conversation and agent, on real OpenTelemetry baggage, resources and
// SDK spans: the shared cases of schemas/testdata/kill-signal-vectors.json (scope_resolution),
// then the active span's resource. No broker: the switches are not started.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { test } from 'node:test';

import { context, propagation, trace } from '@opentelemetry/api';
import { AsyncLocalStorageContextManager } from '@opentelemetry/context-async-hooks';
import { resourceFromAttributes } from '@opentelemetry/resources';
import { BasicTracerProvider } from '@opentelemetry/sdk-trace-base';

import { AgentKilled, KillSwitch, SignalBook, agentOf, readSignal } from '../src/index.js';

// Without a context manager the active context is always the root: baggage set in a
// context.with() would not be seen.
context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable());

const document = JSON.parse(
  readFileSync(new URL('../../../schemas/testdata/kill-signal-vectors.json', import.meta.url), 'utf8'),
);

const unstarted = (options) => new KillSwitch({ brokers: ['127.0.0.1:9'], allowUnsigned: true, log: () => {}, ...options });

function withBaggage(entries, fn) {
  const bag = propagation.createBaggage(Object.fromEntries(Object.entries(entries).map(([key, value]) => [key, { value }])));
  return context.with(propagation.setBaggage(context.active(), bag), fn);
}

test('the vectors hold scope resolution cases', () => {
  assert.ok(document.scope_resolution.length >= 10);
  assert.ok(document.scope_resolution.filter((c) => c.span_resource).length >= 3);
});

for (const c of document.scope_resolution) {
  test(`scope resolution: ${c.name}`, () => {
    const killswitch = unstarted({
      conversationId: c.switch.conversation,
      agent: c.switch.agent ?? undefined,
      resource: resourceFromAttributes(c.switch.resource),
    });
    const given = { conversationId: c.given.conversation, agent: c.given.agent ?? undefined };
    const found = withBaggage(c.baggage, () => {
      if (!c.span_resource) return killswitch.scope(given);
      // The check runs inside an active span of a provider built with this resource.
      const tracer = new BasicTracerProvider({ resource: resourceFromAttributes(c.span_resource) }).getTracer('test');
      return tracer.startActiveSpan('invoke_agent', (span) => {
        try {
          return killswitch.scope(given);
        } finally {
          span.end();
        }
      });
    });
    assert.deepEqual(
      { conversation: found.conversationId ?? null, agent: found.agent ?? null },
      { conversation: c.expect.conversation, agent: c.expect.agent },
    );
  });
}

test("without a resource option, the agent is the active span's resource", () => {
  const provider = new BasicTracerProvider({
    resource: resourceFromAttributes({ 'service.name': 'support-agent', 'gen_ai.agent.name': 'triage' }),
  });
  const tracer = provider.getTracer('test');
  const killswitch = unstarted({});
  assert.equal(killswitch.scope().agent, null); // no active span
  tracer.startActiveSpan('invoke_agent triage', (span) => {
    assert.deepEqual(killswitch.scope().agent, { service: 'support-agent', name: 'triage' });
    span.end();
  });
  const configured = unstarted({ resource: resourceFromAttributes({ 'service.name': 'configured' }) });
  tracer.startActiveSpan('invoke_agent triage', (span) => {
    assert.deepEqual(configured.scope().agent, { service: 'configured', name: null });
    span.end();
  });
  assert.equal(agentOf(resourceFromAttributes({ 'gen_ai.agent.name': 'triage' })), null);
});

test('check() in an active span obeys the kill of the conversation its baggage names', () => {
  const signals = new SignalBook();
  const killswitch = unstarted({ signals });
  const now = Date.now();
  const kill = {
    schema_version: 2, signal_id: 'a'.repeat(32), trace_id: '0'.repeat(32), kind: 'kill', rule: 'manual',
    reason: 'refund loop', evidence: { span_id: '0'.repeat(16) }, agent: { service: 'ts-agent', name: null },
    detected_at: new Date(now).toISOString(), expires_at: new Date(now + 3_600_000).toISOString(),
    system_message: null, operator: 'alice', scope: 'conversation', conversation_id: 'conv-9',
  };
  signals.deliver(readSignal(Buffer.from(JSON.stringify(kill)), null, new Date(now)));
  const tracer = new BasicTracerProvider().getTracer('test');
  tracer.startActiveSpan('invoke_agent', (span) => {
    assert.equal(killswitch.check(), null); // no baggage: only the trace, which nothing killed
    withBaggage({ 'session.id': 'conv-9' }, () => {
      assert.throws(() => killswitch.check(), (error) => error instanceof AgentKilled && error.scope === 'conversation');
    });
    span.end();
  });
});
