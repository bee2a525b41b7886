"""Waiting for something a test cannot be told about (a record consumed, a request received, a
metric counted): poll, with a deadline generous enough for a loaded machine."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    timeout: float = 30.0,
    what: str | Callable[[], str] = "condition",
    interval: float = 0.05,
) -> T:
    """Calls `predicate` until it returns something true and returns that value. After `timeout`
    seconds, TimeoutError naming `what` (a callable is asked then, to show the state at the end)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what() if callable(what) else what} (not within {timeout} s)")
        time.sleep(interval)


def raises(call: Callable[[], object], exception: type[BaseException]) -> bool:
    """Whether `call()` raises `exception` (a predicate to wait on: a switch's check killed)."""
    try:
        call()
    except exception:
        return True
    return False
