package dev.spanguard.killswitch;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertInstanceOf;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertTrue;
import static org.junit.jupiter.api.Assertions.fail;

import io.opentelemetry.api.baggage.Baggage;
import io.opentelemetry.api.common.Attributes;
import io.opentelemetry.api.common.AttributesBuilder;
import io.opentelemetry.api.trace.Span;
import io.opentelemetry.context.Context;
import io.opentelemetry.sdk.resources.Resource;
import io.opentelemetry.sdk.testing.exporter.InMemorySpanExporter;
import io.opentelemetry.sdk.trace.SdkTracerProvider;
import io.opentelemetry.sdk.trace.data.EventData;
import io.opentelemetry.sdk.trace.data.SpanData;
import io.opentelemetry.sdk.trace.export.SimpleSpanProcessor;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.time.Instant;
import java.util.ArrayList;
import java.util.Base64;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;
import java.util.concurrent.atomic.AtomicReference;
import java.util.stream.Stream;
import org.junit.jupiter.api.DynamicTest;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.TestFactory;

/**
 * The shared kill-signal vectors (schemas/testdata/kill-signal-vectors.json), every section the
 * Go client tests (clients/go/vectors_test.go, stop_test.go): every killswitch must reach each
 * verdict, so a record no two languages would read alike is decided alike.
 */
@SuppressWarnings("unchecked")
class VectorsTest {
  // A wait that should end on a step of `meanwhile` gets this long before it is called stuck.
  private static final Duration SAFETY_TIMEOUT = Duration.ofSeconds(10);

  static Map<String, Object> file() throws Exception {
    Path path = Path.of("..", "..", "schemas", "testdata", "kill-signal-vectors.json");
    return (Map<String, Object>) Json.parse(Files.readString(path, StandardCharsets.UTF_8)).value();
  }

  static Instant now(Map<String, Object> file) {
    return Signals.parseDateTime((String) file.get("now")).orElseThrow();
  }

  static Map<String, byte[]> ring(Map<String, Object> file, List<Object> names) {
    Map<String, Object> keys = (Map<String, Object>) file.get("keys");
    List<byte[]> chosen = new ArrayList<>();
    for (Object name : names) {
      chosen.add(((String) keys.get(name)).getBytes(StandardCharsets.UTF_8));
    }
    return Signals.keyring(chosen);
  }

  static List<Map<String, Object>> section(Map<String, Object> file, String name) {
    List<Map<String, Object>> cases = (List<Map<String, Object>>) file.get(name);
    assertTrue(cases != null && !cases.isEmpty(), "no " + name + " in the vectors");
    return cases;
  }

  @Test
  void keyIds() throws Exception {
    Map<String, Object> file = file();
    Map<String, Object> keys = (Map<String, Object>) file.get("keys");
    Map<String, Object> ids = (Map<String, Object>) file.get("key_ids");
    for (String name : keys.keySet()) {
      assertEquals(ids.get(name), Signals.keyId(((String) keys.get(name)).getBytes(StandardCharsets.UTF_8)), name);
    }
  }

  @TestFactory
  Stream<DynamicTest> vectors() throws Exception {
    Map<String, Object> file = file();
    Instant now = now(file);
    return section(file, "vectors").stream().map(vector -> DynamicTest.dynamicTest(
        (String) vector.get("name"), () -> {
          byte[] value = vector.get("value_base64") != null
              ? Base64.getDecoder().decode((String) vector.get("value_base64"))
              : ((String) vector.get("value")).getBytes(StandardCharsets.UTF_8);
          Map<String, byte[]> keys = vector.get("keys") == null
              ? null : ring(file, (List<Object>) vector.get("keys"));
          Signal signal = null;
          String verdict = "obey";
          try {
            signal = Signals.read(value, keys, now);
          } catch (BadSignal bad) {
            verdict = bad.kind();
          }
          assertEquals(vector.get("verdict"), verdict);
          if (signal == null || vector.get("signal") == null) {
            return;
          }
          Map<String, Object> got = new TreeMap<>();
          got.put("kind", signal.kind());
          got.put("trace_id", signal.traceId());
          got.put("signal_id", signal.signalId());
          got.put("rule", signal.rule());
          got.put("reason", signal.reason());
          got.put("system_message", signal.systemMessage());
          got.put("expires_at", signal.expiresAt());
          got.put("pause_until", signal.pauseUntil());
          got.put("pause_fallback", signal.pauseFallback());
          got.put("scope", signal.scope());
          got.put("conversation_id", signal.conversationId());
          got.put("agent_service", signal.agentService());
          got.put("agent_name", signal.agentName());
          if (signal.tool() != null) {
            got.put("tool", Map.of("name", signal.tool().name(), "server", signal.tool().server()));
          }
          for (Map.Entry<String, Object> want : ((Map<String, Object>) vector.get("signal")).entrySet()) {
            assertTrue(got.containsKey(want.getKey()), "unknown field " + want.getKey());
            assertEquals(want.getValue(), got.get(want.getKey()), want.getKey());
          }
        }));
  }

