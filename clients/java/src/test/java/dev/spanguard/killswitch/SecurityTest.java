package dev.spanguard.killswitch;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.nio.file.Files;
import java.nio.file.Path;
import java.util.Map;
import java.util.Properties;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.io.TempDir;

/** TLS and SASL settings: refused when they cannot work together, before any connection. */
class SecurityTest {
  @TempDir Path dir;

  static Security of(String protocol, String ca, String cert, String key, String mechanism, String user, String password) {
    return new Security(protocol, ca, cert, key, "", mechanism, user, password);
  }

  @Test
  void refusals() {
    String missing = dir.resolve("nope.pem").toString();
    Map<String, Security> cases = Map.of(
        "security.protocol must be one of", of("TLS", "", "", "", "", "", ""),
        "needs sasl.mechanism", of("SASL_SSL", "", "", "", "", "u", "p"),
        "needs sasl.username and sasl.password", of("SASL_PLAINTEXT", "", "", "", "PLAIN", "u", ""),
        "use SASL_SSL", of("PLAINTEXT", "", "", "", "PLAIN", "", ""),
        "use SSL or SASL_SSL", of("", missing, "", "", "", "", ""),
        "go together", of("SSL", "", missing, "", "", "", ""),
        "no such file", of("SSL", missing, "", "", "", "", ""));
    cases.forEach((message, security) -> {
      IllegalArgumentException refused = assertThrows(IllegalArgumentException.class, security::properties, message);
      assertTrue(refused.getMessage().contains(message), refused.getMessage() + " / " + message);
    });
  }

  @Test
  void mapsSaslAndTls() throws Exception {
    for (String mechanism : new String[] {"PLAIN", "scram-sha-256", "SCRAM-SHA-512"}) {
      Properties properties = of("sasl_plaintext", "", "", "", mechanism, "u", "p\"q").properties();
      assertEquals(mechanism.toUpperCase(), properties.get("sasl.mechanism"));
      assertTrue(((String) properties.get("sasl.jaas.config")).contains("password=\"p\\\"q\";"));
    }
    assertEquals("PLAINTEXT", Security.PLAINTEXT.properties().get("security.protocol"));
    Path ca = Files.writeString(dir.resolve("ca.pem"), "-----BEGIN CERTIFICATE-----\n");
    Properties tls = new Security("SSL", ca.toString(), "", "", "none", "", "", "").properties();
    assertEquals(java.util.List.of("PEM", ca.toString(), ""), java.util.List.of(
        tls.get("ssl.truststore.type"), tls.get("ssl.truststore.location"), tls.get("ssl.endpoint.identification.algorithm")));
  }

  @Test
  void fromEnvReadsThePasswordFile() throws Exception {
    Path file = Files.writeString(dir.resolve("password"), "s3cret\n");
    Security security = Security.fromEnv(Map.of(
        "SPANGUARD_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT",
        "SPANGUARD_KAFKA_SASL_MECHANISM", "PLAIN",
        "SPANGUARD_KAFKA_SASL_USERNAME", "agent",
        "SPANGUARD_KAFKA_SASL_PASSWORD_FILE", file.toString()));
    assertEquals(java.util.List.of("s3cret", "agent"), java.util.List.of(security.saslPassword(), security.saslUsername()));
  }
}
