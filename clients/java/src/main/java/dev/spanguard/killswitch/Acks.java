package dev.spanguard.killswitch;

import java.net.InetAddress;
import java.nio.charset.StandardCharsets;
import java.time.Instant;
import java.time.ZoneOffset;
import java.time.format.DateTimeFormatter;
import java.util.LinkedHashMap;
import java.util.Map;
import java.util.Properties;
import java.util.function.Consumer;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.serialization.ByteArraySerializer;

/**
 * Acknowledgements (killswitch/acks.py): a check that obeys a kill or hands over a downgrade's
 * message writes one record per signal to the ack topic (agent-kill-acks, keyed by trace id),
 * signed like the signals with the agent's current key. `spanguard explain` reads them back.
 * Fire-and-forget: an ack that cannot be written is logged once and never delays the agent.
 */
final class Acks {
  static final String DEFAULT_TOPIC = "agent-kill-acks";
  private static final int MAX_ACKED = 10_000;
  private static final DateTimeFormatter OBEYED_AT =
      DateTimeFormatter.ofPattern("yyyy-MM-dd'T'HH:mm:ss.SSSxxx").withZone(ZoneOffset.UTC);

  private final String topic;
  private final Properties config;
  private final byte[] key; // null: an unsigned deployment
  private final Consumer<String> log;
  private final LinkedHashMap<String, Boolean> acked = new LinkedHashMap<>();
  private KafkaProducer<byte[], byte[]> producer;
  private int sent;
  private int failed;

  Acks(String topic, Properties config, byte[] key, Consumer<String> log) {
    this.topic = topic;
    this.config = config;
    this.key = key;
    this.log = log;
  }

  static String thisProcess() {
    String host;
    try {
      host = InetAddress.getLocalHost().getHostName();
    } catch (java.io.IOException e) {
      host = "unknown";
    }
    return host + ":" + ProcessHandle.current().pid();
  }

  /** The ack of signal, signed with key (unsigned when null). */
  static Map<String, Object> record(Signal signal, Instant obeyedAt, byte[] key, String process) {
    Map<String, Object> record = new LinkedHashMap<>();
    record.put("kind", "ack");
    record.put("trace_id", Signals.normalizeTraceId(signal.traceId()));
    record.put("signal_id", signal.signalId());
    record.put("action", signal.kind());
    record.put("process", process);
    record.put("obeyed_at", OBEYED_AT.format(obeyedAt));
    return key == null ? record : Signals.sign(record, key);
  }

  /** Writes the ack of signal once (a killed trace's every later check throws again). */
  void acknowledge(Signal signal, Instant obeyedAt) {
    synchronized (this) {
      if (acked.putIfAbsent(signal.signalId(), Boolean.TRUE) != null) {
        return;
      }
      while (acked.size() > MAX_ACKED) {
        acked.remove(acked.keySet().iterator().next());
      }
    }
    Map<String, Object> record = record(signal, obeyedAt, key, thisProcess());
    try {
      synchronized (this) {
        if (producer == null) { // most agents are never killed: made on the first ack
          Properties properties = new Properties();
          properties.putAll(config);
          properties.put("linger.ms", "0");
          properties.put("key.serializer", ByteArraySerializer.class.getName());
          properties.put("value.serializer", ByteArraySerializer.class.getName());
          producer = new KafkaProducer<>(properties);
        }
      }
      producer.send(
          new ProducerRecord<>(topic,
              ((String) record.get("trace_id")).getBytes(StandardCharsets.UTF_8),
              Json.canonicalBytes(record)),
          (metadata, error) -> {
            if (error != null) {
              failed(error.toString());
            } else {
              synchronized (this) {
                sent++;
              }
            }
          });
    } catch (RuntimeException e) { // never the agent's problem: its tool call is stopped
      failed(e.toString());
    }
  }

  private void failed(String why) {
    boolean first;
    synchronized (this) {
      failed++;
      first = failed == 1;
    }
    if (first) {
      log.accept("spanguard killswitch: an ack could not be written to " + topic + " (" + why
          + "); `explain` will show the signal as not acknowledged (further failures counted in"
          + " KillSwitch.acksFailed())");
    }
  }

  synchronized int sent() {
    return sent;
  }

  synchronized int failed() {
    return failed;
  }

  void close() {
    KafkaProducer<byte[], byte[]> toClose;
    synchronized (this) {
      toClose = producer;
      producer = null;
    }
    if (toClose != null) {
      toClose.close(java.time.Duration.ofSeconds(5));
    }
  }
}
