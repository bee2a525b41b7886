// The hooks in real frameworks (scripted models, no network): the AI SDK's generateText and
// LangGraph.js's prebuilt ReAct agent stop before the tool call that follows a kill, and wait
// before the one that follows a pause until a release (it runs) or a kill (the run stops).
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { AIMessage } from '@langchain/core/messages';
import { BaseChatModel } from '@langchain/core/language_models/chat_models';
import { tool as langchainTool } from '@langchain/core/tools';
import { createReactAgent } from '@langchain/langgraph/prebuilt';
import { generateText, stepCountIs, tool } from 'ai';
import { MockLanguageModelV3 } from 'ai/test';
import { z } from 'zod';

import { AgentKilled, SignalBook, ToolContained, guardTools, spanguardCallbackHandler } from '../src/index.js';

const TRACE = 'ab'.repeat(16);
const USAGE = {
  inputTokens: { total: 10, noCache: 10, cacheRead: undefined, cacheWrite: undefined },
  outputTokens: { total: 5, text: 5, reasoning: undefined },
};

function kill(book, kind = 'kill', extra = {}) {
  book.deliver({
    signalId: `${kind}-${book.delivered}`,
    traceId: TRACE,
    kind,
    rule: 'tool_loop',
    reason: 'search_docs called 4x in last 4 steps',
    systemMessage: null,
    ...extra,
  });
}

function pause(book, { fallback = 'kill', inMs = 600_000 } = {}) {
  kill(book, 'pause', {
    reason: 'search_docs called 4x in last 4 steps',
    pauseUntil: new Date(Date.now() + inMs).toISOString(),
    pauseFallback: fallback,
  });
}

function release(book) {
  kill(book, 'release', { rule: 'manual', reason: 'looked fine', operator: 'oncall@example.com' });
}

// The book, and how many times a hook has started waiting on it (the real wait runs).
function watchedBook() {
  const book = new SignalBook();
  const checker = {
    waits: 0,
    check: (traceId) => book.check(traceId),
    wait(traceId, options) {
      this.waits += 1;
      return book.wait(traceId, options);
    },
  };
  return { book, checker };
}

async function until(condition, what, timeoutMs = 10_000) {
  const deadline = Date.now() + timeoutMs;
  while (!condition()) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
}

function loopingModel() {
  let turn = 0;
  return new MockLanguageModelV3({
    doGenerate: async () => {
      turn += 1;
      const call = { type: 'tool-call', toolCallId: `call_${turn}`, toolName: 'search_docs', input: '{"query":"refund policy"}' };
      return { content: [call], finishReason: { unified: 'tool-calls', raw: 'tool_calls' }, usage: USAGE, warnings: [] };
    },
  });
}

// search_docs, counting its runs; `during(runs)` happens inside each run (a signal arriving
// while the tool works), before it answers.
function countedSearch(during) {
  const search = {
    runs: 0,
    async run() {
      search.runs += 1;
      during(search.runs);
      return 'no results';
    },
  };
  return search;
}

// generateText over the looping model, with `tools` guarded by `checker` for `steps` steps;
// its promise and the abort controller a kill aborts.
function guardedGenerate(tools, checker, steps, options = {}) {
  const controller = new AbortController();
  const run = generateText({
    model: loopingModel(),
    tools: guardTools(tools, checker, { traceId: TRACE, abortController: controller, ...options }),
    stopWhen: stepCountIs(steps),
    abortSignal: controller.signal,
    prompt: 'q',
  });
  return { run, controller };
}

function aiSdkSearch(search) {
  return {
    search_docs: tool({
      description: 'Search.',
      inputSchema: z.object({ query: z.string() }),
      execute: search.run,
    }),
  };
}

test('AI SDK: the tool after a kill never runs and generateText rejects with AgentKilled', async () => {
  const book = new SignalBook();
  const search = countedSearch((runs) => {
    if (runs === 3) kill(book); // the worker's kill arrives while the third call runs
  });
  const { run, controller } = guardedGenerate(aiSdkSearch(search), book, 20);
  await assert.rejects(run);
  assert.equal(search.runs, 3);
  assert.ok(controller.signal.reason instanceof AgentKilled);
});

test('AI SDK: a downgrade message is handed over once and the tools go on', async () => {
  const book = new SignalBook();
  const messages = [];
  const search = countedSearch((runs) => {
    if (runs === 1) kill(book, 'downgrade', { systemMessage: 'try another query' });
  });
  await guardedGenerate(aiSdkSearch(search), book, 3, { onDowngrade: (m) => messages.push(m) }).run;
  assert.equal(search.runs, 3);
  assert.deepEqual(messages, ['try another query']);
});

