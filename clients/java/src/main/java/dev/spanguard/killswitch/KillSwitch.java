package dev.spanguard.killswitch;

import io.opentelemetry.api.baggage.Baggage;
import io.opentelemetry.api.common.AttributeKey;
import io.opentelemetry.api.trace.Span;
import io.opentelemetry.api.trace.SpanContext;
import io.opentelemetry.context.Context;
import io.opentelemetry.sdk.resources.Resource;
import io.opentelemetry.sdk.trace.ReadableSpan;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.time.Instant;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.Set;
import java.util.concurrent.atomic.AtomicLong;
import java.util.function.Consumer;
import java.util.function.Supplier;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.common.KafkaException;
import org.apache.kafka.common.PartitionInfo;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.errors.AuthenticationException;
import org.apache.kafka.common.errors.AuthorizationException;
import org.apache.kafka.common.errors.InterruptException;
import org.apache.kafka.common.errors.WakeupException;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;

/**
 * spanguard's killswitch for Java agents: it reads every partition of the kill topic, from the
 * end offsets resolved when {@link Builder#start()} returns, with assign() and no consumer group
 * (no rebalance, no commits), into a {@link SignalBook}; the agent checks before each tool call.
 * A bad record is counted in {@link #ignored()} by kind, logged once per kind, and costs only
 * itself: the reader never stops. Obeyed signals are acknowledged on the ack topic.
 *
 * <pre>{@code
 * KillSwitch killswitch = KillSwitch.builder()
 *     .brokers("kafka:9092")
 *     .signingKey(System.getenv("SPANGUARD_SIGNING_KEY"))
 *     .start();
 * String message = killswitch.checkCurrent(); // AgentKilled / AgentPaused once stopped
 * }</pre>
 */
public final class KillSwitch implements AutoCloseable {
  /** Conversation names in OpenTelemetry baggage, first present wins (as the worker reads). */
  public static final List<String> CONVERSATION_BAGGAGE_KEYS =
      List.of("gen_ai.conversation.id", "session.id");

  private static final String UNGUARDED_CHECK = "check/checkIn";
  private static final String UNGUARDED_CONTEXT = "checkContext";
  // What to do about a check with no trace, by where it found none.
  private static final Map<String, String> UNGUARDED_ADVICE =
      Map.of(
          UNGUARDED_CHECK,
          "given no trace id: pass the run's trace id, or call checkContext/checkCurrent in the"
              + " agent span's context",
          UNGUARDED_CONTEXT,
          "no span in its context: call it in the agent span's context, or check(traceId)");

  private final SignalBook signals;
  private final String topic;
  private final Map<String, byte[]> keys; // null: unsigned signals obeyed
  private final Supplier<Instant> clock;
  private final Consumer<String> log;
  private final ScopeDefaults scope;
  private final KafkaConsumer<byte[], byte[]> consumer; // null: not connected (tests)
  private final Acks acks; // null: no acks written
  private final Thread reader;
  private volatile boolean closing;
  private final Map<String, Integer> ignored = new HashMap<>();
  private final Set<String> warnedUnguarded = new HashSet<>();
  private final Set<String> warnedContained = new HashSet<>(); // tools whose refusal was logged
  private final AtomicLong received = new AtomicLong();
  private final AtomicLong unguarded = new AtomicLong();

  /** A switch's own conversation and agent: its settings', and the agent its resource names. */
  record ScopeDefaults(String conversationId, Agent agent, Agent resourceAgent) {
    static ScopeDefaults of(String conversationId, Agent agent, Resource resource) {
      return new ScopeDefaults(conversationId == null ? "" : conversationId, agent, agentOf(resource));
    }

    CheckScope resolve(Context context, CheckScope given) {
      String conversation = given.conversationId();
      if (conversation.isEmpty()) {
        conversation = conversationId;
      }
      if (conversation.isEmpty()) {
        conversation = conversationOf(context);
      }
      Agent found = given.agent();
      if (found == null) {
        found = agent;
      }
      if (found == null) {
        found = resourceAgent;
      }
      if (found == null && Span.fromContext(context) instanceof ReadableSpan span) {
        // An SDK span carries its provider's resource.
        found = agentOf(span.toSpanData().getResource());
      }
      return new CheckScope(conversation, found);
    }
  }

