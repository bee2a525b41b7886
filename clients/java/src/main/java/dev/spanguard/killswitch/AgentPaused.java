package dev.spanguard.killswitch;

/**
 * Thrown by a check in an agent whose trace is paused: it must wait for an operator's
 * `spanguard release` (go on) or `spanguard kill` (stop), or until {@link #until()}, when the
 * policy's {@link #fallback()} ("kill" or "release") applies. {@code KillSwitch.await} waits.
 */
public final class AgentPaused extends AgentStopped {
  private final String until;
  private final String fallback;

  public AgentPaused(Signal signal) {
    super(message(signal), signal);
    this.until = signal.pauseUntil() == null ? "" : signal.pauseUntil();
    this.fallback = signal.pauseFallback() == null ? "" : signal.pauseFallback();
  }

  private static String message(Signal signal) {
    return "spanguard paused trace " + signal.traceId() + ": " + signal.reason()
        + "; waiting for `spanguard release` or `spanguard kill` until " + signal.pauseUntil()
        + ", then " + signal.pauseFallback();
  }

  /** The pause's pause_until, RFC 3339. */
  public String until() {
    return until;
  }

  public String fallback() {
    return fallback;
  }

  @Override
  public String action() {
    return "pause";
  }
}
