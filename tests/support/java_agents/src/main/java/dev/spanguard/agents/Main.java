package dev.spanguard.agents;

import dev.langchain4j.agent.tool.P;
import dev.langchain4j.agent.tool.Tool;
import dev.langchain4j.agent.tool.ToolExecutionRequest;
import dev.langchain4j.data.message.AiMessage;
import dev.langchain4j.memory.chat.MessageWindowChatMemory;
import dev.langchain4j.model.chat.ChatModel;
import dev.langchain4j.model.chat.listener.ChatModelListener;
import dev.langchain4j.model.chat.request.ChatRequest;
import dev.langchain4j.model.chat.response.ChatResponse;
import dev.langchain4j.model.output.FinishReason;
import dev.langchain4j.model.output.TokenUsage;
import dev.langchain4j.service.AiServices;
import dev.spanguard.killswitch.AgentStopped;
import dev.spanguard.killswitch.Json;
import dev.spanguard.killswitch.KillSwitch;
import dev.spanguard.killswitch.LangChain4jGuard;
import dev.spanguard.killswitch.LangChain4jTracing;
import io.micrometer.observation.ObservationRegistry;
import io.opentelemetry.api.common.AttributeKey;
import io.opentelemetry.api.common.Attributes;
import io.opentelemetry.api.trace.Span;
import io.opentelemetry.api.trace.Tracer;
import io.opentelemetry.context.Context;
import io.opentelemetry.context.Scope;
import io.opentelemetry.exporter.otlp.http.trace.OtlpHttpSpanExporter;
import io.opentelemetry.sdk.OpenTelemetrySdk;
import io.opentelemetry.sdk.resources.Resource;
import io.opentelemetry.sdk.trace.ReadWriteSpan;
import io.opentelemetry.sdk.trace.ReadableSpan;
import io.opentelemetry.sdk.trace.SdkTracerProvider;
import io.opentelemetry.sdk.trace.SpanProcessor;
import io.opentelemetry.sdk.trace.data.EventData;
import io.opentelemetry.sdk.trace.export.BatchSpanProcessor;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicReference;

/**
 * Java agents: a LangChain4j 1.19 AI service with tools over a scripted ChatModel (no network),
 * its spans made by clients/java's LangChain4jTracing (LangChain4j makes none itself) and sent
 * over OTLP/HTTP protobuf by the OpenTelemetry Java SDK.
 *
 * <pre>
 * fixtures --scenarios FILE --mode capture|off --endpoint URL [--library langchain4j|spring-ai]
 *     every scenario of FILE (tests/support/instrumented_agents.py's), one trace each, by the
 *     library's agent (SpringAiAgent for spring-ai); prints one JSON line per scenario:
 *     {"scenario", "trace_id"}
 * e2e --endpoint URL --bootstrap B --kill-topic T [--ack-topic A] [--step-delay S] [--max-calls N]
 *     an agent asking for the same search again and again, guarded by LangChain4jGuard with the
 *     key of SPANGUARD_SIGNING_KEY (or the file SPANGUARD_SIGNING_KEY_FILE); the last line of
 *     stdout: {agent, status: killed|gave_up, calls, reason, trace_id, kill_latency_s,
 *     exception, stop_event}
 * </pre>
 */
public final class Main {
  static final String FINAL_ANSWER = "That is all I could find.";

  /** The AI service the agent is. */
  interface Assistant {
    String chat(String question);
  }

  /** A scenario's calls in order: the model's next request and the tool's next result. */
  static final class Script {
    final List<Map<String, Object>> calls;
    final long stepMillis;
    int turn;
    int results;
    final List<Long> callEnds = new ArrayList<>(); // System.nanoTime() as each tool call ended

    Script(List<Map<String, Object>> calls, long stepMillis) {
      this.calls = calls;
      this.stepMillis = stepMillis;
    }

    synchronized String result() {
      String result = (String) calls.get(results++).get("result");
      callEnds.add(System.nanoTime());
      return result;
    }
  }

  /** The scripted model: asks for the script's next call, then answers; 120 + 20 tokens a call. */
  static final class ScriptedModel implements ChatModel {
    private final Script script;
    private final List<ChatModelListener> listeners;

    ScriptedModel(Script script, List<ChatModelListener> listeners) {
      this.script = script;
      this.listeners = listeners;
    }

    @Override
    public List<ChatModelListener> listeners() {
      return listeners;
    }

