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


def pytest_collection_finish(session) -> None:
    """In a run of one process, the compiled core's wheel starts building now, beside the tests
    before its own (tests/support/compiled_build.py); under xdist its test builds it."""
    from tests.support.compiled_build import COMPILED_BUILD, TEST

    config = session.config
    one_process = not hasattr(config, "workerinput") and not config.getoption("numprocesses", 0)
    selected = any(item.nodeid == TEST for item in session.items)
    if one_process and selected and not config.option.collectonly:
        COMPILED_BUILD.start(background=True)


def pytest_sessionfinish(session) -> None:
    from tests.support.compiled_build import COMPILED_BUILD

    COMPILED_BUILD.stop()
