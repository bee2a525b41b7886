// A real AI SDK agent for the end-to-end test (tests/deploy/test_e2e_languages.py): AI SDK 6's
// own telemetry exported over OTLP/HTTP to the Collector, the TypeScript killswitch reading the
// worker's signals, guardTools checking before each tool call. Its scripted model asks for the
// same search again and again (an empty index), thinking `--step-delay` seconds each time.
//
//   node e2e_agent.mjs --endpoint http://127.0.0.1:4318 --bootstrap 127.0.0.1:9092 \
//     --kill-topic agent-kill-signals [--step-delay 1.0] [--max-calls 12]
//
// SPANGUARD_SIGNING_KEY is the worker's key. The last line of stdout is one JSON object:
// {agent, status: killed|gave_up, calls, reason, trace_id, kill_latency_s}.

import { context, trace } from '@opentelemetry/api';
import { AsyncLocalStorageContextManager } from '@opentelemetry/context-async-hooks';
import { OTLPTraceExporter } from '@opentelemetry/exporter-trace-otlp-http';
import { resourceFromAttributes } from '@opentelemetry/resources';
import { BasicTracerProvider, BatchSpanProcessor } from '@opentelemetry/sdk-trace-base';
import { generateText, stepCountIs, tool } from 'ai6';
import { MockLanguageModelV3 } from 'ai6/test';
import { z } from 'zod';

import { AgentKilled, KillSwitch, guardTools } from '../../../clients/typescript/src/index.js';

function option(name, fallback) {
  const at = process.argv.indexOf(`--${name}`);
  return at === -1 ? fallback : process.argv[at + 1];
}

const endpoint = option('endpoint');
const bootstrap = option('bootstrap', '127.0.0.1:9092');
const killTopic = option('kill-topic', 'agent-kill-signals');
const stepDelayMs = Number(option('step-delay', '1.0')) * 1000;
const maxCalls = Number(option('max-calls', '12'));
const AGENT = 'support-agent';
const USAGE = {
  inputTokens: { total: 800, noCache: 800, cacheRead: undefined, cacheWrite: undefined },
  outputTokens: { total: 60, text: 60, reasoning: undefined },
};

context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable());
const provider = new BasicTracerProvider({
  resource: resourceFromAttributes({ 'service.name': 'support-bot-ts', 'gen_ai.agent.name': AGENT }),
  // A short export delay: a span waiting in the agent is detection latency.
  spanProcessors: [new BatchSpanProcessor(new OTLPTraceExporter({ url: `${endpoint}/v1/traces` }), { scheduledDelayMillis: 50 })],
});
trace.setGlobalTracerProvider(provider);

const killswitch = await new KillSwitch({
  brokers: bootstrap,
  topic: killTopic,
  signingKey: process.env.SPANGUARD_SIGNING_KEY,
}).start();

const result = { agent: AGENT, status: 'gave_up', calls: 0, reason: null, trace_id: null, kill_latency_s: null };
let trippedAt = null;
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
// Watch for the signal's arrival while the model "thinks", to measure the kill latency.
const watch = setInterval(() => {
  if (trippedAt !== null && result.kill_latency_s === null && killswitch.signals.isKilled(result.trace_id)) {
    result.kill_latency_s = (performance.now() - trippedAt) / 1000;
  }
}, 5);

let turn = 0;
const model = new MockLanguageModelV3({
  doGenerate: async () => {
    await sleep(stepDelayMs);
    turn += 1;
    if (turn > maxCalls) {
      return { content: [{ type: 'text', text: 'I could not find it.' }], finishReason: { unified: 'stop', raw: 'stop' }, usage: USAGE, warnings: [] };
    }
    const call = { type: 'tool-call', toolCallId: `call_${turn}`, toolName: 'search_docs', input: '{"query":"refund policy"}' };
    return { content: [call], finishReason: { unified: 'tool-calls', raw: 'tool_calls' }, usage: USAGE, warnings: [] };
  },
});
const tools = {
  search_docs: tool({
    description: 'Search the knowledge base.',
    inputSchema: z.object({ query: z.string() }),
    execute: async ({ query }) => {
      result.calls += 1;
      if (result.calls === 3) trippedAt = performance.now(); // the default loop.threshold trips here
      console.log(`[${AGENT}] call ${result.calls}: search_docs(${JSON.stringify(query)}) -> no results`);
      return 'no results';
    },
  }),
};

const controller = new AbortController();
const tracer = trace.getTracer('spanguard.e2e');
try {
  await tracer.startActiveSpan(`invoke_agent ${AGENT}`, { attributes: { 'gen_ai.agent.name': AGENT } }, async (root) => {
    result.trace_id = root.spanContext().traceId;
    try {
      await generateText({
        model,
        tools: guardTools(tools, killswitch, { abortController: controller }),
        stopWhen: stepCountIs(maxCalls + 2),
        abortSignal: controller.signal,
        prompt: 'What is the refund policy?',
        experimental_telemetry: { isEnabled: true, functionId: AGENT },
      });
    } finally {
      root.end();
    }
  });
} catch (error) {
  const killed = controller.signal.reason;
  if (!(killed instanceof AgentKilled)) throw error;
  result.status = 'killed';
  result.reason = killed.reason;
  console.log(`[${AGENT}] KILLED before call ${result.calls + 1}: ${killed.reason}`);
} finally {
  clearInterval(watch);
  await provider.shutdown();
  await killswitch.close();
}
console.log(JSON.stringify(result));
