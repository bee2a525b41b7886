"""The agent tree of a trace (spanguard/detection/agent_tree.py) and the rules over it:
handoff_cycle, delegation_depth, agent_fan_out; and what bad input costs it."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from spanguard.cli.report import render_html
from spanguard.detection.agent_tree import MAX_LINKS, MAX_RUNS, AgentTree
from spanguard.detection.conventions.values import MAX_TEXT_CHARS
from spanguard.detection.explain import explain_records
from spanguard.detection.guard import Guard, GuardCount
from spanguard.detection.timelines import Timelines
from spanguard.detection.trace_state import STATE_VERSION, TraceState
from spanguard.schemas.decision import validate
from spanguard.schemas.policy import Policy

TRACE = bytes(range(16))
SECOND = 1_000_000_000


def span_id(number: int) -> bytes:
    return (number + 1).to_bytes(8, "big")


class Spans:
    """One OTLP request of hand-made spans of one trace, in the order given (export order)."""

    def __init__(self, scope: str = "tests") -> None:
        self.request = ExportTraceServiceRequest()
        resource = self.request.resource_spans.add()
        attribute = resource.resource.attributes.add()
        attribute.key, attribute.value.string_value = "service.name", "multi-agent"
        self.scope = resource.scope_spans.add()
        self.scope.scope.name = scope

    def service(self, name: str) -> None:
        """The spans from here on are another service's (a resource of their own)."""
        resource = self.request.resource_spans.add()
        attribute = resource.resource.attributes.add()
        attribute.key, attribute.value.string_value = "service.name", name
        self.scope = resource.scope_spans.add()
        self.scope.scope.name = "tests"

    def in_scope(self, scope: str) -> None:
        """The spans from here on are of instrumentation `scope` (the same service)."""
        self.scope = self.request.resource_spans[-1].scope_spans.add()
        self.scope.scope.name = scope

    def span(
        self,
        number: int,
        parent: int | None,
        start: int,
        end: int,
        name: str = "span",
        **attributes: str,
    ) -> None:
        span = self.scope.spans.add()
        span.trace_id, span.span_id = TRACE, span_id(number)
        if parent is not None:
            span.parent_span_id = span_id(parent)
        span.name = name
        span.start_time_unix_nano, span.end_time_unix_nano = start, end
        for key, value in attributes.items():
            attribute = span.attributes.add()
            attribute.key, attribute.value.string_value = key.replace("__", "."), value

    def agent(self, number: int, parent: int | None, name: str, start: int, end: int) -> None:
        self.span(
            number, parent, start, end,
            gen_ai__operation__name="invoke_agent", gen_ai__agent__name=name,
        )  # fmt: skip

    def handoff(self, number: int, from_agent: str, to_agent: str, at: int) -> None:
        self.span(
            number, None, at, at + 1,
            gen_ai__operation__name="agent_handoff", gen_ai__handoff__from_agent=from_agent,
            gen_ai__handoff__to_agent=to_agent,
        )  # fmt: skip

    def tool(self, number: int, name: str, arguments: str, result: str, at: int) -> None:
        self.span(
            number, None, at, at + 1,
            gen_ai__operation__name="execute_tool", gen_ai__tool__name=name,
            gen_ai__tool__call__arguments=arguments, gen_ai__tool__call__result=result,
        )  # fmt: skip


def chain(depth: int) -> Spans:
    """Agents nested `depth` deep, each inside the one before, exported innermost first."""
    spans = Spans()
    base = 1_700_000_000 * SECOND
    for level in range(depth, 0, -1):
        spans.agent(level, level - 1 if level > 1 else None, f"level_{level}",
                    base + level, base + 10 * depth - level)  # fmt: skip
    return spans


def guard(**multi_agent: object) -> Guard:
    settings: dict = {"multi_agent": multi_agent} if multi_agent else {}
    action = settings.get("multi_agent", {}).pop("action", None)
    if action:
        settings["action"] = action
    return Guard(Policy.from_mapping({"defaults": settings}))


def records(decisions: list) -> list[dict]:
    out = [decision.to_dict() for decision in decisions]
    for record in out:
        validate(record, "detection")
    return out


def test_a_chain_deeper_than_max_depth_is_decided_when_its_outer_agent_ends():
    [decision] = records(guard().process(chain(6).request))
    assert (decision["rule"], decision["action"], decision["depth"]) == (
        "delegation_depth", "kill", 6,
    )  # fmt: skip
    assert decision["agents"] == [f"level_{level}" for level in range(1, 7)]
    assert decision["span_id"] == span_id(1).hex()  # level_1's span completes the chain
    assert records(guard().process(chain(5).request)) == []


