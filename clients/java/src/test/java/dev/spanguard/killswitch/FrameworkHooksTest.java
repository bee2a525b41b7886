package dev.spanguard.killswitch;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertSame;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import dev.langchain4j.agent.tool.Tool;
import dev.langchain4j.agent.tool.ToolExecutionRequest;
import dev.langchain4j.data.message.AiMessage;
import dev.langchain4j.memory.chat.MessageWindowChatMemory;
import dev.langchain4j.model.chat.ChatModel;
import dev.langchain4j.model.chat.listener.ChatModelListener;
import dev.langchain4j.model.chat.request.ChatRequest;
import dev.langchain4j.model.chat.response.ChatResponse;
import dev.langchain4j.model.output.TokenUsage;
import dev.langchain4j.service.AiServices;
import io.opentelemetry.api.common.AttributeKey;
import io.opentelemetry.api.trace.Span;
import io.opentelemetry.context.Context;
import io.opentelemetry.context.Scope;
import io.opentelemetry.sdk.OpenTelemetrySdk;
import io.opentelemetry.sdk.testing.exporter.InMemorySpanExporter;
import io.opentelemetry.sdk.trace.SdkTracerProvider;
import io.opentelemetry.sdk.trace.data.SpanData;
import io.opentelemetry.sdk.trace.export.SimpleSpanProcessor;
import java.time.Instant;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.function.IntFunction;
import org.junit.jupiter.api.Test;
import org.springframework.ai.tool.ToolCallback;
import org.springframework.ai.tool.function.FunctionToolCallback;

/**
 * The hooks in real frameworks, fed by the book the Kafka reader fills (KafkaTest covers the
 * reading): a LangChain4j AI service whose scripted model asks for the same search again and
 * again, and a Spring AI tool callback.
 */
class FrameworkHooksTest {
  interface Assistant {
    String chat(String question);
  }

  /** Asks for {@code calls.apply(turn)} on every turn (1, 2, ...); 120 + 20 tokens a call. */
  static final class ScriptedModel implements ChatModel {
    final List<ChatModelListener> listeners;
    final IntFunction<List<ToolExecutionRequest>> calls;
    int turn;

    ScriptedModel(List<ChatModelListener> listeners, IntFunction<List<ToolExecutionRequest>> calls) {
      this.listeners = listeners;
      this.calls = calls;
    }

    @Override
    public List<ChatModelListener> listeners() {
      return listeners;
    }

    @Override
    public ChatResponse doChat(ChatRequest request) {
      turn++;
      return ChatResponse.builder().aiMessage(AiMessage.from(calls.apply(turn)))
          .tokenUsage(new TokenUsage(120, 20)).build();
    }
  }

  static ToolExecutionRequest search(String id, String query) {
    return ToolExecutionRequest.builder().id(id).name("search_docs")
        .arguments("{\"query\":\"" + query + "\"}").build();
  }

  /** Asks for search_docs("refund policy") every turn. */
  static ScriptedModel loopingModel(List<ChatModelListener> listeners) {
    return new ScriptedModel(listeners, turn -> List.of(search("call_" + turn, "refund policy")));
  }

  /** Asks for two searches at once every turn (parallel tool calls). */
  static ScriptedModel twoAtOnceModel(List<ChatModelListener> listeners) {
    return new ScriptedModel(listeners, turn -> List.of(
        search("call_" + turn + "a", "refund policy a"), search("call_" + turn + "b", "refund policy b")));
  }

  /** An SDK whose spans are kept in memory, and LangChain4j's tracing over it. */
  record Traced(InMemorySpanExporter exporter, OpenTelemetrySdk sdk, LangChain4jTracing tracing) {
    static Traced create(boolean captureContent) {
      InMemorySpanExporter exporter = InMemorySpanExporter.create();
      OpenTelemetrySdk sdk = OpenTelemetrySdk.builder().setTracerProvider(SdkTracerProvider.builder()
          .addSpanProcessor(SimpleSpanProcessor.create(exporter)).build()).build();
      return new Traced(exporter, sdk, LangChain4jTracing.create(sdk, captureContent));
    }
  }

  /** The tool; at its 3rd call the worker's kill of the trace arrives (as the worker would). */
  public static final class Search {
    final AtomicInteger calls = new AtomicInteger();
    volatile int at = 3;
    volatile Runnable then;

    Search(Runnable atThird) {
      this.then = atThird;
    }

    void atCount(int count, Runnable action) {
      at = count;
      then = action;
    }

