"""The changelog form of a trace's state: compact, versioned, and what an earlier version wrote
still loads. tests/fixtures/state/trace-state-v1.json holds bytes written by version 1 (the code
before `v` existed): a trace killed for a loop and a token budget, then released;
trace-state-v4.json bytes written by version 4, the last JSON one (every optional field set)."""

from __future__ import annotations

import base64
import contextlib
import json
from pathlib import Path

import pytest

from spanguard.detection import core_build
from spanguard.detection.guard import Guard
from spanguard.detection.results import EMPTY, EMPTY_RESULT_DIGESTS
from spanguard.detection.rules.base import Fired
from spanguard.detection.trace_state import (
    MARK_BYTES,
    STATE_VERSION,
    RecentCalls,
    RecentIds,
    StateDecodeError,
    TraceState,
    call_id_key,
    encode_record,
    stored_state_last_seen,
)
from tests.support.spans import AgentRecorder, one_request_per_span

V1 = Path(__file__).resolve().parents[1] / "fixtures" / "state" / "trace-state-v1.json"
V4 = V1.with_name("trace-state-v4.json")


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


def test_version_1_written_again_is_the_current_version_with_the_same_content():
    old = json.loads(V1.read_bytes())
    written = TraceState.from_bytes(V1.read_bytes()).to_bytes()
    new = json.loads(encode_record(TraceState.from_bytes(written).to_dict()))
    assert new.pop("v") == STATE_VERSION == 6
    # Version 4 keys an empty result by its marker: the empty result version 1 hashed is read
    # as that marker, so a loop goes on counting across the upgrade.
    assert old["window"][0][2] in EMPTY_RESULT_DIGESTS and new["window"][0][2] == EMPTY
    new["window"][0][2] = old["window"][0][2]
    # Version 4 adds when each call id's call ended: unknown (0) for what version 1 wrote.
    assert new.pop("recent_call_ends") == [0] * len(old["recent_call_ids"])
    # Version 5 remembers a call id by its key (hex in a JSON record).
    keys = [call_id_key(call_id).hex() for call_id in old.pop("recent_call_ids")]
    assert new.pop("recent_call_ids") == keys
    assert new == old
    assert list(new)[-1] == "last_seen"  # a JSON record ends with it: eviction reads it there