  /** The time of a sequence: its steps give it, nothing sleeps for it. */
  static final class TestClock {
    private final AtomicReference<Instant> now;

    TestClock(Instant start) {
      now = new AtomicReference<>(start);
    }

    Instant get() {
      return now.get();
    }

    void set(Instant at) {
      now.set(at);
    }
  }

  static CheckScope scopeOf(Map<String, Object> step) {
    String conversation = (String) step.get("conversation");
    Map<String, Object> agent = (Map<String, Object>) step.get("agent");
    return new CheckScope(conversation,
        agent == null ? null : new Agent((String) agent.get("service"), (String) agent.get("name")));
  }

  /** Fails unless a check or wait ended as step expects (outcome: a message or the error). */
  static void checkOutcome(String where, Map<String, Object> step, String message, RuntimeException error) {
    String expect = (String) step.get("expect");
    switch (expect) {
      case "contained" -> {
        ToolContained contained = assertInstanceOf(ToolContained.class, error, where + ": not contained (" + message + ")");
        if (step.get("reason") != null) {
          assertEquals(step.get("reason"), contained.reason(), where);
        }
      }
      case "killed" -> {
        assertTrue(!(error instanceof ToolContained), where + ": contained, not killed");
        AgentKilled killed = assertInstanceOf(AgentKilled.class, error, where + ": not killed (" + message + ")");
        if (step.get("reason") != null) {
          assertEquals(step.get("reason"), killed.reason(), where);
        }
      }
      case "paused" -> {
        AgentPaused paused = assertInstanceOf(AgentPaused.class, error, where + ": not paused (" + message + ")");
        if (step.get("until") != null) {
          assertEquals(step.get("until"), paused.until(), where);
          assertEquals(step.get("fallback"), paused.fallback(), where);
        }
      }
      default -> {
        if (error != null) {
          fail(where + ": " + error);
        }
        assertEquals(expect.equals("pass") ? null : expect, message, where);
      }
    }
  }

  private static double seconds(Object value) {
    return value instanceof Long n ? n : Double.parseDouble(value.toString());
  }

  @TestFactory
  Stream<DynamicTest> sequences() throws Exception {
    Map<String, Object> file = file();
    Instant start = now(file);
    Map<String, byte[]> keys = ring(file, List.of("current"));
    return section(file, "sequences").stream().map(sequence -> DynamicTest.dynamicTest(
        (String) sequence.get("name"), () -> {
          TestClock clock = new TestClock(start);
          SignalBook book = new SignalBook(0, clock::get);
          Map<String, Object> signals = (Map<String, Object>) sequence.get("signals");
          List<Map<String, Object>> steps = (List<Map<String, Object>>) sequence.get("steps");
          for (int i = 0; i < steps.size(); i++) {
            runStep("step " + i, steps.get(i), book, clock, signals, keys);
          }
        }));
  }

