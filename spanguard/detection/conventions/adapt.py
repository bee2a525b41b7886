"""Convention adapters: one OTLP span in, at most one guard event out (a LiteLLM proxy span:
the tool calls its request answered too).

Every instrumentation names the same facts differently; docs/conventions.md says which
attributes are read, for which convention and version, and docs/hot-path.md why the reading
goes in this order. Span kind is never used: tool spans come as INTERNAL or CLIENT depending on
the library.
"""

from __future__ import annotations

import json
from collections.abc import Container
from typing import Any, Final, NamedTuple

from spanguard.detection.conventions.decoding import _arguments, _digest, _result
from spanguard.detection.conventions.events import (
    MISSING,
    AgentRun,
    AgentSeen,
    Event,
    ResourceInfo,
    TokenUsage,
    ToolCall,
    UncarriedRequest,
)
from spanguard.detection.conventions.gateway import gateway_calls
from spanguard.detection.conventions.keys import (
    A2A_SCOPE,
    ADK_MERGED_TOOLS,
    ADK_SCOPE,
    ADK_TRANSFER_ARGUMENT,
    ADK_TRANSFER_TOOL,
    AGENT_NAME,
    AGGREGATE_INPUT_KEY,
    AGGREGATE_OUTPUT_KEY,
    AI_SDK_INFERENCE_OPERATIONS,
    AI_SDK_OPERATION,
    ARGS_HASH_KEY,
    CACHE_KEYS,
    CACHE_READ_KEYS,
    CACHE_WRITE_KEYS,
    CALL_ID_KEYS,
    CONVERSATION_KEYS,
    ERROR_TYPE,
    GATEWAY_SCOPE,
    GENKIT_SUBTYPE,
    HANDOFF_FROM,
    HANDOFF_OPERATION,
    HANDOFF_TO,
    HANDOFF_TOOL_PREFIX,
    INFERENCE_OPERATIONS,
    INPUT_MESSAGES,
    INPUT_TOKEN_KEYS,
    INVOKE_AGENT_OPERATION,
    LANGGRAPH_NAMESPACE,
    LANGGRAPH_PARENT_GRAPH,
    OI_AGENT_KIND,
    OI_AGENT_NAME,
    OI_METADATA,
    OPENINFERENCE_INFERENCE_KINDS,
    OPENINFERENCE_KIND,
    OPERATION,
    OUTPUT_TOKEN_KEYS,
    PLACEHOLDER_CALL_IDS,
    PROVIDER_KEYS,
    REQUEST_MODEL_KEYS,
    RESPONSE_MODEL_KEYS,
    RESULT_HASH_KEY,
    SERVICE_NAME,
    STATUS_ERROR,
    TOOL_NAME_KEYS,
    TRACELOOP_KIND,
    TRACELOOP_LLM_TYPES,
    TRACELOOP_REQUEST_TYPE,
    USAGE_KEYS,
    VOLTAGENT_SCOPE,
    WANTED_KEYS,
)
from spanguard.detection.conventions.kinds import (
    _is_spring_ai_tool,
    _is_tool_span,
    _other_kinds,
    _tool_span_name,
    caller_trace,
    is_a2a_handler,
    is_a2a_request,
)
from spanguard.detection.conventions.turns import conversation_of, ends_with_user_message
from spanguard.detection.conventions.values import (
    MAX_TEXT_CHARS,
    AttributeMap,
    _first_int,
    _first_text,
    _text,
    bounded_text,
)
from spanguard.detection.conventions.voltagent import (
    voltagent_agent,
    voltagent_arguments,
    voltagent_result,
    voltagent_run,
)


