package dev.spanguard.killswitch;

import java.nio.ByteBuffer;
import java.nio.charset.CharacterCodingException;
import java.nio.charset.CodingErrorAction;
import java.nio.charset.StandardCharsets;
import java.security.InvalidKeyException;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;
import java.time.DateTimeException;
import java.time.Instant;
import java.time.LocalDateTime;
import java.time.ZoneOffset;
import java.util.ArrayList;
import java.util.HexFormat;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Optional;
import java.util.Set;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import javax.crypto.Mac;
import javax.crypto.spec.SecretKeySpec;

/**
 * Reading kill-signal records strictly (schemas/kill-signal.schema.json), and their HMAC
 * signatures: every spanguard killswitch (Python, TypeScript, Go, Java) decides the shared
 * vectors in schemas/testdata/kill-signal-vectors.json alike (clients/go/signal.go).
 */
public final class Signals {
  public static final int MAX_SIGNAL_BYTES = 64 * 1024;
  public static final int MAX_SIGNAL_DEPTH = 8;
  public static final long KILL_SIGNAL_SCHEMA_VERSION = 2;
  static final int MAX_CONVERSATION_ID_CHARS = 200;
  private static final String KEY_ID_TEXT = "spanguard kill-signal key id";

  /** Bad records that are not a kill signal at all. */
  public static final Set<String> MALFORMED_KINDS =
      Set.of("empty", "too_large", "not_utf8", "not_json", "too_deep", "not_object", "invalid");

  /** Signals unsigned, signed with a key the agent does not hold, or forged. */
  public static final Set<String> REJECTED_KINDS = Set.of("unsigned", "unknown_key", "forged");

  // matches() anchors these at both ends; "$" would let a trailing newline through.
  private static final Pattern HEX32 = Pattern.compile("[0-9a-f]{32}");
  private static final Pattern HEX16 = Pattern.compile("[0-9a-f]{16}");
  private static final Pattern DATE_TIME =
      Pattern.compile(
          "([0-9]{4})-([0-9]{2})-([0-9]{2})T([0-9]{2}):([0-9]{2}):([0-9]{2})(\\.[0-9]{1,6})?"
              + "(Z|([+-])([0-9]{2}):([0-9]{2}))");
  static final Set<String> KINDS = Set.of("kill", "downgrade", "release", "pause");
  static final Set<String> RULES =
      Set.of("tool_loop", "cycle", "tool_polling", "no_progress", "token_budget", "cost_budget",
          "handoff_cycle", "delegation_depth", "agent_fan_out", "agent_budget", "manual",
          "tool_failing", "loop_signature");
  static final Set<String> SCOPES = Set.of("trace", "conversation", "agent", "tool");
  // The fleet rules: their signals contain a tool, and their release is the tool's recovery.
  static final Set<String> FLEET_RULES = Set.of("tool_failing", "loop_signature");
  static final int MAX_TOOL_NAME_CHARS = 200;
  static final Set<String> FIELDS =
      Set.of("schema_version", "signal_id", "trace_id", "kind", "rule", "reason", "evidence",
          "agent", "detected_at", "expires_at", "system_message", "operator", "pause_until",
          "pause_fallback", "scope", "conversation_id", "tool", "key_id", "signature");
  static final List<String> REQUIRED =
      List.of("schema_version", "signal_id", "trace_id", "kind", "rule", "reason", "evidence",
          "agent", "detected_at", "expires_at");
  // evidence field -> "string", "hex16", or the minimum of an integer
  static final Map<String, Object> EVIDENCE_FIELDS =
      Map.ofEntries(Map.entry("span_id", "hex16"), Map.entry("tool_name", "string"),
          Map.entry("args_hash", "hex16"), Map.entry("result_hash", "hex16"),
          Map.entry("hits", 1L), Map.entry("window", 1L), Map.entry("steps", 1L),
          Map.entry("tokens", 0L), Map.entry("token_budget", 1L),
          Map.entry("cost_micro_usd", 0L), Map.entry("budget_micro_usd", 1L));

  private Signals() {}

  static String printable(String text) {
    StringBuilder out = new StringBuilder();
    text.codePoints()
        .limit(200)
        .forEach(c -> out.append(c < 0x20 || c > 0x7e ? '?' : (char) c));
    return out.toString();
  }

