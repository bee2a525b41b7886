package dev.spanguard.killswitch;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertInstanceOf;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;
import static org.junit.jupiter.api.Assertions.fail;

import io.opentelemetry.api.baggage.Baggage;
import io.opentelemetry.api.common.Attributes;
import io.opentelemetry.api.trace.Span;
import io.opentelemetry.context.Context;
import io.opentelemetry.sdk.resources.Resource;
import io.opentelemetry.sdk.testing.exporter.InMemorySpanExporter;
import io.opentelemetry.sdk.trace.SdkTracerProvider;
import io.opentelemetry.sdk.trace.export.SimpleSpanProcessor;
import java.nio.charset.StandardCharsets;
import java.security.SecureRandom;
import java.time.Duration;
import java.time.Instant;
import java.time.temporal.ChronoUnit;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashMap;
import java.util.HexFormat;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.Set;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicReference;
import java.util.function.BooleanSupplier;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.NewTopic;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.KafkaException;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;
import org.apache.kafka.common.serialization.ByteArraySerializer;
import org.junit.jupiter.api.AfterEach;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;

/**
 * The KillSwitch against a real broker: SPANGUARD_TEST_BOOTSTRAP, else scripts/kafka.sh's
 * 127.0.0.1:9092 (`make kafka-up`). A topic of its own per test, three partitions.
 */
class KafkaTest {
  static final String TEST_KEY = "java-killswitch-test-key-000001";
  private static final SecureRandom RANDOM = new SecureRandom();
  private static final DateTimeFormat TIME = new DateTimeFormat();
  static final int MAX_RECORD_BYTES = 8 << 20;

  private String topic;
  private String ackTopic;
  private Admin admin;
  private KafkaProducer<byte[], byte[]> producer;
  private final List<KillSwitch> switches = new ArrayList<>();

  static String bootstrap() {
    String servers = System.getenv("SPANGUARD_TEST_BOOTSTRAP");
    return servers == null || servers.isEmpty() ? "127.0.0.1:9092" : servers;
  }

  static String randomHex(int bytes) {
    byte[] buffer = new byte[bytes];
    RANDOM.nextBytes(buffer);
    return HexFormat.of().formatHex(buffer);
  }

  /** Microseconds, UTC, as the worker writes. */
  static final class DateTimeFormat {
    String format(Instant at) {
      return at.truncatedTo(ChronoUnit.MICROS).toString();
    }
  }

  @BeforeEach
  void setUp() throws Exception {
    Properties properties = Security.fromEnv().properties();
    properties.put("bootstrap.servers", bootstrap());
    admin = Admin.create(properties);
    topic = "java-killswitch-" + randomHex(4);
    ackTopic = topic + "-acks";
    // Records of megabytes fit: whoever can write the topic can send them.
    NewTopic signals = new NewTopic(topic, 3, (short) 1)
        .configs(Map.of("max.message.bytes", String.valueOf(MAX_RECORD_BYTES)));
    admin.createTopics(List.of(signals, new NewTopic(ackTopic, 1, (short) 1)))
        .all().get(20, TimeUnit.SECONDS); // fails here when the broker is down: make kafka-up
    properties.put("key.serializer", ByteArraySerializer.class.getName());
    properties.put("value.serializer", ByteArraySerializer.class.getName());
    properties.put("max.request.size", String.valueOf(MAX_RECORD_BYTES));
    producer = new KafkaProducer<>(properties);
  }

  @AfterEach
  void tearDown() throws Exception {
    for (KillSwitch k : switches) {
      k.close();
    }
    producer.close();
    admin.deleteTopics(List.of(topic, ackTopic)).all().get(10, TimeUnit.SECONDS);
    admin.close();
  }

  KillSwitch.Builder builder() {
    return KillSwitch.builder().brokers(bootstrap()).topic(topic).ackTopic(ackTopic).log(message -> { });
  }

  KillSwitch started(KillSwitch.Builder builder) {
    KillSwitch k = builder.start();
    switches.add(k);
    return k;
  }

  void send(int partition, byte[] value) throws Exception {
    producer.send(new ProducerRecord<>(topic, partition, null, value)).get(10, TimeUnit.SECONDS);
  }

