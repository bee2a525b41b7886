package dev.spanguard.killswitch;

import static org.junit.jupiter.api.Assertions.assertEquals;

import java.io.ByteArrayOutputStream;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import java.util.List;
import java.util.Map;
import org.junit.jupiter.api.Test;

/** The stop reason as one JSON line and exit status 75, alike in every language. */
class StopTest {
  @Test
  @SuppressWarnings("unchecked")
  void exitCodeIs75WithOneJsonLineAndZeroForAnythingElse() throws Exception {
    Map<String, Object> file = VectorsTest.file();
    List<Map<String, Object>> cases = VectorsTest.section(file, "stop_events");
    Signal signal = Signals.read(((String) cases.get(0).get("signal")).getBytes(StandardCharsets.UTF_8),
        VectorsTest.ring(file, List.of("current")), VectorsTest.now(file));
    ByteArrayOutputStream err = new ByteArrayOutputStream();
    RuntimeException wrapped = new RuntimeException("running tool search_docs", new AgentKilled(signal));
    assertEquals(75, Stop.exitCode(wrapped, new PrintStream(err, true, StandardCharsets.UTF_8)));
    String text = err.toString(StandardCharsets.UTF_8);
    assertEquals(1, text.chars().filter(c -> c == '\n').count(), text);
    Map<String, Object> reason = (Map<String, Object>) Json.parse(text.strip()).value();
    assertEquals(List.of("spanguard", "action", "rule", "decision_id", "scope", "trace_id", "reason"),
        List.copyOf(reason.keySet()));
    assertEquals(List.of("stopped", "kill", "tool_loop", signal.signalId(), "trace", signal.traceId(), signal.reason()),
        List.copyOf(reason.values()));
    err.reset();
    assertEquals(0, Stop.exitCode(new IllegalStateException("a bug"), new PrintStream(err)));
    assertEquals(0, err.size());
  }
}
