package dev.spanguard.killswitch;

import java.time.Duration;
import java.time.Instant;
import java.util.ArrayDeque;
import java.util.HashMap;
import java.util.HashSet;
import java.util.Iterator;
import java.util.LinkedHashMap;
import java.util.Map;
import java.util.Optional;
import java.util.Set;
import java.util.function.Supplier;

/**
 * What each trace was told: the agent's check reads it, the Kafka reader writes it. The same
 * semantics as the Python killswitch's SignalBook and clients/go/book.go:
 *
 * <ul>
 *   <li>deliver records a signal; an id already recorded for its trace is a duplicate (false).
 *   <li>check throws AgentKilled once a kill is recorded, on that check and every later one;
 *       returns a downgrade's system message exactly once; else null.
 *   <li>a release lifts the trace's kill until a later kill (a new signal id).
 *   <li>a pause makes check throw AgentPaused until a release (go on) or a kill, or until its
 *       pause_until, when its fallback applies; a later pause of the trace replaces it; a pause
 *       of a killed trace leaves the kill. await blocks through it.
 *   <li>a tool signal contains a tool: checkTool, and check given the tool, throw ToolContained
 *       while the newest signal of that tool (by detected_at) is a kill not yet expired; a
 *       contain naming no server holds on every server; a null server (unknown) is refused by a
 *       contain of the name on any server.
 * </ul>
 *
 * <p>Memory is bounded by maxTraces per kind of entry; a killed trace this process has checked
 * is never forgotten (until forget). Thread-safe. The clock decides pause deadlines.
 */
public final class SignalBook {
  public static final int DEFAULT_MAX_TRACES = 10_000;
  // An await re-checks at least this often, so a deadline is met even if the clock jumps.
  private static final long WAIT_RECHECK_MILLIS = 1000;

  private final int maxTraces;
  private final Supplier<Instant> clock;
  private final LinkedHashMap<String, TraceSignals> others = new LinkedHashMap<>();
  private final LinkedHashMap<String, TraceSignals> watched = new LinkedHashMap<>();
  private final Map<String, TraceSignals> killed = new HashMap<>();
  private final LinkedHashMap<String, ScopeSignals> scopes = new LinkedHashMap<>();
  // tool name -> the newest signal of the tool per server
  private final LinkedHashMap<String, ToolSignals> tools = new LinkedHashMap<>();
  private static final int MAX_SERVERS_PER_TOOL = 1000;
  private long toolCallsRefused;
  private long changes;
  private int delivered;
  private int duplicates;

  private static final class TraceSignals {
    final Set<String> signalIds = new HashSet<>();
    Signal kill;
    final ArrayDeque<Unread> unread = new ArrayDeque<>();
    Signal pause;
  }

  private static final class ScopeSignals {
    final Set<String> signalIds = new HashSet<>();
    Signal kill;
  }

  private static final class ToolSignals {
    final Set<String> signalIds = new HashSet<>();
    final LinkedHashMap<String, Signal> byServer = new LinkedHashMap<>();
  }

  /** A downgrade's message with its signal (its span event names the decision). */
  record Unread(String message, Signal signal) {}

  /** What a check returned: a downgrade's message and its signal, or nothing. */
  record Checked(String message, Signal downgrade) {
    static final Checked NOTHING = new Checked(null, null);
  }

  public SignalBook() {
    this(0, Instant::now);
  }

  /** maxTraces <= 0 means DEFAULT_MAX_TRACES; clock decides when a pause's deadline has come. */
  public SignalBook(int maxTraces, Supplier<Instant> clock) {
    this.maxTraces = maxTraces <= 0 ? DEFAULT_MAX_TRACES : maxTraces;
    this.clock = clock == null ? Instant::now : clock;
  }

  private static <V> void put(LinkedHashMap<String, V> lru, String key, V value, int limit) {
    lru.remove(key);
    lru.put(key, value);
    Iterator<String> oldest = lru.keySet().iterator();
    while (lru.size() > limit && oldest.hasNext()) {
      oldest.next();
      oldest.remove();
    }
  }

