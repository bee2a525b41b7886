import sys
from pathlib import Path

# tests/ helpers (spans.py) are imported as plain modules.
sys.path.insert(0, str(Path(__file__).parent))


def pytest_sessionstart(session) -> None:
    """Say which Kafka the run uses (tests/kafka_harness.py chooses it), even under -q."""
    from kafka_harness import CLUSTER

    line = f"kafka: {CLUSTER.describe()}"
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line)
    else:
        print(line, file=sys.stderr)
