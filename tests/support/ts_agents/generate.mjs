// Span fixtures made by real TypeScript agent frameworks, from scripted agents (no network).
//
// The TypeScript counterpart of tests/support/instrumented_agents.py, which drives it
// (`python -m tests.support.instrumented_agents --typescript`) and hands it the same scenarios:
//
//   node generate.mjs --scenarios FILE --out DIR [LIBRARY...]
//
// Each (library, mode) runs in a node process of its own (instrumentations patch globally);
// the spans are collected by the OTel JS SDK's in-memory exporter and written as OTLP/JSON, one
// request per scenario: DIR/<library>/<mode>/<scenario>.json.gz, the format `spanguard replay` reads.

import { execFileSync } from 'node:child_process';
import { mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
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
import { z } from 'zod';

import { aiSdkStream, generated, TOKENS_IN, TOKENS_OUT } from './scripted_model.mjs';

const SERVICE = 'scripted-agent';
const FINAL_ANSWER = 'That is all I could find.';
const QUESTION = 'What is the refund policy?';
const TOOL_DOCS = {
  search_docs: 'Search the knowledge base.',
  read_doc: 'Read one document of the knowledge base.',
  get_job_status: 'Status of a background job.',
};
const TOOL_PARAMETERS = {
  search_docs: { query: 'string', request_id: 'optional' },
  read_doc: { doc_id: 'string' },
  get_job_status: { job_id: 'string' },
};

/** The scenario's calls in order: the model's next request and the tool's next result. */
class Script {
  constructor(calls) {
    this.calls = calls;
    this.turn = 0;
    this.resultIndex = 0;
  }

  nextCall() {
    if (this.turn >= this.calls.length) return null;
    return this.calls[this.turn++];
  }

  result() {
    return this.calls[this.resultIndex++].result;
  }
}

function zodShape(tool) {
  const shape = {};
  for (const [name, kind] of Object.entries(TOOL_PARAMETERS[tool])) {
    shape[name] = kind === 'optional' ? z.string().optional() : z.string();
  }
  return z.object(shape);
}

function jsonSchema(tool) {
  const properties = {};
  const required = [];
  for (const [name, kind] of Object.entries(TOOL_PARAMETERS[tool])) {
    properties[name] = { type: 'string' };
    if (kind !== 'optional') required.push(name);
  }
  return { type: 'object', properties, required, additionalProperties: false };
}

// -- the Vercel AI SDK ---------------------------------------------------------------------

/** The scripted model's next answer as AI SDK content parts (the V3 and V4 specs agree). */
function aiSdkTurn(script) {
  const call = script.nextCall();
  if (call === null) {
    return { parts: [{ type: 'text', text: FINAL_ANSWER }], finish: 'stop' };
  }
  const part = {
    type: 'tool-call',
    toolCallId: `call_${script.turn}`,
    toolName: call.tool,
    input: JSON.stringify(call.arguments),
  };
  return { parts: [part], finish: 'tool-calls' };
}

/** A mock model's doGenerate: each call answers the script's next turn. */
function aiSdkGenerate(script) {
  return async () => generated(aiSdkTurn(script));
}

/** One AI SDK agent: generateText (or streamText) with tools, looping until the model answers. */
async function runAiSdk(script, options, ai, MockModel) {
  const model = new MockModel({
    doGenerate: aiSdkGenerate(script),
    doStream: async () => ({ stream: aiSdkStream(aiSdkTurn(script)) }),
  });
  const tools = {};
  for (const name of Object.keys(TOOL_DOCS)) {
    tools[name] = ai.tool({
      description: TOOL_DOCS[name],
      inputSchema: zodShape(name),
      execute: async () => script.result(),
    });
  }
  const call = {
    model,
    tools,
    stopWhen: ai.stepCountIs(100),
    prompt: QUESTION,
    ...options.call,
  };
  if (options.stream) {
    const result = ai.streamText(call);
    await result.consumeStream();
    await result.text;
  } else {
    await ai.generateText(call);
  }
}

async function aiSdk6(mode) {
  // AI SDK 6 records its legacy `ai.*` spans through the global tracer provider by default.
  const ai = await import('ai6');
  const { MockLanguageModelV3 } = await import('ai6/test');
  const telemetry = { isEnabled: true, functionId: 'support', ...mode.telemetry };
  return (script) =>
    runAiSdk(script, { call: { experimental_telemetry: telemetry }, stream: mode.stream }, ai, MockLanguageModelV3);
}

async function aiSdk7(mode) {
  const ai = await import('ai');
  const { MockLanguageModelV4 } = await import('ai/test');
  const otel = await import('@ai-sdk/otel');
  ai.registerTelemetry(mode.legacy ? new otel.LegacyOpenTelemetry() : new otel.OpenTelemetry());
  const telemetry = { functionId: 'support', ...mode.telemetry };
  return (script) =>
    runAiSdk(script, { call: { telemetry }, stream: mode.stream }, ai, MockLanguageModelV4);
}

// -- LangGraph.js under OpenInference JS ---------------------------------------------------

async function langgraphOpenInference(mode, provider) {
  const callbacks = await import('@langchain/core/callbacks/manager');
  const { LangChainInstrumentation } = await import(
    '@arizeai/openinference-instrumentation-langchain'
  );
  const instrumentation = new LangChainInstrumentation({ traceConfig: mode.traceConfig });
  instrumentation.setTracerProvider(provider);
  instrumentation.manuallyInstrument(callbacks);

  const { BaseChatModel } = await import('@langchain/core/language_models/chat_models');
  const { AIMessage } = await import('@langchain/core/messages');
  const { tool } = await import('@langchain/core/tools');
  const { createReactAgent } = await import('@langchain/langgraph/prebuilt');
  const usage = {
    input_tokens: TOKENS_IN,
    output_tokens: TOKENS_OUT,
    total_tokens: TOKENS_IN + TOKENS_OUT,
  };

  return async (script) => {
    class ScriptedChatModel extends BaseChatModel {
      _llmType() {
        return 'scripted';
      }

      bindTools() {
        return this; // the script already knows which tools it calls
      }

      async _generate() {
        const call = script.nextCall();
        const message =
          call === null
            ? new AIMessage({ content: FINAL_ANSWER, usage_metadata: usage })
            : new AIMessage({
                content: '',
                tool_calls: [
                  { name: call.tool, args: call.arguments, id: `call_${script.turn}`, type: 'tool_call' },
                ],
                usage_metadata: usage,
              });
        return { generations: [{ text: typeof message.content === 'string' ? message.content : '', message }] };
      }
    }

    const tools = Object.keys(TOOL_DOCS).map((name) =>
      tool(async () => script.result(), {
        name,
        description: TOOL_DOCS[name],
        schema: zodShape(name),
      }),
    );
    const agent = createReactAgent({ llm: new ScriptedChatModel({}), tools });
    await agent.invoke({ messages: [{ role: 'user', content: QUESTION }] }, { recursionLimit: 100 });
  };
}

// -- the OpenAI Agents SDK for JS under OpenInference JS -----------------------------------

async function openaiAgentsOpenInference(mode, provider) {
  const agents = await import('@openai/agents');
  const { OpenAIAgentsInstrumentation } = await import(
    '@arizeai/openinference-instrumentation-openai-agents'
  );
  const instrumentation = new OpenAIAgentsInstrumentation({
    tracerProvider: provider,
    traceConfig: mode.traceConfig,
  });
  instrumentation.manuallyInstrument(agents);

  return async (script) => {
    const model = {
      // A model of one's own records its call as a generation span, as the SDK's own models
      // and its AI SDK adapter do: that span is where the usage is.
      getResponse: () =>
        agents.withGenerationSpan(async (span) => {
          span.spanData.model = 'scripted';
          span.spanData.usage = { input_tokens: TOKENS_IN, output_tokens: TOKENS_OUT };
          return scriptedResponse();
        }),
      // eslint-disable-next-line require-yield
      async *getStreamedResponse() {
        throw new Error('the scripted model does not stream');
      },
    };
    const scriptedResponse = () => {
      const usage = new agents.Usage({
        requests: 1,
        inputTokens: TOKENS_IN,
        outputTokens: TOKENS_OUT,
        totalTokens: TOKENS_IN + TOKENS_OUT,
      });
      const call = script.nextCall();
      if (call === null) {
        const message = {
          type: 'message',
          role: 'assistant',
          status: 'completed',
          id: 'msg_final',
          content: [{ type: 'output_text', text: FINAL_ANSWER }],
        };
        return { output: [message], usage, responseId: `resp_${script.turn}` };
      }
      const toolCall = {
        type: 'function_call',
        id: `fc_${script.turn}`,
        callId: `call_${script.turn}`,
        name: call.tool,
        arguments: JSON.stringify(call.arguments),
        status: 'completed',
      };
      return { output: [toolCall], usage, responseId: `resp_${script.turn}` };
    };
    const tools = Object.keys(TOOL_DOCS).map((name) =>
      agents.tool({
        name,
        description: TOOL_DOCS[name],
        parameters: jsonSchema(name),
        strict: false,
        execute: async () => script.result(),
      }),
    );
    const agent = new agents.Agent({ name: 'support', model, tools });
    await agents.run(agent, QUESTION, { maxTurns: 100 });
    await agents.getGlobalTraceProvider().forceFlush();
  };
}

// -- Mastra, its own observability exported through @mastra/otel-exporter -------------------

async function mastra(mode) {
  const { Mastra } = await import('@mastra/core');
  const { Agent } = await import('@mastra/core/agent');
  const { createTool } = await import('@mastra/core/tools');
  const { Observability } = await import('@mastra/observability');
  const { OtelExporter } = await import('@mastra/otel-exporter');
  const { MockLanguageModelV3 } = await import('ai6/test');

  return async (script) => {
    // Mastra builds its own tracer provider around the exporter it is given, and shuts it down
    // with the Mastra instance: collect what it exports here and hand it to the caller.
    const exported = [];
    const exporter = {
      export(spans, done) {
        exported.push(...spans);
        done({ code: 0 });
      },
      shutdown: async () => {},
      forceFlush: async () => {},
    };
    const model = new MockLanguageModelV3({ doGenerate: aiSdkGenerate(script) });
    const tools = {};
    for (const name of Object.keys(TOOL_DOCS)) {
      tools[name] = createTool({
        id: name,
        description: TOOL_DOCS[name],
        inputSchema: zodShape(name),
        execute: async () => script.result(),
      });
    }
    const agent = new Agent({ name: 'support', instructions: 'Answer from the knowledge base.', model, tools });
    const otel = new OtelExporter({
      exporter,
      // Required by the exporter's set-up; nothing is sent there (the exporter above is used).
      provider: { custom: { endpoint: 'http://127.0.0.1:9/v1/traces', protocol: 'http/json' } },
      signals: { logs: false },
    });
    const instance = new Mastra({
      agents: { support: agent },
      logger: false,
      observability: new Observability({ configs: { otel: { serviceName: SERVICE, exporters: [otel] } } }),
    });
    await instance.getAgent('support').generate(QUESTION, { maxSteps: 100, tracingOptions: mode.tracingOptions });
    await instance.shutdown();
    return exported;
  };
}

// -- VoltAgent, its own observability on the application's tracer provider -------------------

async function voltagent() {
  // Not a development run: VoltAgent would fetch its model registry (models.dev) at import.
  process.env.NODE_ENV = 'production';
  // ./voltagent has a lockfile of its own: VoltAgent asks for the AI SDK 6 as `ai`.
  const { voltAgentRunner } = await import('./voltagent/agent.mjs');
  return voltAgentRunner({
    service: SERVICE,
    question: QUESTION,
    toolDocs: TOOL_DOCS,
    toolParameters: TOOL_PARAMETERS,
    generate: aiSdkGenerate,
  });
}

// -- the libraries -------------------------------------------------------------------------

// library -> {mode -> what the mode sets}, and how to make its agent. The modes are every
// content-capture setting the library has: on (its default), off, and redacted where it has it.
const HIDE_INPUTS = { traceConfig: { hideInputs: true } };
export const LIBRARIES = {
  'ai-sdk6': {
    modes: {
      capture: {},
      // AI SDK <= 6 tags a tool call's arguments as an output of the model: recordInputs leaves them.
      'inputs-off': { telemetry: { recordInputs: false } },
      off: { telemetry: { recordOutputs: false } },
      stream: { stream: true },
    },
    make: aiSdk6,
  },
  'ai-sdk7-genai': {
    modes: {
      capture: {},
      off: { telemetry: { recordInputs: false } },
      'outputs-off': { telemetry: { recordOutputs: false } },
      stream: { stream: true },
    },
    make: aiSdk7,
  },
  'ai-sdk7-legacy': {
    modes: {
      capture: { legacy: true },
      off: { legacy: true, telemetry: { recordInputs: false } },
      stream: { legacy: true, stream: true },
    },
    make: aiSdk7,
  },
  mastra: {
    modes: {
      capture: {},
      redacted: { tracingOptions: { hideInput: true } },
      'outputs-off': { tracingOptions: { hideOutput: true } },
    },
    make: mastra,
  },
  // VoltAgent records a call's arguments and results whatever is set: one mode.
  voltagent: {
    modes: { capture: {} },
    make: voltagent,
  },
  'langgraphjs-openinference': {
    modes: { capture: {}, redacted: HIDE_INPUTS },
    make: langgraphOpenInference,
  },
  'openai-agents-js-openinference': {
    modes: { capture: {}, redacted: HIDE_INPUTS },
    make: openaiAgentsOpenInference,
  },
};

// -- running and writing -------------------------------------------------------------------

async function generateOne(name, modeName, scenarios, out) {
  const exporter = new InMemorySpanExporter();
  const provider = new BasicTracerProvider({
    resource: resourceFromAttributes({ 'service.name': SERVICE }),
    spanProcessors: [new SimpleSpanProcessor(exporter)],
  });
  // What NodeSDK / NodeTracerProvider.register() set up in an application: spans of one run
  // share its trace through the async context.
  context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable());
  trace.setGlobalTracerProvider(provider);
  const library = LIBRARIES[name];
  const run = await library.make(library.modes[modeName], provider);
  const folder = join(out, name, modeName);
  mkdirSync(folder, { recursive: true });
  for (const [scenario, calls] of Object.entries(scenarios)) {
    exporter.reset();
    const script = new Script(calls);
    // A framework with a tracer provider of its own returns the spans it exported.
    const own = await run(script);
    await provider.forceFlush();
    if (script.turn !== calls.length || script.resultIndex !== calls.length) {
      throw new Error(`${name}/${modeName}/${scenario}: the agent stopped at call ${script.turn}`);
    }
    const spans = Array.isArray(own) ? own : exporter.getFinishedSpans();
    const json = Buffer.from(JsonTraceSerializer.serializeRequest(spans));
    writeFileSync(join(folder, `${scenario}.json.gz`), gzipSync(Buffer.concat([json, Buffer.from('\n')])));
  }
}