def test_nesting_by_parent_span_alone_when_times_are_missing():
    spans = Spans()
    for level in range(4, 0, -1):
        spans.agent(level, level - 1 if level > 1 else None, f"a{level}", 0, 0)
    [decision] = records(guard(max_depth=3).process(spans.request))
    assert decision["depth"] == 4


def test_fan_out_trips_at_the_run_over_the_limit_beyond_the_first():
    spans = Spans()
    base = 1_700_000_000 * SECOND
    for worker in range(1, 31):
        spans.agent(worker, 0, "worker", base + 10 * worker, base + 10 * worker + 5)
    [decision] = records(guard(max_sub_agents=20).process(spans.request))
    assert (decision["rule"], decision["sub_agents"]) == ("agent_fan_out", 21)
    assert decision["span_id"] == span_id(22).hex()
    assert decision["agents"] == ["worker"]


def pingpong(spans: Spans, handoffs: int, first: int = 0) -> None:
    for number in range(handoffs):
        to_agent = "billing" if number % 2 == 0 else "triage"
        from_agent = "triage" if number % 2 == 0 else "billing"
        spans.handoff(first + number, from_agent, to_agent, (first + number + 1) * SECOND)


def test_handoff_cycle_trips_at_the_fourth_handoff_and_tool_loop_leaves_handoffs_to_it():
    spans = Spans()
    pingpong(spans, 8)
    [decision] = records(guard().process(spans.request))
    assert (decision["rule"], decision["hits"], decision["span_id"]) == (
        "handoff_cycle", 2, span_id(3).hex(),
    )  # fmt: skip
    assert decision["agents"] == ["billing", "triage", "billing", "triage"]
    # In shadow mode nothing restarts the count: still one rule decides on the handoffs.
    flags = records(guard(action="flag").process(spans.request))
    assert [(flag["rule"], flag["action"]) for flag in flags] == [("handoff_cycle", "flag")]


def test_with_handoff_cycle_off_tool_loop_catches_the_pingpong_as_before():
    spans = Spans()
    pingpong(spans, 8)
    [decision] = records(guard(cycles=None).process(spans.request))
    assert (decision["rule"], decision["span_id"]) == ("tool_loop", span_id(4).hex())


def test_new_work_between_handoffs_is_no_cycle():
    spans = Spans()
    for visit in range(4):
        spans.handoff(3 * visit, "triage", "billing", (3 * visit + 1) * SECOND)
        spans.tool(3 * visit + 1, "lookup_invoice", f'{{"invoice": "inv-{visit}"}}',
                   f"inv-{visit}: 40 USD", (3 * visit + 2) * SECOND)  # fmt: skip
        spans.handoff(3 * visit + 2, "billing", "triage", (3 * visit + 3) * SECOND)
    assert records(guard().process(spans.request)) == []


def test_each_rule_is_off_with_its_setting_null():
    spans = chain(8)
    pingpong(spans, 8, first=100)
    for worker in range(200, 230):
        spans.agent(worker, None, "worker", 0, 0)
    decided = {d["rule"] for d in records(guard().process(spans.request))}
    assert decided == {"delegation_depth", "handoff_cycle", "agent_fan_out"}
    off = guard(cycles=None, max_depth=None, max_sub_agents=None, action="kill")
    assert {d["rule"] for d in records(off.process(spans.request))} == {"tool_loop"}


def test_a_tree_ten_thousand_deep_or_wide_is_bounded_and_counted():
    for spans, rules in (
        (chain(10_000), ["delegation_depth", "agent_fan_out"]),
        (wide(10_000), ["agent_fan_out"]),
    ):
        checked = guard(action="flag")
        started = time.perf_counter()
        decisions = records(checked.process(spans.request))
        assert time.perf_counter() - started < 20
        assert [decision["rule"] for decision in decisions] == rules
        assert checked.stats.count(GuardCount.AGENT_RUNS_UNPLACED) == 10_000 - MAX_RUNS
        [state] = checked.states.values()
        assert state.agent_tree is not None and len(state.agent_tree.runs) == MAX_RUNS
        assert state.agent_tree.started == 10_000
        assert len(state.to_bytes()) < 200_000


