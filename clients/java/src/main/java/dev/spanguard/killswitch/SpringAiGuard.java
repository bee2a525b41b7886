package dev.spanguard.killswitch;

import io.opentelemetry.context.Context;
import org.springframework.ai.chat.model.ToolContext;
import org.springframework.ai.tool.ToolCallback;
import org.springframework.ai.tool.definition.ToolDefinition;
import org.springframework.ai.tool.execution.ToolExecutionException;
import org.springframework.ai.tool.metadata.ToolMetadata;

/**
 * The kill switch in front of a Spring AI tool: a ToolCallback that checks the current span's
 * trace (and its conversation and agent), then whether its tool is contained, before it calls
 * the tool it wraps. Spring AI's DefaultToolCallingManager hands only a ToolExecutionException
 * to its exception processor (which tells the model); {@link AgentKilled} is not one, so it
 * leaves the ChatClient call and the agent's loop ends there. A {@link ToolContained} is thrown
 * as the cause of a ToolExecutionException instead: the default processor answers the model
 * with its message as the tool's result, so the agent can take another path (a processor built
 * with alwaysThrow ends the loop). A pause waits for the operator's answer.
 *
 * <pre>{@code
 * ToolCallback[] tools = SpringAiGuard.guard(killswitch, ToolCallbacks.from(new MyTools()));
 * chatClient.prompt(question).toolCallbacks(tools).call().content(); // AgentKilled once killed
 * }</pre>
 */
public final class SpringAiGuard implements ToolCallback {
  private final ToolCallback tool;
  private final KillSwitch killswitch;

  public SpringAiGuard(ToolCallback tool, KillSwitch killswitch) {
    this.tool = tool;
    this.killswitch = killswitch;
  }

  /** Every tool behind the kill switch. */
  public static ToolCallback[] guard(KillSwitch killswitch, ToolCallback... tools) {
    ToolCallback[] guarded = new ToolCallback[tools.length];
    for (int i = 0; i < tools.length; i++) {
      guarded[i] = tools[i] instanceof SpringAiGuard ? tools[i] : new SpringAiGuard(tools[i], killswitch);
    }
    return guarded;
  }

  @Override
  public ToolDefinition getToolDefinition() {
    return tool.getToolDefinition();
  }

  @Override
  public ToolMetadata getToolMetadata() {
    return tool.getToolMetadata();
  }

  @Override
  public String call(String toolInput) {
    check();
    return tool.call(toolInput);
  }

  @Override
  public String call(String toolInput, ToolContext toolContext) {
    check();
    return tool.call(toolInput, toolContext);
  }

  private void check() {
    String name = tool.getToolDefinition().name();
    try {
      try {
        killswitch.checkContextTool(Context.current(), name, null);
      } catch (AgentPaused paused) {
        awaitAnswer(paused);
        killswitch.checkContained(name, null); // contained while the trace was paused
      }
    } catch (ToolContained contained) {
      throw new ToolExecutionException(tool.getToolDefinition(), contained);
    }
  }

  private void awaitAnswer(AgentPaused paused) {
    try {
      killswitch.await(paused.signal().traceId(), null);
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
      throw paused;
    }
  }
}
