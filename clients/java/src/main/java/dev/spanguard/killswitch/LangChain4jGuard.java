package dev.spanguard.killswitch;

import dev.langchain4j.service.AiServices;
import dev.langchain4j.service.tool.BeforeToolExecution;
import dev.langchain4j.service.tool.ToolExecution;
import io.opentelemetry.context.Context;
import io.opentelemetry.context.Scope;
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
 * <pre>{@code
 * Assistant assistant = LangChain4jGuard.install(
 *         AiServices.builder(Assistant.class).chatModel(model).tools(new Tools()),
 *         killswitch, tracing) // tracing: a LangChain4jTracing, or null
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
    check(invocations.of(before.invocationContext()));
  }

  private void check(Context context) {
    checked.incrementAndGet();
    String message;
    try {
      message = killswitch.checkContext(context);
    } catch (AgentPaused paused) {
      String traceId = paused.signal().traceId();
      try {
        message = killswitch.await(traceId, null);
      } catch (InterruptedException e) {
        Thread.currentThread().interrupt();
        throw paused;
      }
    }
    if (message != null) {
      onDowngrade.accept(message);
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
    // The check first: a refused call starts no span.
    Consumer<BeforeToolExecution> before = call -> {
      Context context = invocations.of(call.invocationContext());
      check(context);
      try (Scope scope = context.makeCurrent()) { // the tool span's parent
        tracing.beforeToolExecution(call);
      }
    };
    Consumer<ToolExecution> after = tracing::afterToolExecution;
    return builder.beforeToolExecution(before).afterToolExecution(after);
  }
}
