import sys

from tests.support.python_source import pause_gc_while_parsing

# Before pytest imports (and so parses) any test module: see tests/support/python_source.py.
pause_gc_while_parsing()


def pytest_sessionstart(session) -> None:
    """Say which Kafka the run uses (tests/support/kafka_harness.py chooses it), even under -q."""
    from tests.support.kafka_harness import CLUSTER

    line = f"kafka: {CLUSTER.describe()}"
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line)
    else:
        print(line, file=sys.stderr)