  private static <V> void touch(LinkedHashMap<String, V> lru, String key) {
    V value = lru.remove(key);
    if (value != null) {
      lru.put(key, value);
    }
  }

  private static String scopeKey(String scope, String id, String name) {
    return scope + "\0" + id + "\0" + name;
  }

  private static String scopeKeyOf(Signal signal) {
    if (signal.scopeOrTrace().equals("conversation")) {
      return scopeKey("conversation", signal.conversationId(), "");
    }
    return scopeKey("agent", signal.agentService(), signal.agentName() == null ? "" : signal.agentName());
  }

  /** Whether RFC 3339 time later is at or after earlier (unreadable: true). */
  private static boolean atOrAfter(String later, String earlier) {
    Optional<Instant> a = Signals.parseDateTime(later);
    Optional<Instant> b = Signals.parseDateTime(earlier);
    if (a.isEmpty() || b.isEmpty()) {
      return true;
    }
    return !a.get().isBefore(b.get());
  }

  private void changed() {
    changes++;
    notifyAll(); // wakes await
  }

  private boolean deliverScoped(Signal signal) {
    String key = scopeKeyOf(signal);
    ScopeSignals entry = scopes.get(key);
    if (entry != null) {
      touch(scopes, key);
    } else {
      entry = new ScopeSignals();
      put(scopes, key, entry, maxTraces);
    }
    if (!entry.signalIds.add(signal.signalId())) {
      duplicates++;
      return false;
    }
    delivered++;
    changed();
    if (signal.kind().equals("release")) {
      if (entry.kill != null && atOrAfter(signal.detectedAt(), entry.kill.detectedAt())) {
        entry.kill = null;
      }
    } else if (signal.kind().equals("kill")) {
      // The longest-lasting kill of the scope holds.
      if (entry.kill == null || !atOrAfter(entry.kill.expiresAt(), signal.expiresAt())) {
        entry.kill = signal;
      }
    }
    return true;
  }

  // The newest signal of a tool on a server (by detected_at) holds: a contain or a release.
  private boolean deliverTool(Signal signal) {
    String name = signal.tool().name();
    String server = signal.tool().server();
    ToolSignals entry = tools.get(name);
    if (entry != null) {
      touch(tools, name);
    } else {
      entry = new ToolSignals();
      put(tools, name, entry, maxTraces);
    }
    if (!entry.signalIds.add(signal.signalId())) {
      duplicates++;
      return false;
    }
    delivered++;
    changed();
    Signal newest = entry.byServer.get(server);
    if (newest == null || atOrAfter(signal.detectedAt(), newest.detectedAt())) {
      put(entry.byServer, server, signal, MAX_SERVERS_PER_TOOL);
    }
    return true;
  }

  /**
   * The contain in force for tool on server (or one naming no server); a null server is unknown:
   * a contain of the tool on any server holds. Null when none.
   */
  public synchronized Signal contained(String tool, String server) {
    ToolSignals entry = tools.get(tool);
    if (entry == null) {
      return null;
    }
    java.util.List<Signal> candidates = new java.util.ArrayList<>();
    if (server == null) {
      candidates.addAll(entry.byServer.values());
    } else {
      for (String name : java.util.List.of(server, "")) {
        Signal signal = entry.byServer.get(name);
        if (signal != null && !candidates.contains(signal)) {
          candidates.add(signal);
        }
      }
    }
    Instant now = clock.get();
    for (Signal signal : candidates) {
      Optional<Instant> expires = Signals.parseDateTime(signal.expiresAt());
      if (signal.kind().equals("kill") && expires.isPresent() && now.isBefore(expires.get())) {
        return signal;
      }
    }
    return null;
  }

  /** Throws ToolContained if tool (on server; null: unknown) is contained; null checks nothing. */
  public synchronized void checkTool(String tool, String server) {
    if (tool == null || tool.isEmpty() || tools.isEmpty()) {
      return;
    }
    Signal signal = contained(tool, server);
    if (signal != null) {
      toolCallsRefused++;
      throw new ToolContained(signal);
    }
  }

