"""What a span becomes: a ToolCall, a TokenUsage, an AgentSeen, an AgentRun, an
UncarriedRequest (adapt.py makes them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from mypy_extensions import mypyc_attr


class _Missing:
    """The arguments were not recorded (content capture off): not the same as `{}`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Final = _Missing()


@dataclass(slots=True)
class ResourceInfo:
    """What a span's resource tells: the service and any attributes the policy matches on."""

    service: str
    agent_name: str | None
    match_attributes: dict[str, str]


# The events: one object a span, short-lived and never part of a reference cycle. Compiled, they
# are kept out of the cyclic garbage collector's reach and the last one's memory is reused
# (`mypyc_attr` does nothing in pure Python). Their __init__ is written out: mypyc compiles it,
# where the one @dataclass would write stays interpreted (a Python call a span). @dataclass
# still gives them __eq__ and __repr__.
@mypyc_attr(acyclic=True, free_list_len=1)
@dataclass(slots=True, init=False)
class ToolCall:
    span_id: bytes  # raw 8 bytes; hex only when a decision is written
    tool_name: str
    arguments: Any  # decoded JSON-like value, or MISSING
    call_id: str | None
    agent_name: str | None
    match_attributes: dict[str, str] | None
    result: Any  # decoded JSON-like value, or MISSING
    args_digest: str | None  # spanguard.tool.args_hash, made before the span left
    result_digest: str | None  # spanguard.tool.result_hash
    scope: str  # the instrumentation scope's name: which library made the span
    end_time_unix_nano: int  # 0: the span carries no end time
    conversation_id: str | None  # read only when the conversation scope is on
    start_time_unix_nano: int  # 0: the span carries no start time
    failed: bool  # the span says the call failed (status ERROR, error.type)
    handoff: bool  # an agent handing the run to another ("handoff to <agent>")

    def __init__(
        self,
        span_id: bytes,
        tool_name: str,
        arguments: Any,
        call_id: str | None,
        agent_name: str | None,
        match_attributes: dict[str, str] | None,
        result: Any = MISSING,
        args_digest: str | None = None,
        result_digest: str | None = None,
        scope: str = "",
        end_time_unix_nano: int = 0,
        conversation_id: str | None = None,
        start_time_unix_nano: int = 0,
        failed: bool = False,
        handoff: bool = False,
    ) -> None:
        self.span_id = span_id
        self.tool_name = tool_name
        self.arguments = arguments
        self.call_id = call_id
        self.agent_name = agent_name
        self.match_attributes = match_attributes
        self.result = result
        self.args_digest = args_digest
        self.result_digest = result_digest
        self.scope = scope
        self.end_time_unix_nano = end_time_unix_nano
        self.conversation_id = conversation_id
        self.start_time_unix_nano = start_time_unix_nano
        self.failed = failed
        self.handoff = handoff


@mypyc_attr(acyclic=True, free_list_len=1)
@dataclass(slots=True, init=False)
class TokenUsage:
    span_id: bytes  # raw 8 bytes; hex only when a decision is written
    tokens: int
    aggregate: bool  # an agent span's total, which repeats its inference spans
    agent_name: str | None
    match_attributes: dict[str, str] | None
    end_time_unix_nano: int
    # Read only when usage is priced (PRICE_KEYS wanted) and the span names a model.
    input_tokens: int  # cached ones included
    output_tokens: int
    cache_read_tokens: int
    cache_write_tokens: int
    request_model: str | None
    response_model: str | None
    provider: str | None
    conversation_id: str | None  # read only when the conversation scope is on
    # When an inference sent a new user message started (microseconds; 0: not one).
    user_turn: int

    def __init__(
        self,
        span_id: bytes,
        tokens: int,
        aggregate: bool,
        agent_name: str | None,
        match_attributes: dict[str, str] | None,
        end_time_unix_nano: int = 0,
        input_tokens: int = 0,
        output_tokens: int = 0,
        cache_read_tokens: int = 0,
        cache_write_tokens: int = 0,
        request_model: str | None = None,
        response_model: str | None = None,
        provider: str | None = None,
        conversation_id: str | None = None,
    ) -> None:
        self.span_id = span_id
        self.tokens = tokens
        self.aggregate = aggregate
        self.agent_name = agent_name
        self.match_attributes = match_attributes
        self.end_time_unix_nano = end_time_unix_nano
        self.input_tokens = input_tokens
        self.output_tokens = output_tokens
        self.cache_read_tokens = cache_read_tokens
        self.cache_write_tokens = cache_write_tokens
        self.request_model = request_model
        self.response_model = response_model
        self.provider = provider
        self.conversation_id = conversation_id
        self.user_turn = 0

    @property
    def priced(self) -> bool:
        """Whether the span names a model to price its tokens by."""
        return self.request_model is not None or self.response_model is not None