def wide(runs: int) -> Spans:
    spans = Spans()
    for number in range(runs):
        spans.agent(number, 10**9, "worker", SECOND + 10 * number, SECOND + 10 * number + 5)
    return spans


def test_parents_that_never_arrive_and_parents_in_a_cycle_cost_nothing_more():
    spans = Spans()
    spans.agent(1, 2, "a", SECOND, 2 * SECOND)  # each the other's parent
    spans.agent(2, 1, "b", SECOND, 2 * SECOND)
    spans.agent(3, 4, "c", 0, 0)  # 4 never arrives
    spans.agent(4 + 10, 3, "d", 0, 0)
    checked = guard()
    assert records(checked.process(spans.request)) == []
    [state] = checked.states.values()
    assert state.agent_tree is not None and state.agent_tree.deepest == 2


def test_agent_names_of_megabytes_are_bounded():
    spans = chain(7)
    spans.scope.spans[0].attributes[1].value.string_value = "x" * 5_000_000
    [decision] = records(guard().process(spans.request))
    assert all(len(name) <= MAX_TEXT_CHARS + 64 for name in decision["agents"])


def remote_chain(hops: int, agent: str = "remote_{hop}") -> Spans:
    """A host agent asking a remote agent (A2A), which asks the next, `hops` deep, each in a
    service of its own; each hop is the caller's proxy span of the agent (ADK's
    RemoteA2aAgent), its HTTP client span, the service's server span and the agent's own
    span. Exported as they end: innermost first, each service's spans together."""
    spans = Spans()
    base = 1_700_000_000 * SECOND
    for hop in range(hops, 0, -1):
        number, name = 10 * hop, agent.format(hop=hop)
        start, end = base + number, base + 1_000 - number
        spans.service(f"service_{hop}")
        spans.span(number + 3, number + 2, start + 3, end - 3)  # the server's span
        spans.agent(number + 4, number + 3, name, start + 4, end - 4)  # the agent's own
        spans.service(f"service_{hop - 1}" if hop > 1 else "host")
        spans.span(number + 2, number + 1, start + 2, end - 2)  # the HTTP client's span
        caller = 10 * (hop - 1) + 4 if hop > 1 else 1
        spans.agent(number + 1, caller, name, start + 1, end - 1)  # the caller's proxy
    spans.agent(1, None, "host", base, base + 1_000)
    return spans


def test_a_remote_agents_two_spans_are_one_run_and_one_level():
    [decision] = records(guard().process(remote_chain(5).request))
    assert (decision["rule"], decision["depth"]) == ("delegation_depth", 6)
    assert decision["agents"] == ["host", *(f"remote_{hop}" for hop in range(1, 6))]
    assert records(guard().process(remote_chain(4).request)) == []  # 5 levels, not 9
    checked = guard(max_sub_agents=3, max_depth=None)
    [decision] = records(checked.process(remote_chain(5).request))
    assert (decision["rule"], decision["sub_agents"]) == ("agent_fan_out", 4)  # not 8
    [state] = checked.states.values()
    assert state.agent_tree is not None and state.agent_tree.started == 6


def test_an_agent_nested_in_itself_in_one_service_is_two_runs():
    spans = Spans()
    base = 1_700_000_000 * SECOND
    spans.agent(3, 2, "planner", base + 3, base + 7)
    spans.span(2, 1, base + 2, base + 8)  # the tool span of the planner called as a tool
    spans.agent(1, None, "planner", base + 1, base + 9)
    [decision] = records(guard(max_depth=1).process(spans.request))
    assert (decision["depth"], decision["agents"]) == (2, ["planner", "planner"])


def test_a_remote_run_is_kept_as_one_across_the_state_record():
    checked = guard(max_depth=None)
    checked.process(remote_chain(2).request)
    [state] = checked.states.values()
    assert [run.twin for run in state.agent_tree.runs].count(True) == 2  # a proxy a hop
    record = state.agent_tree.to_record()
    assert record["services"] == ["service_2", "service_1", "host"]
    for copy in (TraceState.from_bytes(state.to_bytes()), TraceState.from_dict(state.to_dict())):
        tree = copy.agent_tree
        assert tree is not None and tree.to_record() == record
        assert [run.twin for run in tree.runs] == [run.twin for run in state.agent_tree.runs]
    # A record without services (written before they were kept): no run is another's twin.
    old = {**record, "runs": [run[:7] for run in record["runs"]]}
    del old["services"]
    assert not any(run.twin for run in AgentTree.from_record(old).runs)


