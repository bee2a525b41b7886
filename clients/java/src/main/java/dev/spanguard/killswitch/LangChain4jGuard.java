package dev.spanguard.killswitch;

import dev.langchain4j.agent.tool.ToolExecutionRequest;
import dev.langchain4j.invocation.InvocationContext;
import dev.langchain4j.service.AiServices;
import dev.langchain4j.service.tool.AiServiceTool;
import dev.langchain4j.service.tool.BeforeToolExecution;
import dev.langchain4j.service.tool.ToolExecution;
import dev.langchain4j.service.tool.ToolExecutionResult;
import dev.langchain4j.service.tool.ToolExecutor;
import dev.langchain4j.service.tool.ToolProvider;
import dev.langchain4j.service.tool.ToolProviderRequest;
import dev.langchain4j.service.tool.ToolProviderResult;
import dev.langchain4j.service.tool.ToolService;
import io.opentelemetry.context.Context;
import io.opentelemetry.context.Scope;
import java.util.ArrayList;
import java.util.List;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.atomic.AtomicLong;
import java.util.function.Consumer;

/**
 * The kill switch in a LangChain4j AI service: before each tool call it checks the trace of the
 * current span (and its conversation and agent), and a kill throws {@link AgentKilled} out of
 * the AI service's method: the tool does not run, and the agent's loop ends there.
 *
 * <p>LangChain4j hands an exception thrown by a tool to its ToolExecutionErrorHandler, which by
 * default turns it into a tool result the model reads, and the loop goes on; a check inside the
 * tool could not stop the agent. Its beforeToolExecution hook runs outside that handler, so the
 * check is there. A pause waits for the operator's answer (up to the pause's deadline); a
 * downgrade's message goes to onDowngrade (default: the switch's log).
 *
 * <p>A contained tool ({@link ToolContained}) is refused, not the agent: the tools given
 * through {@link #tools} or {@link #toolProvider} answer a call to it with an error result
 * whose text is the refusal, which the model reads, and the loop goes on. The hook cannot hand
 * the model a result, so a contained tool given to the builder directly is refused by throwing
 * ToolContained (an AgentKilled) out of the AI service's method: it never runs.
 *
 * <pre>{@code
 * LangChain4jGuard guard = new LangChain4jGuard(killswitch);
 * Assistant assistant = guard.installOn(
 *         AiServices.builder(Assistant.class).chatModel(model).tools(guard.tools(new Tools())),
 *         tracing) // tracing: a LangChain4jTracing, or null
 *     .build();
 * try (Scope scope = agentSpan.makeCurrent()) {
 *   assistant.chat("...");     // throws AgentKilled once spanguard kills the trace
 * }
 * }</pre>
 */
public final class LangChain4jGuard {
  private final KillSwitch killswitch;
  private final Consumer<String> onDowngrade;
  private final AtomicLong checked = new AtomicLong();
  private final InvocationContexts invocations = new InvocationContexts();
  // Names of the tools this guard wrapped: their executors answer a contain.
  private final Set<String> guardedTools = ConcurrentHashMap.newKeySet();

  public LangChain4jGuard(KillSwitch killswitch) {
    this(killswitch, null);
  }

  /** onDowngrade receives a downgrade's system message (null: logged as a warning). */
  public LangChain4jGuard(KillSwitch killswitch, Consumer<String> onDowngrade) {
    this.killswitch = killswitch;
    this.onDowngrade = onDowngrade != null ? onDowngrade
        : message -> System.getLogger("spanguard.killswitch")
            .log(System.Logger.Level.WARNING, "spanguard downgrade: " + message);
  }

  /** Tool calls checked so far. */
  public long checked() {
    return checked.get();
  }

  /**
   * For AiServices.beforeToolExecution: throws AgentKilled when the current span's trace (or
   * its conversation or agent) is killed, waits through a pause. Installed by {@link #install}
   * or {@link #installOn}, it checks the context the AI service was called in even when
   * LangChain4j runs the tools concurrently, on threads without it.
   */
  public void beforeToolExecution(BeforeToolExecution before) {
    check(invocations.of(before.invocationContext()), before.request().name());
  }

