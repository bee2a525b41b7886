package dev.spanguard.killswitch;

import static org.junit.jupiter.api.Assertions.assertEquals;

import java.nio.file.Files;
import java.nio.file.Path;
import java.util.HashMap;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;
import org.junit.jupiter.api.Test;

/**
 * The reader's lists are the kill-signal schema's: a client that lags refuses a new rule's
 * signals as invalid, which no vector would catch (docs/rules.md, "Adding a rule").
 */
@SuppressWarnings("unchecked")
class SchemaTest {
  static Map<String, Object> schema() throws Exception {
    Path path = Path.of("..", "..", "schemas", "kill-signal.schema.json");
    return (Map<String, Object>) Json.parse(Files.readString(path)).value();
  }

  static Set<Object> enumOf(Map<String, Object> properties, String name) {
    return new HashSet<>((List<Object>) ((Map<String, Object>) properties.get(name)).get("enum"));
  }

  @Test
  void rulesKindsScopesFieldsAndEvidenceAreTheSchemas() throws Exception {
    Map<String, Object> schema = schema();
    Map<String, Object> properties = (Map<String, Object>) schema.get("properties");
    assertEquals(enumOf(properties, "rule"), Set.copyOf(Signals.RULES));
    assertEquals(enumOf(properties, "kind"), Set.copyOf(Signals.KINDS));
    assertEquals(enumOf(properties, "scope"), Set.copyOf(Signals.SCOPES));
    assertEquals(properties.keySet(), Signals.FIELDS);
    assertEquals(schema.get("required"), Signals.REQUIRED);
    Map<String, Object> evidence = (Map<String, Object>)
        ((Map<String, Object>) properties.get("evidence")).get("properties");
    Map<String, Object> expected = new HashMap<>();
    evidence.forEach((name, rule) -> {
      Map<String, Object> field = (Map<String, Object>) rule;
      expected.put(name, field.get("type").equals("integer") ? field.get("minimum")
          : field.containsKey("pattern") ? "hex16" : "string");
    });
    assertEquals(expected, Signals.EVIDENCE_FIELDS);
  }
}
