// One scripted VoltAgent agent (@voltagent/core) under VoltAgent's own observability. Where the
// application has registered a tracer provider (NodeSDK's, or ../generate.mjs's in-memory one),
// VoltAgent's tracer is that provider's: its spans leave through the application's exporter.
// ../generate.mjs imports this file and hands it the scenario's script and the mock model's
// answers.

import { Agent, createTool, VoltAgentObservability } from '@voltagent/core';
import { MockLanguageModelV3 } from 'ai/test';
import { z } from 'zod';

function zodShape(parameters) {
  const shape = {};
  for (const [name, kind] of Object.entries(parameters)) {
    shape[name] = kind === 'optional' ? z.string().optional() : z.string();
  }
  return z.object(shape);
}

/** A run per scenario; its spans go to the registered tracer provider. */
export function voltAgentRunner({ service, question, toolDocs, toolParameters, generate }) {
  const observability = new VoltAgentObservability({ serviceName: service });
  return async (script) => {
    const tools = Object.keys(toolDocs).map((name) =>
      createTool({
        name,
        description: toolDocs[name],
        parameters: zodShape(toolParameters[name]),
        execute: async () => script.result(),
      }),
    );
    const model = new MockLanguageModelV3({ doGenerate: generate(script) });
    const agent = new Agent({
      name: 'support',
      instructions: 'Answer from the knowledge base.',
      model,
      tools,
      observability,
    });
    await agent.generateText(question, { maxSteps: 100 });
    await observability.forceFlush();
  };
}
