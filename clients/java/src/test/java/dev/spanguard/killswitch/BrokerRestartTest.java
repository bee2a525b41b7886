package dev.spanguard.killswitch;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.io.IOException;
import java.net.ServerSocket;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.TimeUnit;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.NewTopic;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.serialization.ByteArraySerializer;
import org.junit.jupiter.api.AfterEach;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.io.TempDir;

/**
 * A broker that goes away and comes back: a broker of the test's own (scripts/kafka.sh on free
 * ports, a data dir of its own), SIGKILLed and started again from the same data. The shared
 * broker is never touched. Meanwhile the agent's checks answer from memory, and a kill sent
 * after the restart is obeyed by the same KillSwitch.
 */
class BrokerRestartTest {
  private static final Path KAFKA_SH =
      Path.of(System.getProperty("user.dir")).resolve("../../scripts/kafka.sh").normalize();

  @TempDir Path dataDir;
  private final int port = freePort();
  private final int controllerPort = freePort();
  private KillSwitch killswitch;

  static int freePort() {
    try (ServerSocket socket = new ServerSocket(0)) {
      return socket.getLocalPort();
    } catch (IOException e) {
      throw new IllegalStateException(e);
    }
  }

  String bootstrap() {
    return "127.0.0.1:" + port;
  }

  /** kafka.sh up on this test's ports and data dir: returns once the broker answers. */
  void brokerUp() throws Exception {
    Path log = dataDir.resolve("kafka-sh.log");
    Process up = new ProcessBuilder(KAFKA_SH.toString(), "--port", String.valueOf(port),
        "--controller-port", String.valueOf(controllerPort), "--data-dir", dataDir.toString(), "up")
        .redirectErrorStream(true)
        .redirectOutput(ProcessBuilder.Redirect.appendTo(log.toFile())) // the broker keeps no pipe
        .start();
    assertTrue(up.waitFor(300, TimeUnit.SECONDS), "kafka.sh up still running");
    assertEquals(0, up.exitValue(), () -> "kafka.sh up failed:\n" + read(log));
  }

  static String read(Path path) {
    try {
      return Files.readString(path);
    } catch (IOException e) {
      return String.valueOf(e);
    }
  }

  /** SIGKILL: no clean shutdown; the next start recovers the logs. */
  void brokerKill() throws Exception {
    Path pidFile = dataDir.resolve("kafka.pid");
    if (!Files.exists(pidFile)) {
      return;
    }
    long pid = Long.parseLong(Files.readString(pidFile).strip());
    var process = ProcessHandle.of(pid);
    if (process.isPresent()) {
      process.get().destroyForcibly();
      process.get().onExit().get(30, TimeUnit.SECONDS);
    }
  }

  @AfterEach
  void tearDown() throws Exception {
    if (killswitch != null) {
      killswitch.close();
    }
    brokerKill();
  }

  void send(String topic, byte[] value) throws Exception {
    Properties properties = new Properties();
    properties.put("bootstrap.servers", bootstrap());
    properties.put("key.serializer", ByteArraySerializer.class.getName());
    properties.put("value.serializer", ByteArraySerializer.class.getName());
    try (KafkaProducer<byte[], byte[]> producer = new KafkaProducer<>(properties)) {
      producer.send(new ProducerRecord<>(topic, value)).get(30, TimeUnit.SECONDS);
    }
  }

  @Test
  void aBrokerThatGoesAwayAndComesBackIsReadAgainAndItsNextKillObeyed() throws Exception {
    brokerUp();
    String topic = "java-killswitch-restart";
    Properties properties = new Properties();
    properties.put("bootstrap.servers", bootstrap());
    try (Admin admin = Admin.create(properties)) {
      admin.createTopics(List.of(new NewTopic(topic, 3, (short) 1))).all().get(30, TimeUnit.SECONDS);
    }
    killswitch = KillSwitch.builder().brokers(bootstrap()).topic(topic).ackTopic(null)
        .signingKey(KafkaTest.TEST_KEY).log(message -> { }).start();
    String before = KafkaTest.randomHex(16);
    send(topic, KafkaTest.signal(before, KafkaTest.TEST_KEY, Map.of()));
    KafkaTest.until(() -> killswitch.signals().isKilled(before), "the kill before the restart");

    brokerKill();
    // The agent runs on: its checks answer from memory, and never wait for the broker.
    String meanwhile = KafkaTest.randomHex(16);
    long checkStarted = System.nanoTime();
    assertNull(killswitch.check(meanwhile));
    assertThrows(AgentKilled.class, () -> killswitch.check(before));
    long checkMillis = (System.nanoTime() - checkStarted) / 1_000_000;
    assertTrue(checkMillis < 500, "checks took " + checkMillis + " ms with the broker gone");
    Thread.sleep(3_000); // the reader meets the dead connection

    brokerUp();
    long restarted = System.nanoTime();
    String after = KafkaTest.randomHex(16);
    send(topic, KafkaTest.signal(after, KafkaTest.TEST_KEY, Map.of()));
    KafkaTest.until(() -> killswitch.signals().isKilled(after), "the kill after the restart",
        Duration.ofSeconds(90));
    System.out.printf("a kill sent after the restart was read %d ms after the broker answered%n",
        (System.nanoTime() - restarted) / 1_000_000);
    assertThrows(AgentKilled.class, () -> killswitch.check(after));
    assertThrows(AgentKilled.class, () -> killswitch.check(before));
    assertNull(killswitch.check(meanwhile));
  }
}
