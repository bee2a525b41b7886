"""Each framework's adapter finds the run's trace under the real instrumentation libraries.

The looping agents of tests/support/instrumented_agents.py run with spanguard's adapter and a
SignalBook; when their 3rd call runs, the kill is delivered for the trace of the spans the
instrumentation exported so far, as the worker would. The agent stops only if the adapter
checked that trace: OpenInference's LangChain instrumentation sets no current span during
callbacks, so an adapter reading only the current span lets that agent make all 15 calls.
Each row runs in a process of its own (instrumentors patch globally).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import uuid

import pytest

from spanguard.killswitch import AgentKilled, SignalBook
from tests.support.guarded_agents import ROWS, TRIPS_AT, missing
from tests.support.instrumented_agents import LIBRARIES, ROOT
from tests.support.spans import kill_signal

# `make test` runs the row whose instrumentation makes no span current; `make test-agents` all.
ROW_PARAMS = [
    pytest.param(
        row, marks=[] if row == "langgraph+openinference" else [pytest.mark.agents], id=row
    )
    for row in ROWS
]


@pytest.mark.parametrize("row", ROW_PARAMS)
def test_the_adapter_checks_the_instrumented_run_and_stops_it_at_the_trip(row):
    library = LIBRARIES[ROWS[row][0]]
    if (reason := missing(row)) is not None:
        pytest.skip(reason)
    result = subprocess.run(
        [library.python, "-m", "tests.support.guarded_agents", "offline", row],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["status"] == "killed", outcome
    assert outcome["calls"] == TRIPS_AT, outcome
    assert "AgentKilled" in outcome["exception"], outcome
    # What the agent code sees: AgentKilled, or (per framework) an exception caused by it.
    assert outcome["exception"][0] in {"AgentKilled", ROWS[row][1]}, outcome
    assert len(outcome["trace_ids"]) == 1 and outcome["unguarded"] == 0, outcome


def test_a_langchain_run_with_no_trace_is_counted_and_warned_about_once(caplog):
    """No instrumentation, no span of the agent's own: nothing can be checked, and the adapter
    says so (naming LangChain and what to do) instead of skipping in silence."""
    pytest.importorskip("langchain_core")
    from langchain_core.tools import tool

    from spanguard.killswitch.adapters_langchain import SpanguardCallbackHandler

    @tool
    def search_docs(query: str) -> str:
        """Search the knowledge base."""
        return ""

    handler = SpanguardCallbackHandler(SignalBook())
    with caplog.at_level(logging.WARNING, logger="spanguard.killswitch"):
        for _ in range(3):
            search_docs.invoke({"query": "refund policy"}, config={"callbacks": [handler]})
    assert handler.unguarded == 3
    warnings = [r.getMessage() for r in caplog.records if "NOT guarded" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "LangChain" in warnings[0] and "LangChainInstrumentor().instrument()" in warnings[0]


def test_a_killswitch_counts_unguarded_checks_and_warns_once(caplog):
    from spanguard.killswitch.adapters_langchain import SpanguardCallbackHandler
    from spanguard.killswitch.client import KillSwitch

    switch = KillSwitch("127.0.0.1:1", signing_key="k" * 32, start=False)
    with caplog.at_level(logging.WARNING, logger="spanguard.killswitch"):
        assert switch.check() is None  # no trace id, no current span
        assert switch.check() is None
        handler = SpanguardCallbackHandler(switch)
        handler.check_trace(None)
    assert switch.unguarded == 3 and handler.unguarded == 1
    warnings = [r.getMessage() for r in caplog.records if "NOT guarded" in r.getMessage()]
    assert len(warnings) == 2, warnings  # once for check(), once for the adapter
    assert "KillSwitch.check()" in warnings[0] and "LangChain" in warnings[1]


def test_the_langchain_handler_takes_the_trace_recorded_at_the_run_start():
    """A span current when the run starts, none in the callback that starts the tool (a
    thread without the context): the tool's check uses the run's trace."""
    pytest.importorskip("langchain_core")
    from spanguard.killswitch.adapters_langchain import SpanguardCallbackHandler

    book, trace_id = SignalBook(), uuid.uuid4().hex
    handler = SpanguardCallbackHandler(book)
    root, step, tool_run = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    handler.remember_run(root, None, trace_id)  # what on_chain_start records under a span
    handler.on_chain_start({}, {}, run_id=step, parent_run_id=root)
    book.deliver(kill_signal(trace_id))
    with pytest.raises(AgentKilled):
        handler.on_tool_start({}, "refund policy", run_id=tool_run, parent_run_id=step)
    assert handler.unguarded == 0


def test_the_adapters_module_needs_no_framework():
    code = (
        "import sys, spanguard.killswitch.adapters as a; "
        "assert 'langchain_core' not in sys.modules and 'agents' not in sys.modules; "
        "print(sorted(a.__all__))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
