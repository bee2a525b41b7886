"""Every Kafka and HTTP client outside the Faust worker: the Kafka libraries' side of a
connection, topics, the audit and kill-topic readers, the backtest's reader, the judge's client
and the one outbound HTTP delivery loop."""

# Installed as spanguard.connectors; loaded by its folder name (from the repository root) each of
# its modules would exist twice, with two copies of every class.
if __name__ != "spanguard.connectors":
    raise ImportError(f"import spanguard.connectors, not {__name__}")
