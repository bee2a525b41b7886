"""Enforcement at the LLM gateway: a guardrail for LiteLLM's proxy (`spanguard[litellm]`).

An agent that cannot be changed still calls its model through the proxy. This guardrail reads
the kill topic as every `KillSwitch` does (one consumer per proxy process, every partition, no
consumer group, signed and expiring signals, releases obeyed: it is a `KillSwitch`) and, before
each model call (LiteLLM's documented `CustomGuardrail.async_pre_call_hook`, mode `pre_call`):

- refuses the call of a killed trace, conversation or agent with HTTP 403 and an error body
  naming the rule, the decision id and how to release;
- makes the call of a paused trace wait (at most `pause_wait_seconds`) for the operator's
  answer or the pause's own deadline, then lets it through or refuses it (423) as they say;
- adds a downgrade's message to the request as a system message, and refuses nothing;
- removes from the request's `tools` (and legacy `functions`) every tool spanguard contained
  (a signal of scope tool): the model cannot call it, so the agent takes another path. Each
  removal is counted (`GatewayGuard.tools_removed`, by tool); a request whose every tool is
  contained is left as it is, and the first such is logged.

Which trace: the request's W3C `traceparent` header (an instrumented agent's run). Without one,
the run the request names (`x-spanguard-run`, else its conversation: `x-spanguard-conversation`,
`litellm_session_id`, `metadata.session_id`) stands for the trace, as a trace id derived from
it, and the proxy's `litellm_request` span is put in that trace: so the worker sees one agent's
calls as one trace (docs/agents.md, "Agents you cannot change"). A malformed, repeated or
conflicting `traceparent`, or none and no run, is no trace to check: the call passes and is
counted (`unguarded`, warned once), never refused on a guess.

A kill topic the proxy cannot reach at start: the proxy keeps serving and says so once
(`unreachable: fail_open`, the default), or refuses every call with 503 until it is reached
(`fail_closed`). The consumer retries in the background either way.

`GatewayGuard` is the logic, and needs no LiteLLM (tests, the benchmark); `SpanguardGuardrail`
is LiteLLM's guardrail class around it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from spanguard.killswitch.client import KillSwitch, parse_agent
from spanguard.killswitch.signals import AgentKilled, AgentPaused
from spanguard.schemas.decision import AgentIdentity, KillSignal

__all__ = ["GatewayGuard", "Refusal", "RequestFacts", "SpanguardGuardrail", "request_facts"]

log = logging.getLogger("spanguard.killswitch.gateway")

# The headers an agent (or whatever sits in front of it) may set; documented in docs/agents.md.
RUN_HEADER = "x-spanguard-run"
CONVERSATION_HEADER = "x-spanguard-conversation"
AGENT_HEADER = "x-spanguard-agent"
# W3C trace context: version 00, 32 hex trace id, 16 hex parent id, 2 hex flags (lowercase).
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
# Longer names are not ids a signal can carry (MAX_CONVERSATION_ID_CHARS, bounded names): a
# megabyte header costs a length check, never a parse or a lookup.
MAX_NAME_CHARS = 200
MAX_TRACEPARENT_CHARS = 55
UNREACHABLE_CHOICES = ("fail_open", "fail_closed")


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What a model call names: its trace (or why none), its run, conversation and agent."""

    trace_id: str | None
    no_trace: str | None  # "absent", "malformed", "repeated": why trace_id is None
    run: str | None
    conversation_id: str | None
    agent: AgentIdentity | None
    parent_trace_id: str | None = None  # the proxy's own parent span's (repeated headers)


@dataclass(frozen=True, slots=True)
class Refusal:
    """A refused call: the HTTP status and the error body the agent gets."""

    status: int
    body: dict[str, Any]


@dataclass
class Verdict:
    refusal: Refusal | None = None
    system_message: str | None = None  # a downgrade's, for the model
    trace_id: str | None = None
    derived: bool = False  # the trace stands for the request's run
    notes: list[str] = field(default_factory=list)


def derived_trace_id(run: str) -> str:
    """The trace id a run without a traceparent is guarded (and traced) under."""
    return hashlib.sha256(b"spanguard-gateway-run\0" + run.encode("utf-8", "replace")).hexdigest()[
        :32
    ]


def _name(value: Any) -> str | None:
    if not isinstance(value, str):
        return None
    value = value.strip()
    return value if 0 < len(value) <= MAX_NAME_CHARS else None


def _header(headers: Mapping[str, Any], name: str) -> Any:
    value = headers.get(name)
    if value is None:  # a dict of headers as received may keep their case
        for key, item in headers.items():
            if isinstance(key, str) and key.lower() == name:
                return item
    return value