def resource_info(attributes: AttributeMap, match_keys: frozenset[str]) -> ResourceInfo:
    """The service, agent name and matched attributes of a resource's attribute map."""
    service = attributes.get(SERVICE_NAME)
    agent_name = attributes.get(AGENT_NAME)
    matched = {}
    for key in match_keys:
        value = attributes.get(key)
        if value is not None:
            matched[key] = _text(value)
    return ResourceInfo(
        bounded_text(_text(service)) if service is not None else "unknown_service",
        bounded_text(_text(agent_name)) if agent_name is not None else None,
        matched,
    )


class SpanReading(NamedTuple):
    """What adapt_span looks for given its `wanted` keys, worked out once per key set."""

    # A span carrying none of these (and not named `execute_tool`) is no event: what makes a
    # span a tool call, an inference or an agent's, and its usage keys when wanted.
    gate: tuple[str, ...]
    gate_with_agent: tuple[str, ...]  # the same and the agent's name, for `match`
    gate_set: frozenset[str]  # the gate as a set, for spans with few attributes
    gate_set_with_agent: frozenset[str]
    operation_wanted: bool  # gen_ai.operation.name (the commonest gate key) is wanted
    usage: tuple[str, ...]  # the usage keys wanted
    input_tokens: tuple[str, ...]
    output_tokens: tuple[str, ...]
    aggregate_input: tuple[str, ...]
    aggregate_output: tuple[str, ...]
    # Wanted keys beyond the conventions': the policy's match keys, and the price and
    # conversation keys when those are wanted (all of them are match attributes).
    match_keys: tuple[str, ...]
    conversation: tuple[str, ...]  # the conversation keys wanted (the conversation scope)
    models: tuple[str, ...]  # the model keys wanted (usage is priced)
    # Every convention key but usage is wanted: the attribute map itself answers "present?"
    # (a hash lookup in C per key read) instead of a set built from all the span's keys.
    whole: bool
    wanted: frozenset[str]


# The keys that can make a span an event (see adapt_span), commonest first.
_GATE_KEYS: Final = (
    OPERATION,
    OPENINFERENCE_KIND,
    TRACELOOP_KIND,
    AI_SDK_OPERATION,
    GENKIT_SUBTYPE,
    "gen_ai.tool.name",
    "tool.name",
)
# LangGraph's metadata is a few hundred characters: a longer one is not parsed for the agent.
MAX_METADATA_CHARS: Final = 16384
_READINGS: dict[frozenset[str], SpanReading] = {}


