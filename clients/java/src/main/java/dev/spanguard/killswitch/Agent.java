package dev.spanguard.killswitch;

/** An agent's identity: service.name and gen_ai.agent.name ("" when it has none). */
public record Agent(String service, String name) {
  public Agent {
    name = name == null ? "" : name;
  }

  /** "SERVICE/NAME" or "SERVICE" (every agent name of the service). */
  public static Agent parse(String text) {
    int slash = text.indexOf('/');
    String service = slash < 0 ? text : text.substring(0, slash);
    String name = slash < 0 ? "" : text.substring(slash + 1);
    if (service.isEmpty()) {
      throw new IllegalArgumentException(
          "killswitch settings: \"" + text + "\" names no service: SERVICE or SERVICE/NAME");
    }
    return new Agent(service, name);
  }
}
