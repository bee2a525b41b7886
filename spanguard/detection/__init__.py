"""Detection: OTLP spans in, guard decisions out (rules, per-trace state, span conventions, replay)."""
