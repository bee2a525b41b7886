package dev.spanguard.killswitch;

/** Thrown by a check in an agent whose trace, conversation or agent was killed. */
public final class AgentKilled extends AgentStopped {
  public AgentKilled(Signal signal) {
    super("spanguard killed " + signal.describeTarget() + ": " + signal.reason(), signal);
  }

  @Override
  public String action() {
    return signal().kind();
  }
}