  static byte[] signal(String traceId, String key, Map<String, Object> changes) {
    Instant now = Instant.now();
    Map<String, Object> record = new LinkedHashMap<>();
    record.put("schema_version", 2L);
    record.put("signal_id", randomHex(16));
    record.put("trace_id", traceId);
    record.put("kind", "kill");
    record.put("rule", "tool_loop");
    record.put("reason", "search_docs called 4x in last 4 steps");
    record.put("evidence", Map.of("span_id", randomHex(8), "hits", 4L));
    Map<String, Object> agent = new HashMap<>();
    agent.put("service", "java-agent");
    agent.put("name", null);
    record.put("agent", agent);
    record.put("detected_at", TIME.format(now));
    record.put("expires_at", TIME.format(now.plus(Duration.ofHours(1))));
    record.put("system_message", null);
    record.putAll(changes);
    if (key != null) {
      record = Signals.sign(record, key.getBytes(StandardCharsets.UTF_8));
    }
    return Json.canonicalBytes(record);
  }

  static Map<String, Object> changes(Object... pairs) {
    Map<String, Object> out = new LinkedHashMap<>();
    for (int i = 0; i < pairs.length; i += 2) {
      out.put((String) pairs[i], pairs[i + 1]);
    }
    return out;
  }

  static void until(BooleanSupplier condition, String what) throws InterruptedException {
    until(condition, what, Duration.ofSeconds(20));
  }

  static void until(BooleanSupplier condition, String what, Duration timeout) throws InterruptedException {
    long deadline = System.nanoTime() + timeout.toNanos();
    while (!condition.getAsBoolean()) {
      if (System.nanoTime() > deadline) {
        fail("timed out waiting for " + what);
      }
      Thread.sleep(20);
    }
  }

  Set<String> groups() throws Exception {
    Set<String> ids = new java.util.HashSet<>();
    admin.listConsumerGroups().all().get(10, TimeUnit.SECONDS).forEach(g -> ids.add(g.groupId()));
    return ids;
  }

  @Test
  void refusesToStartWithoutAKeyOrWithBoth() {
    assertThrows(IllegalArgumentException.class, () -> KillSwitch.builder().brokers(bootstrap()).start());
    assertThrows(IllegalArgumentException.class,
        () -> KillSwitch.builder().brokers(bootstrap()).signingKey(TEST_KEY).allowUnsigned().start());
  }

  @Test
  void everyPartitionFromItsEndWithoutAGroupBadRecordsCostOnlyThemselves() throws Exception {
    String early = randomHex(16);
    send(0, signal(early, TEST_KEY, Map.of())); // before start: another process's
    Set<String> groupsBefore = groups();
    KillSwitch k = started(builder().signingKey(TEST_KEY));
    String killed = randomHex(16);
    String steered = randomHex(16);
    List<byte[]> junk = List.of(
        new byte[] {(byte) 0xff, (byte) 0xfe},
        "not json".getBytes(StandardCharsets.UTF_8),
        "{\"a\":1,\"a\":2}".getBytes(StandardCharsets.UTF_8),
        signal(killed, "an-other-key-of-enough-length", Map.of()),
        new String(signal(killed, TEST_KEY, Map.of()), StandardCharsets.UTF_8)
            .replace("search_docs called", "tampered").getBytes(StandardCharsets.UTF_8),
        signal(killed, null, Map.of()),
        signal(killed, TEST_KEY, changes("expires_at", "2020-01-01T00:00:00Z")));
    for (int i = 0; i < junk.size(); i++) {
      send(i % 3, junk.get(i));
    }
    String message = "You called search_docs 4 times; try something else.";
    send(1, signal(steered, TEST_KEY, changes("kind", "downgrade", "system_message", message)));
    send(2, signal(killed, TEST_KEY, Map.of()));
    until(() -> k.received() == junk.size() + 2, "every record");
    for (int i = 0; i < 2; i++) { // remembered
      assertThrows(AgentKilled.class, () -> k.check(killed), "ignored " + k.ignored());
    }
    assertEquals(message, k.check(steered));
    assertNull(k.check(steered), "a downgrade's message is handed over once");
    assertNull(k.check(early), "a signal sent before start was seen");
    Map<String, Integer> ignored = new HashMap<>(k.ignored());
    ignored.remove("consumer_error");
    assertEquals(Map.of("not_utf8", 1, "not_json", 2, "unknown_key", 1, "forged", 1, "unsigned", 1, "expired", 1), ignored);
    assertEquals(List.of(3, 3, 1), List.of(k.malformed(), k.rejected(), k.expired()));
    assertEquals(groupsBefore, groups(), "a consumer group appeared");
    // The reader goes on after all that junk.
    String later = randomHex(16);
    send(0, signal(later, TEST_KEY, Map.of()));
    until(() -> k.signals().isKilled(later), "a kill after the junk");
  }

