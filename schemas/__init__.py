"""Wire contracts: OTLP decoding, the policy file, decisions and kill signals, JSON schemas."""

# Installed as spanguard.schemas; loaded by its folder name (from the repository root) each of its
# modules would exist twice, with two copies of every class.
if __name__ != "spanguard.schemas":
    raise ImportError(f"import spanguard.schemas, not {__name__}")