    @Tool(name = "search_docs", value = "Search the knowledge base.")
    public String searchDocs(String query) {
      if (calls.incrementAndGet() == at) {
        then.run();
      }
      return "no results";
    }
  }

  static Signal kill(String traceId) {
    Instant now = Instant.now();
    return new Signal("0af7651916cd43dd8448eb211c80319c", traceId, "kill", "tool_loop",
        "search_docs called 3x in last 3 steps", Map.of("span_id", "00f067aa0ba902b7"),
        "support-agent", null, now.toString(), now.plusSeconds(3600).toString(), null, null,
        null, null, null, null);
  }

  @Test
  void aLangChain4jAgentIsStoppedBeforeItsFourthToolCallWithTheStopOnItsSpan() {
    Traced traced = Traced.create(true);
    SignalBook book = new SignalBook();
    List<String> logged = new ArrayList<>();
    KillSwitch killswitch = new KillSwitch(book, logged::add, KillSwitch.ScopeDefaults.of(null, null, null));
    Span agent = traced.sdk().getTracer("test").spanBuilder("invoke_agent support").startSpan();
    String traceId = agent.getSpanContext().getTraceId();
    Search search = new Search(() -> book.deliver(kill(traceId)));
    Assistant assistant = LangChain4jGuard.install(AiServices.builder(Assistant.class)
            .chatModel(loopingModel(List.of(traced.tracing())))
            .chatMemory(MessageWindowChatMemory.withMaxMessages(100))
            .tools(search), killswitch, traced.tracing())
        .build();
    AgentKilled killed;
    try (Scope scope = agent.makeCurrent()) {
      // LangChain4j's tool error handler never sees it: the check runs before the tool call.
      killed = assertThrows(AgentKilled.class, () -> assistant.chat("What is the refund policy?"));
    } finally {
      agent.end();
    }
    assertEquals(3, search.calls.get(), "the 4th call never ran");
    assertEquals("tool_loop", killed.rule());
    assertEquals(0, killswitch.unguarded());
    List<SpanData> spans = traced.exporter().getFinishedSpanItems();
    List<SpanData> tools = spans.stream().filter(s -> s.getName().equals("execute_tool search_docs")).toList();
    assertEquals(3, tools.size(), "one span per call that ran");
    assertEquals("{\"query\":\"refund policy\"}", tools.get(0).getAttributes().get(AttributeKey.stringKey("gen_ai.tool.call.arguments")));
    assertEquals("no results", tools.get(0).getAttributes().get(AttributeKey.stringKey("gen_ai.tool.call.result")));
    assertEquals(List.of("call_1", "call_2", "call_3"), tools.stream()
        .map(s -> s.getAttributes().get(AttributeKey.stringKey("gen_ai.tool.call.id"))).toList());
    assertTrue(tools.stream().allMatch(s -> s.getTraceId().equals(traceId)), "tool spans in the agent's trace");
    List<SpanData> chats = spans.stream().filter(s -> s.getName().startsWith("chat")).toList();
    assertEquals(4, chats.size(), "the model asked a 4th time; the check refused the call");
    assertEquals(120L, chats.get(0).getAttributes().get(AttributeKey.longKey("gen_ai.usage.input_tokens")));
    SpanData agentSpan = spans.stream().filter(s -> s.getName().equals("invoke_agent support")).findFirst().orElseThrow();
    assertEquals(List.of(Stop.STOP_EVENT), agentSpan.getEvents().stream().map(e -> e.getName()).toList());
    assertEquals("kill", agentSpan.getEvents().get(0).getAttributes().get(AttributeKey.stringKey("spanguard.action")));
    traced.sdk().close();
  }

