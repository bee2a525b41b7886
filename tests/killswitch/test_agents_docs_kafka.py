"""The agent side as documented: the README's and docs/agents.md's snippets run, and
`KillSwitch.start()` is idempotent, against the real broker."""

from __future__ import annotations

import json
import re
import textwrap
import threading
import uuid
from pathlib import Path

import pytest

from spanguard.killswitch import AgentKilled
from spanguard.killswitch.client import KillSwitch
from spanguard.schemas.decision import sign
from tests.support.kafka_harness import (
    BOOTSTRAP,
    CLUSTER,
    ROOT,
    ensure_broker,
    producer,
    scratch_topic,
)
from tests.support.spans import kill_signal
from tests.support.waiting import wait_until

pytestmark = pytest.mark.kafka

KEY = "docs-snippet-signing-key-0123456789"


@pytest.fixture(scope="module")
def topic():
    ensure_broker()
    with scratch_topic(2) as name:
        yield name


def python_blocks(path: Path, section: str | None = None) -> list[str]:
    text = path.read_text()
    if section is not None:
        start = text.index(section)
        end = text.find("\n## ", start + len(section))
        text = text[start : end if end != -1 else None]
    return re.findall(r"```python\n(.*?)```", text, re.S)


def for_the_test(code: str, topic: str) -> str:
    """The snippet with the test's broker and kill topic in place of `kafka:9092`."""
    return code.replace('"kafka:9092"', f'"{BOOTSTRAP}", topic="{topic}", ack_topic="{topic}-acks"')


def publish_kill(topic: str, trace_id: str) -> None:
    record = sign(kill_signal(trace_id).to_dict(), KEY.encode())
    out = producer()
    out.produce(topic, key=trace_id.encode(), value=json.dumps(record).encode())
    assert out.flush(10) == 0


def scripted_langgraph_parts(calls: list[str], kill: object) -> tuple[object, list[object]]:
    """The `model` and `tools` the LangGraph snippet takes: a model asking for the same search
    forever, and a search that has the kill published at its 3rd call (as the worker would)."""
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage
    from langchain_core.tools import tool

    def stuck():
        turn = 0
        while True:
            turn += 1
            call = {"name": "search_docs", "args": {"query": "refund"}, "id": f"call_{turn}"}
            yield AIMessage(content="", tool_calls=[call])

    class ScriptedChatModel(GenericFakeChatModel):
        def bind_tools(self, tools, **kwargs):
            return self

    @tool
    def search_docs(query: str) -> str:
        """Search the knowledge base."""
        calls.append(query)
        if len(calls) == 3:
            kill()
        return "no results"

    return ScriptedChatModel(messages=stuck()), [search_docs]


def test_the_documented_snippets_run_and_stop_a_langgraph_agent(topic, monkeypatch, tmp_path):
    pytest.importorskip("openinference.instrumentation.langchain")
    from openinference.instrumentation.langchain import LangChainInstrumentor

    key_file = tmp_path / "signing-key"
    key_file.write_text(KEY + "\n")
    monkeypatch.delenv("SPANGUARD_SIGNING_KEY", raising=False)
    monkeypatch.setenv("SPANGUARD_SIGNING_KEY_FILE", str(key_file))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")  # nobody there
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")

    namespace: dict = {}
    readme = python_blocks(ROOT / "README.md", "## Agents: the killswitch")
    assert readme, "the README's agent section has no python snippet"
    for code in readme:
        exec(for_the_test(code, topic), namespace)  # no span: check() returns None, counted
    assert namespace["switch"].unguarded == 1
    namespace["switch"].close()

    guide = python_blocks(ROOT / "docs" / "agents.md")
    # The last, the in-process guard, needs an agent's exporter: test_inprocess.py covers it.
    assert len(guide) == 5, (
        "the killswitch, the export processor, LangGraph, exit_on_stop, the in-process guard"
    )
    exec(for_the_test(guide[0], topic), namespace)
    exec(guide[1], namespace)
    switch = namespace["switch"]
    checked: list[str] = []
    check = switch.check

    def recording_check(trace_id=None):
        checked.append(trace_id)
        return check(trace_id)

    switch.check = recording_check  # which trace the adapter checks: the one to kill
    calls: list[str] = []

    def kill() -> None:
        publish_kill(topic, checked[-1])
        for _ in range(200):  # the kill reaches the agent before its next step
            if switch.signals.is_killed(checked[-1]):
                return
            threading.Event().wait(0.05)

    namespace["model"], namespace["tools"] = scripted_langgraph_parts(calls, kill)
    try:
        exec(guide[2], namespace)  # catches AgentKilled and prints the reason
    finally:
        LangChainInstrumentor().uninstrument()
        namespace["provider"].shutdown()
        switch.close()
    assert len(calls) == 3, calls
    assert len(set(checked)) == 1 and None not in checked
    assert switch.unguarded == 0


