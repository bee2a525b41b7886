package dev.spanguard.killswitch;

/**
 * Thrown by a check in an agent whose trace, conversation or agent was killed; its subclass
 * {@link ToolContained} refuses one tool's call only.
 */
public class AgentKilled extends AgentStopped {
  public AgentKilled(Signal signal) {
    super("spanguard killed " + signal.describeTarget() + ": " + signal.reason(), signal);
  }

  AgentKilled(String message, Signal signal) {
    super(message, signal);
  }

  @Override
  public String action() {
    return signal().kind();
  }
}