@mypyc_attr(acyclic=True, free_list_len=1)
@dataclass(slots=True, init=False)
class AgentSeen:
    """A span that tells who the agent is, and nothing the rules count."""

    span_id: bytes
    agent_name: str | None
    match_attributes: dict[str, str] | None
    conversation_id: str | None
    user_turn: int  # when an inference sent a new user message started (us; 0: not one)

    def __init__(
        self,
        span_id: bytes,
        agent_name: str | None,
        match_attributes: dict[str, str] | None,
        conversation_id: str | None = None,
        user_turn: int = 0,
    ) -> None:
        self.span_id = span_id
        self.agent_name = agent_name
        self.match_attributes = match_attributes
        self.conversation_id = conversation_id
        self.user_turn = user_turn


@mypyc_attr(acyclic=True, free_list_len=1)
@dataclass(slots=True, init=False)
class AgentRun:
    """An agent's own span (an `invoke_agent`, OpenInference's AGENT kind): one run of an agent,
    where it sits in the trace (its parent span) and when it ran, for the trace's agent tree."""

    span_id: bytes
    parent_span_id: bytes  # b"": none (the trace's root)
    agent_name: str | None
    match_attributes: dict[str, str] | None
    start_time_unix_nano: int
    end_time_unix_nano: int
    conversation_id: str | None
    # What names one run across several spans (LangGraph's subgraph namespace), or None: the
    # span is the run.
    run_key: str | None
    # A service's answer to one request (a2a-sdk's request handler): the span names no agent,
    # the service's resource does (the guard sets `agent_name` from it).
    by_service: bool
    # The trace (hex) the trace's root run links to, its caller's (VoltAgent links a run to the
    # span current when it started): the caller's trace was not carried. None: no such link.
    caller_trace_id: str | None

    def __init__(
        self,
        span_id: bytes,
        parent_span_id: bytes,
        agent_name: str | None,
        match_attributes: dict[str, str] | None,
        start_time_unix_nano: int = 0,
        end_time_unix_nano: int = 0,
        run_key: str | None = None,
        by_service: bool = False,
        caller_trace_id: str | None = None,
    ) -> None:
        self.span_id = span_id
        self.parent_span_id = parent_span_id
        self.agent_name = agent_name
        self.match_attributes = match_attributes
        self.start_time_unix_nano = start_time_unix_nano
        self.end_time_unix_nano = end_time_unix_nano
        self.conversation_id = None
        self.run_key = run_key
        self.by_service = by_service
        self.caller_trace_id = caller_trace_id


@mypyc_attr(acyclic=True, free_list_len=1)
@dataclass(slots=True, init=False)
class UncarriedRequest:
    """A request to an agent service that starts a trace of its own (an a2a-sdk server span
    without a parent): its caller's trace context did not come with it, so whatever the
    caller did is another trace, and a loop across the two services is not seen as one."""

    span_id: bytes

    def __init__(self, span_id: bytes) -> None:
        self.span_id = span_id


# What a span may be: one event, or (a LiteLLM proxy span) the tool calls its request answered
# followed by its own event, if any.
Event = ToolCall | TokenUsage | AgentSeen | AgentRun | UncarriedRequest