  @TestFactory
  Stream<DynamicTest> toolSequences() throws Exception {
    Map<String, Object> file = file();
    Instant start = now(file);
    Map<String, byte[]> keys = ring(file, List.of("current"));
    return section(file, "tool_sequences").stream().map(sequence -> DynamicTest.dynamicTest(
        (String) sequence.get("name"), () -> {
          TestClock clock = new TestClock(start);
          SignalBook book = new SignalBook(0, clock::get);
          Map<String, Object> signals = (Map<String, Object>) sequence.get("signals");
          List<Map<String, Object>> steps = (List<Map<String, Object>>) sequence.get("steps");
          long refused = 0;
          for (int i = 0; i < steps.size(); i++) {
            Map<String, Object> step = steps.get(i);
            String where = "step " + i;
            if (step.get("check") == null) {
              runStep(where, step, book, clock, signals, keys);
              continue;
            }
            String message = null;
            RuntimeException error = null;
            try {
              message = book.check((String) step.get("check"), (String) step.get("tool"), (String) step.get("server"));
            } catch (AgentStopped stopped) {
              error = stopped;
            }
            checkOutcome(where, step, message, error);
            if (error instanceof ToolContained contained) {
              refused++;
              assertEquals(step.get("tool"), contained.tool(), where);
              assertTrue(contained.getMessage().startsWith("tool " + step.get("tool") + " is contained by spanguard"), where);
            }
          }
          assertEquals(refused, book.toolCallsRefused());
        }));
  }

  private static void runStep(String where, Map<String, Object> step, SignalBook book, TestClock clock,
      Map<String, Object> signals, Map<String, byte[]> keys) throws Exception {
    if (step.get("clock") != null) {
      clock.set(Signals.parseDateTime((String) step.get("clock")).orElseThrow());
    } else if (step.get("deliver") != null) {
      Signal signal = Signals.read(((String) signals.get(step.get("deliver"))).getBytes(StandardCharsets.UTF_8), keys, clock.get());
      assertEquals(step.get("new"), book.deliver(signal), where + ": deliver " + step.get("deliver"));
    } else if (step.get("check") != null) {
      String message = null;
      RuntimeException error = null;
      try {
        message = book.checkIn((String) step.get("check"), scopeOf(step));
      } catch (AgentStopped stopped) {
        error = stopped;
      }
      checkOutcome(where, step, message, error);
    } else if (step.get("meanwhile") == null) {
      String message = null;
      RuntimeException error = null;
      try {
        message = book.await((String) step.get("wait"), Duration.ofMillis((long) (seconds(step.get("timeout")) * 1000)));
      } catch (AgentStopped stopped) {
        error = stopped;
      }
      checkOutcome(where, step, message, error);
    } else {
      AtomicReference<String> message = new AtomicReference<>();
      AtomicReference<RuntimeException> error = new AtomicReference<>();
      Thread waiter = new Thread(() -> {
        try {
          message.set(book.await((String) step.get("wait"), SAFETY_TIMEOUT));
        } catch (AgentStopped stopped) {
          error.set(stopped);
        } catch (InterruptedException e) {
          error.set(new IllegalStateException(e));
        }
      });
      waiter.start();
      Thread.sleep(50); // let it block; either order ends it the same way
      List<Map<String, Object>> meanwhile = (List<Map<String, Object>>) step.get("meanwhile");
      for (int i = 0; i < meanwhile.size(); i++) {
        runStep(where + " meanwhile " + i, meanwhile.get(i), book, clock, signals, keys);
      }
      waiter.join();
      checkOutcome(where, step, message.get(), error.get());
    }
  }

  /** A provider with a processor: the SDK starts no real span for a provider without one. */
  static io.opentelemetry.sdk.trace.SdkTracerProviderBuilder recordingProvider() {
    return SdkTracerProvider.builder().addSpanProcessor(SimpleSpanProcessor.create(InMemorySpanExporter.create()));
  }

  static Resource resourceOf(Map<String, Object> entries) {
    AttributesBuilder attributes = Attributes.builder();
    for (Map.Entry<String, Object> entry : entries.entrySet()) {
      attributes.put(entry.getKey(), (String) entry.getValue());
    }
    // Resource.create merges nothing in: exactly these attributes.
    return Resource.create(attributes.build());
  }

