"""What an agent process imports to obey spanguard's decisions.

- `SignalBook` / `AgentKilled`: the kills and downgrades each trace was told about; the agent's
  `check()` before each tool call raises `AgentKilled` or returns a downgrade message.
- `GuardingSpanProcessor`: in-process mode, the detection core as an OpenTelemetry
  SpanProcessor (needs the `inprocess` extra: opentelemetry-sdk and the OTLP proto encoder).
- `ArgsHashingSpanProcessor` (killswitch.hashing, same extra): tool arguments leave the agent
  as `spanguard.tool.args_hash`, never raw.
"""

from __future__ import annotations

# Installed as spanguard.killswitch; loaded by its folder name (from the repository root) each of its
# modules would exist twice, with two copies of every class.
if __name__ != "spanguard.killswitch":
    raise ImportError(f"import spanguard.killswitch, not {__name__}")

from typing import TYPE_CHECKING, Any

from spanguard.killswitch.signals import AgentKilled, SignalBook, current_trace_id

if TYPE_CHECKING:
    from spanguard.killswitch.processor import GuardingSpanProcessor

__all__ = ["AgentKilled", "GuardingSpanProcessor", "SignalBook", "current_trace_id"]


def __getattr__(name: str) -> Any:
    # Imported on first use: an agent that only reads Kafka signals needs no OTel SDK.
    if name == "GuardingSpanProcessor":
        from spanguard.killswitch.processor import GuardingSpanProcessor

        return GuardingSpanProcessor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
