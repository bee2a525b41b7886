package dev.spanguard.killswitch;

import java.util.Map;

/**
 * A kill, downgrade, release or pause an agent may act on (read by {@link Signals#read}).
 *
 * @param kind kill, downgrade, release or pause
 * @param agentName null: every agent of the service
 * @param pauseUntil kind pause: until when the agent waits for an operator
 * @param pauseFallback kind pause: what applies then, "kill" or "release"
 * @param scope null or "trace": its trace; "conversation": every trace of conversationId;
 *     "agent": every trace of agentService/agentName; "tool": every call to {@code tool} (it
 *     contains the tool, the agent goes on)
 * @param tool scope "tool": the tool contained or released
 */
public record Signal(
    String signalId,
    String traceId,
    String kind,
    String rule,
    String reason,
    Map<String, Object> evidence,
    String agentService,
    String agentName,
    String detectedAt,
    String expiresAt,
    String systemMessage,
    String operator,
    String pauseUntil,
    String pauseFallback,
    String scope,
    String conversationId,
    Tool tool) {

  /** A tool a tool signal names; server "" when none (then every server's tool of the name). */
  public record Tool(String name, String server) {}

  /** A signal of no tool (every signal but a tool signal). */
  public Signal(String signalId, String traceId, String kind, String rule, String reason,
      Map<String, Object> evidence, String agentService, String agentName, String detectedAt,
      String expiresAt, String systemMessage, String operator, String pauseUntil,
      String pauseFallback, String scope, String conversationId) {
    this(signalId, traceId, kind, rule, reason, evidence, agentService, agentName, detectedAt,
        expiresAt, systemMessage, operator, pauseUntil, pauseFallback, scope, conversationId, null);
  }

  /** What it stops: "trace", "conversation", "agent" or "tool". */
  public String scopeOrTrace() {
    return scope == null ? "trace" : scope;
  }

  Signal withKill(String newReason) {
    return new Signal(signalId, traceId, "kill", rule, newReason, evidence, agentService, agentName,
        detectedAt, expiresAt, systemMessage, operator, pauseUntil, pauseFallback, scope,
        conversationId, tool);
  }

  String describeTarget() {
    switch (scopeOrTrace()) {
      case "conversation":
        return "conversation " + conversationId;
      case "tool":
        return "tool " + tool.name() + (tool.server().isEmpty() ? "" : " on " + tool.server());
      case "agent":
        if (agentName != null && !agentName.isEmpty()) {
          return "agent " + agentService + "/" + agentName;
        }
        return "agent " + agentService + " (every agent name)";
      default:
        return "trace " + traceId;
    }
  }
}