A2A_HANDLER = "a2a.server.request_handlers.default_request_handler_v2.DefaultRequestHandlerV2"


def a2a_pingpong(hops: int) -> Spans:
    """Two a2a-sdk services asking each other, `hops` requests nested (each open until the
    innermost answers), the trace carried across: each request's handler span (no attribute,
    only its name) under the service's HTTP server span, under the caller's HTTP client span,
    under the caller's handler. Each service exports its spans together, the HTTP spans first
    (grouped by scope): so they come before the trace has any agent."""
    spans = Spans()
    base = 1_700_000_000 * SECOND
    for service in ("billing", "triage"):
        spans.service(f"{service}-service")
        mine = [hop for hop in range(hops, 0, -1) if hop % 2 == (service == "billing")]
        for hop in mine:  # the server's span, then the client's of the call it made
            number, start, end = 10 * hop, base + 10 * hop, base + 1_000 - 10 * hop
            spans.span(number + 1, number - 1 if hop > 1 else None, start + 1, end - 1)
            spans.span(number + 9, number + 2, start + 8, end - 8)
        spans.in_scope("a2a-python-sdk")
        for hop in mine:
            number, start, end = 10 * hop, base + 10 * hop, base + 1_000 - 10 * hop
            spans.span(number + 2, number + 1, start + 2, end - 2, f"{A2A_HANDLER}.on_message_send")
    return spans


def test_an_a2a_request_handler_is_a_run_of_the_agent_its_service_names():
    [decision] = records(guard().process(a2a_pingpong(9).request))
    assert (decision["rule"], decision["depth"]) == ("delegation_depth", 6)
    assert set(decision["agents"]) == {"billing-service", "triage-service"}
    checked = guard(max_depth=None)
    checked.process(a2a_pingpong(9).request)
    [state] = checked.states.values()
    assert state.agent_tree is not None
    assert (state.agent_tree.started, state.agent_tree.deepest) == (9, 9)
    copy = TraceState.from_dict(state.to_dict()).agent_tree
    assert copy is not None and copy.to_record() == state.agent_tree.to_record()
    assert all(run.handler for run in copy.runs)
    assert records(guard().process(a2a_pingpong(5).request)) == []


def test_only_a2a_sdks_handler_answering_a_message_is_a_run():
    from spanguard.detection.conventions.adapt import adapt_span
    from spanguard.detection.conventions.events import AgentRun

    spans = Spans("a2a-python-sdk")
    dispatcher = 9  # the span above the handler's: the request came with its caller's trace
    for number, method in enumerate(("on_message_send", "on_message_send_stream", "on_get_task")):
        spans.span(number, dispatcher, 1, 2, f"{A2A_HANDLER}.{method}")
    spans.span(3, None, 1, 2, "a2a.client.JsonRpcTransport.send_message")
    spans.span(4, dispatcher, 1, 2, "on_message_send")
    run, *others = (adapt_span(span, scope="a2a-python-sdk") for span in spans.scope.spans)
    assert isinstance(run, AgentRun) and run.by_service and run.agent_name is None
    assert run.parent_span_id == span_id(dispatcher)
    assert others == [None] * 4
    assert adapt_span(spans.scope.spans[0], scope="other") is None


DISPATCHER = "a2a.server.routes.jsonrpc_dispatcher.JsonRpcDispatcher"


def test_an_a2a_request_starting_a_trace_is_one_whose_callers_trace_did_not_come():
    from spanguard.detection.conventions.adapt import adapt_span
    from spanguard.detection.conventions.events import AgentRun, UncarriedRequest

    spans = Spans("a2a-python-sdk")
    spans.span(0, None, 1, 9, f"{DISPATCHER}.handle_requests")
    spans.span(1, 0, 2, 8, f"{DISPATCHER}._process_streaming_request")  # below the request's
    # A root that answers no request (a2a-sdk ends its event queue's sinks outside any span).
    spans.span(2, None, 2, 3, "a2a.server.events.event_queue_v2.EventQueueSource.remove_sink")
    spans.span(3, None, 1, 2, "a2a.client.transports.jsonrpc.JsonRpcTransport.send_message")
    spans.span(4, None, 1, 2, "a2a.server.request_handlers.jsonrpc_handler.JSONRPCHandler.x")  # 0.x
    spans.span(5, None, 1, 2, f"{A2A_HANDLER}.on_message_send")  # a handler with nothing above
    read = [adapt_span(span, scope="a2a-python-sdk") for span in spans.scope.spans]
    assert [type(event).__name__ for event in read[:5]] == [
        "UncarriedRequest",
        "NoneType",
        "NoneType",
        "NoneType",
        "UncarriedRequest",
    ]
    assert isinstance(read[0], UncarriedRequest) and read[0].span_id == span_id(0)
    assert isinstance(read[5], AgentRun) and read[5].parent_span_id == b""
    # The guard counts each such request (the root handler's run too) and places the run.
    checked = guard()
    assert records(checked.process(spans.request)) == []
    assert checked.stats.uncarried_requests == 3
    [state] = checked.states.values()
    assert state.agent_tree is not None and state.agent_tree.started == 1
    # The same spans again (an exporter's retry, a redelivery): no request counted twice.
    assert records(checked.process(spans.request)) == []
    assert checked.stats.uncarried_requests == 3