def reading_of(wanted: frozenset[str]) -> SpanReading:
    """What adapt_span looks for given `wanted` (made once per key set)."""
    reading = _READINGS.get(wanted)
    if reading is not None:
        return reading

    def only_wanted(keys: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(key for key in keys if key in wanted)

    usage = only_wanted(
        (*INPUT_TOKEN_KEYS, *OUTPUT_TOKEN_KEYS, AGGREGATE_INPUT_KEY, AGGREGATE_OUTPUT_KEY)
    )
    gate = only_wanted(_GATE_KEYS) + usage
    gate_with_agent = gate + only_wanted((AGENT_NAME,))
    reading = SpanReading(
        gate=gate,
        gate_with_agent=gate_with_agent,
        gate_set=frozenset(gate),
        gate_set_with_agent=frozenset(gate_with_agent),
        operation_wanted=OPERATION in wanted,
        usage=usage,
        input_tokens=only_wanted(INPUT_TOKEN_KEYS),
        output_tokens=only_wanted(OUTPUT_TOKEN_KEYS),
        aggregate_input=only_wanted((AGGREGATE_INPUT_KEY,)),
        aggregate_output=only_wanted((AGGREGATE_OUTPUT_KEY,)),
        match_keys=tuple(sorted(wanted - WANTED_KEYS)),
        conversation=only_wanted(CONVERSATION_KEYS),
        models=only_wanted((*RESPONSE_MODEL_KEYS, *REQUEST_MODEL_KEYS)),
        whole=wanted >= WANTED_KEYS - USAGE_KEYS,
        wanted=wanted,
    )
    if len(_READINGS) >= 64:  # one per guard's policy in practice; bounded all the same
        _READINGS.clear()
    _READINGS[wanted] = reading
    return reading


def adapt_span(
    span: Any, wanted: frozenset[str] = WANTED_KEYS, *, match: bool = False, scope: str = ""
) -> Event | tuple[Event, ...] | None:
    """Map one span of a request view to a ToolCall, a TokenUsage, or None.

    `wanted` is WANTED_KEYS (less the usage keys when no budget is set anywhere: then chat
    spans cost a few lookups and nothing more) plus the policy's match keys, which are
    returned when `match` is set. The span's attributes are a map (see
    schemas/otlp_view.py): the keys that can make a span an event are looked up first (most
    spans are none: HTTP clients, retrievers), then only the wanted keys the span's kind
    needs, and only the values of those present are read. `scope` is the name of the span's
    instrumentation scope.
    """
    return adapt_read(span, reading_of(wanted), match, scope)


def adapt_read(
    span: Any, reading: SpanReading, match: bool, scope: str
) -> Event | tuple[Event, ...] | None:
    """adapt_span with its `wanted` keys worked out already (`reading_of`): the guard's call,
    once per span. A tuple only for LiteLLM's proxy spans (scope `litellm`)."""
    event = _adapt_one(span, reading, match, scope)
    if scope != GATEWAY_SCOPE:
        return event
    calls = gateway_calls(span, scope)
    if not calls:
        return event
    if event is None:
        return tuple(calls)
    return (*calls, *event) if isinstance(event, tuple) else (*calls, event)


def _adapt_one(
    span: Any, reading: SpanReading, match: bool, scope: str
) -> Event | tuple[Event, ...] | None:
    attributes: AttributeMap = span.attributes
    # Whether the span names its operation, asked once (`OPERATION in present` would say the same).
    has_operation = reading.operation_wanted and OPERATION in attributes
    if not has_operation:
        gate = reading.gate_with_agent if match else reading.gate
        if 2 * len(attributes) < len(gate):
            # Few attributes: one pass over the span's keys costs less than a lookup per key.
            gate_set = reading.gate_set_with_agent if match else reading.gate_set
            through = not gate_set.isdisjoint(attributes)
        else:
            through = False
            for key in gate:
                if key in attributes:
                    through = True
                    break
        if not through and span.name != "execute_tool":
            return _ungated(span, reading, match, scope) if scope in _UNGATED_SCOPES else None
    # Which keys are there: the map itself when it can only be asked for wanted keys (every
    # key asked below is a convention key, the usage and match keys come filtered by wanted).
    present: Any = attributes if reading.whole else reading.wanted.intersection(attributes)

    operation: str | None = attributes[OPERATION].string_value if has_operation else None
    # The other conventions' span kinds: a span with an operation name is told by it alone,
    # so they are read only where the operation name cannot answer (`_other_kinds`).
    oi_kind: str | None = None
    tl_kind: str | None = None
    ai_operation: str | None = None
    if operation is None:
        oi_kind, tl_kind, ai_operation = _other_kinds(attributes, present)
    # Without a policy matching per agent, the keys read for prices or conversations are
    # no match attributes to build.
    match_attributes = _match_attributes(attributes, present, reading) if match else None
    agent_name = bounded_text(_text(attributes[AGENT_NAME])) if AGENT_NAME in present else None
    named = False  # a wanted conversation key is there (only with the conversation scope on)
    for key in reading.conversation:
        if key in present:
            named = True
            break

    if operation == HANDOFF_OPERATION:
        return _handoff(span, attributes, agent_name, match_attributes, scope)
    if (
        (operation == "execute_tool" or _is_spring_ai_tool(operation, attributes))
        if operation is not None
        else _is_tool_span(span.name, present, operation, oi_kind, tl_kind, ai_operation)
    ):
        return _tool_call(
            span,
            attributes,
            present,
            operation,
            oi_kind,
            agent_name,
            match_attributes,
            named,
            scope,
        )
    other = _usage_or_agent(
        span,
        attributes,
        present,
        reading,
        match,
        operation,
        oi_kind,
        tl_kind,
        ai_operation,
        agent_name,
        match_attributes,
        named,
    )
    # An agent's own span is also one run of the agent (the agent run first).
    if operation != INVOKE_AGENT_OPERATION and (operation is not None or oi_kind != OI_AGENT_KIND):
        return other
    run = _agent_run(span, attributes, agent_name, match_attributes)
    return other if run is None else run if other is None else (run, other)


# The libraries whose spans say what they are without a key the gate knows. Most spans end at
# the gate (HTTP, databases): their scope is checked there, with no call.
_UNGATED_SCOPES: Final = frozenset({A2A_SCOPE, VOLTAGENT_SCOPE})


def _ungated(
    span: Any, reading: SpanReading, match: bool, scope: str
) -> Event | tuple[Event, ...] | None:
    """A span of a2a-sdk's or VoltAgent's with no key the gate knows."""
    # a2a-sdk's spans carry no attribute: its request handler's is told by its name.
    if scope == A2A_SCOPE:
        return _a2a_span(span)
    # VoltAgent's agent runs carry keys of their own only.
    matched = _match_attributes(span.attributes, span.attributes, reading) if match else None
    return voltagent_run(span, bool(reading.usage), matched)


def _match_attributes(
    attributes: AttributeMap, present: Container[str], reading: SpanReading
) -> dict[str, str] | None:
    """The span's match attributes: the policy's match keys it carries (None: none)."""
    matched = None
    for key in reading.match_keys:
        if key in present:
            if matched is None:
                matched = {}
            matched[key] = _text(attributes[key])
    return matched


def _tool_call(
    span: Any,
    attributes: AttributeMap,
    present: Container[str],
    operation: str | None,
    oi_kind: str | None,
    agent_name: str | None,
    match_attributes: dict[str, str] | None,
    named: bool,
    scope: str,
) -> ToolCall | None:
    """_adapt_one's tool span: the call, or None for ADK's repeat of parallel calls."""
    tool_name = _first_text(attributes, present, TOOL_NAME_KEYS) or _tool_span_name(span.name)
    if tool_name == ADK_MERGED_TOOLS:
        return None
    if len(tool_name) > MAX_TEXT_CHARS:
        tool_name = bounded_text(tool_name)
    if scope == VOLTAGENT_SCOPE:
        # Its `tool.parameters` is the tool's schema, the same for every call.
        arguments, envelope_call_id = voltagent_arguments(attributes), None
        result = voltagent_result(attributes)
        agent_name = agent_name or voltagent_agent(attributes)
    else:
        if operation is not None and "tool.parameters" in present:
            oi_kind = _other_kinds(attributes, present)[0]  # whether it is OpenInference's
        arguments, envelope_call_id = _arguments(span, attributes, present, oi_kind, scope)
        result = _result(span, attributes, present, scope)
    call_id = _call_id(attributes, present)
    if call_id is None and envelope_call_id:
        call_id = bounded_text(envelope_call_id)
    to_agent = _handed_to(tool_name, arguments, result, scope)
    handoff = False
    if to_agent is not None:
        # A handoff: the handing agent's call "handoff to <agent>", as for the OpenAI Agents
        # SDK's (`_handoff`); what the handoff tool returns (the graph's whole state, or
        # nothing) is no work done.
        tool_name = f"handoff to {to_agent}"
        arguments = _handoff_arguments(arguments, agent_name, to_agent)
        result = MISSING
    elif arguments is MISSING and tool_name == ADK_TRANSFER_TOOL and scope == ADK_SCOPE:
        # ADK's transfer without its arguments (content not captured): a handoff from the
        # agent, to the one making the next transfer (handoff_cycle works it out).
        arguments = {"from_agent": agent_name or ""}
        result = MISSING
        handoff = True
    return ToolCall(
        span_id=span.span_id,
        tool_name=tool_name,
        arguments=arguments,
        call_id=call_id,
        agent_name=agent_name,
        match_attributes=match_attributes,
        result=result,
        # Hashes made before the span left (rare: most spans carry the values).
        args_digest=_digest(attributes, ARGS_HASH_KEY) if ARGS_HASH_KEY in present else None,
        result_digest=(
            _digest(attributes, RESULT_HASH_KEY) if RESULT_HASH_KEY in present else None
        ),
        scope=scope,
        end_time_unix_nano=span.end_time_unix_nano,
        conversation_id=conversation_of(attributes, present) if named else None,
        start_time_unix_nano=span.start_time_unix_nano,
        failed=span.status.code == STATUS_ERROR or ERROR_TYPE in present,
        # OpenInference's OpenAI Agents handoff: a tool span "handoff to <agent>".
        handoff=handoff or tool_name.startswith(HANDOFF_TOOL_PREFIX),
    )


def _usage_or_agent(
    span: Any,
    attributes: AttributeMap,
    present: Container[str],
    reading: SpanReading,
    match: bool,
    operation: str | None,
    oi_kind: str | None,
    tl_kind: str | None,
    ai_operation: str | None,
    agent_name: str | None,
    match_attributes: dict[str, str] | None,
    named: bool,
) -> TokenUsage | AgentSeen | None:
    """_adapt_one's other spans: their usage, else who the agent is when that matters (the
    policy matches on it, or the span names a conversation or a new user turn)."""
    user_turn = 0
    if INPUT_MESSAGES in present and ends_with_user_message(attributes[INPUT_MESSAGES]):
        user_turn = (span.start_time_unix_nano or span.end_time_unix_nano) // 1000 or 1
    for key in reading.usage:
        if key in present:
            break
    else:
        # The conversation may be named only on the agent's span: read it off any span a GenAI
        # convention marks (`session.id` on a plain HTTP span is a web session, not a chat).
        if named and not operation and operation is not None:
            oi_kind, tl_kind, ai_operation = _other_kinds(attributes, present)
        conversation_id = (
            conversation_of(attributes, present)
            if named and (operation or oi_kind or tl_kind or ai_operation)
            else None
        )
        if (match and agent_name is not None) or conversation_id is not None or user_turn:
            # The policy matches on the agent's name, which may only be on this span.
            return AgentSeen(span.span_id, agent_name, match_attributes, conversation_id, user_turn)
        return None
    if operation is not None and operation not in INFERENCE_OPERATIONS:
        oi_kind, tl_kind, ai_operation = _other_kinds(attributes, present)
    inference = (
        operation in INFERENCE_OPERATIONS
        or oi_kind in OPENINFERENCE_INFERENCE_KINDS
        or ai_operation in AI_SDK_INFERENCE_OPERATIONS
        or (
            TRACELOOP_REQUEST_TYPE in present
            and attributes[TRACELOOP_REQUEST_TYPE].string_value in TRACELOOP_LLM_TYPES
        )
    )
    tokens_in = _first_int(attributes, present, reading.input_tokens)
    tokens_out = _first_int(attributes, present, reading.output_tokens)
    if tokens_in is None and tokens_out is None and not inference:
        tokens_in = _first_int(attributes, present, reading.aggregate_input)
        tokens_out = _first_int(attributes, present, reading.aggregate_output)
    if tokens_in is None and tokens_out is None:
        if user_turn:
            return AgentSeen(span.span_id, agent_name, match_attributes, None, user_turn)
        return None
    tokens = (tokens_in or 0) + (tokens_out or 0)
    # Usage on anything but an inference span (agent, workflow, chain) is an aggregate.
    # Positional: a call by keyword costs twice as much, once per inference span.
    usage = TokenUsage(
        span.span_id,
        tokens,
        not inference,  # aggregate
        agent_name,
        match_attributes,
        span.end_time_unix_nano,
    )
    if named:
        usage.conversation_id = conversation_of(attributes, present)
    usage.user_turn = user_turn
    for key in reading.models:
        if key in present:
            _read_price_facts(usage, attributes, present, inference, tokens_in, tokens_out)
            break
    return usage


def _read_price_facts(
    usage: TokenUsage,
    attributes: AttributeMap,
    present: Container[str],
    inference: bool,
    tokens_in: int | None,
    tokens_out: int | None,
) -> None:
    """What pricing needs of a usage span: the model, the provider and the counts apart
    (`tokens_in`, `tokens_out`: the counts the span's usage was read from)."""
    usage.request_model = _model_text(attributes, present, REQUEST_MODEL_KEYS)
    usage.response_model = _model_text(attributes, present, RESPONSE_MODEL_KEYS)
    usage.provider = _model_text(attributes, present, PROVIDER_KEYS)
    if not inference:  # an agent's total: its own counts where the inference keys lack one
        if tokens_in is None:
            tokens_in = _first_int(attributes, present, (AGGREGATE_INPUT_KEY,))
        if tokens_out is None:
            tokens_out = _first_int(attributes, present, (AGGREGATE_OUTPUT_KEY,))
    usage.input_tokens = tokens_in or 0
    usage.output_tokens = tokens_out or 0
    # Most spans report no cache counts: one pass over both key lists finds that out.
    for key in CACHE_KEYS:
        if key in present:
            usage.cache_read_tokens = _first_int(attributes, present, CACHE_READ_KEYS) or 0
            usage.cache_write_tokens = _first_int(attributes, present, CACHE_WRITE_KEYS) or 0
            break


def _model_text(
    attributes: AttributeMap, present: Container[str], keys: tuple[str, ...]
) -> str | None:
    """The first non-empty text of `keys` on the span, bounded (MAX_TEXT_CHARS): the model or
    provider a priced span names (three per span, so a string value is read inline)."""
    for key in keys:
        if key in present:
            value = attributes[key]
            text = value.string_value or _text(value)
            if text:
                return text if len(text) <= MAX_TEXT_CHARS else bounded_text(text)
    return None


def _agent_run(
    span: Any,
    attributes: AttributeMap,
    agent_name: str | None,
    match_attributes: dict[str, str] | None,
) -> AgentRun | None:
    """An agent's own span: one run of the agent, for the trace's agent tree (OpenInference
    names the agent `agent.name`, the GenAI conventions `gen_ai.agent.name`). None for one
    that names no agent: the OpenAI Agents SDK's "Agent workflow" span around a whole run."""
    name = agent_name
    run_key = None
    if name is None and OI_AGENT_NAME in attributes:
        name = bounded_text(_text(attributes[OI_AGENT_NAME]))
    if not name and OI_METADATA in attributes:
        run_key = _langgraph_namespace(_text(attributes[OI_METADATA]))
        if run_key:
            name = bounded_text(run_key.rpartition("|")[2].partition(":")[0])
    if not name:
        return None
    return AgentRun(
        span.span_id,
        span.parent_span_id,
        name,
        match_attributes,
        span.start_time_unix_nano,
        span.end_time_unix_nano,
        run_key,
        caller_trace_id=caller_trace(span),
    )


def _a2a_span(span: Any) -> AgentRun | UncarriedRequest | None:
    """What the guard reads of a2a-sdk's spans, which carry no attribute:

    - its request handler answering one message (`on_message_send`; not the streamed one,
      keys.A2A_HANDLER_METHODS): one run of the service's agent. Nothing on the span names
      the agent, only the service's resource does: the guard names the run after its
      `service.name`. Without a parent it is also a request whose caller's trace is unknown.
    - any other span that starts answering a request (a dispatcher's), without a parent: the
      request came without its caller's trace context (UncarriedRequest).
    """
    name = span.name
    if not is_a2a_handler(name):
        if not span.parent_span_id and is_a2a_request(name):
            return UncarriedRequest(span.span_id)
        return None
    return AgentRun(
        span.span_id,
        span.parent_span_id,
        None,
        None,
        span.start_time_unix_nano,
        span.end_time_unix_nano,
        by_service=True,
    )


def _langgraph_namespace(metadata: str) -> str | None:
    """The subgraph namespace a LangGraph node ran in (`checkpoint_ns` of OpenInference's
    `metadata`), bounded; None at the root graph (a lone agent's model turns: no sub-agent)
    or where the metadata is none of LangGraph's."""
    if LANGGRAPH_NAMESPACE not in metadata or len(metadata) > MAX_METADATA_CHARS:
        return None
    try:
        namespace = json.loads(metadata).get(LANGGRAPH_NAMESPACE)
    except (ValueError, AttributeError, RecursionError):
        return None
    return bounded_text(namespace) if type(namespace) is str and namespace else None


def _handoff(
    span: Any,
    attributes: AttributeMap,
    agent_name: str | None,
    match_attributes: dict[str, str] | None,
    scope: str,
) -> ToolCall | None:
    """An `agent_handoff` span (the OpenTelemetry OpenAI Agents instrumentation): the agent
    handing the run to another, counted as its call "handoff to <agent>" with both agents as
    arguments, so two agents handing a task back and forth are a loop like any other."""
    if HANDOFF_TO not in attributes:
        return None
    to_agent = bounded_text(_text(attributes[HANDOFF_TO]))
    from_agent = bounded_text(_text(attributes[HANDOFF_FROM])) if HANDOFF_FROM in attributes else ""
    return ToolCall(
        span_id=span.span_id,
        tool_name=f"handoff to {to_agent}",
        arguments={"from_agent": from_agent, "to_agent": to_agent},
        call_id=None,
        agent_name=agent_name,
        match_attributes=match_attributes,
        result=MISSING,
        scope=scope,
        end_time_unix_nano=span.end_time_unix_nano,
        start_time_unix_nano=span.start_time_unix_nano,
        handoff=True,
    )


def _handed_to(tool_name: str, arguments: Any, result: Any, scope: str) -> str | None:
    """The agent a tool call hands the run to, or None for a call like any other: a LangGraph
    Command to the parent graph going to one node (langgraph-supervisor's `transfer_to_<agent>`
    tools), or Google ADK's `transfer_to_agent` (the agent only where arguments are recorded)."""
    if type(result) is dict and result.get("graph") == LANGGRAPH_PARENT_GRAPH:
        goto = result.get("goto")
        return bounded_text(goto) if type(goto) is str and goto else None
    if tool_name == ADK_TRANSFER_TOOL and scope == ADK_SCOPE and type(arguments) is dict:
        to_agent = arguments.get(ADK_TRANSFER_ARGUMENT)
        return bounded_text(to_agent) if type(to_agent) is str and to_agent else None
    return None


def _handoff_arguments(arguments: Any, from_agent: str | None, to_agent: str) -> dict[str, Any]:
    """A handoff's arguments: both agents, as `_handoff` keeps them, and what else the handoff
    tool was given (a task description: the same handoff with another task is new work)."""
    kept = {
        key: value
        for key, value in (arguments.items() if type(arguments) is dict else ())
        if key != ADK_TRANSFER_ARGUMENT
    }
    return {**kept, "from_agent": from_agent or "", "to_agent": to_agent}


def _call_id(attributes: AttributeMap, present: Container[str]) -> str | None:
    for key in CALL_ID_KEYS:
        if key in present:
            text = _text(attributes[key])
            if text.strip().lower() not in PLACEHOLDER_CALL_IDS:
                return bounded_text(text)
    return None
