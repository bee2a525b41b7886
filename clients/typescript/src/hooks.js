// Framework hooks that call check() before each tool call, in the spirit of the Python adapters
// (killswitch/adapters.py). Each takes anything with check(traceId) -> string | null (a
// KillSwitch or a SignalBook) and, optionally, a fixed trace id (default: the active span's).
// AgentKilled stops the tool before it runs; a downgrade's system message goes to onDowngrade
// (or waits in pendingMessages for the agent to inject it).

import { AgentKilled } from './book.js';
import { currentTraceId } from './killswitch.js';

class Gate {
  constructor(checker, { traceId, onDowngrade } = {}) {
    this.checker = checker;
    this.traceId = traceId ?? null;
    this.onDowngrade = onDowngrade ?? null;
    this.pendingMessages = [];
  }

  beforeTool() {
    const traceId = this.traceId ?? currentTraceId();
    if (!traceId) return;
    const message = this.checker.check(traceId); // throws AgentKilled
    if (message === null || message === undefined) return;
    if (this.onDowngrade) this.onDowngrade(message);
    else this.pendingMessages.push(message);
  }
}

/**
 * The Vercel AI SDK: the same tools, each checking before it runs.
 *
 *   const controller = new AbortController();
 *   await generateText({ model, tools: guardTools(tools, killswitch, { abortController: controller }),
 *     abortSignal: controller.signal, ... });   // rejects once the trace is killed
 *
 * The AI SDK turns an error thrown by a tool into a tool-error result and lets the model go on;
 * so on a kill the tool does not run, and `abortController` (when given) is aborted with the
 * AgentKilled as its reason, which ends the whole generateText / streamText call.
 */
export function guardTools(tools, checker, { traceId, onDowngrade, abortController } = {}) {
  const gate = new Gate(checker, { traceId, onDowngrade });
  const guarded = {};
  for (const [name, tool] of Object.entries(tools)) {
    if (typeof tool.execute !== 'function') {
      guarded[name] = tool;
      continue;
    }
    const execute = tool.execute;
    guarded[name] = {
      ...tool,
      execute(...args) {
        try {
          gate.beforeTool();
        } catch (error) {
          if (error instanceof AgentKilled) abortController?.abort(error);
          throw error;
        }
        return execute.apply(tool, args);
      },
    };
  }
  Object.defineProperty(guarded, 'pendingMessages', { value: gate.pendingMessages, enumerable: false });
  return guarded;
}

/**
 * LangChain.js and LangGraph.js: a callback handler that checks on every tool start.
 *
 *   const handler = await spanguardCallbackHandler(killswitch);
 *   await agent.invoke(input, { callbacks: [handler] });
 *
 * raiseError makes LangChain.js let AgentKilled out of the tool call (it swallows handler errors
 * otherwise) and awaitHandlers runs the check before the tool. LangGraph's ToolNode turns a
 * tool's error into a message for the model (handleToolErrors), so give `abortController` and
 * pass its signal to invoke ({ signal: controller.signal }): a kill aborts the run with the
 * AgentKilled as the reason. Needs @langchain/core.
 */
export async function spanguardCallbackHandler(checker, { traceId, onDowngrade, abortController } = {}) {
  let BaseCallbackHandler;
  try {
    ({ BaseCallbackHandler } = await import('@langchain/core/callbacks/base'));
  } catch {
    throw new Error('spanguardCallbackHandler needs @langchain/core installed beside the agent');
  }
  const gate = new Gate(checker, { traceId, onDowngrade });
  class SpanguardCallbackHandler extends BaseCallbackHandler {
    name = 'spanguard';

    constructor() {
      super({ raiseError: true });
      this.raiseError = true;
      this.awaitHandlers = true;
      this.pendingMessages = gate.pendingMessages;
    }

    handleToolStart() {
      try {
        gate.beforeTool();
      } catch (error) {
        if (error instanceof AgentKilled) abortController?.abort(error);
        throw error;
      }
    }
  }
  return new SpanguardCallbackHandler();
}
