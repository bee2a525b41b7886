"""VoltAgent's own spans (scope `@voltagent/core`): what they say in keys of their own
(keys.py, VOLTAGENT_*; docs/conventions.md).

A tool's span passes adapt.py's gate by its `tool.name` and is read there as any tool call,
its arguments and result taken from here. An agent's run carries no key the gate knows: it
is read here whole, as the run and, when a budget asks, the run's usage. VoltAgent's llm span
covers every model call of a run and carries one call's usage, so it is not read: the run's
own usage is the total, known when the run ends.
"""

from __future__ import annotations

from typing import Any

from spanguard.detection.conventions.decoding import _decode_value, _not_recorded
from spanguard.detection.conventions.events import MISSING, AgentRun, TokenUsage
from spanguard.detection.conventions.keys import (
    VOLTAGENT_ENTITY_NAME,
    VOLTAGENT_ENTITY_TYPE,
    VOLTAGENT_INPUT,
    VOLTAGENT_MODEL,
    VOLTAGENT_OUTPUT,
    VOLTAGENT_SCOPE,
    VOLTAGENT_SPAN_TYPE,
    VOLTAGENT_SUBAGENT_NAME,
    VOLTAGENT_USAGE_INPUT,
    VOLTAGENT_USAGE_OUTPUT,
)
from spanguard.detection.conventions.kinds import caller_trace
from spanguard.detection.conventions.values import AttributeMap, _first_int, _text, bounded_text

_USAGE_INPUT = (VOLTAGENT_USAGE_INPUT,)
_USAGE_OUTPUT = (VOLTAGENT_USAGE_OUTPUT,)


def voltagent_value(attributes: AttributeMap, key: str) -> Any:
    """A tool span's `input` (arguments) or `output` (result), decoded; MISSING when absent
    (VoltAgent leaves `input` out for a call without arguments, `output` for a failed one)."""
    if key not in attributes:
        return MISSING
    value = _decode_value(attributes[key])
    return MISSING if _not_recorded(value, VOLTAGENT_SCOPE) else value


def voltagent_arguments(attributes: AttributeMap) -> Any:
    return voltagent_value(attributes, VOLTAGENT_INPUT)


def voltagent_result(attributes: AttributeMap) -> Any:
    return voltagent_value(attributes, VOLTAGENT_OUTPUT)


def voltagent_agent(attributes: AttributeMap) -> str | None:
    """The agent a span of a run is of: a sub-agent's own name, else the agent's."""
    for key in (VOLTAGENT_SUBAGENT_NAME, VOLTAGENT_ENTITY_NAME):
        if key in attributes:
            name = _text(attributes[key])
            if name:
                return bounded_text(name)
    return None


def voltagent_run(
    span: Any, usage_wanted: bool, match_attributes: dict[str, str] | None
) -> AgentRun | tuple[AgentRun, TokenUsage] | None:
    """An agent's run (`entity.type` "agent", no `span.type`), with the run's usage as an
    aggregate when a budget asks (`usage_wanted`) and the span has it; None for any other
    span VoltAgent makes without a tool name (memory, llm, guardrails)."""
    attributes: AttributeMap = span.attributes
    if VOLTAGENT_SPAN_TYPE in attributes or VOLTAGENT_ENTITY_TYPE not in attributes:
        return None
    if _text(attributes[VOLTAGENT_ENTITY_TYPE]) != "agent":
        return None
    name = voltagent_agent(attributes)
    if name is None:
        return None
    run = AgentRun(
        span.span_id,
        span.parent_span_id,
        name,
        match_attributes,
        span.start_time_unix_nano,
        span.end_time_unix_nano,
        caller_trace_id=caller_trace(span),
    )
    if not usage_wanted:
        return run
    tokens_in = _first_int(attributes, attributes, _USAGE_INPUT)
    tokens_out = _first_int(attributes, attributes, _USAGE_OUTPUT)
    if tokens_in is None and tokens_out is None:
        return run
    usage = TokenUsage(
        span.span_id,
        (tokens_in or 0) + (tokens_out or 0),
        True,  # aggregate: the run's total
        name,
        match_attributes,
        span.end_time_unix_nano,
    )
    usage.input_tokens, usage.output_tokens = tokens_in or 0, tokens_out or 0
    if VOLTAGENT_MODEL in attributes:
        usage.request_model = bounded_text(_text(attributes[VOLTAGENT_MODEL]))
    return run, usage
