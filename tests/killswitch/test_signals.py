"""SignalBook and AgentKilled (killswitch/signals.py): the kills and downgrades each trace was
told about, each handed to its agent once."""

from __future__ import annotations

import pickle
import threading
from dataclasses import replace

import pytest

from spanguard.killswitch import AgentKilled, SignalBook
from tests.support.spans import kill_signal

signal = kill_signal


def test_signal_book_ignores_duplicates_and_keeps_a_kill():
    book = SignalBook()
    assert book  # empty yet truthy: `signals or SignalBook()` keeps a shared book
    kill = signal("ab" * 16)
    assert book.check("ab" * 16) is None
    assert book.deliver(kill) is True
    assert book.deliver(kill) is False
    assert (book.delivered, book.duplicates) == (1, 1)
    for _ in range(3):
        with pytest.raises(AgentKilled) as caught:
            book.check("AB" * 16)  # hex case does not matter
        assert caught.value.signal == kill
    assert book.check("cd" * 16) is None


def test_signal_book_hands_a_downgrade_once_and_a_kill_wins():
    book = SignalBook()
    trace_id = "12" * 16
    book.deliver(signal(trace_id, "downgrade", "try something else"))
    book.deliver(signal(trace_id, "downgrade", "try something else"))  # redelivered
    assert book.check(trace_id) == "try something else"
    assert book.check(trace_id) is None
    book.deliver(signal(trace_id, "kill"))
    with pytest.raises(AgentKilled):
        book.check(trace_id)


def test_signal_book_release_lifts_a_kill_until_a_new_one():
    book = SignalBook()
    trace_id = "34" * 16
    assert book.check(trace_id) is None  # this process runs the trace
    kill = signal(trace_id)
    book.deliver(kill)
    with pytest.raises(AgentKilled):
        book.check(trace_id)
    release = replace(kill, signal_id="01" * 16, kind="release", operator="alice")
    assert book.deliver(release) is True
    assert book.check(trace_id) is None and not book.is_killed(trace_id)
    assert book.deliver(kill) is False  # the old kill redelivered: still a duplicate
    assert book.check(trace_id) is None
    book.deliver(replace(kill, signal_id="02" * 16, reason="killed again"))
    with pytest.raises(AgentKilled, match="killed again"):
        book.check(trace_id)


def test_signal_book_forgets_other_traces_first_and_never_a_kill_its_agent_checks():
    book = SignalBook(max_traces=3)
    mine, checked_later = "aa" * 16, "bb" * 16
    assert book.check(mine) is None  # this process runs `mine`
    assert book.check(checked_later) is None
    book.deliver(signal(mine))
    others = [f"{i:032x}" for i in range(1, 100)]
    for trace_id in others:  # the rest of the fleet's kills, far beyond max_traces
        book.deliver(signal(trace_id))
    book.deliver(signal(checked_later))  # arrives after the flood, before the agent's check
    for _ in range(3):
        with pytest.raises(AgentKilled):
            book.check(mine)
    with pytest.raises(AgentKilled):
        book.check(checked_later)
    # Bounded: the other traces' signals beyond max_traces are forgotten, oldest first.
    assert book.tracked_traces <= 3 + 2
    assert not book.is_killed(others[0]) and book.is_killed(others[-1])
    for trace_id in others:  # a second flood still cannot push out the checked kills
        book.deliver(signal(trace_id, "downgrade", "again"))
    for trace_id in (mine, checked_later):
        with pytest.raises(AgentKilled):
            book.check(trace_id)
    book.forget(mine)
    assert book.check(mine) is None


def test_signal_book_a_kill_checked_first_after_arrival_is_kept():
    book = SignalBook(max_traces=2)
    book.deliver(signal("cc" * 16))
    with pytest.raises(AgentKilled):
        book.check("cc" * 16)  # first check after the kill arrived: now it is this agent's
    for i in range(1, 10):
        book.deliver(signal(f"{i:032x}"))
        assert book.check(f"{i + 100:032x}") is None  # and many traces checked meanwhile
    with pytest.raises(AgentKilled):
        book.check("cc" * 16)


def test_signal_book_delivers_each_signal_once_across_threads():
    book = SignalBook()
    kill = signal("ef" * 16)
    barrier = threading.Barrier(16)
    results: list[bool] = []

    def deliver() -> None:
        barrier.wait()
        results.append(book.deliver(kill))

    threads = [threading.Thread(target=deliver) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [False] * 15 + [True]


def test_agent_killed_pickles_with_its_signal():
    exc = AgentKilled(signal("ab" * 16))
    copy = pickle.loads(pickle.dumps(exc))
    assert (copy.trace_id, copy.reason, copy.signal) == (exc.trace_id, exc.reason, exc.signal)
    assert str(copy) == str(exc)
