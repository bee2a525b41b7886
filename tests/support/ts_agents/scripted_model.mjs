// The scripted models' answers in the AI SDK's language-model V3 spec, as doGenerate returns
// them and as doStream streams them: generate.mjs's agents and voltagent/multi.mjs answer
// alike. A turn is `{parts, finish}` (content parts and the finish reason).

export const TOKENS_IN = 120;
export const TOKENS_OUT = 20;
export const V3_USAGE = {
  inputTokens: { total: TOKENS_IN, noCache: TOKENS_IN, cacheRead: undefined, cacheWrite: undefined },
  outputTokens: { total: TOKENS_OUT, text: TOKENS_OUT, reasoning: undefined },
};

/** A turn as doGenerate's result. */
export function generated(turn) {
  return {
    content: turn.parts,
    finishReason: { unified: turn.finish, raw: turn.finish },
    usage: V3_USAGE,
    warnings: [],
  };
}

/** A turn as doStream's stream. */
export function aiSdkStream(turn) {
  const chunks = [{ type: 'stream-start', warnings: [] }];
  for (const part of turn.parts) {
    if (part.type === 'text') {
      chunks.push({ type: 'text-start', id: 't' });
      chunks.push({ type: 'text-delta', id: 't', delta: part.text });
      chunks.push({ type: 'text-end', id: 't' });
    } else {
      chunks.push(part);
    }
  }
  chunks.push({
    type: 'finish',
    finishReason: { unified: turn.finish, raw: turn.finish },
    usage: V3_USAGE,
  });
  return new ReadableStream({
    start(controller) {
      for (const chunk of chunks) controller.enqueue(chunk);
      controller.close();
    },
  });
}
