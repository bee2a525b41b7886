package dev.spanguard.killswitch;

import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.Locale;
import java.util.Map;
import java.util.Properties;

/**
 * How the reader connects: TLS, mutual TLS and SASL, from the SPANGUARD_KAFKA_* variables the
 * worker, the Python killswitch and clients/go read; settings that cannot work together (a SASL
 * mechanism over PLAINTEXT, a certificate without its key) are refused before any connection,
 * with the same words as clients/go.
 *
 * @param protocol PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL
 * @param sslEndpointIdentification https (default) or none
 * @param saslMechanism PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512
 */
public record Security(
    String protocol,
    String sslCaLocation,
    String sslCertificateLocation,
    String sslKeyLocation,
    String sslEndpointIdentification,
    String saslMechanism,
    String saslUsername,
    String saslPassword) {

  public static final Security PLAINTEXT = new Security("", "", "", "", "", "", "", "");

  public Security {
    protocol = blankIfNull(protocol);
    sslCaLocation = blankIfNull(sslCaLocation);
    sslCertificateLocation = blankIfNull(sslCertificateLocation);
    sslKeyLocation = blankIfNull(sslKeyLocation);
    sslEndpointIdentification = blankIfNull(sslEndpointIdentification);
    saslMechanism = blankIfNull(saslMechanism);
    saslUsername = blankIfNull(saslUsername);
    saslPassword = blankIfNull(saslPassword);
  }

  private static String blankIfNull(String text) {
    return text == null ? "" : text;
  }

  /** SPANGUARD_KAFKA_* of this process (a password also from ..._SASL_PASSWORD_FILE). */
  public static Security fromEnv() {
    return fromEnv(System.getenv());
  }

  public static Security fromEnv(Map<String, String> env) {
    java.util.function.Function<String, String> get =
        name -> blankIfNull(env.get("SPANGUARD_KAFKA_" + name));
    String password = get.apply("SASL_PASSWORD");
    String file = get.apply("SASL_PASSWORD_FILE");
    if (password.isEmpty() && !file.isEmpty()) {
      try {
        password = Files.readString(Path.of(file), StandardCharsets.UTF_8).replaceAll("[\r\n]+$", "");
      } catch (IOException e) {
        throw new IllegalArgumentException(
            "killswitch settings: SPANGUARD_KAFKA_SASL_PASSWORD_FILE: cannot read \"" + file + "\"");
      }
    }
    return new Security(
        get.apply("SECURITY_PROTOCOL"),
        get.apply("SSL_CA_LOCATION"),
        get.apply("SSL_CERTIFICATE_LOCATION"),
        get.apply("SSL_KEY_LOCATION"),
        get.apply("SSL_ENDPOINT_IDENTIFICATION_ALGORITHM"),
        get.apply("SASL_MECHANISM"),
        get.apply("SASL_USERNAME"),
        password);
  }

  private static IllegalArgumentException refused(String why) {
    return new IllegalArgumentException("killswitch settings: " + why);
  }

  /**
   * Kafka client properties for these settings.
   *
   * @throws IllegalArgumentException for settings that cannot work together
   */
  public Properties properties() {
    String upper = protocol.trim().toUpperCase(Locale.ROOT);
    if (upper.isEmpty()) {
      upper = "PLAINTEXT";
    }
    boolean usesSasl = upper.startsWith("SASL_");
    boolean usesTls = upper.equals("SSL") || upper.equals("SASL_SSL");
    if (!upper.equals("PLAINTEXT") && !usesSasl && !usesTls
        || usesSasl && !upper.equals("SASL_SSL") && !upper.equals("SASL_PLAINTEXT")) {
      throw refused("security.protocol must be one of PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL, not \""
          + protocol + "\"");
    }
    Properties out = new Properties();
    out.put("security.protocol", upper);
    if (usesSasl) {
      if (saslUsername.isEmpty() || saslPassword.isEmpty()) {
        throw refused("security.protocol " + upper + " needs sasl.username and sasl.password");
      }
      String mechanism = saslMechanism.trim().toUpperCase(Locale.ROOT);
      String module =
          switch (mechanism) {
            case "PLAIN" -> "org.apache.kafka.common.security.plain.PlainLoginModule";
            case "SCRAM-SHA-256", "SCRAM-SHA-512" ->
                "org.apache.kafka.common.security.scram.ScramLoginModule";
            default -> throw refused("security.protocol " + upper
                + " needs sasl.mechanism, one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 (got \""
                + saslMechanism + "\")");
          };
      out.put("sasl.mechanism", mechanism);
      out.put("sasl.jaas.config", module + " required username=" + jaasQuote(saslUsername)
          + " password=" + jaasQuote(saslPassword) + ";");
    } else if (!saslMechanism.isEmpty() || !saslUsername.isEmpty() || !saslPassword.isEmpty()) {
      throw refused("SASL settings are set but security.protocol is " + upper
          + ": use SASL_SSL (or SASL_PLAINTEXT)");
    }
    if (!usesTls) {
      if (!sslCaLocation.isEmpty() || !sslCertificateLocation.isEmpty() || !sslKeyLocation.isEmpty()) {
        throw refused("TLS settings are set but security.protocol is " + upper + ": use SSL or SASL_SSL");
      }
      return out;
    }
    if (sslCertificateLocation.isEmpty() != sslKeyLocation.isEmpty()) {
      throw refused("ssl.certificate.location and ssl.key.location go together (mutual TLS): set both or neither");
    }
    if (!sslCaLocation.isEmpty()) {
      if (!Files.isReadable(Path.of(sslCaLocation))) {
        throw refused("ssl.ca.location: no such file \"" + sslCaLocation + "\"");
      }
      // The Java client reads a PEM file of CA certificates as a trust store of type PEM.
      out.put("ssl.truststore.type", "PEM");
      out.put("ssl.truststore.location", sslCaLocation);
    }
    if (!sslCertificateLocation.isEmpty()) {
      try {
        // A PEM key store takes the chain and the (unencrypted PKCS#8) key as text.
        out.put("ssl.keystore.type", "PEM");
        out.put("ssl.keystore.certificate.chain", Files.readString(Path.of(sslCertificateLocation)));
        out.put("ssl.keystore.key", Files.readString(Path.of(sslKeyLocation)));
      } catch (IOException e) {
        throw refused("ssl.certificate.location / ssl.key.location: " + e.getMessage());
      }
    }
    switch (sslEndpointIdentification.toLowerCase(Locale.ROOT)) {
      case "", "https" -> out.put("ssl.endpoint.identification.algorithm", "https");
      // The chain is still verified; only the broker's name is not checked against it.
      case "none" -> out.put("ssl.endpoint.identification.algorithm", "");
      default -> throw refused("ssl.endpoint.identification.algorithm must be https or none, not \""
          + sslEndpointIdentification + "\"");
    }
    return out;
  }

  private static String jaasQuote(String text) {
    return "\"" + text.replace("\\", "\\\\").replace("\"", "\\\"") + "\"";
  }
}