  /** Records of megabytes are refused unread (too_large); the reader goes on to the next. */
  @Test
  void signalsOfMegabytesAreCountedAndTheNextKillStillArrives() throws Exception {
    KillSwitch k = started(builder().signingKey(TEST_KEY));
    String padded = randomHex(16);
    byte[] junk = new byte[5 << 20];
    Arrays.fill(junk, (byte) '{');
    // A valid signature over a reason of 3 MB: too large all the same.
    send(0, signal(padded, TEST_KEY, changes("reason", "x".repeat(3 << 20))));
    send(1, junk);
    send(2, "[".repeat(2 << 20).getBytes(StandardCharsets.UTF_8));
    String later = randomHex(16);
    send(0, signal(later, TEST_KEY, Map.of()));
    until(() -> k.received() == 4, "the big records and the kill after them");
    assertTrue(k.signals().isKilled(later), "the kill after the big records: ignored " + k.ignored());
    assertNull(k.check(padded), "a signal over the size limit was obeyed");
    Map<String, Integer> ignored = new HashMap<>(k.ignored());
    ignored.remove("consumer_error");
    assertEquals(Map.of("too_large", 3), ignored);
    assertEquals(3, k.malformed());
  }

  /**
   * A kill topic that is not there fails the start within its timeout, naming the topic, and
   * is not created: a topic made by a typo would be read by no worker.
   */
  @Test
  void aTopicThatIsNotThereFailsTheStartAndIsNotCreated() throws Exception {
    String missing = topic + "-missing";
    long started = System.nanoTime();
    var error = assertThrows(KafkaException.class,
        () -> started(builder().topic(missing).signingKey(TEST_KEY).startTimeout(Duration.ofSeconds(3))));
    long tookMillis = (System.nanoTime() - started) / 1_000_000;
    assertTrue(error.getMessage().contains(missing) && error.getMessage().contains("not found"),
        error.getMessage());
    assertTrue(tookMillis < 15_000, "the start took " + tookMillis + " ms");
    if (admin.listTopics().names().get(10, TimeUnit.SECONDS).contains(missing)) {
      admin.deleteTopics(List.of(missing)).all().get(10, TimeUnit.SECONDS);
      fail("starting on a missing topic created it");
    }
  }

  @Test
  void releaseAndRotation() throws Exception {
    String previous = "previous-key-still-accepted-01";
    KillSwitch k = started(builder().signingKey(TEST_KEY).signingKey(previous));
    String trace = randomHex(16);
    assertNull(k.check(trace));
    byte[] kill = signal(trace, previous, Map.of()); // rotation: signed with the old key
    send(0, kill);
    until(() -> k.signals().isKilled(trace), "the kill");
    send(1, signal(trace, TEST_KEY, changes("kind", "release", "rule", "manual", "operator",
        "oncall@example.com", "reason", "released", "evidence", Map.of("span_id", "0".repeat(16)))));
    send(2, kill); // redelivered old kill: a duplicate
    until(() -> k.received() == 3, "release and redelivery");
    assertNull(k.check(trace), "still killed after release");
    send(0, signal(trace, TEST_KEY, changes("reason", "killed again")));
    until(() -> k.received() == 4, "the second kill");
    AgentKilled again = assertThrows(AgentKilled.class, () -> k.check(trace.toUpperCase()));
    assertTrue(again.getMessage().contains("killed again"), again.getMessage());
  }