  /** Calls refused because their tool was contained. */
  public synchronized long toolCallsRefused() {
    return toolCallsRefused;
  }

  /**
   * Throws AgentKilled if the conversation or the agent (that name, or a kill naming every agent
   * of the service) is under a kill not yet expired nor released.
   */
  public synchronized void checkScopes(CheckScope scope) {
    if (scopes.isEmpty()) {
      return;
    }
    java.util.List<String> keys = new java.util.ArrayList<>();
    if (!scope.conversationId().isEmpty()) {
      keys.add(scopeKey("conversation", scope.conversationId(), ""));
    }
    Agent agent = scope.agent();
    if (agent != null && !agent.service().isEmpty()) {
      keys.add(scopeKey("agent", agent.service(), agent.name()));
      if (!agent.name().isEmpty()) {
        keys.add(scopeKey("agent", agent.service(), ""));
      }
    }
    Instant now = clock.get();
    for (String key : keys) {
      ScopeSignals entry = scopes.get(key);
      if (entry == null || entry.kill == null) {
        continue;
      }
      Optional<Instant> expires = Signals.parseDateTime(entry.kill.expiresAt());
      if (expires.isPresent() && !now.isBefore(expires.get())) {
        entry.kill = null; // its window freed: the scope goes on
        continue;
      }
      touch(scopes, key);
      throw new AgentKilled(entry.kill);
    }
  }

  /** check for a trace of a conversation or agent: a kill of either stops it too. */
  public String checkIn(String traceId, CheckScope scope) {
    checkScopes(scope);
    return check(traceId);
  }

  /** Records signal for its trace; false when its id was already recorded. */
  public synchronized boolean deliver(Signal signal) {
    String scope = signal.scopeOrTrace();
    if (scope.equals("conversation") || scope.equals("agent")) {
      return deliverScoped(signal);
    }
    if (scope.equals("tool")) {
      return deliverTool(signal);
    }
    String traceId = Signals.normalizeTraceId(signal.traceId());
    TraceSignals entry = killed.get(traceId);
    if (entry == null) {
      entry = watched.get(traceId);
    }
    if (entry == null) {
      entry = others.get(traceId);
      if (entry == null) {
        entry = new TraceSignals();
        put(others, traceId, entry, maxTraces);
      } else {
        touch(others, traceId);
      }
    }
    if (!entry.signalIds.add(signal.signalId())) {
      duplicates++;
      return false;
    }
    delivered++;
    changed();
    switch (signal.kind()) {
      case "pause" -> {
        if (entry.kill == null) {
          entry.pause = signal;
        }
      }
      case "release" -> {
        entry.pause = null; // the operator's answer to a pause
        entry.kill = null;
        if (killed.remove(traceId) != null) {
          put(watched, traceId, entry, maxTraces);
        }
      }
      case "kill" -> {
        entry.pause = null;
        if (entry.kill == null) { // the first kill's reason is the one the agent sees
          entry.kill = signal;
        }
        if (watched.remove(traceId) != null) { // its agent checks it: keep it for good
          killed.put(traceId, entry);
        }
      }
      default -> {
        String message = signal.systemMessage() != null
            ? signal.systemMessage()
            : "spanguard: " + signal.reason()
                + ". Try a different approach or stop and report what you found.";
        entry.unread.add(new Unread(message, signal));
      }
    }
    return true;
  }

  /**
   * Throws AgentKilled if traceId is killed, AgentPaused while it is paused; else returns a
   * downgrade's message not yet read, or null.
   */
  public String check(String traceId) {
    return checked(traceId).message();
  }

  /**
   * check for a call to tool (on server; null: unknown): after the trace's kill or pause, a
   * contained tool throws ToolContained (a downgrade's message then waits for the next check).
   */
  public String check(String traceId, String tool, String server) {
    return checked(traceId, tool, server).message();
  }

  /** check, with the downgrade whose message it returns (for its span event). */
  synchronized Checked checked(String traceId) {
    return checked(traceId, null, null);
  }