function parse(argv) {
  const args = { libraries: [], one: null, scenarios: null, out: null };
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === '--scenarios') args.scenarios = argv[++i];
    else if (argv[i] === '--out') args.out = argv[++i];
    else if (argv[i] === '--one') args.one = [argv[++i], argv[++i]];
    else args.libraries.push(argv[i]);
  }
  if (!args.scenarios || !args.out) {
    throw new Error('usage: node generate.mjs --scenarios FILE --out DIR [LIBRARY...]');
  }
  return args;
}

async function main() {
  const args = parse(process.argv.slice(2));
  const scenarios = JSON.parse(readFileSync(args.scenarios, 'utf8'));
  if (args.one) {
    await generateOne(args.one[0], args.one[1], scenarios, args.out);
    // Every file is written: a framework's timers (VoltAgent's observability) must not keep
    // the process alive.
    process.exit(0);
  }
  const names = args.libraries.length ? args.libraries : Object.keys(LIBRARIES);
  const unknown = names.filter((name) => !(name in LIBRARIES));
  if (unknown.length) throw new Error(`unknown libraries: ${unknown.join(', ')}`);
  const self = fileURLToPath(import.meta.url);
  for (const name of names) {
    for (const mode of Object.keys(LIBRARIES[name].modes)) {
      const command = [self, '--scenarios', args.scenarios, '--out', args.out, '--one', name, mode];
      execFileSync(process.execPath, command, { stdio: 'inherit' });
    }
    console.log(`${name}: ${Object.keys(LIBRARIES[name].modes).join(', ')}`);
  }
}

await main();
