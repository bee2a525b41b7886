package dev.spanguard.killswitch;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertSame;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import dev.langchain4j.agent.tool.Tool;
import dev.langchain4j.agent.tool.ToolExecutionRequest;
import dev.langchain4j.data.message.AiMessage;
import dev.langchain4j.data.message.ChatMessage;
import dev.langchain4j.data.message.ToolExecutionResultMessage;
import dev.langchain4j.memory.chat.MessageWindowChatMemory;
import dev.langchain4j.model.chat.ChatModel;
import dev.langchain4j.model.chat.listener.ChatModelListener;
import dev.langchain4j.model.chat.request.ChatRequest;
import dev.langchain4j.model.chat.response.ChatResponse;
import dev.langchain4j.model.output.TokenUsage;
import dev.langchain4j.service.AiServices;
import dev.langchain4j.service.tool.ToolProvider;
import dev.langchain4j.service.tool.ToolProviderResult;
import dev.langchain4j.service.tool.ToolService;
import io.opentelemetry.api.common.AttributeKey;
import io.opentelemetry.api.trace.Span;
import io.opentelemetry.api.trace.StatusCode;
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
import java.util.function.Supplier;
import org.junit.jupiter.api.Test;
import org.springframework.ai.chat.messages.AssistantMessage;
import org.springframework.ai.chat.messages.Message;
import org.springframework.ai.chat.messages.ToolResponseMessage;
import org.springframework.ai.chat.messages.UserMessage;
import org.springframework.ai.chat.model.Generation;
import org.springframework.ai.chat.prompt.Prompt;
import org.springframework.ai.model.tool.DefaultToolCallingManager;
import org.springframework.ai.model.tool.ToolCallingChatOptions;
import org.springframework.ai.model.tool.ToolCallingManager;
import org.springframework.ai.tool.ToolCallback;
import org.springframework.ai.tool.execution.ToolExecutionException;
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

  /**
   * Asks for {@code calls.apply(turn)} on every turn (1, 2, ...), the final answer when that is
   * empty; 120 + 20 tokens a call.
   */
  static final class ScriptedModel implements ChatModel {
    final List<ChatModelListener> listeners;
    final IntFunction<List<ToolExecutionRequest>> calls;
    final List<ChatRequest> requests = new ArrayList<>();
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
      requests.add(request);
      List<ToolExecutionRequest> asked = calls.apply(turn);
      AiMessage message = asked.isEmpty() ? AiMessage.from(FINAL_ANSWER) : AiMessage.from(asked);
      return ChatResponse.builder().aiMessage(message).tokenUsage(new TokenUsage(120, 20)).build();
    }
  }

  static final String FINAL_ANSWER = "Refunds within 30 days.";

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

  static final String CONTAIN_REASON = "search_docs failed for 40 traces in the last 5 minutes";

  /** The fleet rule's contain of tool (on every server). */
  static Signal contain(String tool) {
    Instant now = Instant.now().truncatedTo(java.time.temporal.ChronoUnit.SECONDS);
    return new Signal("5c2d6e7f8a9b4c0d9e1f2a3b4c5d6e7f", null, "kill", "tool_failing",
        CONTAIN_REASON, Map.of(), null, null, now.toString(), now.plusSeconds(3600).toString(),
        null, null, null, null, "tool", null, new Signal.Tool(tool, ""));
  }

  static final String REFUSAL = "tool search_docs is contained by spanguard: " + CONTAIN_REASON
      + "; use another tool";

  /** The other path: a web search. */
  public static final class WebSearch {
    final AtomicInteger calls = new AtomicInteger();
    volatile Runnable onCall = () -> { };

    @Tool(name = "search_web", value = "Search the web.")
    public String searchWeb(String query) {
      calls.incrementAndGet();
      onCall.run();
      return "refunds within 30 days";
    }
  }

  static ToolExecutionRequest webSearch(String id) {
    return ToolExecutionRequest.builder().id(id).name("search_web")
        .arguments("{\"query\":\"refund policy\"}").build();
  }

  /** search_docs, then search_web {@code webSearches} times, then the answer. */
  static ScriptedModel fallbackModel(List<ChatModelListener> listeners, int webSearches) {
    return new ScriptedModel(listeners, turn -> turn == 1 ? List.of(search("call_1", "refund policy"))
        : turn <= 1 + webSearches ? List.of(webSearch("call_" + turn)) : List.of());
  }

  record Guarded(Traced traced, SignalBook book, List<String> logged, KillSwitch killswitch,
      LangChain4jGuard guard, Span agent) {
    /** A run whose book has already contained `tool`. */
    static Guarded containing(String tool) {
      Traced traced = Traced.create(true);
      SignalBook book = new SignalBook();
      book.deliver(contain(tool));
      List<String> logged = new ArrayList<>();
      KillSwitch killswitch = new KillSwitch(book, logged::add, KillSwitch.ScopeDefaults.of(null, null, null));
      Span agent = traced.sdk().getTracer("test").spanBuilder("invoke_agent support").startSpan();
      return new Guarded(traced, book, logged, killswitch, new LangChain4jGuard(killswitch), agent);
    }

    String traceId() {
      return agent.getSpanContext().getTraceId();
    }

    /** What `call` returns, called inside the agent's span, which ends after it. */
    <T> T inAgent(Supplier<T> call) {
      try (Scope scope = agent.makeCurrent()) {
        return call.get();
      } finally {
        agent.end();
      }
    }

    List<String> agentEvents() {
      return traced.exporter().getFinishedSpanItems().stream()
          .filter(s -> s.getName().equals("invoke_agent support")).findFirst().orElseThrow()
          .getEvents().stream().map(e -> e.getName()).toList();
    }
  }

  @Test
  void aContainedLangChain4jToolIsRefusedToTheModelWhichTakesAnotherTool() {
    Guarded run = Guarded.containing("search_docs");
    Search search = new Search(() -> { });
    WebSearch web = new WebSearch();
    ScriptedModel model = fallbackModel(List.of(run.traced().tracing()), 1);
    Assistant assistant = run.guard().installOn(AiServices.builder(Assistant.class).chatModel(model)
            .chatMemory(MessageWindowChatMemory.withMaxMessages(100))
            .tools(run.guard().tools(search, web)), run.traced().tracing())
        .build();
    String answer = run.inAgent(() -> assistant.chat("What is the refund policy?"));
    assertEquals(FINAL_ANSWER, answer, "the run went on to its answer");
    assertEquals(0, search.calls.get(), "the contained tool never ran");
    assertEquals(1, web.calls.get());
    List<ChatMessage> read = model.requests.get(1).messages();
    ToolExecutionResultMessage refusal = (ToolExecutionResultMessage) read.get(read.size() - 1);
    assertEquals("search_docs", refusal.toolName());
    assertEquals(REFUSAL, refusal.text());
    assertTrue(refusal.isError(), "the model reads it as the tool's error");
    assertEquals(1, run.book().toolCallsRefused());
    assertEquals(1, run.logged().size(), "the first refusal is logged: " + run.logged());
    assertTrue(run.logged().get(0).contains(REFUSAL));
    assertEquals(List.of(), run.agentEvents(), "nothing stopped the agent");
    List<SpanData> tools = run.traced().exporter().getFinishedSpanItems().stream()
        .filter(s -> s.getName().startsWith("execute_tool")).toList();
    assertEquals(List.of("execute_tool search_docs", "execute_tool search_web"),
        tools.stream().map(SpanData::getName).toList());
    assertEquals(StatusCode.ERROR, tools.get(0).getStatus().getStatusCode(), "the refused call failed");
    assertEquals(StatusCode.UNSET, tools.get(1).getStatus().getStatusCode());
    run.traced().sdk().close();
  }

  /** The tools of a ToolProvider (MCP's, say) this time: the contained one refused alike. */
  @Test
  void aKillOfTheTraceStillEndsALangChain4jRunOfGuardedTools() {
    Guarded run = Guarded.containing("search_docs");
    Search search = new Search(() -> { });
    WebSearch web = new WebSearch();
    web.onCall = () -> run.book().deliver(kill(run.traceId()));
    ToolProvider provider = request -> new ToolProviderResult(
        java.util.stream.Stream.of(search, web).flatMap(tools -> ToolService.findTools(tools).stream()).toList());
    ScriptedModel model = fallbackModel(List.of(), 2);
    Assistant assistant = run.guard().installOn(AiServices.builder(Assistant.class).chatModel(model)
            .chatMemory(MessageWindowChatMemory.withMaxMessages(100))
            .toolProvider(run.guard().toolProvider(provider)), null)
        .build();
    AgentKilled killed = run.inAgent(
        () -> assertThrows(AgentKilled.class, () -> assistant.chat("What is the refund policy?")));
    assertFalse(killed instanceof ToolContained, "the trace's kill, not the contain");
    assertEquals("tool_loop", killed.rule());
    assertEquals(0, search.calls.get());
    List<ChatMessage> read = model.requests.get(1).messages();
    assertEquals(REFUSAL, ((ToolExecutionResultMessage) read.get(read.size() - 1)).text());
    assertEquals(1, web.calls.get(), "the second web search never ran");
    assertEquals(List.of(Stop.STOP_EVENT), run.agentEvents());
    run.traced().sdk().close();
  }

  /** The hook cannot answer the model: a contained tool not given through guard.tools ends the run. */
  @Test
  void aContainedLangChain4jToolGivenToTheBuilderDirectlyEndsTheRunUnrun() {
    Guarded run = Guarded.containing("search_docs");
    Search search = new Search(() -> { });
    Assistant assistant = run.guard().installOn(AiServices.builder(Assistant.class)
            .chatModel(loopingModel(List.of()))
            .chatMemory(MessageWindowChatMemory.withMaxMessages(100))
            .tools(search), null)
        .build();
    ToolContained refused = run.inAgent(
        () -> assertThrows(ToolContained.class, () -> assistant.chat("What is the refund policy?")));
    assertEquals(REFUSAL, refused.getMessage());
    assertEquals(0, search.calls.get());
    assertEquals(1, run.book().toolCallsRefused());
    run.traced().sdk().close();
  }

  /**
   * Spring AI's DefaultToolCallingManager runs the tool the script names on each turn, as a
   * provider's ChatModel does; returns the tool responses the model read, in order.
   */
  static List<ToolResponseMessage.ToolResponse> springAiRun(ToolCallback[] tools, List<String> script) {
    ToolCallingManager manager = DefaultToolCallingManager.builder().build();
    ToolCallingChatOptions options = ToolCallingChatOptions.builder().toolCallbacks(tools)
        .internalToolExecutionEnabled(true).build();
    List<Message> history = new ArrayList<>(List.of(new UserMessage("What is the refund policy?")));
    List<ToolResponseMessage.ToolResponse> read = new ArrayList<>();
    for (int turn = 0; turn < script.size(); turn++) {
      AssistantMessage asked = AssistantMessage.builder().content("").toolCalls(List.of(
          new AssistantMessage.ToolCall("call_" + turn, "function", script.get(turn),
              "{\"query\":\"refund policy\"}"))).build();
      var response = new org.springframework.ai.chat.model.ChatResponse(List.of(new Generation(asked)));
      history = manager.executeToolCalls(new Prompt(history, options), response).conversationHistory();
      read.addAll(((ToolResponseMessage) history.get(history.size() - 1)).getResponses());
    }
    return read;
  }

  static ToolCallback springAiTool(String name, AtomicInteger ran, String answer) {
    return FunctionToolCallback.builder(name, (Query q) -> {
          ran.incrementAndGet();
          return answer;
        })
        .description("Search.").inputType(Query.class).build();
  }

  @Test
  void aContainedSpringAiToolIsRefusedToTheModelAndAKillStillEndsTheLoop() {
    SdkTracerProvider provider = SdkTracerProvider.builder()
        .addSpanProcessor(SimpleSpanProcessor.create(InMemorySpanExporter.create())).build();
    SignalBook book = new SignalBook();
    List<String> logged = new ArrayList<>();
    KillSwitch killswitch = new KillSwitch(book, logged::add, KillSwitch.ScopeDefaults.of(null, null, null));
    AtomicInteger searched = new AtomicInteger();
    AtomicInteger searchedWeb = new AtomicInteger();
    ToolCallback[] guarded = SpringAiGuard.guard(killswitch,
        springAiTool("search_docs", searched, "no results"),
        springAiTool("search_web", searchedWeb, "refunds within 30 days"));
    book.deliver(contain("search_docs"));
    Span agent = provider.get("test").spanBuilder("invoke_agent support").startSpan();
    try (Scope scope = agent.makeCurrent()) {
      List<ToolResponseMessage.ToolResponse> read = springAiRun(guarded, List.of("search_docs", "search_web"));
      assertEquals(List.of("search_docs", "search_web"), read.stream().map(r -> r.name()).toList());
      assertEquals(REFUSAL, read.get(0).responseData(), "the model reads the refusal as the tool's answer");
      assertEquals("\"refunds within 30 days\"", read.get(1).responseData());
      book.deliver(kill(agent.getSpanContext().getTraceId()));
      AgentKilled killed = assertThrows(AgentKilled.class, () -> springAiRun(guarded, List.of("search_web")));
      assertFalse(killed instanceof ToolContained, "the trace's kill, not the contain");
      assertEquals("tool_loop", killed.rule());
    } finally {
      agent.end();
    }
    assertEquals(0, searched.get(), "the contained tool never ran");
    assertEquals(1, searchedWeb.get(), "the killed call never ran");
    assertEquals(1, book.toolCallsRefused());
    assertEquals(0, killswitch.unguarded());
    assertEquals(1, logged.size(), "the first refusal is logged: " + logged);
    ToolExecutionException direct = assertThrows(ToolExecutionException.class,
        () -> guarded[0].call("{\"query\":\"refund policy\"}"));
    assertTrue(direct.getCause() instanceof ToolContained);
    assertSame(guarded[0].getToolDefinition(), direct.getToolDefinition());
    provider.close();
  }
}