// A chat model that calls search_docs on each of its first `toolTurns` turns, then answers.
function scriptedChatModel(toolTurns = Infinity) {
  let turn = 0;
  class ScriptedChatModel extends BaseChatModel {
    _llmType() {
      return 'scripted';
    }

    bindTools() {
      return this;
    }

    async _generate() {
      turn += 1;
      const message =
        turn > toolTurns
          ? new AIMessage({ content: 'The refund policy is 30 days.' })
          : new AIMessage({
              content: '',
              tool_calls: [{ name: 'search_docs', args: { query: 'refund policy' }, id: `call_${turn}`, type: 'tool_call' }],
            });
      return { generations: [{ text: '', message }] };
    }
  }
  return new ScriptedChatModel({});
}

// LangGraph.js's ReAct agent over the scripted chat model with `search` as its tool, checked
// against `checker` by the callback handler: its run's promise and the abort controller.
async function guardedReactAgent(search, checker, toolTurns = Infinity) {
  const searchTool = langchainTool(search.run, {
    name: 'search_docs',
    description: 'Search.',
    schema: z.object({ query: z.string() }),
  });
  const agent = createReactAgent({ llm: scriptedChatModel(toolTurns), tools: [searchTool] });
  const controller = new AbortController();
  const handler = await spanguardCallbackHandler(checker, { traceId: TRACE, abortController: controller });
  const run = agent.invoke(
    { messages: [{ role: 'user', content: 'q' }] },
    { recursionLimit: 50, callbacks: [handler], signal: controller.signal },
  );
  return { run, controller };
}

async function quietly(promise) {
  const quiet = console.error;
  console.error = () => {}; // LangChain.js prints every raised handler error
  try {
    return await promise;
  } finally {
    console.error = quiet;
  }
}

test('LangGraph.js: the callback handler stops the ReAct agent before the next tool call', async () => {
  const book = new SignalBook();
  const search = countedSearch((runs) => {
    if (runs === 3) kill(book);
  });
  const { run, controller } = await guardedReactAgent(search, book);
  await assert.rejects(quietly(run));
  assert.equal(search.runs, 3);
  assert.ok(controller.signal.reason instanceof AgentKilled);
});

test('AI SDK: after a pause the next tool call waits; a release lets it run and the call go on', async () => {
  const { book, checker } = watchedBook();
  const search = countedSearch((runs) => {
    if (runs === 1) pause(book);
  });
  const { run, controller } = guardedGenerate(aiSdkSearch(search), checker, 3);
  await until(() => checker.waits === 1, 'the second tool call to wait');
  await new Promise((resolve) => setTimeout(resolve, 100));
  assert.equal(search.runs, 1); // still waiting: the paused tool call has not run
  release(book);
  await run;
  assert.equal(search.runs, 3);
  assert.equal(controller.signal.aborted, false);
});

