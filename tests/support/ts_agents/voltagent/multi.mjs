// VoltAgent supervisors and their sub-agents (`subAgents`, reached by the supervisor's
// `delegate_task` tool), from scripted models, under VoltAgent's own observability: the
// multi-agent fixtures of tests/fixtures/multi_agent/voltagent, driven by
// tests/support/multi_frameworks.py (`python -m tests.support.multi_frameworks voltagent`).
//
//   node multi.mjs --out DIR
//
// writes DIR/<scenario>.json.gz (OTLP/JSON, one request a scenario): VoltAgent starts each
// run's trace at its top agent's span, linked to the span current when it started (here a
// request's span, as a server's would be). A scenario with `asks` runs one agent once per ask
// within the request: a trace per run, each linked to the request's.

import { mkdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { gzipSync } from 'node:zlib';

import { context, trace } from '@opentelemetry/api';
import { AsyncLocalStorageContextManager } from '@opentelemetry/context-async-hooks';
import { JsonTraceSerializer } from '@opentelemetry/otlp-transformer';
import { resourceFromAttributes } from '@opentelemetry/resources';
import {
  BasicTracerProvider,
  InMemorySpanExporter,
  SimpleSpanProcessor,
} from '@opentelemetry/sdk-trace-base';

import { aiSdkStream, generated } from '../scripted_model.mjs';

const SERVICE = 'scripted-multi-agent';
const NOTHING_NEW = 'Nothing to add.';
const FINAL = 'Done.';
const DEPTH = 6; // agents below the supervisor in the delegation chain: a0 -> a1 -> ... -> a6

const delegate = (agent, task) => ({ tool: 'delegate_task', args: { task, targetAgents: [agent] } });
const fanOut = (workers) =>
  Array.from({ length: workers }, (_, i) => delegate(['worker_a', 'worker_b'][i % 2], `Look up item-${i}.`));

// Per scenario: the supervisor's turns in order (a turn is one tool call, several made at once,
// or a final answer), and what a worker does with a task: look its item up first, or answer.
const SCENARIOS = {
  // supervisor -> worker_a, again and again, the same task and the worker adding nothing.
  handoff_pingpong: {
    supervisor: [...Array(8).fill([delegate('worker_a', 'Check the refund.')]), FINAL],
    worker: 'answer',
  },
  // A healthy chain: worker_a looks the invoice up, worker_b refunds it, each once.
  handoff_chain: {
    supervisor: [
      [delegate('worker_a', 'Look up inv-1.')],
      [delegate('worker_b', 'Refund inv-1.')],
      FINAL,
    ],
    worker: 'work',
  },
  // Back and forth to worker_a, but each time another invoice: work, not a loop.
  handoff_with_work: {
    supervisor: [...['inv-1', 'inv-2', 'inv-3', 'inv-4'].map((inv) => [delegate('worker_a', `Look up ${inv}.`)]), FINAL],
    worker: 'work',
  },
  // The supervisor handing 50 items out at once, alternating its two workers.
  fan_out_50: { supervisor: [fanOut(50), FINAL], worker: 'work' },
  fan_out_5: { supervisor: [fanOut(5), FINAL], worker: 'work' },
  // a0 delegates to a1, which delegates to a2 ... to a6, which looks the item up.
  delegation_depth_6: { chain: DEPTH },
  // A healthy delegation: a0 -> a1 -> a2, which looks the item up.
  delegation_depth_2: { chain: 2 },
  // A caller asking the billing agent the same thing again and again, a run (and a trace) per
  // ask: the same lookup with the same answer each time.
  linked_runs_repeat: { asks: Array(6).fill('Look up inv-1.') },
  // The same caller asking about another invoice each time: work, not a loop.
  linked_runs_with_work: { asks: ['inv-1', 'inv-2', 'inv-3', 'inv-4'].map((inv) => `Look up ${inv}.`) },
};

function textOf(prompt) {
  return prompt
    .map((message) =>
      typeof message.content === 'string'
        ? message.content
        : message.content.map((part) => part.text ?? JSON.stringify(part.output ?? '')).join(' '),
    )
    .join('\n');
}

function toolCall(turn, index) {
  return {
    type: 'tool-call',
    toolCallId: `call_${index}_${Math.random().toString(36).slice(2, 8)}`,
    toolName: turn.tool,
    input: JSON.stringify(turn.args),
  };
}

/** A model answering from a function of its prompt: content parts and the finish reason. */
function scriptedModel(MockModel, decide) {
  const answer = (options) => {
    const parts = decide(options.prompt);
    const finish = parts.some((part) => part.type === 'tool-call') ? 'tool-calls' : 'stop';
    return { parts, finish };
  };
  return new MockModel({
    doGenerate: async (options) => generated(answer(options)),
    doStream: async (options) => ({ stream: aiSdkStream(answer(options)) }),
  });
}

const lastRole = (prompt) => prompt[prompt.length - 1].role;
const text = (value) => [{ type: 'text', text: value }];

/** The supervisor's model: its turns in order (it runs one at a time). */
function supervisorModel(MockModel, turns) {
  let next = 0;
  return scriptedModel(MockModel, () => {
    const turn = turns[next++] ?? FINAL;
    return typeof turn === 'string' ? text(turn) : turn.map(toolCall);
  });
}

/** A worker's model: answers from its own prompt (workers run concurrently in a fan-out). */
function workerModel(MockModel, mode) {
  return scriptedModel(MockModel, (prompt) => {
    const asked = textOf(prompt);
    const item = (asked.match(/(inv|item)-\d+/g) ?? ['item-0']).at(-1);
    if (mode === 'answer') return text(NOTHING_NEW);
    if (lastRole(prompt) === 'tool') return text(`${item}: done`);
    const refund = /Refund/.test(asked);
    return [toolCall({ tool: refund ? 'issue_refund' : 'lookup', args: refund ? { invoice: item } : { item } }, 0)];
  });
}

async function build(voltagent, MockModel, spec, observability) {
  const { Agent, createTool } = voltagent;
  const { z } = await import('zod');
  const tools = [
    createTool({ name: 'lookup', description: 'Look an item up.', parameters: z.object({ item: z.string() }), execute: async ({ item }) => `${item}: 40 USD` }),
    createTool({ name: 'issue_refund', description: 'Refund an invoice.', parameters: z.object({ invoice: z.string() }), execute: async ({ invoice }) => `refund of ${invoice} issued` }),
  ];
  const options = { instructions: 'Answer.', tools, observability };
  if (spec.asks !== undefined) {
    return new Agent({ ...options, name: 'billing', model: workerModel(MockModel, 'work') });
  }
  if (spec.chain !== undefined) {
    // a<chain> looks the item up; each agent above it delegates to the one below.
    let below = new Agent({ ...options, name: `a${spec.chain}`, model: workerModel(MockModel, 'work') });
    for (let level = spec.chain - 1; level >= 0; level--) {
      const turns = [[delegate(`a${level + 1}`, `Look up item-1, level ${level + 1}.`)], FINAL];
      below = new Agent({ ...options, name: `a${level}`, model: supervisorModel(MockModel, turns), subAgents: [below] });
    }
    return below;
  }
  const workers = ['worker_a', 'worker_b'].map(
    (name) => new Agent({ ...options, name, model: workerModel(MockModel, spec.worker) }),
  );
  return new Agent({ ...options, name: 'supervisor', model: supervisorModel(MockModel, spec.supervisor), subAgents: workers });
}

async function main() {
  const out = process.argv[process.argv.indexOf('--out') + 1];
  if (!process.argv.includes('--out') || !out) throw new Error('usage: node multi.mjs --out DIR');
  // Not a development run: VoltAgent would fetch its model registry (models.dev) at import.
  process.env.NODE_ENV = 'production';
  const exporter = new InMemorySpanExporter();
  const provider = new BasicTracerProvider({
    resource: resourceFromAttributes({ 'service.name': SERVICE }),
    spanProcessors: [new SimpleSpanProcessor(exporter)],
  });
  context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable());
  trace.setGlobalTracerProvider(provider);
  const voltagent = await import('@voltagent/core');
  const { MockLanguageModelV3 } = await import('ai/test');
  const observability = new voltagent.VoltAgentObservability({ serviceName: SERVICE });
  mkdirSync(out, { recursive: true });
  for (const [scenario, spec] of Object.entries(SCENARIOS)) {
    exporter.reset();
    const top = await build(voltagent, MockLanguageModelV3, spec, observability);
    // The request the run answers: VoltAgent links its run's trace to this span.
    await trace.getTracer('scripted-request').startActiveSpan('POST /agents/run', async (request) => {
      for (const ask of spec.asks ?? ['Please help.']) {
        await top.generateText(ask, { maxSteps: 100 });
      }
      request.end();
    });
    await provider.forceFlush();
    const spans = exporter.getFinishedSpans();
    const json = Buffer.from(JsonTraceSerializer.serializeRequest(spans));
    writeFileSync(join(out, `${scenario}.json.gz`), gzipSync(Buffer.concat([json, Buffer.from('\n')])));
    console.log(`${scenario}: ${spans.length} spans`);
  }
}

await main();
// Every file is written: VoltAgent's observability must not keep the process alive.
process.exit(0);