  synchronized Checked checked(String traceId, String tool, String server) {
    String id = Signals.normalizeTraceId(traceId);
    TraceSignals entry = killed.get(id);
    if (entry == null) {
      entry = watched.get(id);
      if (entry != null) {
        touch(watched, id);
      } else {
        // From now on this process checks the trace: its signals are its agent's.
        entry = others.remove(id);
        if (entry == null) {
          entry = new TraceSignals();
        }
        if (entry.kill == null) {
          put(watched, id, entry, maxTraces);
        }
      }
      if (entry.kill != null) {
        watched.remove(id);
        killed.put(id, entry);
      }
    }
    if (entry.pause != null && entry.kill == null) {
      pauseOver(id, entry);
      if (entry.pause != null) {
        throw new AgentPaused(entry.pause);
      }
    }
    if (entry.kill != null) {
      throw new AgentKilled(entry.kill);
    }
    checkTool(tool, server);
    Unread unread = entry.unread.poll();
    return unread == null ? Checked.NOTHING : new Checked(unread.message(), unread.signal());
  }

  /**
   * check, and while the trace is paused, blocks until an operator answers: a release returns
   * (the agent goes on, with what check then returns), a kill throws AgentKilled; unanswered at
   * the pause's pause_until, its fallback applies (kill: AgentKilled; release: returns). After
   * timeout (null: no limit) it throws AgentPaused again.
   */
  public String await(String traceId, Duration timeout) throws InterruptedException {
    long giveUpAt = timeout == null ? Long.MAX_VALUE : System.nanoTime() + timeout.toNanos();
    while (true) {
      long seen;
      synchronized (this) {
        seen = changes; // taken before the check: a delivery after it still wakes us
      }
      try {
        return check(traceId);
      } catch (AgentPaused paused) {
        long left = giveUpAt - System.nanoTime();
        if (left <= 0) {
          throw paused;
        }
        long untilDeadline = untilMillis(paused.until());
        long waitMillis = Math.min(Math.min(untilDeadline, WAIT_RECHECK_MILLIS), left / 1_000_000);
        synchronized (this) {
          if (changes == seen && waitMillis > 0) {
            wait(waitMillis);
          }
        }
      }
    }
  }

  /** Milliseconds until the RFC 3339 moment; 0 or less once it has come. */
  private long untilMillis(String moment) {
    Optional<Instant> at = Signals.parseDateTime(moment);
    if (at.isEmpty()) {
      return 0;
    }
    return Duration.between(clock.get(), at.get()).toMillis();
  }

  /** Applies the policy's fallback to a pause past its pause_until with no answer. */
  private void pauseOver(String traceId, TraceSignals entry) {
    Signal pause = entry.pause;
    String until = pause.pauseUntil() == null ? "" : pause.pauseUntil();
    Optional<Instant> at = Signals.parseDateTime(until);
    if (at.isPresent() && clock.get().isBefore(at.get())) {
      return;
    }
    entry.pause = null;
    if ("kill".equals(pause.pauseFallback())) {
      entry.kill = pause.withKill(pause.reason() + "; paused with no answer by " + until
          + ": the policy's fallback kills");
      watched.remove(traceId);
      killed.put(traceId, entry);
    }
  }

  /** Whether a kill is recorded for traceId. */
  public synchronized boolean isKilled(String traceId) {
    String id = Signals.normalizeTraceId(traceId);
    if (killed.containsKey(id)) {
      return true;
    }
    TraceSignals entry = watched.get(id);
    if (entry == null) {
      entry = others.get(id);
    }
    return entry != null && entry.kill != null;
  }

  /** Drops everything about traceId (its agent is done with it). */
  public synchronized void forget(String traceId) {
    String id = Signals.normalizeTraceId(traceId);
    others.remove(id);
    watched.remove(id);
    killed.remove(id);
  }

  /** Signals recorded. */
  public synchronized int delivered() {
    return delivered;
  }

  /** Duplicates dropped. */
  public synchronized int duplicates() {
    return duplicates;
  }
}