def test_a_loaded_version_1_state_goes_on_counting():
    """The fixture's trace was killed and released; its window counts on where it stopped."""
    state = TraceState.from_bytes(V1.read_bytes())
    state.fired.clear()  # as if no rule had fired yet
    guard = Guard()
    agent = AgentRecorder("support-bot", "support")
    guard.states[agent.trace_id] = state
    for _ in range(2):  # with the window's one search_docs: 3 (the default threshold)
        # The result written as the version-1 worker read a plain-text result ({"_raw": text}):
        # a bare string hashes as itself since, so "no results" keys a new call.
        agent.tool(
            "search_docs",
            {"query": "refund policy"},
            result=json.dumps({"_raw": "no results"}),
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
    assert "cycle_runs" not in state.to_dict()
    state.cycle_runs = [0, 3, 0, 0, 0, 0, 0, 0, 0, 0]
    again = TraceState.from_bytes(state.to_bytes())
    assert again.cycle_runs == state.cycle_runs
    state.restart_window()
    assert state.cycle_runs is None


def test_json_records_are_encoded_by_orjson_and_what_it_refuses_by_json_read_back_alike():
    """The JSON record: the conversation's state, and a trace's the binary form cannot hold."""
    orjson = pytest.importorskip("orjson")  # the worker's extra, installed by `make install`
    state = TraceState.from_bytes(V1.read_bytes())
    state.agent_name = "agent-é"  # orjson writes UTF-8 where json escapes: both read the same
    data = encode_record(state.to_dict())
    assert data == orjson.dumps(state.to_dict())
    assert json.loads(data) == json.loads(json.dumps(state.to_dict()))
    assert data.endswith(b"}") and b'"last_seen":' in data[-40:]  # eviction reads it there
    # A trace that priced absurd counts: a cost past 64 bits, which orjson refuses.
    state.inference_cost = 2**70
    data = encode_record(state.to_dict())
    assert TraceState.from_bytes(data).inference_cost == 2**70
    assert TraceState.from_bytes(state.to_bytes()).inference_cost == 2**70  # binary: any size
    assert TraceState.from_bytes(data).to_dict() == TraceState.from_bytes(
        V1.read_bytes()
    ).to_dict() | {
        "agent_name": "agent-é",
        "inference_cost": 2**70,
        "aggregate_cost": 0,
        "unpriced_tokens": 0,
        "v": STATE_VERSION,
    }


def test_a_state_written_by_version_4_loads_with_every_field():
    data = V4.read_bytes()
    assert json.loads(data)["v"] == 4
    state = TraceState.from_bytes(data)
    assert (state.service, state.agent_name, state.conversation_id) == (
        "support-bot",
        "support",
        "conv-42",
    )
    assert [key[0] for key in state.window] == [
        "search_docs",
        "get_job_status",
        "get_job_status",
        "lookup",
        "search_docs",
    ]
    assert len(state.polls) == 5 and state.counts[state.window[0]] == 1
    assert state.fired == {Fired("tool_loop", "kill")} and state.cycle_runs == [0, 2, 0, 0]
    assert (state.inference_tokens, state.aggregate_tokens) == (1700, 2100)
    assert (state.inference_cost, state.aggregate_cost, state.unpriced_tokens) == (
        123_456_789,
        5_000_000,
        40,
    )
    assert state.released_at == 1796299999.5 and state.last_seen == 1796300000.25
    assert len(state.recent_span_ids) == 5 and all(state.recent_call_ids.values())
    # Its call ids, read as their keys: a partial span of one of those calls is still known.
    assert call_id_key("call_3Xy7Qp2LmN8vR4tK1wZ9aB3c") in state.recent_call_ids
    assert [call["span_id"] is not None for call in state.window_calls()] == [True] * 5


def test_version_4_written_again_is_binary_with_the_same_content():
    old = TraceState.from_bytes(V4.read_bytes())
    data = old.to_bytes()
    assert data[:2] == b"\x00\x06" and len(data) * 2 < len(V4.read_bytes())
    new = TraceState.from_bytes(data)
    assert new.to_dict() == old.to_dict()
    assert new.counts == old.counts and new.poll_counts == old.poll_counts
    assert new.window_marks == old.window_marks
    assert stored_state_last_seen(data) == 1796300000.25  # the header: eviction reads it there


def _odd_state() -> TraceState:
    """Every shape the binary form has a branch for."""
    state = TraceState("svc-é", None, last_seen=12.5)
    state.window.extend(
        [
            ("tool-ü", None, None),  # no arguments recorded
            ("b", "ABCDEF0123456789", "0123456789abcdef"),  # upper-case hex: kept as text
            ("b", "not a hash", "0123456789abcdef"),
            ("c", "0123 456789abcde", None),  # what bytes.fromhex reads past a space
        ]
    )
    state.window_marks += bytes(16)  # unknown span id and time
    state.window_marks += b"\x01" * 8 + (5).to_bytes(8, "big")  # not among the recent ids
    state.window_marks += b"\x02" * 8 + (2**63).to_bytes(8, "big")
    state.window_marks += b"\x03" * 8 + (1).to_bytes(8, "big")  # earlier: a negative offset
    state.polls.extend([("b", "not a hash"), ("tool-ü", "0123456789abcdef")])
    state.recent_span_ids = RecentIds.of([b"\x02" * 8, b"\x03" * 8, b"\x04" * 8])
    state.recent_call_ids = RecentCalls.of([(call_id_key("x"), 0), (call_id_key("xy"), 7)])
    state.recent_call_ids.add(call_id_key(""), 3)
    state.inference_cost, state.aggregate_tokens = None, -3  # absurd, still written
    state.unpriced_tokens, state.cycle_runs = 2**80, [0, 1, 300]
    return state


def test_the_binary_form_holds_every_shape_of_state():
    for state in (TraceState(), _odd_state(), TraceState.from_bytes(V4.read_bytes())):
        back = TraceState.from_bytes(state.to_bytes())
        assert back.to_dict() == state.to_dict() and back.window_marks == state.window_marks
        assert back.counts == state.counts and back.poll_counts == state.poll_counts
        assert back.recent_call_ids == state.recent_call_ids


def test_a_state_the_binary_form_cannot_hold_is_written_as_json():
    state = TraceState(last_seen=3.0)
    state.cycle_runs = [-1]  # run lengths are never negative: not this one
    data = state.to_bytes()
    assert data.startswith(b"{") and TraceState.from_bytes(data).cycle_runs == [-1]


def test_an_id_not_of_8_bytes_is_remembered_as_8():
    state = TraceState(last_seen=3.0)
    state.recent_span_ids.add(b"short", 32)
    back = TraceState.from_bytes(state.to_bytes())
    assert b"short" in back.recent_span_ids and len(back.recent_span_ids.data) == 8


def test_a_field_of_another_type_than_declared_is_written_as_json():
    """Pure Python lets a JSON record set a field to another type (compiled, it is refused)."""
    if core_build() == "compiled":
        pytest.skip("compiled classes refuse the field's value when it is read")
    odd = TraceState.from_dict({**TraceState().to_dict(), "service": None, "fired": []})
    assert odd.to_bytes().startswith(b"{") and TraceState.from_bytes(odd.to_bytes()).service is None


def test_truncated_or_garbage_bytes_are_refused_with_a_reason_never_a_crash():
    data = TraceState.from_bytes(V4.read_bytes()).to_bytes()
    for size in range(len(data)):
        with pytest.raises(StateDecodeError, match=r"empty|truncated|items announced|tool"):
            TraceState.from_bytes(data[:size])
    with pytest.raises(StateDecodeError, match="bytes after the state"):
        TraceState.from_bytes(data + b"\x00")
    garbage = [b"", b"\x00", b"\x00\x04" + bytes(20), b"null", b"[1]", b"{}", b"\xff" * 64]
    garbage += [V4.read_bytes()[:-5], bytes(range(256)), data[:10] + b"\xff" * 40]
    for junk in garbage:
        with pytest.raises(StateDecodeError):
            TraceState.from_bytes(junk)
    flipped = bytearray(data)
    for at in range(10, len(data)):  # any one byte changed: a state or a refusal
        flipped[at] ^= 0xA5
        with contextlib.suppress(StateDecodeError):
            TraceState.from_bytes(bytes(flipped))
        flipped[at] ^= 0xA5


def test_a_later_versions_appended_sections_are_ignored():
    """A worker rolled back reads what a newer one wrote: a later version only appends."""
    data = bytearray(TraceState.from_bytes(V4.read_bytes()).to_bytes())
    data[1] = STATE_VERSION + 1
    later = TraceState.from_bytes(bytes(data) + b"a later section")
    assert later.to_dict() == TraceState.from_bytes(V4.read_bytes()).to_dict()


def test_ids_and_marks_that_fill_no_whole_entry_load_and_count_on():
    """A JSON record whose span ids, call ends and window marks do not fit the fixed-width
    entries (an odd length, a count off by one) still loads: the ids whole, the marks aligned
    with the window, and the window counts its calls."""
    key = ("search", "0123456789abcdef", None)
    record = TraceState().to_dict()
    record["v"] = 4
    record["window"] = [list(key)] * 3
    record["window_marks"] = base64.b64encode(bytes(20)).decode()  # 1.25 calls' marks
    record["recent_span_ids"] = base64.b64encode(bytes(range(13))).decode()  # 1.6 ids
    record["recent_call_ids"], record["recent_call_ends"] = ["a", "b"], [5]
    state = TraceState.from_bytes(json.dumps(record).encode())
    assert len(state.window) == 3 and len(state.window_marks) == 3 * MARK_BYTES
    assert state.window.count(key) == 3 and len(state.recent_span_ids) == 2
    assert dict(state.recent_call_ids.items()) == {call_id_key("a"): 0, call_id_key("b"): 0}
    assert TraceState.from_bytes(state.to_bytes()).to_dict() == state.to_dict()
