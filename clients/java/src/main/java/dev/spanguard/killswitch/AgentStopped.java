package dev.spanguard.killswitch;

/**
 * The guard stopped the agent: {@link AgentKilled} or {@link AgentPaused}. Unchecked, so that a
 * tool hook can throw it through a framework's tool call (LangChain4jGuard rethrows it past
 * LangChain4j's tool error handler, which would hand any other error to the model).
 */
public abstract class AgentStopped extends RuntimeException {
  private final Signal signal;

  AgentStopped(String message, Signal signal) {
    super(message, null, false, false);
    this.signal = signal;
  }

  public Signal signal() {
    return signal;
  }

  /** What the spanguard.stop event names. */
  public String rule() {
    return signal.rule();
  }

  public abstract String action();

  /** The worker's decision_id. */
  public String decisionId() {
    return signal.signalId();
  }

  /** What it stops: "trace", "conversation" or "agent". */
  public String scope() {
    return signal.scopeOrTrace();
  }

  public String reason() {
    return signal.reason();
  }
}