  @Test
  void pauseThenReleaseEndsTheWaitAndAStretchedPauseIsForged() throws Exception {
    KillSwitch k = started(builder().signingKey(TEST_KEY));
    String trace = randomHex(16);
    String other = randomHex(16);
    assertNull(k.check(trace));
    String pauseUntil = TIME.format(Instant.now().plus(Duration.ofMinutes(10)));
    Map<String, Object> pause = changes("kind", "pause", "pause_until", pauseUntil, "pause_fallback", "kill");
    // Signed for a short pause, then stretched: the deadline is inside the signature.
    String stretched = new String(signal(other, TEST_KEY, pause), StandardCharsets.UTF_8)
        .replace(pauseUntil, "2099-01-01T00:00:00Z");
    send(2, stretched.getBytes(StandardCharsets.UTF_8));
    send(0, signal(trace, TEST_KEY, pause));
    until(() -> k.received() == 2, "the pauses");
    assertEquals(1, k.ignored().get("forged"));
    assertNull(k.check(other), "a forged pause was obeyed");
    AgentPaused paused = assertThrows(AgentPaused.class, () -> k.check(trace));
    assertEquals(List.of(pauseUntil, "kill"), List.of(paused.until(), paused.fallback()));
    AtomicReference<Object> result = new AtomicReference<>();
    Thread waiter = new Thread(() -> {
      try {
        result.set(String.valueOf(k.await(trace, Duration.ofSeconds(30))));
      } catch (Exception e) {
        result.set(e);
      }
    });
    waiter.start();
    waiter.join(300);
    assertTrue(waiter.isAlive(), "the wait ended before any answer: " + result.get());
    long sent = System.nanoTime();
    send(1, signal(trace, TEST_KEY, changes("kind", "release", "rule", "manual", "operator",
        "oncall@example.com", "reason", "looked fine", "evidence", Map.of("span_id", "0".repeat(16)))));
    waiter.join(20_000);
    assertEquals("null", result.get(), "the wait did not end on the release");
    System.out.printf("the wait returned %d ms after the release was sent%n",
        (System.nanoTime() - sent) / 1_000_000);
    assertNull(k.check(trace));
  }

  @Test
  void conversationAndAgentKillsStopTheirScopeOnlyUntilReleased() throws Exception {
    KillSwitch k = started(builder().signingKey(TEST_KEY).agent(new Agent("java-agent", "triage")));
    String conversation = "conv-" + randomHex(4);
    String noTrace = "0".repeat(32);
    Map<String, Object> manual = changes("rule", "manual", "operator", "alice", "evidence", Map.of("span_id", "0".repeat(16)));
    Map<String, Object> conversationKill = new LinkedHashMap<>(manual);
    conversationKill.putAll(changes("scope", "conversation", "conversation_id", conversation));
    Map<String, Object> agentKill = new LinkedHashMap<>(manual);
    agentKill.putAll(changes("scope", "agent", "agent", Map.of("service", "java-agent", "name", "triage")));
    send(0, signal(noTrace, TEST_KEY, conversationKill));
    send(1, signal(noTrace, TEST_KEY, agentKill));
    until(() -> k.received() >= 2, "the scoped kills");
    assertEquals("agent", assertThrows(AgentKilled.class, () -> k.check(randomHex(16))).scope());
    Agent billing = new Agent("java-agent", "billing");
    assertEquals("conversation",
        assertThrows(AgentKilled.class, () -> k.checkIn(randomHex(16), new CheckScope(conversation, billing))).scope());
    assertNull(k.checkIn(randomHex(16), new CheckScope("another", billing)));
    Map<String, Object> release = new LinkedHashMap<>(agentKill);
    release.putAll(changes("kind", "release", "detected_at", TIME.format(Instant.now().plusSeconds(1))));
    send(2, signal(noTrace, TEST_KEY, release));
    until(() -> k.received() >= 3, "the release");
    assertNull(k.check(randomHex(16)), "after the release");
  }