def request_facts(data: Mapping[str, Any], key_alias: str | None = None) -> RequestFacts:
    """The facts of one LiteLLM proxy request (`data` as the pre-call hook gets it)."""
    request = data.get("proxy_server_request")
    headers = request.get("headers") if isinstance(request, Mapping) else None
    headers = headers if isinstance(headers, Mapping) else {}
    metadata = data.get("metadata")
    metadata = metadata if isinstance(metadata, Mapping) else {}
    parent = metadata.get("litellm_parent_otel_span")
    parent_trace_id = None
    context = getattr(parent, "get_span_context", None)
    if callable(context):
        span_context = context()
        if getattr(span_context, "is_valid", False):
            parent_trace_id = format(span_context.trace_id, "032x")

    trace_id: str | None = None
    no_trace: str | None = "absent"
    traceparent = _header(headers, "traceparent")
    if traceparent is not None:
        text = traceparent if isinstance(traceparent, str) else ""
        found = _TRACEPARENT.fullmatch(text.strip()) if len(text) <= MAX_TRACEPARENT_CHARS else None
        if "," in text:
            no_trace = "repeated"  # two headers folded into one value
        elif found is None or found.group(1) == "0" * 32 or found.group(2) == "0" * 16:
            no_trace = "malformed"
        elif parent_trace_id is not None and parent_trace_id != found.group(1):
            # The proxy's spans went to another trace than this header names: the request
            # carried several traceparent headers, and each reader took another.
            no_trace = "repeated"
        else:
            trace_id, no_trace = found.group(1), None

    conversation = (
        _name(_header(headers, CONVERSATION_HEADER))
        or _name(metadata.get("spanguard_conversation"))
        or _name(data.get("litellm_session_id"))
        or _name(metadata.get("session_id"))
    )
    run = (
        _name(_header(headers, RUN_HEADER)) or _name(metadata.get("spanguard_run")) or conversation
    )
    agent_text = (
        _name(_header(headers, AGENT_HEADER))
        or _name(metadata.get("spanguard_agent"))
        or _name(key_alias)
        or _name(metadata.get("user_api_key_alias"))
        or _name(data.get("user"))
    )
    agent = None
    if agent_text:
        try:
            agent = parse_agent(agent_text)
        except ValueError:
            agent = None
    return RequestFacts(trace_id, no_trace, run, conversation, agent, parent_trace_id)


def refusal_body(signal: KillSignal, *, paused: bool = False) -> dict[str, Any]:
    """The error body of a refused call: what stopped it, by which decision, how to release."""
    target = signal.describe_target()
    if signal.stops == "conversation":
        release = f"spanguard release --conversation {signal.conversation_id}"
    elif signal.stops == "agent":
        name = f"/{signal.agent.name}" if signal.agent.name else ""
        release = f"spanguard release --agent {signal.agent.service}{name}"
    else:
        release = f"spanguard release {signal.trace_id}"
    action = "paused" if paused else "killed"
    message = (
        f"spanguard {action} {target}: rule {signal.rule}, decision {signal.signal_id}:"
        f" {signal.reason}. To let it go on: `{release}`"
    )
    if paused:
        message += f" (unanswered by {signal.pause_until}, {signal.pause_fallback} applies)"
    return {
        "error": message,
        "spanguard": {
            "action": "pause" if paused else str(signal.kind),
            "rule": str(signal.rule),
            "decision_id": signal.signal_id,
            "scope": signal.stops,
            "trace_id": signal.trace_id,
            "reason": signal.reason,
            "release": release,
        },
    }


