package dev.spanguard.killswitch;

/**
 * Who checks, beyond the trace: a conversation or agent kill stops every trace of it. Empty or
 * null fields are not checked.
 */
public record CheckScope(String conversationId, Agent agent) {
  public static final CheckScope NONE = new CheckScope(null, null);

  public CheckScope {
    conversationId = conversationId == null ? "" : conversationId;
  }
}