    @Override
    public ChatResponse doChat(ChatRequest request) {
      if (script.stepMillis > 0) {
        try {
          Thread.sleep(script.stepMillis); // the model "thinks"
        } catch (InterruptedException e) {
          Thread.currentThread().interrupt();
        }
      }
      ChatResponse.Builder response = ChatResponse.builder()
          .modelName("scripted")
          .tokenUsage(new TokenUsage(120, 20));
      if (script.turn >= script.calls.size()) {
        return response.aiMessage(AiMessage.from(FINAL_ANSWER)).finishReason(FinishReason.STOP).build();
      }
      Map<String, Object> call = script.calls.get(script.turn++);
      ToolExecutionRequest toolCall = ToolExecutionRequest.builder()
          .id("call_" + script.turn)
          .name((String) call.get("tool"))
          .arguments(Json.canonical(call.get("arguments")))
          .build();
      return response.aiMessage(AiMessage.from(List.of(toolCall)))
          .finishReason(FinishReason.TOOL_EXECUTION).build();
    }
  }

  /** The knowledge-base tools: each answers what the script says. */
  public static final class Tools {
    private final Script script;

    Tools(Script script) {
      this.script = script;
    }

    @Tool(name = "search_docs", value = "Search the knowledge base.")
    public String searchDocs(@P("what to search for") String query,
        @P(value = "the request's id", required = false) String request_id) {
      return script.result();
    }

    @Tool(name = "read_doc", value = "Read one document of the knowledge base.")
    public String readDoc(@P("the document's id") String doc_id) {
      return script.result();
    }

    @Tool(name = "get_job_status", value = "Status of a background job.")
    public String getJobStatus(@P("the job's id") String job_id) {
      return script.result();
    }
  }

  /** Keeps the spanguard.stop events of ended spans (what the trace says about the stop). */
  static final class StopEvents implements SpanProcessor {
    final AtomicReference<String> action = new AtomicReference<>();

    @Override
    public void onStart(Context parentContext, ReadWriteSpan span) {}

    @Override
    public boolean isStartRequired() {
      return false;
    }

    @Override
    public void onEnd(ReadableSpan span) {
      for (EventData event : span.toSpanData().getEvents()) {
        if (event.getName().equals("spanguard.stop")) {
          action.compareAndSet(null, event.getAttributes().get(AttributeKey.stringKey("spanguard.action")));
        }
      }
    }

    @Override
    public boolean isEndRequired() {
      return true;
    }
  }

  static Map<String, String> flags(String[] args) {
    Map<String, String> out = new LinkedHashMap<>();
    for (int i = 1; i + 1 < args.length; i += 2) {
      out.put(args[i].replaceFirst("^--", ""), args[i + 1]);
    }
    return out;
  }

  static OpenTelemetrySdk sdk(String endpoint, String service, SpanProcessor... extra) {
    OtlpHttpSpanExporter exporter = OtlpHttpSpanExporter.builder()
        .setEndpoint(endpoint.replaceAll("/+$", "") + "/v1/traces").build();
    var provider = SdkTracerProvider.builder()
        .setResource(Resource.getDefault().merge(Resource.create(
            Attributes.of(AttributeKey.stringKey("service.name"), service))))
        // A short export delay: a span waiting in the agent is detection latency.
        .addSpanProcessor(BatchSpanProcessor.builder(exporter)
            .setScheduleDelay(Duration.ofMillis(50)).build());
    for (SpanProcessor processor : extra) {
      provider.addSpanProcessor(processor);
    }
    return OpenTelemetrySdk.builder().setTracerProvider(provider.build()).build();
  }

  static Assistant assistant(Script script, LangChain4jTracing tracing, KillSwitch killswitch) {
    AiServices<Assistant> builder = AiServices.builder(Assistant.class)
        .chatModel(new ScriptedModel(script, List.of(tracing)))
        .chatMemory(MessageWindowChatMemory.withMaxMessages(200))
        .tools(new Tools(script));
    if (killswitch != null) {
      return LangChain4jGuard.install(builder, killswitch, tracing).build();
    }
    return tracing.installOn(builder).build();
  }

  /** The agent's own span around the AI service call. */
  static Span agentSpan(Tracer tracer, String name) {
    return tracer.spanBuilder("invoke_agent " + name)
        .setAttribute("gen_ai.operation.name", "invoke_agent")
        .setAttribute("gen_ai.agent.name", name)
        .startSpan();
  }

  @SuppressWarnings("unchecked")
  static int fixtures(Map<String, String> flags) throws Exception {
    Map<String, Object> scenarios = (Map<String, Object>) Json.parse(
        Files.readString(Path.of(flags.get("scenarios")))).value();
    boolean capture = !"off".equals(flags.get("mode"));
    boolean springAi = "spring-ai".equals(flags.getOrDefault("library", "langchain4j"));
    OpenTelemetrySdk sdk = sdk(flags.get("endpoint"), "scripted-agent");
    LangChain4jTracing tracing = LangChain4jTracing.create(sdk, capture);
    ObservationRegistry registry = SpringAiAgent.registry(sdk, capture);
    Tracer tracer = sdk.getTracer("scripted-agent");
    for (Map.Entry<String, Object> scenario : scenarios.entrySet()) {
      Script script = new Script((List<Map<String, Object>>) scenario.getValue(), 0);
      Span root = agentSpan(tracer, "support");
      try (Scope scope = root.makeCurrent()) {
        if (springAi) {
          SpringAiAgent.run(script, registry);
        } else {
          assistant(script, tracing, null).chat("What is the refund policy?");
        }
      } finally {
        root.end();
      }
      System.out.println(Json.canonical(Map.of("scenario", scenario.getKey(),
          "trace_id", root.getSpanContext().getTraceId())));
    }
    sdk.getSdkTracerProvider().forceFlush().join(10, TimeUnit.SECONDS);
    sdk.close();
    return 0;
  }