def view_spans(spans: Spans) -> list:
    """The spans as the guard reads them (schemas/otlp_view.py's view)."""
    from spanguard.schemas.otlp_view import view_of

    return list(view_of(spans.request).resource_spans[0].scope_spans[0].spans)


def test_an_agent_run_starting_a_trace_linked_to_its_callers_is_counted_and_told_once(caplog):
    """VoltAgent starts each agent run in a trace of its own, linked to the span current when
    it started (an instrumented server's, in the caller's trace): the trace rules do not
    follow links, so the guard counts such runs and tells each service once."""
    from spanguard.detection.conventions.adapt import adapt_span
    from spanguard.detection.conventions.events import AgentRun

    def linked(spans: Spans, trace: bytes) -> None:
        link = spans.scope.spans[-1].links.add()
        link.trace_id, link.span_id = trace, span_id(7)

    caller = bytes.fromhex("ab" * 16)
    voltagent = Spans("@voltagent/core")
    voltagent.span(0, None, 1, 9, "billing", entity__type="agent", entity__name="billing")
    linked(voltagent, caller)
    voltagent.span(2, 0, 2, 8, "sub", entity__type="agent", entity__name="billing")
    linked(voltagent, caller)  # a run with a parent: the trace was carried
    voltagent.span(3, None, 1, 9, "self", entity__type="agent", entity__name="billing")
    linked(voltagent, TRACE)  # a link within its own trace
    for number, bad in ((4, bytes(16)), (5, b"abc")):  # no valid trace id: no caller
        voltagent.span(number, None, 1, 9, "bad", entity__type="agent", entity__name="billing")
        linked(voltagent, bad)
    genai = Spans()
    genai.agent(1, None, "triage", 1, 9)
    linked(genai, caller)
    read = [adapt_span(span, scope="@voltagent/core") for span in view_spans(voltagent)]
    read.append(adapt_span(view_spans(genai)[0], scope="tests"))
    assert all(isinstance(run, AgentRun) for run in read)
    callers = [run.caller_trace_id for run in read]  # type: ignore[union-attr]
    assert callers == [caller.hex(), None, None, None, None, caller.hex()]
    checked = guard()
    with caplog.at_level("WARNING", logger="spanguard.core"):
        assert records(checked.process(voltagent.request)) == []
        assert records(checked.process(voltagent.request)) == []  # again: placed once
    assert checked.stats.linked_runs == 1 and checked.stats.uncarried_requests == 0
    told = [r.getMessage() for r in caplog.records if "linked to its caller" in r.getMessage()]
    assert len(told) == 1 and "'multi-agent'" in told[0], told
    # Another trace of the same service: counted, not told again.
    for span in voltagent.scope.spans:
        span.trace_id = caller[::-1]
    with caplog.at_level("WARNING", logger="spanguard.core"):
        checked.process(voltagent.request)
    assert checked.stats.linked_runs == 2
    assert [
        r.getMessage() for r in caplog.records if "linked to its caller" in r.getMessage()
    ] == told


def served(handler_first: bool) -> Spans:
    """A service (Google ADK's `to_a2a`) answering a request: a2a-sdk's handler span, its
    agent's run inside it; exported in the order given."""
    spans = Spans()
    spans.service("billing-service")
    base = 1_700_000_000 * SECOND
    for step in (0, 1) if handler_first else (1, 0):
        if step:
            spans.in_scope("tests")
            spans.agent(3, 2, "billing", base + 3, base + 7)
            spans.span(2, 1, base + 2, base + 8)
        else:
            spans.in_scope("a2a-python-sdk")
            spans.span(1, None, base + 1, base + 9, f"{A2A_HANDLER}.on_message_send")
    return spans