  private static byte[] hmac(byte[] key, byte[] text) {
    try {
      Mac mac = Mac.getInstance("HmacSHA256");
      mac.init(new SecretKeySpec(key, "HmacSHA256"));
      return mac.doFinal(text);
    } catch (NoSuchAlgorithmException | InvalidKeyException e) {
      throw new IllegalStateException("HMAC-SHA256", e);
    }
  }

  /** The id a signed signal names its key by: 16 hex of HMAC-SHA256(key, a fixed text). */
  public static String keyId(byte[] key) {
    return HexFormat.of().formatHex(hmac(key, KEY_ID_TEXT.getBytes(StandardCharsets.UTF_8)))
        .substring(0, 16);
  }

  /** Key id -> key, for one key or several (rotation: new and old). */
  public static Map<String, byte[]> keyring(List<byte[]> keys) {
    Map<String, byte[]> ring = new LinkedHashMap<>();
    for (byte[] key : keys) {
      if (key == null || key.length == 0) {
        throw new IllegalArgumentException("a signing key must not be empty");
      }
      ring.put(keyId(key), key.clone());
    }
    return ring;
  }

  /** record with its key's key_id and an HMAC-SHA256 signature over its canonical JSON. */
  public static Map<String, Object> sign(Map<String, Object> record, byte[] key) {
    Map<String, Object> named = new LinkedHashMap<>(record);
    named.remove("signature");
    named.put("key_id", keyId(key));
    named.put("signature", HexFormat.of().formatHex(hmac(key, Json.canonicalBytes(named))));
    return named;
  }

  /** How record's signature stands against keys: valid, unsigned, unknown_key or forged. */
  public static String verify(Map<String, Object> record, Map<String, byte[]> keys) {
    if (!record.containsKey("signature")) {
      return "unsigned";
    }
    Object id = record.get("key_id");
    byte[] key = id instanceof String text ? keys.get(text) : null;
    if (key == null) {
      return "unknown_key";
    }
    if (!(record.get("signature") instanceof String given)) {
      return "forged";
    }
    Map<String, Object> unsigned = new LinkedHashMap<>(record);
    unsigned.remove("signature");
    byte[] text;
    try {
      text = Json.canonicalBytes(unsigned);
    } catch (IllegalArgumentException noCanonicalForm) {
      return "forged";
    }
    byte[] expected = HexFormat.of().formatHex(hmac(key, text)).getBytes(StandardCharsets.UTF_8);
    return MessageDigest.isEqual(given.getBytes(StandardCharsets.UTF_8), expected)
        ? "valid"
        : "forged";
  }

  /**
   * An RFC 3339 date-time with a zone (at most 6 fractional digits) that exists on the calendar.
   */
  public static Optional<Instant> parseDateTime(String text) {
    if (text == null) {
      return Optional.empty();
    }
    Matcher m = DATE_TIME.matcher(text);
    if (!m.matches()) {
      return Optional.empty();
    }
    int year = Integer.parseInt(m.group(1));
    int month = Integer.parseInt(m.group(2));
    int day = Integer.parseInt(m.group(3));
    int hour = Integer.parseInt(m.group(4));
    int minute = Integer.parseInt(m.group(5));
    int second = Integer.parseInt(m.group(6));
    if (month < 1 || month > 12 || hour > 23 || minute > 59 || second > 59) {
      return Optional.empty();
    }
    int nanos = 0;
    if (m.group(7) != null) {
      nanos = Integer.parseInt((m.group(7).substring(1) + "000000").substring(0, 6)) * 1000;
    }
    int offset = 0;
    if (!m.group(8).equals("Z")) {
      int offsetHours = Integer.parseInt(m.group(10));
      int offsetMinutes = Integer.parseInt(m.group(11));
      if (offsetHours > 23 || offsetMinutes > 59) {
        return Optional.empty();
      }
      offset = offsetHours * 3600 + offsetMinutes * 60;
      if (m.group(9).equals("-")) {
        offset = -offset;
      }
    }
    try {
      // of() refuses 30 February and day 0: not a date. Offsets past 18h are refused by
      // ZoneOffset, so the offset is applied as seconds.
      LocalDateTime local = LocalDateTime.of(year, month, day, hour, minute, second, nanos);
      return Optional.of(local.toInstant(ZoneOffset.UTC).minusSeconds(offset));
    } catch (DateTimeException notADate) {
      return Optional.empty();
    }
  }