  /**
   * What an instrumented Java agent has: a tracer provider with its resource, baggage naming its
   * conversation, the agent span current. The stop is an event on that span, and the kill is
   * acknowledged, signed, on the ack topic.
   */
  @Test
  void checkCurrentFindsBaggageAndResourceRecordsTheStopAndAcknowledges() throws Exception {
    InMemorySpanExporter exporter = InMemorySpanExporter.create();
    SdkTracerProvider provider = SdkTracerProvider.builder()
        .setResource(Resource.create(Attributes.builder().put("service.name", "java-otel-agent")
            .put("gen_ai.agent.name", "triage").build()))
        .addSpanProcessor(SimpleSpanProcessor.create(exporter)).build();
    KillSwitch k = started(builder().signingKey(TEST_KEY));
    String conversation = "conv-" + randomHex(4);
    Context context = Context.root().with(Baggage.builder().put("gen_ai.conversation.id", conversation).build());
    Span span = provider.get("test").spanBuilder("invoke_agent triage").setParent(context).startSpan();
    String traceId = span.getSpanContext().getTraceId();
    try (var scope = context.with(span).makeCurrent()) {
      assertNull(k.checkCurrent());
      send(0, signal(traceId, TEST_KEY, changes("reason", "search_docs looped")));
      until(() -> k.received() >= 1, "the kill");
      AgentKilled killed = assertThrows(AgentKilled.class, k::checkCurrent);
      assertEquals("trace", killed.scope());
      assertThrows(AgentKilled.class, k::checkCurrent);
    }
    span.end();
    var events = exporter.getFinishedSpanItems().get(0).getEvents();
    assertEquals(1, events.size(), "one event per decision");
    assertEquals(Stop.STOP_EVENT, events.get(0).getName());
    assertEquals("search_docs looped", events.get(0).getAttributes().get(io.opentelemetry.api.common.AttributeKey.stringKey("spanguard.reason")));
    // Every agent of the service: this one, named by the resource of its span.
    Map<String, Object> agentKill = changes("rule", "manual", "operator", "alice", "evidence",
        Map.of("span_id", "0".repeat(16)), "scope", "agent", "agent", new HashMap<>(Map.of("service", "java-otel-agent")));
    ((Map<String, Object>) agentKill.get("agent")).put("name", null);
    send(1, signal("0".repeat(32), TEST_KEY, agentKill));
    until(() -> k.received() >= 2, "the agent kill");
    Span other = provider.get("test").spanBuilder("invoke_agent other").setNoParent().startSpan();
    assertEquals("agent", assertThrows(AgentKilled.class, () -> k.checkContext(Context.root().with(other))).scope());
    other.end();
    assertNull(k.check(randomHex(16)), "no context, no resource: the agent is unknown");
    // The ack of the trace kill: signed with the current key, keyed by the trace id.
    Map<String, Object> ack = readAck(traceId);
    assertEquals(List.of("ack", "kill", "valid"), List.of(ack.get("kind"), ack.get("action"),
        Signals.verify(ack, Signals.keyring(List.of(TEST_KEY.getBytes(StandardCharsets.UTF_8))))));
    assertTrue(((String) ack.get("obeyed_at")).matches("\\d{4}-\\d\\d-\\d\\dT\\d\\d:\\d\\d:\\d\\d\\.\\d{3}\\+00:00"), (String) ack.get("obeyed_at"));
    provider.close();
  }

  @SuppressWarnings("unchecked")
  Map<String, Object> readAck(String traceId) throws Exception {
    Properties properties = Security.fromEnv().properties();
    properties.put("bootstrap.servers", bootstrap());
    properties.put("key.deserializer", ByteArrayDeserializer.class.getName());
    properties.put("value.deserializer", ByteArrayDeserializer.class.getName());
    try (KafkaConsumer<byte[], byte[]> consumer = new KafkaConsumer<>(properties)) {
      TopicPartition partition = new TopicPartition(ackTopic, 0);
      consumer.assign(List.of(partition));
      consumer.seekToBeginning(List.of(partition));
      long deadline = System.nanoTime() + Duration.ofSeconds(20).toNanos();
      while (System.nanoTime() < deadline) {
        for (ConsumerRecord<byte[], byte[]> record : consumer.poll(Duration.ofMillis(200))) {
          if (traceId.equals(new String(record.key(), StandardCharsets.UTF_8))) {
            return (Map<String, Object>) Json.parse(new String(record.value(), StandardCharsets.UTF_8)).value();
          }
        }
      }
    }
    throw new AssertionError("no ack for " + traceId + " on " + ackTopic);
  }
}
