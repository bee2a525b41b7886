"""Conversation and agent kills on the real broker: `spanguard kill|release --conversation ID`
and `--agent SERVICE[/NAME]` (the real CLI, signed with the worker's key) against a KillSwitch
that knows its conversation and agent (passed in, set on the switch, or from OTel baggage)."""

from __future__ import annotations

import subprocess
import uuid

import pytest
from opentelemetry import baggage, context

from spanguard.killswitch.client import KillSwitch
from spanguard.killswitch.signals import AgentKilled
from spanguard.schemas.decision import AgentIdentity
from tests.support.kafka_harness import BOOTSTRAP, SIGNING_KEY
from tests.support.waiting import wait_until
from tests.support.worker import operator_cli

pytestmark = pytest.mark.kafka


def new_trace() -> str:
    return uuid.uuid4().hex


def sent(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr


def test_a_conversation_kill_stops_that_conversation_only_until_released(topics):
    conversation, other = f"conv-{uuid.uuid4().hex[:8]}", f"conv-{uuid.uuid4().hex[:8]}"
    with KillSwitch(BOOTSTRAP, topics.kills, signing_key=SIGNING_KEY, ack_topic=None) as switch:
        assert switch.check(new_trace(), conversation_id=conversation) is None
        sent(
            operator_cli("kill", topics, "--conversation", conversation, "--reason", "refund loop")
        )
        wait_until(lambda: switch.received >= 1)
        # A new trace of the conversation is stopped at its first check.
        with pytest.raises(AgentKilled) as caught:
            switch.check(new_trace(), conversation_id=conversation)
        assert caught.value.scope == "conversation"
        assert caught.value.signal.conversation_id == conversation
        assert f"conversation {conversation}" in str(caught.value)
        assert switch.check(new_trace(), conversation_id=other) is None
        assert switch.check(new_trace()) is None
        # The conversation named in OpenTelemetry baggage, as a framework propagates it.
        token = context.attach(baggage.set_baggage("gen_ai.conversation.id", conversation))
        try:
            with pytest.raises(AgentKilled):
                switch.check(new_trace())
        finally:
            context.detach(token)
        sent(operator_cli("release", topics, "--conversation", conversation))
        wait_until(lambda: switch.received >= 2)
        assert switch.check(new_trace(), conversation_id=conversation) is None


def test_an_agent_kill_stops_that_agent_and_not_another_until_released(topics):
    service = f"svc-{uuid.uuid4().hex[:6]}"
    triage = KillSwitch(
        BOOTSTRAP, topics.kills, signing_key=SIGNING_KEY, ack_topic=None, agent=f"{service}/triage"
    )
    billing = KillSwitch(
        BOOTSTRAP,
        topics.kills,
        signing_key=SIGNING_KEY,
        ack_topic=None,
        agent=AgentIdentity(service, "billing"),
    )
    with triage, billing:
        result = operator_cli("kill", topics, "--agent", f"{service}/triage", "--reason", "spend")
        sent(result)
        assert f"agent {service}/triage" in result.stdout and "until" in result.stdout
        wait_until(lambda: triage.received >= 1 and billing.received >= 1)
        with pytest.raises(AgentKilled) as caught:
            triage.check(new_trace())  # a trace it never ran before
        assert caught.value.scope == "agent"
        assert caught.value.signal.agent == AgentIdentity(service, "triage")
        assert billing.check(new_trace()) is None
        # The agent passed to one check wins over the switch's own.
        assert triage.check(new_trace(), agent=f"{service}/billing") is None
        sent(operator_cli("release", topics, "--agent", f"{service}/triage"))
        wait_until(lambda: triage.received >= 2)
        assert triage.check(new_trace()) is None
        # Without /NAME: every agent of the service.
        sent(operator_cli("kill", topics, "--agent", service, "--reason", "all of them"))
        wait_until(lambda: billing.received >= 3)
        with pytest.raises(AgentKilled):
            billing.check(new_trace())
        assert billing.check(new_trace(), agent=f"other-{service}/billing") is None


def test_the_cli_refuses_a_scope_without_its_id_and_two_targets(topics):
    for args in (
        ["--conversation", ""],
        ["--agent", "/triage"],
        ["--conversation", "c" * 201],
        [new_trace(), "--conversation", "c1"],
        [],
    ):
        result = operator_cli("release", topics, *args)
        assert result.returncode != 0, args
        assert result.stderr.strip().count("\n") == 0, result.stderr  # one line