  private static BadSignal invalid(String where, String message) {
    return new BadSignal("invalid", "field " + where + ": " + message);
  }

  private static boolean isInteger(Object value, long minimum) {
    return value instanceof Long n && n >= minimum;
  }

  private static BadSignal checkSchema(Map<String, Object> record) {
    for (String name : REQUIRED) {
      if (!record.containsKey(name)) {
        return invalid("(top level)", "'" + name + "' is a required property");
      }
    }
    for (String name : record.keySet()) {
      if (!FIELDS.contains(name)) {
        return invalid("(top level)", "additional property '" + name + "'");
      }
    }
    if (!(record.get("schema_version") instanceof Long version && version == KILL_SIGNAL_SCHEMA_VERSION)) {
      return invalid("schema_version", "must be 2");
    }
    for (String name : List.of("signal_id", "trace_id")) {
      if (!(record.get(name) instanceof String id32 && HEX32.matcher(id32).matches())) {
        return invalid(name, "not 32 lowercase hex");
      }
    }
    String kind = record.get("kind") instanceof String s ? s : "";
    if (!KINDS.contains(kind)) {
      return invalid("kind", "not kill, downgrade, release or pause");
    }
    String rule = record.get("rule") instanceof String s ? s : "";
    if (!RULES.contains(rule)) {
      return invalid("rule", "not a rule");
    }
    if (!(record.get("reason") instanceof String reason && !reason.isEmpty())) {
      return invalid("reason", "not a non-empty string");
    }
    if (!(record.get("evidence") instanceof Map<?, ?> evidence)) {
      return invalid("evidence", "not an object");
    }
    if (!evidence.containsKey("span_id")) {
      return invalid("evidence", "'span_id' is a required property");
    }
    for (Map.Entry<?, ?> entry : evidence.entrySet()) {
      Object expected = EVIDENCE_FIELDS.get((String) entry.getKey());
      if (expected == null) {
        return invalid("evidence", "additional property '" + entry.getKey() + "'");
      }
      Object value = entry.getValue();
      boolean fine;
      if (expected instanceof String type) {
        fine = value instanceof String text
            && (type.equals("string") || HEX16.matcher(text).matches());
      } else {
        fine = isInteger(value, (Long) expected);
      }
      if (!fine) {
        return invalid("evidence." + entry.getKey(), "wrong type or value");
      }
    }
    if (!(record.get("agent") instanceof Map<?, ?> agent)) {
      return invalid("agent", "not an object");
    }
    if (!(agent.get("service") instanceof String)) {
      return invalid("agent.service", "not a string");
    }
    for (Map.Entry<?, ?> entry : agent.entrySet()) {
      Object name = entry.getKey();
      if (!name.equals("service") && !name.equals("name")) {
        return invalid("agent", "additional property '" + name + "'");
      }
      if (name.equals("name") && entry.getValue() != null && !(entry.getValue() instanceof String)) {
        return invalid("agent.name", "not a string or null");
      }
    }
    for (String name : List.of("detected_at", "expires_at")) {
      String text = record.get(name) instanceof String s ? s : "";
      if (parseDateTime(text).isEmpty()) {
        return invalid(name, "not an RFC 3339 date-time with a zone");
      }
    }
    Object systemMessage = record.get("system_message");
    if (systemMessage != null && !(systemMessage instanceof String)) {
      return invalid("system_message", "not a string or null");
    }
    if (kind.equals("downgrade") && !(systemMessage instanceof String)) {
      return invalid("system_message", "a downgrade carries one");
    }
    boolean hasOperator = record.containsKey("operator");
    if (hasOperator && !(record.get("operator") instanceof String operator && !operator.isEmpty())) {
      return invalid("operator", "not a non-empty string");
    }
    boolean recovery = "tool".equals(record.get("scope")) && FLEET_RULES.contains(rule);
    if (kind.equals("release") && !recovery && (!rule.equals("manual") || !hasOperator)) {
      return invalid("kind", "a release is manual and names its operator");
    }
    boolean hasPauseUntil = record.containsKey("pause_until");
    if (hasPauseUntil) {
      String text = record.get("pause_until") instanceof String s ? s : "";
      if (parseDateTime(text).isEmpty()) {
        return invalid("pause_until", "not an RFC 3339 date-time with a zone");
      }
    }
    boolean hasPauseFallback = record.containsKey("pause_fallback");
    Object fallback = record.get("pause_fallback");
    if (hasPauseFallback && !"kill".equals(fallback) && !"release".equals(fallback)) {
      return invalid("pause_fallback", "not kill or release");
    }
    if (kind.equals("pause") && (!hasPauseUntil || !hasPauseFallback)) {
      return invalid("kind", "a pause carries pause_until and pause_fallback");
    }
    boolean hasScope = record.containsKey("scope");
    String scope = record.get("scope") instanceof String s ? s : "";
    if (hasScope && !SCOPES.contains(scope)) {
      return invalid("scope", "not trace, conversation, agent or tool");
    }
    BadSignal badTool = checkTool(record, scope, rule);
    if (badTool != null) {
      return badTool;
    }
    boolean hasConversation = record.containsKey("conversation_id");
    if (hasConversation) {
      Object conversation = record.get("conversation_id");
      if (!(conversation instanceof String text)
          || text.isEmpty()
          || text.codePointCount(0, text.length()) > MAX_CONVERSATION_ID_CHARS) {
        return invalid("conversation_id",
            "not a string of 1 to " + MAX_CONVERSATION_ID_CHARS + " characters");
      }
    }
    if (scope.equals("conversation") != hasConversation) {
      return invalid("conversation_id", "a conversation signal, and only it, names its conversation");
    }
    if (scope.equals("agent") && ((String) agent.get("service")).isEmpty()) {
      return invalid("agent.service", "an agent signal names its service");
    }
    if ((scope.equals("conversation") || scope.equals("agent") || scope.equals("tool"))
        && !kind.equals("kill") && !kind.equals("release")) {
      return invalid("kind", "a scoped signal is a kill or a release");
    }
    boolean hasKeyId = record.containsKey("key_id");
    boolean hasSignature = record.containsKey("signature");
    if (hasKeyId != hasSignature) {
      return invalid("(top level)", "key_id and signature go together");
    }
    if (hasKeyId) {
      if (!(record.get("key_id") instanceof String id && HEX16.matcher(id).matches())) {
        return invalid("key_id", "not 16 lowercase hex");
      }
      if (!(record.get("signature") instanceof String)) {
        return invalid("signature", "not a string");
      }
    }
    return null;
  }