  static Agent agentOf(Object entry) {
    if (entry == null) {
      return null;
    }
    Map<String, Object> agent = (Map<String, Object>) entry;
    return new Agent((String) agent.get("service"), (String) agent.get("name"));
  }

  @TestFactory
  Stream<DynamicTest> scopeResolution() throws Exception {
    Map<String, Object> file = file();
    List<Map<String, Object>> cases = section(file, "scope_resolution");
    assertTrue(cases.stream().filter(c -> c.get("span_resource") != null).count() >= 3,
        "scope cases with an active span");
    return cases.stream().map(c -> DynamicTest.dynamicTest((String) c.get("name"), () -> {
      Map<String, Object> given = (Map<String, Object>) c.get("given");
      Map<String, Object> settings = (Map<String, Object>) c.get("switch");
      KillSwitch.ScopeDefaults defaults = KillSwitch.ScopeDefaults.of(
          (String) settings.get("conversation"), agentOf(settings.get("agent")),
          resourceOf((Map<String, Object>) settings.get("resource")));
      var baggage = Baggage.builder();
      ((Map<String, Object>) c.get("baggage")).forEach((key, value) -> baggage.put(key, (String) value));
      Context context = Context.root().with(baggage.build());
      SdkTracerProvider provider = null;
      Span span = null;
      if (c.get("span_resource") != null) {
        provider = recordingProvider()
            .setResource(resourceOf((Map<String, Object>) c.get("span_resource"))).build();
        span = provider.get("test").spanBuilder("invoke_agent").setParent(context).startSpan();
        context = context.with(span);
      }
      try {
        CheckScope got = defaults.resolve(context, new CheckScope(
            (String) given.get("conversation"), agentOf(given.get("agent"))));
        Map<String, Object> expect = (Map<String, Object>) c.get("expect");
        String conversation = (String) expect.get("conversation");
        assertEquals(conversation == null ? "" : conversation, got.conversationId());
        assertEquals(agentOf(expect.get("agent")), got.agent());
      } finally {
        if (span != null) {
          span.end();
          provider.close();
        }
      }
    }));
  }

  @TestFactory
  Stream<DynamicTest> unguardedChecks() throws Exception {
    Map<String, Object> file = file();
    Instant now = now(file);
    Map<String, byte[]> keys = ring(file, List.of("current"));
    List<DynamicTest> tests = new ArrayList<>();
    for (Map<String, Object> sequence : section(file, "unguarded_checks")) {
      for (String method : List.of("check", "checkIn")) {
        tests.add(DynamicTest.dynamicTest(method + ": " + sequence.get("name"), () -> {
          SignalBook book = new SignalBook(0, () -> now);
          List<String> logged = new ArrayList<>();
          KillSwitch k = new KillSwitch(book, logged::add, KillSwitch.ScopeDefaults.of(null, null, null));
          Map<String, Object> signals = (Map<String, Object>) sequence.get("signals");
          List<Map<String, Object>> steps = (List<Map<String, Object>>) sequence.get("steps");
          for (int i = 0; i < steps.size(); i++) {
            Map<String, Object> step = steps.get(i);
            String where = "step " + i;
            if (step.get("deliver") != null) {
              Signal signal = Signals.read(((String) signals.get(step.get("deliver"))).getBytes(StandardCharsets.UTF_8), keys, now);
              assertEquals(step.get("new"), book.deliver(signal), where);
              continue;
            }
            CheckScope scope = scopeOf(step);
            String traceId = (String) step.get("check");
            String message = null;
            RuntimeException error = null;
            try {
              message = method.equals("check") && scope.conversationId().isEmpty() && scope.agent() == null
                  ? k.check(traceId)
                  : k.checkIn(traceId, scope);
            } catch (AgentStopped stopped) {
              error = stopped;
            }
            checkOutcome(where, step, message, error);
            assertEquals(((Long) step.get("unguarded")).longValue(), k.unguarded(), where + ": unguarded()");
            assertEquals(((Long) step.get("warnings")).intValue(), logged.size(), where + ": warnings");
          }
          if (!logged.isEmpty()) {
            assertTrue(logged.get(0).contains("NOT guarded"), logged.get(0));
          }
        }));
      }
    }
    return tests.stream();
  }

