// The hooks in real frameworks (scripted models, no network): the AI SDK's generateText and
// LangGraph.js's prebuilt ReAct agent stop before the tool call that follows a kill.
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { AIMessage } from '@langchain/core/messages';
import { BaseChatModel } from '@langchain/core/language_models/chat_models';
import { tool as langchainTool } from '@langchain/core/tools';
import { createReactAgent } from '@langchain/langgraph/prebuilt';
import { generateText, stepCountIs, tool } from 'ai';
import { MockLanguageModelV3 } from 'ai/test';
import { z } from 'zod';

import { AgentKilled, SignalBook, guardTools, spanguardCallbackHandler } from '../src/index.js';

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

test('AI SDK: the tool after a kill never runs and generateText rejects with AgentKilled', async () => {
  const book = new SignalBook();
  let runs = 0;
  const tools = {
    search_docs: tool({
      description: 'Search the knowledge base.',
      inputSchema: z.object({ query: z.string() }),
      execute: async () => {
        runs += 1;
        if (runs === 3) kill(book); // the worker's kill arrives while the third call runs
        return 'no results';
      },
    }),
  };
  const controller = new AbortController();
  await assert.rejects(
    generateText({
      model: loopingModel(),
      tools: guardTools(tools, book, { traceId: TRACE, abortController: controller }),
      stopWhen: stepCountIs(20),
      abortSignal: controller.signal,
      prompt: 'What is the refund policy?',
    }),
  );
  assert.equal(runs, 3);
  assert.ok(controller.signal.reason instanceof AgentKilled);
});

test('AI SDK: a downgrade message is handed over once and the tools go on', async () => {
  const book = new SignalBook();
  const messages = [];
  let runs = 0;
  const tools = {
    search_docs: tool({
      description: 'Search.',
      inputSchema: z.object({ query: z.string() }),
      execute: async () => {
        runs += 1;
        if (runs === 1) kill(book, 'downgrade', { systemMessage: 'try another query' });
        return 'no results';
      },
    }),
  };
  await generateText({
    model: loopingModel(),
    tools: guardTools(tools, book, { traceId: TRACE, onDowngrade: (m) => messages.push(m) }),
    stopWhen: stepCountIs(3),
    prompt: 'q',
  });
  assert.equal(runs, 3);
  assert.deepEqual(messages, ['try another query']);
});

test('LangGraph.js: the callback handler stops the ReAct agent before the next tool call', async () => {
  const book = new SignalBook();
  let runs = 0;
  let turn = 0;
  class LoopingChatModel extends BaseChatModel {
    _llmType() {
      return 'scripted';
    }

    bindTools() {
      return this;
    }

    async _generate() {
      turn += 1;
      const message = new AIMessage({
        content: '',
        tool_calls: [{ name: 'search_docs', args: { query: 'refund policy' }, id: `call_${turn}`, type: 'tool_call' }],
      });
      return { generations: [{ text: '', message }] };
    }
  }
  const search = langchainTool(
    async () => {
      runs += 1;
      if (runs === 3) kill(book);
      return 'no results';
    },
    { name: 'search_docs', description: 'Search.', schema: z.object({ query: z.string() }) },
  );
  const agent = createReactAgent({ llm: new LoopingChatModel({}), tools: [search] });
  const controller = new AbortController();
  const handler = await spanguardCallbackHandler(book, { traceId: TRACE, abortController: controller });
  const quiet = console.error;
  console.error = () => {}; // LangChain.js prints every raised handler error
  try {
    await assert.rejects(
      agent.invoke(
        { messages: [{ role: 'user', content: 'q' }] },
        { recursionLimit: 50, callbacks: [handler], signal: controller.signal },
      ),
    );
  } finally {
    console.error = quiet;
  }
  assert.equal(runs, 3);
  assert.ok(controller.signal.reason instanceof AgentKilled);
});