  static String signingKey() throws Exception {
    String file = System.getenv("SPANGUARD_SIGNING_KEY_FILE");
    if (file != null && !file.isEmpty()) {
      return Files.readString(Path.of(file)).strip();
    }
    return System.getenv("SPANGUARD_SIGNING_KEY");
  }

  static int e2e(Map<String, String> flags) throws Exception {
    String agent = "support-agent";
    long stepMillis = Math.round(Double.parseDouble(flags.getOrDefault("step-delay", "0.3")) * 1000);
    int maxCalls = Integer.parseInt(flags.getOrDefault("max-calls", "12"));
    StopEvents stops = new StopEvents();
    OpenTelemetrySdk sdk = sdk(flags.get("endpoint"), "support-bot-java", stops);
    LangChain4jTracing tracing = LangChain4jTracing.create(sdk);
    KillSwitch killswitch = KillSwitch.builder()
        .brokers(flags.getOrDefault("bootstrap", "127.0.0.1:9092"))
        .topic(flags.getOrDefault("kill-topic", "agent-kill-signals"))
        .ackTopic(flags.getOrDefault("ack-topic", "agent-kill-acks"))
        .signingKey(signingKey())
        .start();
    List<Map<String, Object>> calls = new ArrayList<>();
    for (int i = 0; i < maxCalls; i++) {
      calls.add(Map.of("tool", "search_docs", "arguments", Map.of("query", "refund policy"), "result", "no results"));
    }
    Script script = new Script(calls, stepMillis);
    Span root = agentSpan(sdk.getTracer("spanguard.e2e"), agent);
    String traceId = root.getSpanContext().getTraceId();
    // When the kill reached the agent's book, whatever the agent does meanwhile.
    AtomicReference<Long> arrived = new AtomicReference<>();
    Thread watcher = new Thread(() -> {
      while (arrived.get() == null && !Thread.currentThread().isInterrupted()) {
        if (killswitch.signals().isKilled(traceId)) {
          arrived.set(System.nanoTime());
        }
        try {
          Thread.sleep(2);
        } catch (InterruptedException e) {
          return;
        }
      }
    });
    watcher.setDaemon(true);
    watcher.start();
    Map<String, Object> out = new LinkedHashMap<>();
    out.put("agent", agent);
    out.put("status", "gave_up");
    out.put("reason", null);
    List<String> chain = new ArrayList<>();
    try (Scope scope = root.makeCurrent()) {
      assistant(script, tracing, killswitch).chat("What is the refund policy?");
    } catch (RuntimeException error) {
      for (Throwable at = error; at != null && !chain.contains(at.getClass().getSimpleName()); at = at.getCause()) {
        chain.add(at.getClass().getSimpleName());
      }
      AgentStopped stopped = dev.spanguard.killswitch.Stop.find(error);
      if (stopped == null) {
        throw error;
      }
      out.put("status", "killed");
      out.put("reason", stopped.reason());
    } finally {
      root.end();
      watcher.interrupt();
      sdk.getSdkTracerProvider().forceFlush().join(10, TimeUnit.SECONDS);
      killswitch.close();
      sdk.close();
    }
    out.put("calls", (long) script.callEnds.size());
    out.put("trace_id", traceId);
    Long at = arrived.get();
    Object latency = null;
    if (at != null && script.callEnds.size() >= 3) {
      latency = String.format(java.util.Locale.ROOT, "%.3f", (at - script.callEnds.get(2)) / 1e9);
    }
    out.put("kill_latency_s", latency); // as text: the client's JSON writer writes no floats
    out.put("exception", new ArrayList<Object>(chain));
    out.put("stop_event", stops.action.get());
    System.out.println(Json.canonical(out));
    return 0;
  }

  public static void main(String[] args) throws Exception {
    if (args.length == 0) {
      System.err.println("usage: fixtures ... | e2e ... (see the class's docs)");
      System.exit(2);
    }
    int code = switch (args[0]) {
      case "fixtures" -> fixtures(flags(args));
      case "e2e" -> e2e(flags(args));
      default -> {
        System.err.println("unknown command " + args[0]);
        yield 2;
      }
    };
    System.exit(code);
  }
}