  @TestFactory
  Stream<DynamicTest> stopEvents() throws Exception {
    Map<String, Object> file = file();
    Instant now = now(file);
    Map<String, byte[]> keys = ring(file, List.of("current"));
    List<Map<String, Object>> cases = section(file, "stop_events");
    assertTrue(cases.size() >= 3, "stop_events");
    return cases.stream().map(c -> DynamicTest.dynamicTest((String) c.get("name"), () -> {
      InMemorySpanExporter exporter = InMemorySpanExporter.create();
      SdkTracerProvider provider = SdkTracerProvider.builder()
          .addSpanProcessor(SimpleSpanProcessor.create(exporter)).build();
      SignalBook book = new SignalBook(0, () -> now);
      KillSwitch k = new KillSwitch(book, message -> { }, KillSwitch.ScopeDefaults.of(null, null, null));
      book.deliver(Signals.read(((String) c.get("signal")).getBytes(StandardCharsets.UTF_8), keys, now));
      Span span = provider.get("agent").spanBuilder("step").startSpan();
      Map<String, Object> check = (Map<String, Object>) c.get("check");
      Map<String, Object> event = (Map<String, Object>) c.get("event");
      Map<String, Object> attributes = (Map<String, Object>) event.get("attributes");
      for (int i = 0; i < 2; i++) { // the same check again adds no second event
        try {
          String message = k.checkIn(Context.root().with(span), (String) check.get("trace"),
              new CheckScope((String) check.get("conversation"), null), "checkContext");
          if (message != null) { // handed over once: the second check returns none
            assertEquals("message", c.get("expect"));
          }
        } catch (AgentKilled killed) {
          assertEquals("killed", c.get("expect"));
          assertEquals(List.of(attributes.get("spanguard.rule"), attributes.get("spanguard.action"),
                  attributes.get("spanguard.decision_id"), attributes.get("spanguard.scope"),
                  attributes.get("spanguard.reason")),
              List.of(killed.rule(), killed.action(), killed.decisionId(), killed.scope(), killed.reason()));
        }
      }
      span.end();
      List<SpanData> spans = exporter.getFinishedSpanItems();
      assertEquals(1, spans.size());
      List<EventData> events = spans.get(0).getEvents();
      assertEquals(1, events.size(), "events " + events);
      assertEquals(event.get("name"), events.get(0).getName());
      Map<String, Object> got = new TreeMap<>();
      events.get(0).getAttributes().forEach((key, value) -> got.put(key.getKey(), value));
      assertEquals(new TreeMap<>(attributes), got);
      provider.close();
    }));
  }

  @Test
  void expiryIsExactToTheMicrosecond() {
    Instant expires = Signals.parseDateTime("2026-06-01T12:00:00.000001Z").orElseThrow();
    assertTrue(Instant.parse("2026-06-01T12:00:00Z").isBefore(expires));
  }

  @Test
  void checkContextWithoutASpanIsCountedAndWarnedOnce() {
    List<String> logged = new ArrayList<>();
    KillSwitch k = new KillSwitch(new SignalBook(), logged::add, KillSwitch.ScopeDefaults.of(null, null, null));
    for (int i = 0; i < 3; i++) {
      assertNull(k.checkContext(Context.root()));
    }
    assertEquals(3, k.unguarded());
    assertEquals(1, logged.size());
    assertTrue(logged.get(0).contains("checkContext found no trace"), logged.get(0));
    assertNull(k.check(""));
    assertEquals(4, k.unguarded());
    assertEquals(2, logged.size());
    SdkTracerProvider provider = recordingProvider().build();
    Span span = provider.get("test").spanBuilder("invoke_agent").startSpan();
    assertNull(k.checkContext(Context.root().with(span)));
    assertEquals(4, k.unguarded(), "with a span: not unguarded");
    span.end();
    provider.close();
  }
}