  KillSwitch(SignalBook signals, Consumer<String> log, ScopeDefaults scope) {
    this(signals, null, null, Instant::now, log, scope, null, null);
  }

  private KillSwitch(
      SignalBook signals,
      String topic,
      Map<String, byte[]> keys,
      Supplier<Instant> clock,
      Consumer<String> log,
      ScopeDefaults scope,
      KafkaConsumer<byte[], byte[]> consumer,
      Acks acks) {
    this.signals = signals;
    this.topic = topic;
    this.keys = keys;
    this.clock = clock;
    this.log = log;
    this.scope = scope;
    this.consumer = consumer;
    this.acks = acks;
    if (consumer != null) {
      reader = new Thread(this::run, "spanguard-killswitch-reader");
      reader.setDaemon(true);
      reader.start();
    } else {
      reader = null;
    }
  }

  public static Builder builder() {
    return new Builder();
  }

  /** The conversation the OpenTelemetry baggage of context names, or "". */
  public static String conversationOf(Context context) {
    Baggage baggage = Baggage.fromContext(context);
    for (String key : CONVERSATION_BAGGAGE_KEYS) {
      String value = baggage.getEntryValue(key);
      if (value != null && !value.isEmpty()) {
        return value;
      }
    }
    return "";
  }

  /** The agent a resource names (service.name, with gen_ai.agent.name), or null. */
  public static Agent agentOf(Resource resource) {
    if (resource == null) {
      return null;
    }
    String service = resource.getAttribute(AttributeKey.stringKey("service.name"));
    if (service == null || service.isEmpty()) {
      return null;
    }
    return new Agent(service, resource.getAttribute(AttributeKey.stringKey("gen_ai.agent.name")));
  }

  /** Settings of a KillSwitch; {@link #start()} connects and starts reading. */
  public static final class Builder {
    private final List<String> brokers = new ArrayList<>();
    private String topic = "agent-kill-signals";
    private String ackTopic = Acks.DEFAULT_TOPIC;
    private final List<byte[]> signingKeys = new ArrayList<>();
    private boolean allowUnsigned;
    private SignalBook signals;
    private Security security;
    private Supplier<Instant> clock = Instant::now;
    private Consumer<String> log = message -> System.getLogger("spanguard.killswitch")
        .log(System.Logger.Level.WARNING, message);
    private Duration startTimeout = Duration.ofSeconds(30);
    private String conversationId = "";
    private Agent agent;
    private Resource resource;

    private Builder() {}

    public Builder brokers(String... servers) {
      for (String server : servers) {
        brokers.addAll(List.of(server.split(",")));
      }
      return this;
    }

    public Builder topic(String topic) {
      this.topic = topic;
      return this;
    }

    /** Where obeyed signals are acknowledged (default agent-kill-acks); null writes none. */
    public Builder ackTopic(String ackTopic) {
      this.ackTopic = ackTopic;
      return this;
    }

    /** The worker's SPANGUARD_SIGNING_KEY; call again for each key while rotating (new first:
     * the first signs the acks). */
    public Builder signingKey(byte[] key) {
      signingKeys.add(key);
      return this;
    }

    public Builder signingKey(String key) {
      return signingKey(key == null ? new byte[0] : key.getBytes(StandardCharsets.UTF_8));
    }

    /** INSECURE: anyone who can write the topic can stop the agent. */
    public Builder allowUnsigned() {
      this.allowUnsigned = true;
      return this;
    }

    public Builder signals(SignalBook signals) {
      this.signals = signals;
      return this;
    }

    /** Default: {@link Security#fromEnv()}. */
    public Builder security(Security security) {
      this.security = security;
      return this;
    }

    /** Decides expiry (and pause deadlines, in the default book). */
    public Builder clock(Supplier<Instant> clock) {
      this.clock = clock;
      return this;
    }

    /** Where warnings go (default System.Logger "spanguard.killswitch"). */
    public Builder log(Consumer<String> log) {
      this.log = log;
      return this;
    }

    public Builder startTimeout(Duration startTimeout) {
      this.startTimeout = startTimeout;
      return this;
    }

    /** This process's conversation, checked on every check (a check's own wins). */
    public Builder conversationId(String conversationId) {
      this.conversationId = conversationId;
      return this;
    }

