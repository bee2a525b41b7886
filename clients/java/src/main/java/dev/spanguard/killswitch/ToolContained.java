package dev.spanguard.killswitch;

/**
 * Thrown by a check naming a tool that spanguard contained (a signal of scope "tool"): the call
 * to that tool is refused, not the agent. An {@link AgentKilled}, so code that catches only
 * AgentKilled still stops; a framework hook hands the model its message as the tool's error
 * instead, so the agent can take another path.
 */
public final class ToolContained extends AgentKilled {
  public ToolContained(Signal signal) {
    super("tool " + signal.tool().name() + " is contained by spanguard: " + signal.reason()
        + "; use another tool", signal);
  }

  /** The contained tool's name. */
  public String tool() {
    return signal().tool().name();
  }

  /** The contain's server ("" when it names none: every server). */
  public String server() {
    return signal().tool().server();
  }

  @Override
  public String action() {
    return "contain";
  }
}
