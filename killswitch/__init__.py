"""What an agent process imports to obey spanguard's decisions: one import path for all of it.

    from spanguard.killswitch import KillSwitch, AgentKilled, AgentPaused, exit_on_stop

- `KillSwitch`: the consumer of the kill-signal topic and the `check()` before each tool call
  (raises `AgentKilled`, waits or raises `AgentPaused`, or returns a downgrade's message).
- `AgentKilled` / `AgentPaused`: what `check()` raises, with the rule, action, decision id and
  scope as attributes; `exit_on_stop()`: a process stopped by the guard exits with status 75.
- `ToolContained`: an AgentKilled raised by `check(tool=NAME)` for a tool spanguard contained;
  the call is refused, not the agent (the adapters hand it to the model as the tool's error).
- `SignalBook`: the kills and downgrades each trace was told about (the KillSwitch's memory).
- `PromptBatchSpanProcessor`: the SDK's batch processor that lets tool spans leave at once.
- `GuardingSpanProcessor`: in-process mode, the detection core as an OpenTelemetry
  SpanProcessor; `ArgsHashingSpanProcessor`: tool arguments leave the agent as hashes (both need
  the `inprocess` extra: opentelemetry-sdk and the OTLP proto encoder).

Framework adapters live beside it, one module per framework (`adapters_langchain`, ...).
"""

from __future__ import annotations

# Installed as spanguard.killswitch; loaded by its folder name (from the repository root) each of its
# modules would exist twice, with two copies of every class.
if __name__ != "spanguard.killswitch":
    raise ImportError(f"import spanguard.killswitch, not {__name__}")

from importlib import import_module
from typing import TYPE_CHECKING, Any

from spanguard.killswitch.signals import (
    AgentKilled,
    AgentPaused,
    SignalBook,
    ToolContained,
    current_trace_id,
)

if TYPE_CHECKING:
    from spanguard.killswitch.client import KillSwitch
    from spanguard.killswitch.export import PromptBatchSpanProcessor
    from spanguard.killswitch.hashing import ArgsHashingSpanProcessor
    from spanguard.killswitch.processor import GuardingSpanProcessor
    from spanguard.killswitch.stop import exit_on_stop

__all__ = [
    "AgentKilled",
    "AgentPaused",
    "ArgsHashingSpanProcessor",
    "GuardingSpanProcessor",
    "KillSwitch",
    "PromptBatchSpanProcessor",
    "SignalBook",
    "ToolContained",
    "current_trace_id",
    "exit_on_stop",
]

# Imported on first use: an agent that only reads Kafka signals needs no OTel SDK, and one that
# guards in process needs no Kafka client.
_LAZY = {
    "KillSwitch": "spanguard.killswitch.client",
    "PromptBatchSpanProcessor": "spanguard.killswitch.export",
    "ArgsHashingSpanProcessor": "spanguard.killswitch.hashing",
    "GuardingSpanProcessor": "spanguard.killswitch.processor",
    "exit_on_stop": "spanguard.killswitch.stop",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(module), name)
