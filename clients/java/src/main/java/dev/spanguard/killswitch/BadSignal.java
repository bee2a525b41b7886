package dev.spanguard.killswitch;

/** A record on the kill topic that is not a signal this agent may act on; kind names why. */
public final class BadSignal extends Exception {
  private final String kind;

  BadSignal(String kind, String detail) {
    // The detail quotes attacker-controlled text: short and printable.
    super(Signals.printable(detail), null, false, false);
    this.kind = kind;
  }

  /** empty, too_large, not_utf8, not_json, too_deep, not_object, invalid, unsigned,
   * unknown_key, forged, expired (and consumer_error, internal in the reader's counts). */
  public String kind() {
    return kind;
  }

  @Override
  public String toString() {
    return kind + ": " + getMessage();
  }
}