test('AI SDK: a pause unanswered by its deadline with fallback kill ends the call with AgentKilled', async () => {
  const { book, checker } = watchedBook();
  const search = countedSearch((runs) => {
    if (runs === 1) pause(book, { fallback: 'kill', inMs: 300 });
  });
  const { run, controller } = guardedGenerate(aiSdkSearch(search), checker, 20);
  await assert.rejects(run);
  assert.equal(search.runs, 1);
  assert.equal(checker.waits, 1);
  assert.ok(controller.signal.reason instanceof AgentKilled);
  assert.match(controller.signal.reason.reason, /paused with no answer by .*: the policy's fallback kills$/);
});

test('LangGraph.js: after a pause the ReAct agent waits before its next tool; a release lets it finish', async () => {
  const { book, checker } = watchedBook();
  const search = countedSearch((runs) => {
    if (runs === 1) pause(book);
  });
  const { run, controller } = await guardedReactAgent(search, checker, 3);
  await until(() => checker.waits === 1, 'the second tool call to wait');
  await new Promise((resolve) => setTimeout(resolve, 100));
  assert.equal(search.runs, 1);
  release(book);
  const result = await run;
  assert.equal(search.runs, 3);
  assert.equal(result.messages.at(-1).content, 'The refund policy is 30 days.');
  assert.equal(controller.signal.aborted, false);
});

test('LangGraph.js: a kill while the agent waits on a pause stops the run with AgentKilled', async () => {
  const { book, checker } = watchedBook();
  const search = countedSearch((runs) => {
    if (runs === 1) pause(book);
  });
  const { run, controller } = await guardedReactAgent(search, checker);
  const finished = quietly(run);
  await until(() => checker.waits === 1, 'the second tool call to wait');
  kill(book, 'kill', { reason: 'stuck on the index' });
  await assert.rejects(finished);
  assert.equal(search.runs, 1);
  assert.ok(controller.signal.reason instanceof AgentKilled);
  assert.equal(controller.signal.reason.reason, 'stuck on the index');
});

test('AI SDK: a streaming tool (async generator) waits through a pause too, then streams', async () => {
  const { book, checker } = watchedBook();
  let runs = 0;
  const tools = {
    search_docs: tool({
      description: 'Search.',
      inputSchema: z.object({ query: z.string() }),
      async *execute() {
        runs += 1;
        if (runs === 1) pause(book);
        yield 'searching';
        yield 'no results';
      },
    }),
  };
  const { run } = guardedGenerate(tools, checker, 2);
  await until(() => checker.waits === 1, 'the second tool call to wait');
  assert.equal(runs, 1);
  release(book);
  const result = await run;
  assert.equal(runs, 2);
  const outputs = result.steps.flatMap((step) => step.toolResults.map((r) => r.output));
  assert.deepEqual(outputs, ['no results', 'no results']);
});

// A contained tool: the refusal reaches the model as the tool's error, the run goes on.
function contain(book, tool = 'search_docs') {
  book.deliver({
    signalId: `contain-${book.delivered}`,
    traceId: '0'.repeat(32),
    kind: 'kill',
    rule: 'tool_failing',
    reason: 'the index answers 503 for every trace',
    detectedAt: new Date().toISOString(),
    expiresAt: new Date(Date.now() + 600_000).toISOString(),
    scope: 'tool',
    tool: { name: tool, server: '' },
  });
}

const REFUSAL = 'tool search_docs is contained by spanguard';

test('AI SDK: a contained tool is refused to the model, which takes its other tool and finishes', async () => {
  const book = new SignalBook();
  contain(book);
  const runs = [];
  const searchTool = (name, answer) =>
    tool({
      description: name,
      inputSchema: z.object({ query: z.string() }),
      execute: async () => {
        runs.push(name);
        return answer;
      },
    });
  let turn = 0;
  const model = new MockLanguageModelV3({
    doGenerate: async ({ prompt }) => {
      turn += 1;
      const seen = JSON.stringify(prompt);
      let content;
      if (turn === 1) content = [{ type: 'tool-call', toolCallId: 'c1', toolName: 'search_docs', input: '{"query":"refunds"}' }];
      else if (turn === 2) {
        assert.ok(seen.includes(REFUSAL), seen);
        content = [{ type: 'tool-call', toolCallId: 'c2', toolName: 'web_search', input: '{"query":"refunds"}' }];
      } else content = [{ type: 'text', text: 'refunds within 30 days' }];
      const finish = turn < 3 ? { unified: 'tool-calls', raw: 'tool_calls' } : { unified: 'stop', raw: 'stop' };
      return { content, finishReason: finish, usage: USAGE, warnings: [] };
    },
  });
  const controller = new AbortController();
  const result = await generateText({
    model,
    tools: guardTools(
      { search_docs: searchTool('search_docs', 'no results'), web_search: searchTool('web_search', 'refunds within 30 days') },
      book,
      { traceId: TRACE, abortController: controller },
    ),
    stopWhen: stepCountIs(5),
    abortSignal: controller.signal,
    prompt: 'What is the refund policy?',
  });
  assert.equal(result.text, 'refunds within 30 days');
  assert.deepEqual(runs, ['web_search']);
  assert.equal(controller.signal.aborted, false);
  assert.equal(book.toolCallsRefused, 1);
});

test('LangGraph.js: a contained tool becomes a tool error; the agent takes its other tool and finishes', async () => {
  const book = new SignalBook();
  contain(book);
  const runs = [];
  const named = (name, answer) =>
    langchainTool(
      async () => {
        runs.push(name);
        return answer;
      },
      { name, description: name, schema: z.object({ query: z.string() }) },
    );
  let turn = 0;
  class Scripted extends BaseChatModel {
    _llmType() {
      return 'scripted';
    }

    bindTools() {
      return this;
    }

    async _generate(messages) {
      turn += 1;
      const call = (name) => new AIMessage({ content: '', tool_calls: [{ name, args: { query: 'refunds' }, id: `call_${turn}`, type: 'tool_call' }] });
      let message;
      if (turn === 1) message = call('search_docs');
      else if (turn === 2) {
        assert.ok(String(messages.at(-1).content).includes(REFUSAL), String(messages.at(-1).content));
        message = call('web_search');
      } else message = new AIMessage({ content: `Answer: ${messages.at(-1).content}` });
      return { generations: [{ text: '', message }] };
    }
  }
  const agent = createReactAgent({ llm: new Scripted({}), tools: [named('search_docs', 'no results'), named('web_search', 'refunds within 30 days')] });
  const handler = await spanguardCallbackHandler(book, { traceId: TRACE });
  const result = await quietly(agent.invoke({ messages: [{ role: 'user', content: 'q' }] }, { recursionLimit: 20, callbacks: [handler] }));
  assert.equal(result.messages.at(-1).content, 'Answer: refunds within 30 days');
  assert.deepEqual(runs, ['web_search']);
  assert.equal(book.toolCallsRefused, 1);
});

test('a ToolContained is an AgentKilled', () => {
  const book = new SignalBook();
  contain(book);
  assert.throws(() => book.check(TRACE, { tool: 'search_docs' }), (error) => error instanceof ToolContained && error instanceof AgentKilled);
  assert.equal(book.check(TRACE, { tool: 'web_search' }), null);
  assert.equal(book.check(TRACE), null);
});