class GatewayGuard:
    """The gateway's decisions over one `KillSwitch`, started in the background.

    `check(facts)` (async) returns a Verdict: a Refusal, or a downgrade's system message, or
    nothing (go on). It never waits on Kafka; only a paused trace's call waits, bounded."""

    def __init__(
        self,
        make_switch: Callable[[], KillSwitch],
        *,
        unreachable: str = "fail_open",
        pause_wait_seconds: float = 5.0,
        retry_seconds: float = 10.0,
    ) -> None:
        if unreachable not in UNREACHABLE_CHOICES:
            raise ValueError(
                f"unreachable must be one of {UNREACHABLE_CHOICES}, not {unreachable!r}"
            )
        self.fail_closed = unreachable == "fail_closed"
        self.pause_wait_seconds = pause_wait_seconds
        self.retry_seconds = retry_seconds
        self._make_switch = make_switch
        self.switch: KillSwitch | None = None
        self.start_error: Exception | None = None
        # Calls that passed with no trace checked, by why (absent, malformed, repeated,
        # unreachable); the first of all is warned about, the rest only counted.
        self.unguarded: Counter[str] = Counter()
        self._warned = False
        # Contained tools taken out of requests, by name; requests left whole because every
        # tool in them was contained (the first is logged).
        self.tools_removed: Counter[str] = Counter()
        self.all_tools_contained = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._starter = threading.Thread(target=self._start, name="spanguard-gateway", daemon=True)
        self._starter.start()

    def _start(self) -> None:
        said = False
        while not self._stop.is_set():
            switch = self._make_switch()
            try:
                switch.start()
            # Unreachable, refused credentials, missing topic: the thread retries, never dies.
            except Exception as exc:  # noqa: BLE001
                switch.close()
                self.start_error = exc
                if not said:
                    said = True
                    how = "refusing every call (503)" if self.fail_closed else "serving unguarded"
                    log.error(
                        "spanguard gateway: the kill topic cannot be read (%s): %s until it is"
                        " (unreachable: %s); retrying every %g s",
                        exc,
                        how,
                        "fail_closed" if self.fail_closed else "fail_open",
                        self.retry_seconds,
                    )
                self._stop.wait(self.retry_seconds)
                continue
            self.switch = switch
            self.start_error = None
            if said:
                log.warning("spanguard gateway: the kill topic is read now; calls are guarded")
            return

    def wait_ready(self, timeout: float) -> bool:
        self._starter.join(timeout)
        return self.switch is not None

    def close(self) -> None:
        self._stop.set()
        if self.switch is not None:
            self.switch.close()

    def _unguarded(self, why: str) -> None:
        with self._lock:
            self.unguarded[why] += 1
            first = not self._warned
            self._warned = True
        if first:
            log.warning(
                "spanguard gateway: a model call passed with no trace to check (%s); send a W3C"
                " traceparent, or name the run (%s), or it is NOT guarded (further ones are"
                " counted in GatewayGuard.unguarded, not logged)",
                why,
                RUN_HEADER,
            )

    def remove_contained_tools(self, data: dict[str, Any]) -> list[str]:
        """Take the contained tools out of the request's `tools` and `functions`; the names
        taken out. A request whose every tool is contained keeps them all (the model has no
        other path: removing them would change what it is asked, not stop the calls)."""
        switch = self.switch
        if switch is None:
            return []
        removed: list[str] = []
        for key in ("tools", "functions"):
            tools = data.get(key)
            if not isinstance(tools, list) or not tools:
                continue
            contained = [tool for tool in tools if _contained(switch, _tool_name(tool))]
            if not contained:
                continue
            if len(contained) == len(tools):
                self._every_tool_contained(key, contained)
                continue
            data[key] = [tool for tool in tools if tool not in contained]
            removed += [name for tool in contained if (name := _tool_name(tool))]
        if removed:
            _drop_forced_choice(data, set(removed))
            with self._lock:
                self.tools_removed.update(removed)
        return removed

    def _every_tool_contained(self, key: str, tools: list[Any]) -> None:
        with self._lock:
            self.all_tools_contained += 1
            first = self.all_tools_contained == 1
        if first:
            log.warning(
                "spanguard gateway: every tool of a request's %s is contained (%s): the request"
                " is left as it is (further ones are counted in"
                " GatewayGuard.all_tools_contained, not logged)",
                key,
                ", ".join(str(_tool_name(tool)) for tool in tools[:10]),
            )

    async def check(self, facts: RequestFacts) -> Verdict:
        switch = self.switch
        if switch is None:
            if self.fail_closed:
                return Verdict(
                    Refusal(
                        503,
                        {
                            "error": "spanguard: the kill topic cannot be read and the gateway"
                            " fails closed (unreachable: fail_closed); try again later",
                            "spanguard": {"action": "unreachable"},
                        },
                    )
                )
            self._unguarded("unreachable")
            return Verdict()
        trace_id, derived = facts.trace_id, False
        if trace_id is None and facts.no_trace == "absent" and facts.run:
            trace_id, derived = derived_trace_id(facts.run), True
        verdict = Verdict(trace_id=trace_id, derived=derived)
        try:
            if trace_id is None:
                switch.check_scopes(facts.conversation_id, facts.agent)
                self._unguarded(facts.no_trace or "absent")
                return verdict
            try:
                verdict.system_message = switch.check(
                    trace_id, conversation_id=facts.conversation_id, agent=facts.agent
                )
            except AgentPaused as paused:
                try:
                    verdict.system_message = await switch.wait_async(
                        trace_id, timeout=self.pause_wait_seconds
                    )
                except AgentPaused:
                    verdict.refusal = Refusal(423, refusal_body(paused.signal, paused=True))
        except AgentKilled as killed:
            verdict.refusal = Refusal(403, refusal_body(killed.signal))
        return verdict