def test_a_handler_and_its_agents_run_inside_it_are_one_run_named_by_the_agent():
    for handler_first in (True, False):
        checked = guard(max_depth=1)
        assert records(checked.process(served(handler_first).request)) == []
        [state] = checked.states.values()
        tree = state.agent_tree
        assert tree is not None and (tree.started, tree.agent_names()) == (1, ["billing"])
        copy = TraceState.from_bytes(state.to_bytes()).agent_tree
        assert copy is not None and copy.to_record() == tree.to_record()


def test_the_tree_is_kept_in_the_state_record_and_read_back():
    checked = guard(max_depth=None)
    spans = chain(3)
    pingpong(spans, 1, first=50)
    checked.process(spans.request)
    [state] = checked.states.values()
    for copy in (TraceState.from_bytes(state.to_bytes()), TraceState.from_dict(state.to_dict())):
        tree = copy.agent_tree
        assert tree is not None
        assert tree.to_record() == state.agent_tree.to_record()
        assert [(depth, name) for depth, name in tree.levels()] == [
            (0, "level_1"), (1, "level_2"), (2, "level_3"),
        ]  # fmt: skip
    # A state without agents has no section, as before; a record of version 5 (no agent tree
    # section) reads as a trace without agents, and a worker of version 5 reads version 6.
    assert TraceState().agent_tree is None
    assert b"agent_tree" not in TraceState().to_bytes()
    without = bytearray(TraceState("svc", last_seen=1.0).to_bytes())
    without[1] = 5
    assert TraceState.from_bytes(bytes(without)).agent_tree is None
    assert state.to_bytes()[1] == STATE_VERSION == 6


def langgraph_turn(spans: Spans, number: int, namespace: str | None, at: int) -> None:
    """A model turn of a LangGraph agent under OpenInference: an AGENT span named `agent`,
    the subgraph it runs in only in `metadata`."""
    metadata = {"langgraph_node": "agent", "langgraph_step": 1}
    if namespace is not None:
        metadata["checkpoint_ns"] = namespace
    spans.span(number, 0, at, at + 1, openinference__span__kind="AGENT",
               metadata=json.dumps(metadata))  # fmt: skip


def test_langgraph_agents_are_named_by_their_namespace_and_its_turns_are_one_run():
    spans = Spans()
    langgraph_turn(spans, 1, "supervisor:s1", SECOND)
    for worker in range(30):  # two model turns each: one run
        for turn in range(2):
            langgraph_turn(spans, 10 + 2 * worker + turn, f"worker_{worker % 2}:w{worker}",
                           (2 + 2 * worker + turn) * SECOND)  # fmt: skip
    [decision] = records(guard().process(spans.request))
    assert (decision["rule"], decision["sub_agents"]) == ("agent_fan_out", 21)
    assert decision["span_id"] == span_id(10 + 2 * 20).hex()  # the 21st worker's first turn
    assert decision["agents"] == ["supervisor", "worker_0", "worker_1"]
    # The root graph's turns (no namespace), metadata that is no JSON object or too long to
    # read: no run.
    spans = Spans()
    for number in range(40):
        langgraph_turn(spans, number, None, (number + 1) * SECOND)
    for number, metadata in enumerate(
        (
            "[1]",
            "{not json",
            '{"checkpoint_ns": 5}',
            json.dumps({"checkpoint_ns": "a:" + "x" * 10**6}),
        )
    ):
        spans.span(100 + number, 0, SECOND, SECOND, openinference__span__kind="AGENT",
                   metadata=metadata)  # fmt: skip
    checked = guard()
    assert records(checked.process(spans.request)) == []
    assert all(state.agent_tree is None for state in checked.states.values())


def adk_transfer(spans: Spans, number: int, agent: str, at: int) -> None:
    """Google ADK's transfer with content capture off: no arguments, the handing agent named."""
    spans.span(number, None, at, at + 1, gen_ai__operation__name="execute_tool",
               gen_ai__tool__name="transfer_to_agent", gen_ai__agent__name=agent)  # fmt: skip


