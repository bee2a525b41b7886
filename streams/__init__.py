"""The Faust worker: wiring, agents, the table-backed state, topics, metrics, health."""

# Installed as spanguard.streams; loaded by its folder name (from the repository root) each of its
# modules would exist twice, with two copies of every class.
if __name__ != "spanguard.streams":
    raise ImportError(f"import spanguard.streams, not {__name__}")