    /** This process's agent, checked on every check (a check's own wins). */
    public Builder agent(Agent agent) {
      this.agent = agent;
      return this;
    }

    /**
     * The resource the agent's tracer provider was built with: its service.name and
     * gen_ai.agent.name name the agent when neither the check nor {@link #agent} does. Without
     * it, a check reads the resource of the current SDK span.
     */
    public Builder resource(Resource resource) {
      this.resource = resource;
      return this;
    }

    /**
     * Connects, positions every partition at its end offset, and starts reading.
     *
     * @throws IllegalArgumentException for settings that cannot work
     * @throws KafkaException when the topic cannot be reached in the start timeout, or a
     *     password or certificate is refused
     */
    public KillSwitch start() {
      if (!signingKeys.isEmpty() && allowUnsigned) {
        throw new IllegalArgumentException(
            "killswitch settings: give signing keys or allowUnsigned, not both");
      }
      if (signingKeys.isEmpty() && !allowUnsigned) {
        throw new IllegalArgumentException(
            "killswitch settings: no signing key: pass signingKey (the worker's"
                + " SPANGUARD_SIGNING_KEY), or allowUnsigned to obey unsigned signals (insecure)");
      }
      Map<String, byte[]> ring;
      try {
        ring = signingKeys.isEmpty() ? null : Signals.keyring(signingKeys);
      } catch (IllegalArgumentException e) {
        throw new IllegalArgumentException("killswitch settings: " + e.getMessage());
      }
      if (brokers.isEmpty()) {
        throw new IllegalArgumentException("killswitch settings: no brokers");
      }
      Properties base = (security == null ? Security.fromEnv() : security).properties();
      base.put("bootstrap.servers", String.join(",", brokers));
      base.put("client.id", "spanguard-killswitch");
      Properties consumerProperties = new Properties();
      consumerProperties.putAll(base);
      consumerProperties.put("key.deserializer", ByteArrayDeserializer.class.getName());
      consumerProperties.put("value.deserializer", ByteArrayDeserializer.class.getName());
      consumerProperties.put("enable.auto.commit", "false"); // no group: nothing to commit
      consumerProperties.put("isolation.level", "read_committed");
      consumerProperties.put("fetch.max.wait.ms", "50");
      // A misspelt topic would be created, read by no worker: the start fails instead.
      consumerProperties.put("allow.auto.create.topics", "false");
      KafkaConsumer<byte[], byte[]> consumer = new KafkaConsumer<>(consumerProperties);
      try {
        positionAtEnd(consumer, topic, startTimeout);
      } catch (RuntimeException e) {
        consumer.close(Duration.ZERO);
        throw e;
      }
      SignalBook book = signals != null ? signals : new SignalBook(0, clock);
      byte[] ackKey = ring == null ? null : signingKeys.get(0);
      Acks acks = ackTopic == null ? null : new Acks(ackTopic, base, ackKey, log);
      return new KillSwitch(book, topic, ring, clock, log,
          ScopeDefaults.of(conversationId, agent, resource), consumer, acks);
    }
  }

  /**
   * Assigns every partition of topic and resolves each one's end offset now, retrying while a
   * new topic settles; a refused password or certificate fails at once.
   */
  private static void positionAtEnd(
      KafkaConsumer<byte[], byte[]> consumer, String topic, Duration timeout) {
    long deadline = System.nanoTime() + timeout.toNanos();
    KafkaException last = null;
    while (System.nanoTime() < deadline) {
      Duration left = Duration.ofNanos(Math.max(deadline - System.nanoTime(), 1_000_000));
      try {
        List<PartitionInfo> partitions = consumer.partitionsFor(topic, left);
        if (partitions != null && !partitions.isEmpty()) {
          List<TopicPartition> assigned = new ArrayList<>();
          for (PartitionInfo partition : partitions) {
            assigned.add(new TopicPartition(topic, partition.partition()));
          }
          consumer.assign(assigned);
          consumer.seekToEnd(assigned);
          for (TopicPartition partition : assigned) {
            consumer.position(partition, left); // resolved now: signals from here on count
          }
          return;
        }
        last = new KafkaException("topic \"" + topic + "\" not found");
      } catch (AuthenticationException | AuthorizationException refused) {
        throw new KafkaException("kill-signal topic \"" + topic + "\": " + refused.getMessage(), refused);
      } catch (KafkaException e) {
        last = e;
      }
      try {
        Thread.sleep(200);
      } catch (InterruptedException e) {
        Thread.currentThread().interrupt();
        throw new InterruptException(e);
      }
    }
    throw new KafkaException("kill-signal topic \"" + topic + "\": "
        + (last == null ? "timed out" : last.getMessage()), last);
  }