def test_adk_transfers_without_arguments_hand_to_the_next_transferring_agent():
    spans = Spans("gcp.vertex.agent")
    for number in range(8):
        adk_transfer(spans, number, "triage" if number % 2 == 0 else "billing", number * SECOND)
    [decision] = records(guard().process(spans.request))
    # The 4th handoff (billing -> triage) is known at the 5th transfer, made by triage.
    assert (decision["rule"], decision["span_id"], decision["tool_name"]) == (
        "handoff_cycle", span_id(4).hex(), "handoff to triage",
    )  # fmt: skip
    assert decision["agents"] == ["billing", "triage", "billing", "triage"]
    # A call between them whose arguments are not recorded may be new work: no cycle.
    spans = Spans("gcp.vertex.agent")
    for number in range(8):
        adk_transfer(spans, 2 * number, "triage" if number % 2 == 0 else "billing",
                     2 * number * SECOND)  # fmt: skip
        spans.span(2 * number + 1, None, (2 * number + 1) * SECOND, (2 * number + 1) * SECOND,
                   gen_ai__operation__name="execute_tool", gen_ai__tool__name="lookup",
                   gen_ai__agent__name="billing")  # fmt: skip
    assert records(guard().process(spans.request)) == []
    # Elsewhere than ADK's scope a tool named so is a tool like any other.
    spans = Spans()
    for number in range(8):
        adk_transfer(spans, number, "triage" if number % 2 == 0 else "billing", number * SECOND)
    assert records(guard().process(spans.request)) == []


def routed_turns(remote_agents: list[str]) -> Spans:
    """A host handing each turn to a remote agent with content capture off (Google ADK over
    A2A): every transfer is the host's, the remote agent's run between them."""
    spans = Spans("gcp.vertex.agent")
    for turn, remote in enumerate(remote_agents):
        at = 10 * turn * SECOND
        adk_transfer(spans, 3 * turn, "host", at)
        spans.agent(3 * turn + 1, None, remote, at + 2, at + SECOND)
        spans.span(3 * turn + 2, None, at + 2 * SECOND, at + 2 * SECOND + 1,
                   gen_ai__operation__name="generate_content", gen_ai__agent__name="host")  # fmt: skip
    return spans


def test_a_transfer_naming_no_agent_hands_to_the_agent_seen_after_it():
    # A host routing each turn to another agent is no cycle (each transfer is the host's).
    assert records(guard().process(routed_turns(["billing", "refunds", "shipping"]).request)) == []
    # Routing the task back and forth is: known at the host's 5th transfer.
    spans = routed_turns(["billing", "triage"] * 4)
    [decision] = records(guard().process(spans.request))
    assert (decision["rule"], decision["span_id"], decision["tool_name"]) == (
        "handoff_cycle", span_id(3 * 4).hex(), "handoff to triage",
    )  # fmt: skip
    assert decision["agents"] == ["billing", "triage", "billing", "triage"]
    # The same agent transferring again with no other agent seen between: whom its transfer
    # reached is not known, so it is no handoff and the handoffs before it are no loop.
    spans = Spans("gcp.vertex.agent")
    for number in range(8):
        adk_transfer(spans, number, "host", number * SECOND)
    assert records(guard().process(spans.request)) == []
    tree = AgentTree()
    tree.add_handoff(("handoff to billing", None, None), "billing")
    assert tree.add_transfer(("transfer_to_agent", None, None), "host") is None
    assert tree.add_transfer(("transfer_to_agent", None, None), "host") is None
    assert tree.handoffs == []


def test_a_run_key_and_an_unresolved_transfer_are_kept_in_the_state_record():
    checked = guard()
    spans = Spans("gcp.vertex.agent")
    langgraph_turn(spans, 1, "supervisor:s1", SECOND)
    adk_transfer(spans, 2, "triage", 2 * SECOND)
    checked.process(spans.request)
    [state] = checked.states.values()
    tree = state.agent_tree
    assert tree is not None and tree.unresolved is not None and tree.runs[0].key
    for copy in (TraceState.from_bytes(state.to_bytes()), TraceState.from_dict(state.to_dict())):
        assert copy.agent_tree is not None
        assert copy.agent_tree.to_record() == tree.to_record()
    # The agent seen after it (the one it handed to) is kept too.
    spans = Spans("gcp.vertex.agent")
    spans.agent(3, None, "billing", 3 * SECOND, 4 * SECOND)
    checked.process(spans.request)
    assert tree.unresolved is not None and tree.unresolved[2] == "billing"
    copy = TraceState.from_bytes(state.to_bytes())
    assert copy.agent_tree is not None and copy.agent_tree.unresolved == tree.unresolved