  /**
   * The trace's check; a tool this guard wraps is left to its executor (which answers the model
   * when it is contained), any other contained tool throws ToolContained here.
   */
  private void check(Context context, String toolName) {
    checked.incrementAndGet();
    String tool = guardedTools.contains(toolName) ? null : toolName;
    String message;
    try {
      message = killswitch.checkContextTool(context, tool, null);
    } catch (AgentPaused paused) {
      String traceId = paused.signal().traceId();
      try {
        message = killswitch.await(traceId, null);
      } catch (InterruptedException e) {
        Thread.currentThread().interrupt();
        throw paused;
      }
      if (tool != null) {
        killswitch.checkContained(tool, null); // contained while the trace was paused
      }
    }
    if (message != null) {
      onDowngrade.accept(message);
    }
  }

  /**
   * The @Tool methods of objectsWithTools (as AiServices.tools(Object...) finds them), for
   * AiServices.tools(List): a call to a contained one is answered with the refusal as the tool's
   * error result, so the model can call another tool. Install this guard on the same builder:
   * its hook checks the trace first. Their @CompensateFor actions are not registered
   * (AiServices finds those only in tools(Object...)).
   */
  public List<AiServiceTool> tools(Object... objectsWithTools) {
    List<AiServiceTool> tools = new ArrayList<>();
    for (Object objectWithTools : objectsWithTools) {
      // LangChain4j's own scan (marked internal): the same tools AiServices.tools(Object...) adds.
      for (AiServiceTool tool : ToolService.findTools(objectWithTools)) {
        tools.add(guarded(tool));
      }
    }
    return tools;
  }

  /** provider's tools (MCP's, say), each refused as {@link #tools} refuses a contained one. */
  public ToolProvider toolProvider(ToolProvider provider) {
    return new ToolProvider() {
      @Override
      public ToolProviderResult provideTools(ToolProviderRequest request) {
        ToolProviderResult result = provider.provideTools(request);
        if (result == null) {
          return null;
        }
        return new ToolProviderResult(result.aiServiceTools().stream().map(LangChain4jGuard.this::guarded).toList());
      }

      @Override
      public boolean isDynamic() {
        return provider.isDynamic();
      }
    };
  }

  private AiServiceTool guarded(AiServiceTool tool) {
    guardedTools.add(tool.name());
    if (tool.toolExecutor() instanceof Refusing) {
      return tool;
    }
    return tool.toBuilder().toolExecutor(new Refusing(tool.toolExecutor())).build();
  }

  /**
   * Runs its tool unless the tool is contained; then the call's result is the refusal, an error
   * LangChain4j hands the model (no error handler in between to rethrow it).
   */
  private final class Refusing implements ToolExecutor {
    private final ToolExecutor tool;

    Refusing(ToolExecutor tool) {
      this.tool = tool;
    }

    // For a caller without an invocation context: the refusal as the result's text.
    @Override
    public String execute(ToolExecutionRequest request, Object memoryId) {
      try {
        killswitch.checkContained(request.name(), null);
      } catch (ToolContained contained) {
        return contained.getMessage();
      }
      return tool.execute(request, memoryId);
    }

    @Override
    public ToolExecutionResult executeWithContext(ToolExecutionRequest request, InvocationContext context) {
      try {
        killswitch.checkContained(request.name(), null);
      } catch (ToolContained contained) {
        return ToolExecutionResult.builder().isError(true).resultText(contained.getMessage()).build();
      }
      return tool.executeWithContext(request, context);
    }
  }

  /**
   * Installs the check before each tool call of builder's AI service, then tracing's tool spans
   * (null: none); returns builder.
   */
  public static <T> AiServices<T> install(AiServices<T> builder, KillSwitch killswitch, LangChain4jTracing tracing) {
    return new LangChain4jGuard(killswitch).installOn(builder, tracing);
  }

  public <T> AiServices<T> installOn(AiServices<T> builder, LangChain4jTracing tracing) {
    invocations.registerOn(builder);
    if (tracing == null) {
      return builder.beforeToolExecution(this::beforeToolExecution);
    }
    // The check first: a call it stops starts no span (a contained tool's refusal has one).
    Consumer<BeforeToolExecution> before = call -> {
      Context context = invocations.of(call.invocationContext());
      check(context, call.request().name());
      try (Scope scope = context.makeCurrent()) { // the tool span's parent
        tracing.beforeToolExecution(call);
      }
    };
    Consumer<ToolExecution> after = tracing::afterToolExecution;
    return builder.beforeToolExecution(before).afterToolExecution(after);
  }
}