def test_the_documented_exit_on_stop_exits_75_with_the_stop_reason(capsys):
    (snippet,) = [b for b in python_blocks(ROOT / "docs" / "agents.md") if "exit_on_stop" in b]
    killed = AgentKilled(kill_signal(uuid.uuid4().hex))

    class StoppedAgent:  # a framework that wraps the AgentKilled, as ADK does
        def invoke(self, *args: object) -> None:
            raise RuntimeError("Error in plugin 'spanguard'") from killed

    with pytest.raises(SystemExit) as exited:
        exec(textwrap.dedent(snippet), {"agent": StoppedAgent()})  # a list item's block
    assert exited.value.code == 75
    reason = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert reason["decision_id"] == killed.decision_id and reason["action"] == "kill"


def test_start_is_idempotent(topic):
    switch = KillSwitch(BOOTSTRAP, topic, signing_key=KEY)
    try:
        assert switch.start() is switch and switch.start() is switch
        trace_id = uuid.uuid4().hex
        publish_kill(topic, trace_id)
        deadline = threading.Event()
        for _ in range(200):
            if switch.signals.is_killed(trace_id):
                break
            deadline.wait(0.05)
        with pytest.raises(AgentKilled):
            switch.check(trace_id)
    finally:
        switch.close()

    deferred = KillSwitch(BOOTSTRAP, topic, signing_key=KEY, start=False)
    try:
        assert deferred.start() is deferred
        assert deferred.start() is deferred
        threads = [t for t in threading.enumerate() if t.name == "spanguard-killswitch"]
        assert len(threads) == 1
    finally:
        deferred.close()


def test_an_obeyed_kill_and_downgrade_are_acknowledged_once_signed(topic):
    from spanguard.connectors.audit import read_decisions
    from spanguard.killswitch.acks import ack_status
    from spanguard.schemas.decision import keyring

    with scratch_topic(2, "obeyed-acks") as acks_topic:
        trace_id = uuid.uuid4().hex
        switch = KillSwitch(BOOTSTRAP, topic, signing_key=KEY, ack_topic=acks_topic)
        try:
            out = producer()
            for action in ("downgrade", "kill"):
                record = sign(
                    kill_signal(trace_id, action, "Stop and report.").to_dict(), KEY.encode()
                )
                out.produce(topic, key=trace_id.encode(), value=json.dumps(record).encode())
            assert out.flush(10) == 0
            wait_until(lambda: switch.signals.is_killed(trace_id), timeout=10)
            with pytest.raises(AgentKilled):  # the kill wins; the downgrade's message stays unread
                switch.check(trace_id)
            with pytest.raises(AgentKilled):  # raised again, acked once
                switch.check(trace_id)
        finally:
            switch.close()  # flushes the acks
        scan = read_decisions(BOOTSTRAP, CLUSTER.security, acks_topic, trace_id, timeout=20)
    assert [ack["action"] for ack in scan.records] == ["kill"], scan.records
    ack = scan.records[0]
    assert ack["kind"] == "ack" and ack["trace_id"] == trace_id and ":" in ack["process"]
    assert ack_status(ack, keyring(KEY)) == "valid"
    assert ack_status(ack, keyring("another-key-0123456789")) == "unknown_key"


def test_a_read_downgrade_is_acknowledged(topic):
    from spanguard.connectors.audit import read_decisions

    with scratch_topic(1, "acks") as acks_topic:
        trace_id = uuid.uuid4().hex
        switch = KillSwitch(BOOTSTRAP, topic, signing_key=KEY, ack_topic=acks_topic)
        try:
            assert switch.check(trace_id) is None  # the agent runs the trace
            signal = kill_signal(trace_id, "downgrade", "Try a different approach.")
            record = sign(signal.to_dict(), KEY.encode())
            out = producer()
            out.produce(topic, key=trace_id.encode(), value=json.dumps(record).encode())
            assert out.flush(10) == 0
            message = wait_until(lambda: switch.check(trace_id), timeout=10)
            assert message == "Try a different approach."
        finally:
            switch.close()
        scan = read_decisions(BOOTSTRAP, CLUSTER.security, acks_topic, trace_id, timeout=20)
    assert [(a["action"], a["signal_id"]) for a in scan.records] == [
        ("downgrade", signal.signal_id)
    ]