def test_the_spans_between_agents_say_what_is_nested_not_time():
    """Parallel workers, each under a graph node span of its own, one inside another's time:
    siblings. Agents called as tools through spans between them: nested, each chain known
    when its outer agent ends, as by time."""
    spans = Spans()
    base = 1_700_000_000 * SECOND
    spans.agent(1, 0, "supervisor", base, base + 10)
    for worker in reversed(range(8)):  # worker k from k to 100 - k; exported as they end
        run, node = 100 + 2 * worker, 101 + 2 * worker
        spans.agent(run, node, f"worker_{worker}", base + 20 + worker, base + 120 - worker)
        spans.span(node, 1000, base + 20 + worker, base + 120 - worker)  # 1000: the graph
    assert records(guard(max_depth=2).process(spans.request)) == []
    # Without the node spans, in one service: a library exports a span after the spans below
    # it, so a parent not come is above or beside both runs, never between: siblings (as
    # VoltAgent's sub-agents run at once, each below a tool span that ends after them all).
    spans = Spans()
    for worker in reversed(range(8)):
        spans.agent(100 + 2 * worker, 101 + 2 * worker, f"worker_{worker}",
                    base + 20 + worker, base + 120 - worker)  # fmt: skip
    assert records(guard(max_depth=2).process(spans.request)) == []
    # Each worker in a service of its own (spans sent in another order, or not at all): time
    # says.
    spans = Spans()
    for worker in reversed(range(8)):
        spans.service(f"worker-{worker}-service")
        spans.agent(100 + 2 * worker, 101 + 2 * worker, f"worker_{worker}",
                    base + 20 + worker, base + 120 - worker)  # fmt: skip
    assert [d["rule"] for d in records(guard(max_depth=2).process(spans.request))] == [
        "delegation_depth"
    ]
    # level_k inside a tool span inside a turn span of level_k-1, exported inner first.
    spans = Spans()
    for level in range(6, 0, -1):
        start, end = base + level * 10, base + 1000 - level * 10
        above = 10 * (level - 1)  # level_k-1's agent span; + 1 its tool span, + 2 its turn
        spans.agent(10 * level, above + 1 if level > 1 else None, f"level_{level}", start, end)
        if level > 1:
            spans.span(above + 1, above + 2, start - 1, end + 1)
            spans.span(above + 2, above, start - 2, end + 2)
    [decision] = records(guard().process(spans.request))
    assert (decision["rule"], decision["depth"]) == ("delegation_depth", 6)
    assert decision["span_id"] == span_id(10).hex()  # level_1's span


def test_the_spans_kept_per_trace_are_bounded_and_counted():
    spans = Spans()
    spans.agent(0, 1, "a", SECOND, 2 * SECOND)
    for number in range(1, 10_001):  # a chain of 10,000 spans above it, and a cycle
        spans.span(number, number + 1 if number < 10_000 else 1, SECOND, 3 * SECOND)
    checked = guard()
    started = time.perf_counter()
    assert records(checked.process(spans.request)) == []
    assert time.perf_counter() - started < 20
    [state] = checked.states.values()
    assert state.agent_tree is not None and len(state.agent_tree.links) == MAX_LINKS
    assert checked.stats.count(GuardCount.AGENT_LINKS_UNKEPT) == 10_001 - MAX_LINKS
    assert len(state.to_bytes()) < 200_000
    copy = TraceState.from_bytes(state.to_bytes()).agent_tree
    assert copy is not None and copy.links == state.agent_tree.links


def test_explain_draws_the_agent_tree():
    [decision] = records(guard().process(chain(6).request))
    text = explain_records(decision["trace_id"], [decision], now=datetime.now(UTC))
    assert "agent tree (the deepest chain, 6 agents, outermost first):" in text
    assert "    level_1\n    └─ level_2\n       └─ level_3\n" in text


def test_agent_tree_alone():
    tree = AgentTree()
    assert tree.repeated_handoffs(2) == 0
    assert tree.deepest_chain() == [] and tree.levels() == []


def test_the_replay_page_draws_the_agent_tree():
    timelines = Timelines()
    checked = guard()
    checked.add_observer(timelines)
    checked.process(chain(6).request)
    page = render_html(timelines, checked.stats, ["chain"], checked.states)
    assert "agent tree: 6 runs, 6 deep" in page
    assert "level_1\n   └─ level_2\n      └─ level_3" in page
    assert "agents: level_1 → level_2" in page