  private static String text(Object value) {
    return value instanceof String s ? s : null;
  }

  /**
   * The signal in value (any bytes), or a BadSignal naming the kind of bad record. keys (see
   * {@link #keyring}) are those a signal must be signed with; null obeys unsigned signals.
   */
  public static Signal read(byte[] value, Map<String, byte[]> keys, Instant now)
      throws BadSignal {
    if (value == null || value.length == 0) {
      throw new BadSignal("empty", "no value");
    }
    if (value.length > MAX_SIGNAL_BYTES) {
      throw new BadSignal("too_large",
          value.length + " bytes (at most " + MAX_SIGNAL_BYTES + ")");
    }
    String text;
    try {
      // Strict: malformed or surrogate-encoding bytes are refused, never replaced.
      text = StandardCharsets.UTF_8.newDecoder()
          .onMalformedInput(CodingErrorAction.REPORT)
          .onUnmappableCharacter(CodingErrorAction.REPORT)
          .decode(ByteBuffer.wrap(value))
          .toString();
    } catch (CharacterCodingException notUtf8) {
      throw new BadSignal("not_utf8", "not UTF-8");
    }
    Json.Parsed parsed;
    try {
      parsed = Json.parse(text);
    } catch (Json.JsonError e) {
      throw new BadSignal(e.kind(), e.getMessage());
    }
    if (!(parsed.value() instanceof Map<?, ?> map)) {
      String type = parsed.value() == null ? "null" : parsed.value().getClass().getSimpleName();
      throw new BadSignal("not_object", "a JSON " + type + ", not an object");
    }
    @SuppressWarnings("unchecked")
    Map<String, Object> record = (Map<String, Object>) map;
    if (Json.depthOf(record) > MAX_SIGNAL_DEPTH) {
      throw new BadSignal("too_deep", "nested more than " + MAX_SIGNAL_DEPTH + " levels");
    }
    if (parsed.loneSurrogate()) {
      throw new BadSignal("not_utf8", "a string holds a lone surrogate escape");
    }
    BadSignal problem = checkSchema(record);
    if (problem != null) {
      throw problem;
    }
    String traceId = (String) record.get("trace_id");
    if (keys != null) {
      String check = verify(record, keys);
      if (!check.equals("valid")) {
        String detail = "signal for trace " + traceId;
        if (check.equals("unknown_key")) {
          detail += ", signed with key id " + record.get("key_id") + ", not one of this agent's";
        }
        throw new BadSignal(check, detail);
      }
    }
    String expiresAt = (String) record.get("expires_at");
    Instant expires = parseDateTime(expiresAt).orElseThrow();
    if (!now.isBefore(expires)) {
      throw new BadSignal("expired", "signal for trace " + traceId + " expired at " + expiresAt);
    }
    @SuppressWarnings("unchecked")
    Map<String, Object> agent = (Map<String, Object>) record.get("agent");
    @SuppressWarnings("unchecked")
    Map<String, Object> evidence = (Map<String, Object>) record.get("evidence");
    return new Signal(
        (String) record.get("signal_id"),
        traceId,
        (String) record.get("kind"),
        (String) record.get("rule"),
        (String) record.get("reason"),
        Map.copyOf(evidence),
        (String) agent.get("service"),
        text(agent.get("name")),
        (String) record.get("detected_at"),
        expiresAt,
        text(record.get("system_message")),
        text(record.get("operator")),
        text(record.get("pause_until")),
        text(record.get("pause_fallback")),
        text(record.get("scope")),
        text(record.get("conversation_id")),
        record.get("tool") instanceof Map<?, ?> tool
            ? new Signal.Tool((String) tool.get("name"), (String) tool.get("server"))
            : null);
  }

