package dev.spanguard.killswitch;

import dev.langchain4j.invocation.InvocationContext;
import dev.langchain4j.observability.api.listener.AiServiceCompletedListener;
import dev.langchain4j.observability.api.listener.AiServiceErrorListener;
import dev.langchain4j.observability.api.listener.AiServiceStartedListener;
import dev.langchain4j.service.AiServices;
import io.opentelemetry.api.trace.Span;
import io.opentelemetry.context.Context;
import java.util.LinkedHashMap;
import java.util.Map;
import java.util.UUID;
import java.util.concurrent.ConcurrentHashMap;

/**
 * The OpenTelemetry context each LangChain4j AI service invocation was called in, by its
 * invocation id. With {@code executeToolsConcurrently()} LangChain4j runs the tool hooks on its
 * executor's threads, where the caller's context (the agent span) is not current: without this
 * a check there would find no trace, and a tool span would start a trace of its own.
 */
final class InvocationContexts {
  /** Ended invocations remembered for the hooks still running after them. */
  static final int ENDED_KEPT = 1024;

  private final Map<UUID, Context> started = new ConcurrentHashMap<>();
  // A kill thrown by one of a round's concurrent tools ends the invocation (its error listener)
  // while the round's other hooks are still to run on their threads: they must still find the
  // invocation's trace, and be refused, rather than run unguarded.
  private final Map<UUID, Context> ended = new LinkedHashMap<>(16, 0.75f, false) {
    @Override
    protected boolean removeEldestEntry(Map.Entry<UUID, Context> eldest) {
      return size() > ENDED_KEPT;
    }
  };

  /** Registers the listeners that remember each invocation's context until it ends. */
  <T> AiServices<T> registerOn(AiServices<T> builder) {
    AiServiceStartedListener onStart = event -> remember(event.invocationContext(), Context.current());
    AiServiceCompletedListener onCompleted = event -> forget(event.invocationContext());
    AiServiceErrorListener onError = event -> forget(event.invocationContext());
    return builder.registerListeners(onStart, onCompleted, onError);
  }

  private void remember(InvocationContext invocation, Context context) {
    if (invocation != null && invocation.invocationId() != null) {
      started.put(invocation.invocationId(), context);
    }
  }

  private void forget(InvocationContext invocation) {
    if (invocation != null && invocation.invocationId() != null) {
      Context context = started.remove(invocation.invocationId());
      if (context != null) {
        synchronized (ended) {
          ended.put(invocation.invocationId(), context);
        }
      }
    }
  }

  /** The current context when it holds a span, else the one invocation was called in. */
  Context of(InvocationContext invocation) {
    Context current = Context.current();
    if (Span.fromContext(current).getSpanContext().isValid()
        || invocation == null || invocation.invocationId() == null) {
      return current;
    }
    Context context = started.get(invocation.invocationId());
    if (context == null) {
      synchronized (ended) {
        context = ended.get(invocation.invocationId());
      }
    }
    return context != null ? context : current;
  }
}