def _tool_name(tool: Any) -> str | None:
    """A request tool's name: OpenAI's {"type": "function", "function": {"name"}}, a legacy
    function's or Anthropic's {"name"}."""
    if not isinstance(tool, Mapping):
        return None
    function = tool.get("function")
    name = function.get("name") if isinstance(function, Mapping) else tool.get("name")
    return name if isinstance(name, str) and 0 < len(name) <= MAX_NAME_CHARS else None


def _contained(switch: KillSwitch, name: str | None) -> bool:
    # The request names no server: a contain of the name on any server holds.
    return name is not None and switch.signals.contained(name) is not None


def _drop_forced_choice(data: dict[str, Any], removed: set[str]) -> None:
    """A `tool_choice` (or `function_call`) forcing a removed tool is dropped: auto again."""
    for key in ("tool_choice", "function_call"):
        choice = data.get(key)
        if not isinstance(choice, Mapping):
            continue
        function = choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else choice.get("name")
        if name in removed:
            del data[key]


def _settings_default(name: str, fallback: str) -> str:
    # The worker's own variables (SPANGUARD_BOOTSTRAP, SPANGUARD_KILL_TOPIC): one stack, one set.
    return os.environ.get(f"SPANGUARD_{name.upper()}") or fallback


try:  # the class LiteLLM loads; the logic above needs no LiteLLM
    from litellm.integrations.custom_guardrail import CustomGuardrail as _CustomGuardrail
except ImportError:  # pragma: no cover - spanguard[litellm] not installed
    _CustomGuardrail = object  # type: ignore[assignment,misc]


class SpanguardGuardrail(_CustomGuardrail):  # type: ignore[misc,valid-type]
    """LiteLLM's proxy guardrail (config.yaml, docs/agents.md):

    guardrails:
      - guardrail_name: spanguard
        litellm_params:
          guardrail: spanguard.killswitch.gateway.SpanguardGuardrail
          mode: pre_call
          default_on: true
    """

    def __init__(
        self,
        bootstrap_servers: str | None = None,
        kill_topic: str | None = None,
        ack_topic: str | None = "agent-kill-acks",
        unreachable: str = "fail_open",
        pause_wait_seconds: float = 5.0,
        **kwargs: Any,
    ) -> None:
        if _CustomGuardrail is object:
            raise ImportError(
                'the gateway guardrail needs LiteLLM: pip install "spanguard[litellm]"'
            )
        super().__init__(**kwargs)
        bootstrap = bootstrap_servers or _settings_default("bootstrap", "127.0.0.1:9092")
        topic = kill_topic or _settings_default("kill_topic", "agent-kill-signals")

        def make_switch() -> KillSwitch:
            return KillSwitch(bootstrap, topic, ack_topic=ack_topic, start=False)

        self.guard = GatewayGuard(
            make_switch, unreachable=unreachable, pause_wait_seconds=float(pause_wait_seconds)
        )

    async def async_pre_call_hook(
        self, user_api_key_dict: Any, cache: Any, data: dict, call_type: Any
    ) -> dict:
        from fastapi import HTTPException

        facts = request_facts(data, getattr(user_api_key_dict, "key_alias", None))
        verdict = await self.guard.check(facts)
        if verdict.refusal is not None:
            raise HTTPException(status_code=verdict.refusal.status, detail=verdict.refusal.body)
        if verdict.derived and verdict.trace_id is not None:
            _trace_the_run(data, verdict.trace_id)
        if verdict.system_message and isinstance(data.get("messages"), list):
            data["messages"].append({"role": "system", "content": verdict.system_message})
        self.guard.remove_contained_tools(data)
        return data


def _trace_the_run(data: dict, trace_id: str) -> None:
    """Put the proxy's `litellm_request` span of this call in the run's trace: LiteLLM's otel
    callback parents it to `metadata.litellm_parent_otel_span` before anything else."""
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    metadata = data.get("metadata")
    if not isinstance(metadata, dict):
        return
    parent = SpanContext(
        trace_id=int(trace_id, 16),
        span_id=int.from_bytes(secrets.token_bytes(8), "big") or 1,
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
    )
    metadata["litellm_parent_otel_span"] = NonRecordingSpan(parent)
