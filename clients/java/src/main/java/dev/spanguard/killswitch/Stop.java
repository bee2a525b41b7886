package dev.spanguard.killswitch;

import io.opentelemetry.api.common.Attributes;
import io.opentelemetry.api.trace.Span;
import io.opentelemetry.api.trace.SpanContext;
import java.io.PrintStream;
import java.util.LinkedHashMap;
import java.util.Map;

/**
 * Why an agent stopped, machine-readable (as killswitch/stop.py, stop.js and clients/go/stop.go):
 * on obeying a kill, a pause or a downgrade, a check adds an event to the current span,
 * "spanguard.stop" (kill, pause) or "spanguard.downgrade", with spanguard.rule, spanguard.action,
 * spanguard.decision_id, spanguard.scope and spanguard.reason (the shared vectors' stop_events
 * keep the languages alike). An agent run as a process exits with EXIT_KILLED (75) after one
 * JSON line on stderr: {@link #exitOnStop} does both.
 */
public final class Stop {
  public static final String STOP_EVENT = "spanguard.stop";
  public static final String DOWNGRADE_EVENT = "spanguard.downgrade";
  /** EX_TEMPFAIL in sysexits.h: the work was not done, and may be retried once released. */
  public static final int EXIT_KILLED = 75;

  // Spans already told of a decision: a paused agent re-checks while it waits; one event says it.
  private static final int MAX_RECORDED = 10_000;
  private static final LinkedHashMap<String, Boolean> RECORDED =
      new LinkedHashMap<>(16, 0.75f, false) {
        @Override
        protected boolean removeEldestEntry(Map.Entry<String, Boolean> eldest) {
          return size() > MAX_RECORDED;
        }
      };

  private Stop() {}

  /** The attributes of a signal's span event. */
  public static Attributes attributes(Signal signal) {
    return Attributes.builder()
        .put("spanguard.rule", signal.rule())
        .put("spanguard.action", signal.kind())
        .put("spanguard.decision_id", signal.signalId()) // the worker's decision_id
        .put("spanguard.scope", signal.scopeOrTrace())
        .put("spanguard.reason", signal.reason())
        .build();
  }

  /** The event a signal leaves: spanguard.downgrade or spanguard.stop. */
  public static String eventName(Signal signal) {
    return signal.kind().equals("downgrade") ? DOWNGRADE_EVENT : STOP_EVENT;
  }

  /** Adds the signal's event to span, once per span and decision; false when not recording. */
  static boolean record(Span span, Signal signal) {
    if (span == null || !span.isRecording()) {
      return false;
    }
    SpanContext context = span.getSpanContext();
    String key = context.getTraceId() + context.getSpanId() + signal.signalId();
    synchronized (RECORDED) {
      if (RECORDED.putIfAbsent(key, Boolean.TRUE) != null) {
        return false;
      }
    }
    span.addEvent(eventName(signal), attributes(signal));
    return true;
  }

  /** The one-line JSON a stopped agent writes to stderr, alike in every language. */
  public static String reasonLine(AgentStopped stopped) {
    Signal signal = stopped.signal();
    StringBuilder out = new StringBuilder("{");
    String[][] fields = {
      {"spanguard", "stopped"}, {"action", stopped.action()}, {"rule", signal.rule()},
      {"decision_id", signal.signalId()}, {"scope", signal.scopeOrTrace()},
      {"trace_id", signal.traceId()}, {"reason", signal.reason()},
    };
    for (int i = 0; i < fields.length; i++) {
      if (i > 0) {
        out.append(',');
      }
      Json.quote(out, fields[i][0]);
      out.append(':');
      Json.quote(out, fields[i][1]);
    }
    return out.append('}').toString();
  }

  /** The AgentKilled or AgentPaused in error's cause chain, or null. */
  public static AgentStopped find(Throwable error) {
    for (Throwable at = error; at != null; at = at.getCause()) {
      if (at instanceof AgentStopped stopped) {
        return stopped;
      }
      if (at.getCause() == at) {
        break;
      }
    }
    return null;
  }

  /**
   * Writes error's stop reason to err as one JSON line and returns EXIT_KILLED when the guard
   * stopped the agent; else returns 0 and writes nothing.
   */
  public static int exitCode(Throwable error, PrintStream err) {
    AgentStopped stopped = find(error);
    if (stopped == null) {
      return 0;
    }
    err.println(reasonLine(stopped));
    err.flush();
    return EXIT_KILLED;
  }

  /** Exits with EXIT_KILLED after the JSON line when error says the guard stopped the agent. */
  public static void exitOnStop(Throwable error) {
    int code = exitCode(error, System.err);
    if (code != 0) {
      System.exit(code);
    }
  }
}
