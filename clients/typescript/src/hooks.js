// Framework hooks that call check() before each tool call, in the spirit of the Python adapters
// (killswitch/adapters.py). Each takes anything with check(traceId) -> string | null (a
// KillSwitch or a SignalBook) and, optionally, a fixed trace id (default: the active span's).
// AgentKilled stops the tool before it runs; a downgrade's system message goes to onDowngrade
// (or waits in pendingMessages for the agent to inject it). On a paused trace the tool waits in
// the checker's wait() (off the event loop's critical path: it is a promise) until an
// operator's release (the tool runs) or kill (AgentKilled), or the pause's deadline, when the
// policy's fallback applies; a checker without wait() lets AgentPaused out, and the run stops.
// A call to a tool that spanguard contained throws ToolContained (an AgentKilled) without
// aborting the run: the framework turns it into a tool error the model reads, and the agent can
// take another tool.
// Where a hook finds no trace (no traceId given, no active span) the tool call is not guarded:
// it says so once, loudly (through the KillSwitch's log, else console.warn), and counts the
// call in its `unguarded` and in the KillSwitch's. Never a silent skip.

import { AgentKilled, AgentPaused, ToolContained } from './book.js';
import { currentTraceId } from './killswitch.js';

const AsyncGeneratorFunction = Object.getPrototypeOf(async function* () {}).constructor;

class Gate {
  constructor(checker, hook, { traceId, onDowngrade, abortController, conversationId, agent } = {}) {
    this.checker = checker;
    this.hook = hook; // names the hook in the warning about an unguarded call
    this.traceId = traceId ?? null;
    // Passed to every check: a conversation or agent kill stops this run too.
    this.scope = { conversationId: conversationId ?? undefined, agent: agent ?? undefined };
    this.onDowngrade = onDowngrade ?? null;
    this.abortController = abortController ?? null;
    this.pendingMessages = [];
    this.unguarded = 0;
    this.warned = false;
  }

  /** Check before a tool: nothing to wait for (undefined), or a promise that settles when a
   * pause is answered. Throws (or rejects with) AgentKilled, and AgentPaused when it cannot
   * wait; either aborts the run through the abortController. */
  beforeTool(tool) {
    const traceId = this.traceId ?? currentTraceId();
    if (!traceId) {
      this.reportUnguarded();
      if (tool && typeof this.checker.checkTool === 'function') this.checker.checkTool(tool);
      return undefined;
    }
    let message;
    try {
      message = this.checker.check(traceId, tool ? { ...this.scope, tool } : this.scope);
    } catch (error) {
      if (error instanceof AgentPaused && typeof this.checker.wait === 'function') {
        return this.checker
          .wait(traceId, { signal: this.abortController?.signal })
          .then((answer) => this.hand(answer), (failure) => this.stop(failure));
      }
      this.stop(error);
    }
    this.hand(message);
    return undefined;
  }

  reportUnguarded() {
    this.unguarded += 1;
    const whatToDo =
      'run the agent inside an OpenTelemetry span (@opentelemetry/api with a context manager registered), or pass traceId to the hook';
    if (typeof this.checker.noteUnguarded === 'function') {
      this.checker.noteUnguarded(this.hook, whatToDo); // a KillSwitch: counted there too, warned once per hook
    } else if (!this.warned) {
      console.warn(
        `spanguard killswitch: ${this.hook} found no trace to check, so this tool call is NOT guarded: ${whatToDo} (further ones are counted in .unguarded, not logged)`,
      );
    }
    this.warned = true;
  }

  hand(message) {
    if (message === null || message === undefined) return;
    if (this.onDowngrade) this.onDowngrade(message);
    else this.pendingMessages.push(message);
  }

  stop(error) {
    if (error instanceof ToolContained) throw error; // the tool is refused, the run goes on
    if (error instanceof AgentKilled || error instanceof AgentPaused) this.abortController?.abort(error);
    throw error;
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
 * AgentKilled as its reason, which ends the whole generateText / streamText call. On a pause
 * the tool call waits (see the module's comment) and then runs, or the call ends as on a kill.
 */
export function guardTools(tools, checker, options = {}) {
  const gate = new Gate(checker, 'guardTools (Vercel AI SDK tools)', options);
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
        const waiting = gate.beforeTool(name);
        if (waiting === undefined) return execute.apply(tool, args);
        if (execute instanceof AsyncGeneratorFunction) {
          // A streaming tool: the SDK iterates what execute returns, so the wait goes inside.
          return (async function* () {
            await waiting;
            yield* execute.apply(tool, args);
          })();
        }
        return waiting.then(() => execute.apply(tool, args));
      },
    };
  }
  Object.defineProperty(guarded, 'pendingMessages', { value: gate.pendingMessages, enumerable: false });
  Object.defineProperty(guarded, 'unguarded', { get: () => gate.unguarded, enumerable: false });
  return guarded;
}

/**
 * LangChain.js and LangGraph.js: a callback handler that checks on every tool start.
 *
 *   const handler = await spanguardCallbackHandler(killswitch);
 *   await agent.invoke(input, { callbacks: [handler] });
 *
 * raiseError makes LangChain.js let AgentKilled out of the tool call (it swallows handler errors
 * otherwise) and awaitHandlers runs the check, and the wait of a paused trace, before the tool.
 * LangGraph's ToolNode turns a tool's error into a message for the model (handleToolErrors), so
 * give `abortController` and pass its signal to invoke ({ signal: controller.signal }): a kill
 * aborts the run with the AgentKilled as the reason. Needs @langchain/core.
 */
export async function spanguardCallbackHandler(checker, options = {}) {
  let BaseCallbackHandler;
  try {
    ({ BaseCallbackHandler } = await import('@langchain/core/callbacks/base'));
  } catch {
    throw new Error('spanguardCallbackHandler needs @langchain/core installed beside the agent');
  }
  const gate = new Gate(checker, 'spanguardCallbackHandler (LangChain.js tool callbacks)', options);
  class SpanguardCallbackHandler extends BaseCallbackHandler {
    name = 'spanguard';

    constructor() {
      super({ raiseError: true });
      this.raiseError = true;
      this.awaitHandlers = true;
      this.pendingMessages = gate.pendingMessages;
    }

    /** Tool calls that found no trace to check (see the module's comment). */
    get unguarded() {
      return gate.unguarded;
    }

    handleToolStart(tool, input, runId, parentRunId, tags, metadata, runName) {
      // A promise while a paused trace waits: LangChain awaits it.
      return gate.beforeTool(runName ?? tool?.name ?? tool?.id?.at?.(-1));
    }
  }
  return new SpanguardCallbackHandler();
}