  /** The conversation and agent a check stands for (see the class's docs: the precedence). */
  public CheckScope scope(Context context, CheckScope given) {
    return scope.resolve(context, given == null ? CheckScope.NONE : given);
  }

  /**
   * Throws AgentKilled if traceId was killed (AgentPaused while paused); returns a downgrade's
   * system message once; else null. Reads memory only: it never waits on Kafka. A null or empty
   * traceId checks the switch's scope only, and is counted in {@link #unguarded()} (warned about
   * once): a tool call no trace kill can stop is never silent.
   */
  public String check(String traceId) {
    return checkIn(Context.root(), traceId, CheckScope.NONE, UNGUARDED_CHECK);
  }

  /** check for a trace of a conversation or agent (empty fields: the switch's). */
  public String checkIn(String traceId, CheckScope scope) {
    return checkIn(Context.root(), traceId, scope, UNGUARDED_CHECK);
  }

  /**
   * checkIn for a call to tool (on server; null: unknown): a contained tool throws
   * {@link ToolContained} after the trace's own kill or pause; the first refusal per tool is
   * logged, every one counted in the book's toolCallsRefused.
   */
  public String checkTool(String traceId, CheckScope scope, String tool, String server) {
    try {
      return checkIn(Context.root(), traceId, scope, UNGUARDED_CHECK, tool, server);
    } catch (ToolContained contained) {
      noteContained(contained);
      throw contained;
    }
  }

  private void noteContained(ToolContained contained) {
    boolean first;
    synchronized (warnedContained) {
      first = warnedContained.size() < SignalBook.DEFAULT_MAX_TRACES
          && warnedContained.add(contained.tool() + "\0" + contained.server());
    }
    if (first) {
      log.accept("spanguard killswitch: " + contained.getMessage() + " (rule " + contained.rule()
          + ", signal " + contained.decisionId() + "); further calls to it are counted in"
          + " signals().toolCallsRefused(), not logged");
    }
  }

  /**
   * check for the trace of the span in context, in the scope its baggage and resource name;
   * the stop's span event goes on that span. Without a valid span only the scope is checked, and
   * the call is counted in {@link #unguarded()}.
   */
  public String checkContext(Context context) {
    SpanContext span = Span.fromContext(context).getSpanContext();
    String traceId = span.isValid() ? span.getTraceId() : "";
    return checkIn(context, traceId, CheckScope.NONE, UNGUARDED_CONTEXT);
  }

  /** checkContext of {@link Context#current()}: the agent's current span. */
  public String checkCurrent() {
    return checkContext(Context.current());
  }

  String checkIn(Context context, String traceId, CheckScope given, String where) {
    return checkIn(context, traceId, given, where, null, null);
  }

  String checkIn(Context context, String traceId, CheckScope given, String where, String tool,
      String server) {
    Span span = Span.fromContext(context);
    try {
      signals.checkScopes(scope.resolve(context, given == null ? CheckScope.NONE : given));
    } catch (AgentKilled killed) {
      obeyed(span, killed.signal());
      throw killed;
    }
    if (traceId == null || traceId.isEmpty()) {
      noteUnguarded(where);
      signals.checkTool(tool, server);
      return null;
    }
    SignalBook.Checked checked;
    try {
      checked = signals.checked(traceId, tool, server);
    } catch (ToolContained contained) {
      throw contained; // a refused call: nothing stopped, no stop event
    } catch (AgentStopped stopped) {
      obeyed(span, stopped.signal());
      throw stopped;
    }
    if (checked.downgrade() != null) {
      obeyed(span, checked.downgrade());
    }
    return checked.message();
  }

  /** The span event, and the ack of a kill or downgrade (a pause is not obeyed yet). */
  private void obeyed(Span span, Signal signal) {
    Stop.record(span, signal);
    if (acks != null && !signal.kind().equals("pause")) {
      acks.acknowledge(signal, clock.get());
    }
  }

