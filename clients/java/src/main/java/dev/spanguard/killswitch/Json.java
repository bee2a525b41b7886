package dev.spanguard.killswitch;

import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Comparator;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * A strict JSON reader for kill-signal records, and the canonical JSON a signature covers.
 *
 * <p>Jackson and org.json keep the last of duplicate keys (or fail late) and read big integers
 * exactly; another language's parser may keep the first key or round. A record two parsers would
 * read differently must be refused by every killswitch alike
 * (schemas/testdata/kill-signal-vectors.json), so, as clients/go/json.go: duplicate keys are
 * refused, a number that is not an integer within +-(2**53 - 1) stays a {@link RawNumber} (the
 * schema then refuses it), and a lone surrogate escape is reported.
 *
 * <p>Values: {@code Map<String, Object>} (insertion order), {@code List<Object>}, {@code Long},
 * {@link RawNumber}, {@code String}, {@code Boolean}, {@code null}.
 */
public final class Json {
  static final int MAX_PARSE_DEPTH = 512;
  static final long MAX_SAFE_INTEGER = (1L << 53) - 1;

  private static final Pattern NUMBER =
      Pattern.compile("-?(?:0|[1-9][0-9]*)(?:\\.[0-9]+)?(?:[eE][+-]?[0-9]+)?");
  private static final Pattern INTEGER = Pattern.compile("-?(?:0|[1-9][0-9]*)");

  private Json() {}

  /** A JSON number that is not a safe integer, as written. */
  public record RawNumber(String text) {
    @Override
    public String toString() {
      return text;
    }
  }

  /** Why a text is not JSON: kind "not_json" or "too_deep". */
  public static final class JsonError extends Exception {
    final String kind;

    JsonError(String kind, String detail) {
      super(detail, null, false, false);
      this.kind = kind;
    }

    public String kind() {
      return kind;
    }
  }

  /** A parsed document, and whether a string in it held a lone surrogate escape. */
  public record Parsed(Object value, boolean loneSurrogate) {}

  public static Parsed parse(String text) throws JsonError {
    Parser p = new Parser(text);
    Object value = p.value(0);
    p.space();
    if (p.at != text.length()) {
      throw p.fail("extra data after the document");
    }
    return new Parsed(value, p.loneSurrogate);
  }

  private static final class Parser {
    final String text;
    int at;
    boolean loneSurrogate;

    Parser(String text) {
      this.text = text;
    }

    JsonError fail(String what) {
      return new JsonError("not_json", what + " at offset " + at);
    }

    void space() {
      while (at < text.length()) {
        char c = text.charAt(at);
        if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
          at++;
        } else {
          return;
        }
      }
    }

    Object value(int depth) throws JsonError {
      space();
      if (at >= text.length()) {
        throw fail("unexpected end");
      }
      char c = text.charAt(at);
      if (c == '{' || c == '[') {
        if (depth >= MAX_PARSE_DEPTH) {
          throw new JsonError("too_deep", "nested too deeply to decode");
        }
        return c == '{' ? object(depth + 1) : array(depth + 1);
      }
      if (c == '"') {
        return string();
      }
      if (text.startsWith("true", at)) {
        at += 4;
        return Boolean.TRUE;
      }
      if (text.startsWith("false", at)) {
        at += 5;
        return Boolean.FALSE;
      }
      if (text.startsWith("null", at)) {
        at += 4;
        return null;
      }
      Matcher m = NUMBER.matcher(text).region(at, text.length());
      if (!m.lookingAt()) {
        throw fail("unexpected character");
      }
      String literal = m.group();
      at += literal.length();
      if (INTEGER.matcher(literal).matches() && literal.length() <= 20) {
        try {
          long n = Long.parseLong(literal);
          if (n >= -MAX_SAFE_INTEGER && n <= MAX_SAFE_INTEGER) {
            return n;
          }
        } catch (NumberFormatException beyondLong) {
          // a RawNumber below
        }
      }
      return new RawNumber(literal);
    }

    String string() throws JsonError {
      at++; // the opening quote
      StringBuilder out = new StringBuilder();
      int start = at;
      while (true) {
        if (at >= text.length()) {
          throw fail("unterminated string");
        }
        char c = text.charAt(at);
        if (c == '"') {
          out.append(text, start, at);
          at++;
          return out.toString();
        }
        if (c < 0x20) {
          throw fail("control character in a string");
        }
        if (c != '\\') {
          at++;
          continue;
        }
        out.append(text, start, at);
        if (at + 1 >= text.length()) {
          throw fail("bad escape");
        }
        char escape = text.charAt(at + 1);
        at += 2;
        switch (escape) {
          case '"', '\\', '/' -> out.append(escape);
          case 'b' -> out.append('\b');
          case 'f' -> out.append('\f');
          case 'n' -> out.append('\n');
          case 'r' -> out.append('\r');
          case 't' -> out.append('\t');
          case 'u' -> unicode(out);
          default -> throw fail("bad escape");
        }
        start = at;
      }
    }

    private void unicode(StringBuilder out) throws JsonError {
      int unit = hex4();
      if (!Character.isSurrogate((char) unit)) {
        out.append((char) unit);
        return;
      }
      if (unit < 0xdc00 && text.startsWith("\\u", at)) {
        int save = at;
        at += 2;
        int low = hex4();
        if (low >= 0xdc00 && low <= 0xdfff) {
          out.append((char) unit).append((char) low);
          return;
        }
        at = save;
      }
      // Another language's parser would fail or substitute: refused as not_utf8 later.
      loneSurrogate = true;
      out.append('\ufffd');
    }