  /** A tool signal names its tool ({name, server}), and only it; fleet rules only contain tools. */
  private static BadSignal checkTool(Map<?, ?> record, String scope, String rule) {
    boolean hasTool = record.containsKey("tool");
    if (hasTool) {
      if (!(record.get("tool") instanceof Map<?, ?> tool)) {
        return invalid("tool", "not an object");
      }
      for (String name : List.of("name", "server")) {
        if (!tool.containsKey(name)) {
          return invalid("tool", "'" + name + "' is a required property");
        }
      }
      for (Object name : tool.keySet()) {
        if (!"name".equals(name) && !"server".equals(name)) {
          return invalid("tool", "additional property '" + name + "'");
        }
      }
      if (!(tool.get("name") instanceof String name)
          || name.isEmpty()
          || name.codePointCount(0, name.length()) > MAX_TOOL_NAME_CHARS) {
        return invalid("tool.name", "not a string of 1 to " + MAX_TOOL_NAME_CHARS + " characters");
      }
      if (!(tool.get("server") instanceof String server)
          || server.codePointCount(0, server.length()) > MAX_TOOL_NAME_CHARS) {
        return invalid("tool.server",
            "not a string of at most " + MAX_TOOL_NAME_CHARS + " characters");
      }
    }
    if (scope.equals("tool") != hasTool) {
      return invalid("tool", "a tool signal, and only it, names its tool");
    }
    if (scope.equals("tool") && !FLEET_RULES.contains(rule) && !rule.equals("manual")) {
      return invalid("rule", "a tool signal is a fleet rule's or manual");
    }
    if (FLEET_RULES.contains(rule) && !scope.equals("tool")) {
      return invalid("scope", "a fleet rule contains a tool");
    }
    return null;
  }

  /** Trace ids are kept in lower case. */
  static String normalizeTraceId(String traceId) {
    return traceId.toLowerCase(java.util.Locale.ROOT);
  }

  static List<String> sortedKeys(Map<String, ?> map) {
    List<String> keys = new ArrayList<>(map.keySet());
    keys.sort(Json.CODE_POINT_ORDER);
    return keys;
  }
}