  private void noteUnguarded(String where) {
    unguarded.incrementAndGet();
    boolean first;
    synchronized (warnedUnguarded) {
      first = warnedUnguarded.add(where);
    }
    if (first) {
      log.accept("spanguard killswitch: " + where + " found no trace to check, so this tool call"
          + " is NOT guarded against a kill of its trace: " + UNGUARDED_ADVICE.get(where)
          + " (further ones are counted in unguarded(), not logged)");
    }
  }

  /** Checks that found no trace to check: tool calls nothing guarded. */
  public long unguarded() {
    return unguarded.get();
  }

  /**
   * check, and while the trace is paused, blocks until an operator's release (returns) or kill
   * (AgentKilled), or the pause's deadline, when the policy's fallback applies; after timeout
   * (null: none) AgentPaused again.
   */
  public String await(String traceId, Duration timeout) throws InterruptedException {
    if (traceId == null || traceId.isEmpty()) {
      return null;
    }
    try {
      String message = signals.await(traceId, timeout);
      return message;
    } catch (AgentKilled killed) {
      obeyed(Span.current(), killed.signal());
      throw killed;
    }
  }

  public SignalBook signals() {
    return signals;
  }

  /** Records read (delivered to the book or ignored). */
  public long received() {
    return received.get();
  }

  /** Bad records by kind. */
  public Map<String, Integer> ignored() {
    synchronized (ignored) {
      return Map.copyOf(ignored);
    }
  }

  /** Records that are not a kill signal at all. */
  public int malformed() {
    return sum(Signals.MALFORMED_KINDS);
  }

  /** Signals unsigned, signed with a key the agent lacks, or forged. */
  public int rejected() {
    return sum(Signals.REJECTED_KINDS);
  }

  /** Valid signals read after their expires_at. */
  public int expired() {
    return ignored().getOrDefault("expired", 0);
  }

  /** Acks written, and acks that could not be written. */
  public int acksSent() {
    return acks == null ? 0 : acks.sent();
  }

  public int acksFailed() {
    return acks == null ? 0 : acks.failed();
  }

  private int sum(Set<String> kinds) {
    int total = 0;
    for (Map.Entry<String, Integer> entry : ignored().entrySet()) {
      if (kinds.contains(entry.getKey())) {
        total += entry.getValue();
      }
    }
    return total;
  }

  /** Stops the reader and flushes the acks. */
  @Override
  public void close() {
    closing = true;
    if (consumer != null) {
      consumer.wakeup();
      try {
        reader.join(10_000);
      } catch (InterruptedException e) {
        Thread.currentThread().interrupt();
      }
    }
    if (acks != null) {
      acks.close();
    }
  }

  private void run() {
    try {
      while (!closing) {
        try {
          for (ConsumerRecord<byte[], byte[]> record : consumer.poll(Duration.ofMillis(100))) {
            accept(record.value());
          }
        } catch (WakeupException e) {
          if (closing) {
            return;
          }
        } catch (RuntimeException e) {
          // Leaders move and brokers restart: count and go on, never stop.
          ignore(new BadSignal("consumer_error", String.valueOf(e)));
          sleepQuietly(100);
        }
      }
    } finally {
      consumer.close(Duration.ofSeconds(1));
    }
  }

  private static void sleepQuietly(long millis) {
    try {
      Thread.sleep(millis);
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
    }
  }

  void accept(byte[] value) {
    try {
      signals.deliver(Signals.read(value, keys, clock.get()));
    } catch (BadSignal bad) {
      ignore(bad);
    } catch (RuntimeException bug) { // a bug must cost one record, never the reader
      ignore(new BadSignal("internal", String.valueOf(bug)));
    } finally {
      received.incrementAndGet(); // counted once the record is in the book or in ignored
    }
  }

  private void ignore(BadSignal bad) {
    boolean first;
    synchronized (ignored) {
      first = ignored.merge(bad.kind(), 1, Integer::sum) == 1;
    }
    if (first) { // once per kind: a flood of junk must not flood the log
      log.accept("spanguard killswitch: ignored a kill-signal record (" + bad.kind() + "): "
          + bad.getMessage() + "; further ones of this kind are counted in ignored(), not logged");
    }
  }
}
