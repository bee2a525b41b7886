"""The changelog form of a trace's state: compact, versioned, and what an earlier version wrote
still loads. tests/fixtures/state/trace-state-v1.json holds bytes written by version 1 (the code
before `v` existed): a trace killed for a loop and a token budget, then released."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spanguard.detection.guard import Guard
from spanguard.detection.results import EMPTY, EMPTY_RESULT_DIGESTS
from spanguard.detection.rules.base import Fired
from spanguard.detection.trace_state import STATE_VERSION, TraceState
from tests.support.spans import AgentRecorder, one_request_per_span

V1 = Path(__file__).resolve().parents[1] / "fixtures" / "state" / "trace-state-v1.json"


def test_a_state_written_by_version_1_loads():
    data = V1.read_bytes()
    assert b'"v"' not in data  # version 1 had no version key
    state = TraceState.from_bytes(data)
    assert state.fired == {Fired("tool_loop", "kill"), Fired("token_budget", "kill")}
    assert state.service == "support-bot" and state.inference_tokens == 1700
    assert [key[0] for key in state.window] == [
        "search_docs",
        "get_job_status",
        "get_job_status",
        "get_job_status",
        "lookup",
    ]
    assert state.counts[state.window[1]] == 1 and len(state.polls) == 4
    assert state.released_at == 1796299999.5 and state.last_seen == 1796300000.25
    assert state.cycle_runs is None
    assert len(state.window_calls()) == 5 and state.window_calls()[0]["span_id"] is not None


def test_version_1_written_again_is_version_2_with_the_same_content():
    old = json.loads(V1.read_bytes())
    new = json.loads(TraceState.from_bytes(V1.read_bytes()).to_bytes())
    assert new.pop("v") == STATE_VERSION == 4
    # Version 4 keys an empty result by its marker: the empty result version 1 hashed is read
    # as that marker, so a loop goes on counting across the upgrade.
    assert old["window"][0][2] in EMPTY_RESULT_DIGESTS and new["window"][0][2] == EMPTY
    new["window"][0][2] = old["window"][0][2]
    # Version 4 adds when each call id's call ended: unknown (0) for what version 1 wrote.
    assert new.pop("recent_call_ends") == [0] * len(old["recent_call_ids"])
    assert new == old
    assert list(new)[-1] == "last_seen"  # eviction reads it off the end of the bytes


def test_a_loaded_version_1_state_goes_on_counting():
    """The fixture's trace was killed and released; its window counts on where it stopped."""
    state = TraceState.from_bytes(V1.read_bytes())
    state.fired.clear()  # as if no rule had fired yet
    guard = Guard()
    agent = AgentRecorder("support-bot", "support")
    guard.states[agent.trace_id] = state
    for _ in range(2):  # with the window's one search_docs: 3 (the default threshold)
        agent.tool(
            "search_docs",
            attributes={
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": "search_docs",
                "gen_ai.tool.call.arguments": json.dumps({"query": "refund policy"}),
                # Written as the version-1 worker read a plain-text result ({"_raw": text}):
                # a bare string hashes as itself since, so "no results" keys a new call.
                "gen_ai.tool.call.result": json.dumps({"_raw": "no results"}),
            },
        )
    assert [d for r in one_request_per_span(agent.finished()) for d in guard.process(r)] == []
    # The loaded search and the two new ones are one call: counted 3 times in the window
    # (no kill: the window's `lookup`, whose result was not recorded, may have been new work).
    key = guard.states[agent.trace_id].window[-1]
    assert key[2] == EMPTY and guard.states[agent.trace_id].counts[key] == 3


def test_keys_a_version_does_not_know_are_ignored():
    """A worker rolled back reads what a newer one wrote (and the other way round)."""
    record = json.loads(V1.read_bytes())
    record["v"] = 99
    record["a_later_field"] = [1, 2, 3]
    state = TraceState.from_dict(record)
    assert state.service == "support-bot"


def test_cycle_runs_are_written_only_while_a_cycle_builds():
    state = TraceState.from_bytes(V1.read_bytes())
    assert b"cycle_runs" not in state.to_bytes()
    state.cycle_runs = [0, 3, 0, 0, 0, 0, 0, 0, 0, 0]
    again = TraceState.from_bytes(state.to_bytes())
    assert again.cycle_runs == state.cycle_runs
    state.restart_window()
    assert state.cycle_runs is None


def test_states_are_encoded_by_orjson_and_what_it_refuses_by_json_read_back_alike():
    orjson = pytest.importorskip("orjson")  # the worker's extra, installed by `make install`
    state = TraceState.from_bytes(V1.read_bytes())
    state.agent_name = "agent-é"  # orjson writes UTF-8 where json escapes: both read the same
    data = state.to_bytes()
    assert data == orjson.dumps(state.to_dict())
    assert json.loads(data) == json.loads(json.dumps(state.to_dict()))
    assert data.endswith(b"}") and b'"last_seen":' in data[-40:]  # eviction reads it there
    # A trace that priced absurd counts: a cost past 64 bits, which orjson refuses.
    state.inference_cost = 2**70
    data = state.to_bytes()
    assert TraceState.from_bytes(data).inference_cost == 2**70
    assert TraceState.from_bytes(data).to_dict() == TraceState.from_bytes(
        V1.read_bytes()
    ).to_dict() | {
        "agent_name": "agent-é",
        "inference_cost": 2**70,
        "aggregate_cost": 0,
        "unpriced_tokens": 0,
        "v": STATE_VERSION,
    }
