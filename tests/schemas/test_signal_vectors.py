"""The Python killswitch against the kill-signal vectors every language's client reads.

schemas/testdata/kill-signal-vectors.json is written by tests/support/signal_vectors.py;
clients/typescript and clients/go run the same vectors in their own tests. A vector marked
`python_lax` is decided strictly by those clients and not yet by this checkout's read_signal:
it is an expected failure here (strict: once read_signal decides it, the mark must go).

The sequences give the time instead of sleeping: the book's clock is set per step (SignalBook
reads the time through its module's `datetime`), and a wait's `meanwhile` steps happen on this
thread while the wait blocks on another. The scope resolution cases build real OpenTelemetry
baggage, a real SDK resource and, where a case has one, an active span of a real SDK provider,
as the clients' own tests do. The unguarded checks run through a KillSwitch (not started) and
count the warnings its logger writes.
"""

from __future__ import annotations

import base64
import functools
import json
import logging
import threading
import time
from datetime import UTC, datetime

import pytest
from opentelemetry import baggage
from opentelemetry import context as otel_context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

from spanguard.killswitch import signals as signals_module
from spanguard.killswitch.client import KillSwitch
from spanguard.killswitch.signals import AgentKilled, AgentPaused, SignalBook, ToolContained
from spanguard.schemas.decision import AgentIdentity, BadSignal, keyring, read_signal
from tests.support.signal_vectors import VECTORS, build

DOCUMENT = json.loads(VECTORS.read_text())
NOW = datetime.fromisoformat(DOCUMENT["now"].replace("Z", "+00:00"))
# A wait that should end on a step of `meanwhile` gets this long before the test calls it stuck.
SAFETY_TIMEOUT = 10.0


def value_of(vector: dict) -> bytes:
    if "value_base64" in vector:
        return base64.b64decode(vector["value_base64"])
    return vector["value"].encode("utf-8", "surrogatepass")


def keys_of(vector: dict) -> dict[str, bytes] | None:
    if vector["keys"] is None:
        return None
    return keyring([DOCUMENT["keys"][name] for name in vector["keys"]])


def verdict(vector: dict):
    try:
        signal = read_signal(value_of(vector), keys_of(vector), NOW)
    except BadSignal as bad:
        return bad.kind, None
    return "obey", signal


def test_the_file_is_what_the_generator_writes():
    assert json.loads(json.dumps(build())) == DOCUMENT


def test_the_key_ids_are_the_keys_own():
    assert {name: next(iter(keyring(key))) for name, key in DOCUMENT["keys"].items()} == DOCUMENT[
        "key_ids"
    ]


@pytest.mark.parametrize(
    "vector",
    [
        pytest.param(
            vector,
            id=vector["name"],
            marks=[pytest.mark.xfail(strict=True, reason="read_signal is laxer than the vector")]
            if vector.get("python_lax")
            else [],
        )
        for vector in DOCUMENT["vectors"]
    ],
)
def test_each_vector_gets_its_verdict(vector):
    kind, signal = verdict(vector)
    assert kind == vector["verdict"]
    if signal is not None:
        expected = vector["signal"]
        read = {
            **signal.to_dict(),
            "scope": signal.scope,
            "conversation_id": signal.conversation_id,
        }
        read["agent_service"], read["agent_name"] = signal.agent.service, signal.agent.name
        assert {name: read.get(name) for name in expected} == expected


class _Clock(datetime):
    """The sequence's time: `datetime.now()` in the signal book's module answers it."""

    current = NOW

    @classmethod
    def now(cls, tz=None):  # type: ignore[override]
        return cls.current.astimezone(tz or UTC)


def _at(moment: str) -> datetime:
    return datetime.fromisoformat(moment.replace("Z", "+00:00"))


def _outcome(call):
    """How a check or wait ends: ("pass" | "message" | "killed" | "paused", detail)."""
    try:
        message = call()
    except ToolContained as contained:
        return "contained", contained
    except AgentKilled as killed:
        return "killed", killed
    except AgentPaused as paused:
        return "paused", paused
    return ("pass", None) if message is None else ("message", message)


def _assert_outcome(outcome, step):
    kind, detail = outcome
    expect = step["expect"]
    if expect in ("killed", "paused", "pass", "contained"):
        assert kind == expect, (step, outcome)
    else:
        assert (kind, detail) == ("message", expect), step
    if "reason" in step:
        assert detail.reason == step["reason"], step
    if "until" in step:
        assert (detail.until, detail.fallback) == (step["until"], step["fallback"]), step


@pytest.fixture
def book(monkeypatch) -> SignalBook:
    """A SignalBook on the vectors' clock: _Clock, at the vectors' now until a step moves it."""
    monkeypatch.setattr(signals_module, "datetime", _Clock)
    monkeypatch.setattr(_Clock, "current", NOW)
    return SignalBook()


def _clock_or_delivery(
    step: dict, signals: dict[str, str], keys: dict[str, bytes], book: SignalBook
) -> bool:
    """Play a sequence step that sets the clock or delivers a signal to the book; False: the
    step is neither, and is the caller's to play."""
    if "clock" in step:
        _Clock.current = _at(step["clock"])
    elif "deliver" in step:
        signal = read_signal(signals[step["deliver"]].encode(), keys, _Clock.current)
        assert book.deliver(signal) is step["new"], step
    else:
        return False
    return True