  /**
   * executeToolsConcurrently: LangChain4j runs the hooks on its executor's threads, where the
   * agent span is not current. The guard checks the context the AI service was called in, and
   * the tool spans stay in the agent's trace.
   */
  @Test
  void toolsRunConcurrentlyAreCheckedInTheCallersTrace() {
    Traced traced = Traced.create(true);
    SignalBook book = new SignalBook();
    KillSwitch killswitch = new KillSwitch(book, message -> { }, KillSwitch.ScopeDefaults.of(null, null, null));
    Span agent = traced.sdk().getTracer("test").spanBuilder("invoke_agent support").startSpan();
    String traceId = agent.getSpanContext().getTraceId();
    Search search = new Search(() -> { });
    Set<String> threads = ConcurrentHashMap.newKeySet();
    AiServices<Assistant> builder = AiServices.builder(Assistant.class)
        .chatModel(twoAtOnceModel(List.of(traced.tracing())))
        .chatMemory(MessageWindowChatMemory.withMaxMessages(100))
        .tools(search).executeToolsConcurrently()
        .afterToolExecution(done -> threads.add(Thread.currentThread().getName()));
    Assistant assistant = LangChain4jGuard.install(builder, killswitch, traced.tracing()).build();
    AgentKilled killed;
    try (Scope scope = agent.makeCurrent()) {
      // The kill arrives once the first round of two calls has ended.
      search.atCount(2, () -> book.deliver(kill(traceId)));
      killed = assertThrows(AgentKilled.class, () -> assistant.chat("What is the refund policy?"));
    } finally {
      agent.end();
    }
    assertEquals("tool_loop", killed.rule());
    assertEquals(2, search.calls.get(), "a call of the second round ran");
    assertEquals(0, killswitch.unguarded(), "a concurrent check found no trace");
    assertTrue(threads.stream().noneMatch(name -> name.equals(Thread.currentThread().getName())),
        "the tools ran on the caller's thread: " + threads);
    List<SpanData> tools = traced.exporter().getFinishedSpanItems().stream()
        .filter(s -> s.getName().equals("execute_tool search_docs")).toList();
    assertEquals(2, tools.size());
    assertTrue(tools.stream().allMatch(s -> s.getTraceId().equals(traceId)
        && s.getParentSpanId().equals(agent.getSpanContext().getSpanId())), "tool spans outside the agent's trace");
    traced.sdk().close();
  }

  @Test
  void contentCaptureOffLeavesTheArgumentsOffTheToolSpans() {
    Traced traced = Traced.create(false);
    LangChain4jTracing tracing = traced.tracing();
    Search search = new Search(() -> { });
    ScriptedModel model = loopingModel(List.of(tracing));
    Assistant assistant = AiServices.builder(Assistant.class).chatModel(model)
        .chatMemory(MessageWindowChatMemory.withMaxMessages(100)).tools(search)
        .maxSequentialToolsInvocations(2)
        .beforeToolExecution(tracing::beforeToolExecution).afterToolExecution(tracing::afterToolExecution)
        .build();
    assertThrows(RuntimeException.class, () -> assistant.chat("q")); // past 2 invocations
    List<SpanData> tools = traced.exporter().getFinishedSpanItems().stream()
        .filter(s -> s.getName().startsWith("execute_tool")).toList();
    assertEquals(2, tools.size());
    for (SpanData span : tools) {
      assertEquals("search_docs", span.getAttributes().get(AttributeKey.stringKey("gen_ai.tool.name")));
      assertEquals(null, span.getAttributes().get(AttributeKey.stringKey("gen_ai.tool.call.arguments")));
      assertEquals(null, span.getAttributes().get(AttributeKey.stringKey("gen_ai.tool.call.result")));
    }
    traced.sdk().close();
  }

  record Query(String query) {}

  @Test
  void aSpringAiToolOfAKilledTraceDoesNotRun() {
    SdkTracerProvider provider = SdkTracerProvider.builder()
        .addSpanProcessor(SimpleSpanProcessor.create(InMemorySpanExporter.create())).build();
    SignalBook book = new SignalBook();
    KillSwitch killswitch = new KillSwitch(book, message -> { }, KillSwitch.ScopeDefaults.of(null, null, null));
    AtomicInteger ran = new AtomicInteger();
    ToolCallback tool = FunctionToolCallback.builder("search_docs", (Query q) -> {
          ran.incrementAndGet();
          return "no results for " + q.query();
        })
        .description("Search the knowledge base.").inputType(Query.class).build();
    ToolCallback[] guarded = SpringAiGuard.guard(killswitch, tool);
    assertSame(tool.getToolDefinition(), guarded[0].getToolDefinition());
    Span agent = provider.get("test").spanBuilder("invoke_agent support").startSpan();
    try (Scope scope = agent.makeCurrent()) {
      assertEquals("\"no results for refund policy\"", guarded[0].call("{\"query\":\"refund policy\"}"));
      book.deliver(kill(agent.getSpanContext().getTraceId()));
      assertThrows(AgentKilled.class, () -> guarded[0].call("{\"query\":\"refund policy\"}"));
    } finally {
      agent.end();
    }
    assertEquals(1, ran.get(), "the killed call never ran");
    assertEquals(0, killswitch.unguarded());
    assertSame(guarded[0], SpringAiGuard.guard(killswitch, guarded)[0], "not wrapped twice");
    provider.close();
    assertTrue(Context.current() == Context.root());
  }
}
