package dev.spanguard.killswitch;

import dev.langchain4j.agent.tool.ToolExecutionRequest;
import dev.langchain4j.model.chat.listener.ChatModelErrorContext;
import dev.langchain4j.model.chat.listener.ChatModelListener;
import dev.langchain4j.model.chat.listener.ChatModelRequestContext;
import dev.langchain4j.model.chat.listener.ChatModelResponseContext;
import dev.langchain4j.model.chat.response.ChatResponse;
import dev.langchain4j.model.output.TokenUsage;
import dev.langchain4j.service.AiServices;
import dev.langchain4j.service.tool.BeforeToolExecution;
import dev.langchain4j.service.tool.ToolExecution;
import io.opentelemetry.api.OpenTelemetry;
import io.opentelemetry.api.trace.Span;
import io.opentelemetry.api.trace.SpanKind;
import io.opentelemetry.api.trace.StatusCode;
import io.opentelemetry.api.trace.Tracer;
import io.opentelemetry.context.Context;
import java.time.Instant;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;

/**
 * OpenTelemetry spans for a LangChain4j agent, in the GenAI semantic conventions, which is what
 * the spanguard worker reads: LangChain4j (1.19) makes no spans of its own; it has listeners
 * (ChatModelListener, AI service events) and tool hooks. This turns them into
 *
 * <ul>
 *   <li>one {@code chat MODEL} span per model call (a ChatModelListener): gen_ai.operation.name
 *       chat, gen_ai.request.model, gen_ai.usage.input_tokens / output_tokens (read once per
 *       call), gen_ai.response.finish_reasons;
 *   <li>one {@code execute_tool NAME} span per tool call (beforeToolExecution /
 *       afterToolExecution): gen_ai.tool.name, gen_ai.tool.call.id, and with content capture on
 *       (its default: {@code captureContent(true)}) gen_ai.tool.call.arguments (LangChain4j's
 *       JSON text) and gen_ai.tool.call.result.
 * </ul>
 *
 * <p>Both are children of the span current when the AI service was called (the agent's own
 * {@code invoke_agent} span). {@link LangChain4jGuard#install} installs the tool hooks with the
 * kill check first: a refused call runs no tool and leaves no tool span.
 *
 * <pre>{@code
 * LangChain4jTracing tracing = LangChain4jTracing.create(openTelemetry);
 * ChatModel model = OpenAiChatModel.builder()...listeners(List.of(tracing)).build();
 * Assistant assistant = tracing.installOn(AiServices.builder(Assistant.class).chatModel(model)
 *     .tools(new Tools())).build();
 * }</pre>
 */
public final class LangChain4jTracing implements ChatModelListener {
  /** The instrumentation scope of these spans (the worker names its capture setting by it). */
  public static final String SCOPE = "dev.spanguard.langchain4j";

  private static final Object SPAN_KEY = new Object();
  private final Tracer tracer;
  private final boolean captureContent;
  // Tool call id (or the request itself) -> when it started and in which context.
  private final Map<Object, Started> started = new ConcurrentHashMap<>();
  private final InvocationContexts invocations = new InvocationContexts();

  private record Started(Instant at, Context parent) {}

  private LangChain4jTracing(Tracer tracer, boolean captureContent) {
    this.tracer = tracer;
    this.captureContent = captureContent;
  }

  /** Spans through openTelemetry's tracer provider, with the tool calls' content. */
  public static LangChain4jTracing create(OpenTelemetry openTelemetry) {
    return create(openTelemetry, true);
  }

  /**
   * captureContent false leaves the tool calls' arguments and results off the spans: the worker
   * then sees which tools ran but cannot tell a loop from progress (it warns, naming this).
   */
  public static LangChain4jTracing create(OpenTelemetry openTelemetry, boolean captureContent) {
    return new LangChain4jTracing(openTelemetry.getTracer(SCOPE), captureContent);
  }

