package dev.spanguard.agents;

import dev.spanguard.killswitch.Json;
import io.micrometer.observation.ObservationRegistry;
import io.micrometer.tracing.handler.DefaultTracingObservationHandler;
import io.micrometer.tracing.otel.bridge.OtelBaggageManager;
import io.micrometer.tracing.otel.bridge.OtelCurrentTraceContext;
import io.micrometer.tracing.otel.bridge.OtelTracer;
import io.opentelemetry.api.OpenTelemetry;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import org.springframework.ai.chat.messages.AssistantMessage;
import org.springframework.ai.chat.messages.Message;
import org.springframework.ai.chat.messages.UserMessage;
import org.springframework.ai.chat.metadata.ChatGenerationMetadata;
import org.springframework.ai.chat.metadata.ChatResponseMetadata;
import org.springframework.ai.chat.metadata.DefaultUsage;
import org.springframework.ai.chat.model.ChatModel;
import org.springframework.ai.chat.model.ChatResponse;
import org.springframework.ai.chat.model.Generation;
import org.springframework.ai.chat.observation.ChatModelObservationContext;
import org.springframework.ai.chat.observation.ChatModelObservationDocumentation;
import org.springframework.ai.chat.observation.DefaultChatModelObservationConvention;
import org.springframework.ai.chat.prompt.Prompt;
import org.springframework.ai.model.tool.DefaultToolCallingManager;
import org.springframework.ai.model.tool.DefaultToolExecutionEligibilityPredicate;
import org.springframework.ai.model.tool.ToolCallingChatOptions;
import org.springframework.ai.model.tool.ToolCallingManager;
import org.springframework.ai.model.tool.ToolExecutionEligibilityPredicate;
import org.springframework.ai.model.tool.ToolExecutionResult;
import org.springframework.ai.support.ToolCallbacks;
import org.springframework.ai.tool.ToolCallback;
import org.springframework.ai.tool.annotation.Tool;
import org.springframework.ai.tool.annotation.ToolParam;
import org.springframework.ai.tool.observation.ToolCallingContentObservationFilter;

/**
 * Spring AI 1.1 tool calling over a scripted ChatModel, traced by Spring AI's own Micrometer
 * observations made OpenTelemetry spans by Micrometer Tracing's OTel bridge, wired as Spring
 * Boot wires them (a DefaultTracingObservationHandler over an OtelTracer of the SDK's tracer
 * "org.springframework.boot"), without Spring Boot. The model observes each call as a provider's
 * ChatModel does (ChatModelObservationDocumentation, the default convention) and runs the tool
 * calls through a DefaultToolCallingManager on the same registry, as OpenAiChatModel does.
 * Capture on registers ToolCallingContentObservationFilter (what
 * spring.ai.tools.observations.include-content=true registers); off leaves it out (the default).
 */
final class SpringAiAgent {
  /** Spring Boot 3's name for the tracer it hands Micrometer Tracing. */
  static final String TRACER = "org.springframework.boot";

  private SpringAiAgent() {}

  static ObservationRegistry registry(OpenTelemetry openTelemetry, boolean capture) {
    OtelCurrentTraceContext current = new OtelCurrentTraceContext();
    OtelTracer tracer = new OtelTracer(openTelemetry.getTracer(TRACER), current, event -> { },
        new OtelBaggageManager(current, List.of(), List.of()));
    ObservationRegistry registry = ObservationRegistry.create();
    registry.observationConfig().observationHandler(new DefaultTracingObservationHandler(tracer));
    if (capture) {
      registry.observationConfig().observationFilter(new ToolCallingContentObservationFilter());
    }
    return registry;
  }

  /** The knowledge-base tools: each answers what the script says. */
  public static final class Tools {
    private final Main.Script script;

    Tools(Main.Script script) {
      this.script = script;
    }

    @Tool(name = "search_docs", description = "Search the knowledge base.")
    public String searchDocs(@ToolParam(description = "what to search for") String query,
        @ToolParam(description = "the request's id", required = false) String request_id) {
      return script.result();
    }

    @Tool(name = "read_doc", description = "Read one document of the knowledge base.")
    public String readDoc(@ToolParam(description = "the document's id") String doc_id) {
      return script.result();
    }

    @Tool(name = "get_job_status", description = "Status of a background job.")
    public String getJobStatus(@ToolParam(description = "the job's id") String job_id) {
      return script.result();
    }
  }

  /** Asks for the script's next call, then answers; 120 + 20 tokens a call. */
  static final class ScriptedModel implements ChatModel {
    private final Main.Script script;
    private final ObservationRegistry registry;
    private final ToolCallingManager tools;
    private final ToolExecutionEligibilityPredicate toolsRequired =
        new DefaultToolExecutionEligibilityPredicate();

    ScriptedModel(Main.Script script, ObservationRegistry registry) {
      this.script = script;
      this.registry = registry;
      this.tools = DefaultToolCallingManager.builder().observationRegistry(registry).build();
    }

    @Override
    public ChatResponse call(Prompt prompt) {
      ChatResponse response = observed(prompt);
      if (toolsRequired.isToolExecutionRequired(prompt.getOptions(), response)) {
        ToolExecutionResult result = tools.executeToolCalls(prompt, response);
        return call(new Prompt(result.conversationHistory(), prompt.getOptions()));
      }
      return response;
    }

    private ChatResponse observed(Prompt prompt) {
      ChatModelObservationContext context = ChatModelObservationContext.builder()
          .prompt(prompt).provider("scripted").build();
      return ChatModelObservationDocumentation.CHAT_MODEL_OPERATION
          .observation(null, new DefaultChatModelObservationConvention(), () -> context, registry)
          .observe(() -> {
            ChatResponse response = answer();
            context.setResponse(response);
            return response;
          });
    }

    private ChatResponse answer() {
      ChatResponseMetadata metadata = ChatResponseMetadata.builder()
          .model("scripted").usage(new DefaultUsage(120, 20)).build();
      if (script.turn >= script.calls.size()) {
        return new ChatResponse(List.of(new Generation(new AssistantMessage(Main.FINAL_ANSWER),
            ChatGenerationMetadata.builder().finishReason("STOP").build())), metadata);
      }
      Map<String, Object> call = script.calls.get(script.turn++);
      AssistantMessage.ToolCall toolCall = new AssistantMessage.ToolCall("call_" + script.turn,
          "function", (String) call.get("tool"), Json.canonical(call.get("arguments")));
      AssistantMessage message = AssistantMessage.builder().content("").toolCalls(List.of(toolCall)).build();
      return new ChatResponse(List.of(new Generation(message,
          ChatGenerationMetadata.builder().finishReason("TOOL_CALLS").build())), metadata);
    }
  }

  /** The agent's question, answered with the tools, in the current OpenTelemetry context. */
  static void run(Main.Script script, ObservationRegistry registry) {
    ToolCallback[] callbacks = ToolCallbacks.from(new Tools(script));
    ToolCallingChatOptions options = ToolCallingChatOptions.builder()
        .model("scripted").toolCallbacks(callbacks).internalToolExecutionEnabled(true).build();
    List<Message> messages = new ArrayList<>(List.of(new UserMessage("What is the refund policy?")));
    new ScriptedModel(script, registry).call(new Prompt(messages, options));
  }
}