    int hex4() throws JsonError {
      if (at + 4 > text.length()) {
        throw fail("bad \\u escape");
      }
      int n = 0;
      for (int i = 0; i < 4; i++) {
        int digit = Character.digit(text.charAt(at + i), 16);
        if (digit < 0 || text.charAt(at + i) > 0x7f) {
          throw fail("bad \\u escape");
        }
        n = n * 16 + digit;
      }
      at += 4;
      return n;
    }

    /** Steps over c when it comes next. */
    boolean eat(char c) {
      if (at < text.length() && text.charAt(at) == c) {
        at++;
        return true;
      }
      return false;
    }

    /** After a member of a container that close ends: true when another member follows. */
    boolean another(char close) throws JsonError {
      space();
      if (eat(',')) {
        return true;
      }
      if (eat(close)) {
        return false;
      }
      throw fail("expected ',' or '" + close + "'");
    }

    Map<String, Object> object(int depth) throws JsonError {
      at++;
      Map<String, Object> out = new LinkedHashMap<>();
      space();
      if (eat('}')) {
        return out;
      }
      do {
        space();
        if (at >= text.length() || text.charAt(at) != '"') {
          throw fail("expected a key");
        }
        String key = string();
        if (out.containsKey(key)) {
          throw fail("duplicate key " + Signals.printable(key));
        }
        space();
        if (!eat(':')) {
          throw fail("expected ':'");
        }
        out.put(key, value(depth));
      } while (another('}'));
      return out;
    }

    List<Object> array(int depth) throws JsonError {
      at++;
      List<Object> out = new ArrayList<>();
      space();
      if (eat(']')) {
        return out;
      }
      do {
        out.add(value(depth));
      } while (another(']'));
      return out;
    }
  }

  /** How deeply containers nest in value (1 for a flat object). */
  static int depthOf(Object value) {
    int deepest = 0;
    if (value instanceof Map<?, ?> map) {
      for (Object child : map.values()) {
        deepest = Math.max(deepest, depthOf(child));
      }
      return deepest + 1;
    }
    if (value instanceof List<?> list) {
      for (Object child : list) {
        deepest = Math.max(deepest, depthOf(child));
      }
      return deepest + 1;
    }
    return 0;
  }

  /** Keys in code point order, as Python's sort_keys and Go's bytewise UTF-8 sort. */
  static final Comparator<String> CODE_POINT_ORDER =
      (a, b) -> {
        int i = 0;
        int j = 0;
        while (i < a.length() && j < b.length()) {
          int x = a.codePointAt(i);
          int y = b.codePointAt(j);
          if (x != y) {
            return Integer.compare(x, y);
          }
          i += Character.charCount(x);
          j += Character.charCount(y);
        }
        return Integer.compare(a.length() - i, b.length() - j);
      };

  /**
   * The text a signature covers: keys sorted by code point, no spaces, only quote, backslash and
   * control characters escaped (Python's json.dumps, sort_keys, ensure_ascii=False).
   *
   * @throws IllegalArgumentException for a value with no canonical form (a RawNumber)
   */
  public static String canonical(Object value) {
    StringBuilder out = new StringBuilder();
    write(out, value);
    return out.toString();
  }

  static byte[] canonicalBytes(Object value) {
    return canonical(value).getBytes(StandardCharsets.UTF_8);
  }

  private static void write(StringBuilder out, Object value) {
    if (value == null) {
      out.append("null");
    } else if (value instanceof Boolean b) {
      out.append(b.booleanValue());
    } else if (value instanceof Long || value instanceof Integer) {
      out.append(((Number) value).longValue());
    } else if (value instanceof String s) {
      quote(out, s);
    } else if (value instanceof List<?> list) {
      out.append('[');
      String comma = "";
      for (Object item : list) {
        out.append(comma);
        write(out, item);
        comma = ",";
      }
      out.append(']');
    } else if (value instanceof Map<?, ?> map) {
      List<String> keys = new ArrayList<>();
      for (Object key : map.keySet()) {
        keys.add((String) key);
      }
      keys.sort(CODE_POINT_ORDER);
      out.append('{');
      String comma = "";
      for (String key : keys) {
        out.append(comma);
        quote(out, key);
        out.append(':');
        write(out, map.get(key));
        comma = ",";
      }
      out.append('}');
    } else {
      throw new IllegalArgumentException("no canonical JSON for a " + value.getClass().getSimpleName());
    }
  }

  static void quote(StringBuilder out, String text) {
    out.append('"');
    for (int i = 0; i < text.length(); i++) {
      char c = text.charAt(i);
      switch (c) {
        case '"' -> out.append("\\\"");
        case '\\' -> out.append("\\\\");
        case '\n' -> out.append("\\n");
        case '\r' -> out.append("\\r");
        case '\t' -> out.append("\\t");
        case '\b' -> out.append("\\b");
        case '\f' -> out.append("\\f");
        default -> {
          if (c < 0x20) {
            out.append(String.format("\\u%04x", (int) c));
          } else {
            out.append(c);
          }
        }
      }
    }
    out.append('"');
  }
}