  @Override
  public void onRequest(ChatModelRequestContext context) {
    String model = context.chatRequest().parameters() == null
        ? null : context.chatRequest().parameters().modelName();
    Span span = tracer.spanBuilder(model == null ? "chat" : "chat " + model)
        .setSpanKind(SpanKind.CLIENT)
        .setAttribute("gen_ai.operation.name", "chat")
        .setAttribute("gen_ai.provider.name", String.valueOf(context.modelProvider()).toLowerCase(java.util.Locale.ROOT))
        .startSpan();
    if (model != null) {
      span.setAttribute("gen_ai.request.model", model);
    }
    context.attributes().put(SPAN_KEY, span);
  }

  @Override
  public void onResponse(ChatModelResponseContext context) {
    if (!(context.attributes().remove(SPAN_KEY) instanceof Span span)) {
      return;
    }
    ChatResponse response = context.chatResponse();
    TokenUsage usage = response.tokenUsage();
    if (usage != null && usage.inputTokenCount() != null) {
      span.setAttribute("gen_ai.usage.input_tokens", usage.inputTokenCount().longValue());
    }
    if (usage != null && usage.outputTokenCount() != null) {
      span.setAttribute("gen_ai.usage.output_tokens", usage.outputTokenCount().longValue());
    }
    if (response.modelName() != null) {
      span.setAttribute("gen_ai.response.model", response.modelName());
    }
    if (response.finishReason() != null) {
      span.setAttribute(io.opentelemetry.api.common.AttributeKey.stringArrayKey("gen_ai.response.finish_reasons"),
          java.util.List.of(response.finishReason().name().toLowerCase(java.util.Locale.ROOT)));
    }
    span.end();
  }

  @Override
  public void onError(ChatModelErrorContext context) {
    if (context.attributes().remove(SPAN_KEY) instanceof Span span) {
      span.setStatus(StatusCode.ERROR, String.valueOf(context.error()));
      span.setAttribute("error.type", context.error().getClass().getName());
      span.end();
    }
  }

  private static Object keyOf(ToolExecutionRequest request) {
    return request.id() != null ? request.id() : request;
  }

  /**
   * The tool hooks on builder (without a kill check: {@link LangChain4jGuard#install} installs
   * both), and listeners that keep the tool spans in the caller's trace when LangChain4j runs
   * the tools concurrently, on threads without the caller's context; returns builder.
   */
  public <T> AiServices<T> installOn(AiServices<T> builder) {
    invocations.registerOn(builder);
    return builder.beforeToolExecution(this::beforeToolExecution)
        .afterToolExecution(this::afterToolExecution);
  }

  /** For AiServices.beforeToolExecution: the tool call starts now. */
  public void beforeToolExecution(BeforeToolExecution before) {
    started.put(keyOf(before.request()),
        new Started(Instant.now(), invocations.of(before.invocationContext())));
  }

  /** For AiServices.afterToolExecution: the call's span, from its start to now. */
  public void afterToolExecution(ToolExecution execution) {
    ToolExecutionRequest request = execution.request();
    Started start = started.remove(keyOf(request));
    var builder = tracer.spanBuilder("execute_tool " + request.name())
        .setSpanKind(SpanKind.INTERNAL)
        .setParent(start == null ? Context.current() : start.parent())
        .setAttribute("gen_ai.operation.name", "execute_tool")
        .setAttribute("gen_ai.tool.name", request.name())
        .setAttribute("gen_ai.tool.type", "function");
    if (start != null) {
      builder.setStartTimestamp(start.at());
    }
    if (request.id() != null) {
      builder.setAttribute("gen_ai.tool.call.id", request.id());
    }
    if (captureContent) {
      builder.setAttribute("gen_ai.tool.call.arguments", request.arguments());
      if (execution.result() != null) {
        builder.setAttribute("gen_ai.tool.call.result", execution.result());
      }
    }
    Span span = builder.startSpan();
    if (execution.hasFailed()) {
      span.setStatus(StatusCode.ERROR);
    }
    span.end();
  }
}