@pytest.mark.parametrize("sequence", DOCUMENT["sequences"], ids=lambda s: s["name"])
def test_each_sequence_through_the_signal_book(sequence, book):
    keys = keyring(DOCUMENT["keys"]["current"])

    def run(step):
        if _clock_or_delivery(step, sequence["signals"], keys, book):
            return
        if "check" in step:
            agent = AgentIdentity(**step["agent"]) if "agent" in step else None
            check = lambda: book.check(step["check"], step.get("conversation"), agent)  # noqa: E731
            _assert_outcome(_outcome(check), step)
        elif "meanwhile" not in step:
            wait = lambda: book.wait(step["wait"], step["timeout"])  # noqa: E731
            _assert_outcome(_outcome(wait), step)
        else:
            ended: list = []
            waiter = threading.Thread(
                target=lambda: ended.append(
                    _outcome(lambda: book.wait(step["wait"], SAFETY_TIMEOUT))
                )
            )
            waiter.start()
            time.sleep(0.05)  # let it block; either order ends the wait the same way
            for inner in step["meanwhile"]:
                run(inner)
            waiter.join(SAFETY_TIMEOUT + 5)
            assert ended, f"the wait did not end: {step}"
            _assert_outcome(ended[0], step)

    for step in sequence["steps"]:
        run(step)


@pytest.mark.parametrize("sequence", DOCUMENT["tool_sequences"], ids=lambda s: s["name"])
def test_each_tool_sequence_through_the_signal_book(sequence, book):
    keys = keyring(DOCUMENT["keys"]["current"])
    refused = 0
    for step in sequence["steps"]:
        if _clock_or_delivery(step, sequence["signals"], keys, book):
            continue
        outcome = _outcome(
            functools.partial(
                book.check, step["check"], tool=step.get("tool"), server=step.get("server")
            )
        )
        _assert_outcome(outcome, step)
        refused += outcome[0] == "contained"
        if outcome[0] == "contained":
            assert outcome[1].tool == step["tool"], step
            assert str(outcome[1]).startswith(f"tool {step['tool']} is contained by spanguard")
    assert book.tool_calls_refused == refused


def _agent(entry: dict | None) -> AgentIdentity | None:
    return AgentIdentity(entry["service"], entry["name"]) if entry else None


@pytest.mark.parametrize("case", DOCUMENT["scope_resolution"], ids=lambda c: c["name"])
def test_each_scope_resolution_through_the_kill_switch(case):
    """KillSwitch.scope on real OpenTelemetry baggage and a real SDK provider's resource."""
    switch = KillSwitch(
        "127.0.0.1:9",  # never contacted: the switch is not started
        allow_unsigned=True,
        start=False,
        ack_topic=None,
        conversation_id=case["switch"].get("conversation"),
        agent=_agent(case["switch"].get("agent")),
        tracer_provider=TracerProvider(resource=Resource(case["switch"]["resource"])),
    )
    bag = otel_context.get_current()
    for key, value in case["baggage"].items():
        bag = baggage.set_baggage(key, value, context=bag)
    token = otel_context.attach(bag)
    try:
        given = (case["given"].get("conversation"), _agent(case["given"].get("agent")))
        if "span_resource" in case:
            tracer = TracerProvider(resource=Resource(case["span_resource"])).get_tracer("test")
            with tracer.start_as_current_span("invoke_agent"):
                found = switch.scope(*given)
        else:
            found = switch.scope(*given)
    finally:
        otel_context.detach(token)
        switch.close()
    assert found == (case["expect"]["conversation"], _agent(case["expect"]["agent"]))


def test_the_vectors_hold_scope_cases_with_an_active_span():
    assert sum("span_resource" in case for case in DOCUMENT["scope_resolution"]) >= 3


@pytest.mark.parametrize("sequence", DOCUMENT["unguarded_checks"], ids=lambda s: s["name"])
def test_each_unguarded_check_sequence_through_the_kill_switch(sequence, caplog):
    """KillSwitch.check with no trace id and no span: counted in `unguarded`, warned once."""
    switch = KillSwitch(
        "127.0.0.1:9",  # never contacted: the switch is not started
        signing_key=DOCUMENT["keys"]["current"],
        start=False,
        ack_topic=None,
        clock=lambda: NOW,
    )
    keys = keyring(DOCUMENT["keys"]["current"])
    caplog.set_level(logging.WARNING, logger="spanguard.killswitch")
    try:
        for step in sequence["steps"]:
            if "deliver" in step:
                signal = read_signal(sequence["signals"][step["deliver"]].encode(), keys, NOW)
                assert switch.signals.deliver(signal) is step["new"], step
                continue
            check = functools.partial(
                switch.check,
                step["check"],
                conversation_id=step.get("conversation"),
                agent=_agent(step.get("agent")),
            )
            _assert_outcome(_outcome(check), step)
            warnings = [r for r in caplog.records if r.name == "spanguard.killswitch"]
            assert (switch.unguarded, len(warnings)) == (step["unguarded"], step["warnings"]), step
    finally:
        switch.close()
    if any(step.get("warnings") for step in sequence["steps"]):
        assert "NOT guarded" in warnings[0].getMessage()
