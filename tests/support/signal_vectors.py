"""The shared kill-signal test vectors: schemas/testdata/kill-signal-vectors.json.

Every killswitch (Python, clients/typescript, clients/go) reads that one file in its tests and
must reach each vector's verdict, so a record that one language's JSON parser would read
differently (duplicate keys, big integers, lone surrogates) is decided alike everywhere.

    python -m tests.support.signal_vectors          # rewrite the file (deterministic)

The verdicts follow the strict reading of a signal:
- the bytes are UTF-8 and one JSON object, without duplicate keys, NaN or Infinity, nested at
  most 8 levels, no string holding a lone surrogate (`not_json`, `not_utf8`, `too_deep`, ...);
- the schema (schemas/kill-signal.schema.json), with patterns matched against the whole value
  (an id with a trailing newline is `invalid`), integers written as integers within
  +-(2**53 - 1) (the range every language's JSON numbers hold exactly), `detected_at` and
  `expires_at` RFC 3339 date-times with a zone that exist on the calendar, and `kind: release`
  only with `rule: manual` and an `operator`; `kind: pause` with `pause_until` (a date-time like
  `expires_at`) and `pause_fallback` (`kill` or `release`), both covered by the signature;
- then the signature: HMAC-SHA256 over the canonical JSON (sorted keys, no spaces, UTF-8,
  only `"`, `\\` and control characters escaped) with the key its `key_id` names
  (`unsigned`, `unknown_key`, `forged`), and `expires_at` after `now` (`expired`).

Python's read_signal decides every vector strictly. `python_lax=True` marks a vector it does not
(its test then expects the failure, xfail strict), for a rule added to the clients first.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import sys
from pathlib import Path
from typing import Any

from spanguard.schemas.decision import canonical_json, key_id, sign

ROOT = Path(__file__).resolve().parents[2]
VECTORS = ROOT / "schemas" / "testdata" / "kill-signal-vectors.json"

NOW = "2026-06-01T12:00:00Z"
KEYS = {
    "current": "spanguard-test-key-current-0001",
    "previous": "spanguard-test-key-previous-002",
    "other": "someone-elses-key-of-32-bytes-xx",
}
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SIGNAL = "0af7651916cd43dd8448eb211c80319c"

BASE: dict[str, Any] = {
    "schema_version": 2,
    "signal_id": SIGNAL,
    "trace_id": TRACE,
    "kind": "kill",
    "rule": "tool_loop",
    "reason": "search_docs called 4x in last 4 steps",
    "evidence": {
        "span_id": "00f067aa0ba902b7",
        "tool_name": "search_docs",
        "args_hash": "1d79773f7dd21571",
        "hits": 4,
        "window": 10,
    },
    "agent": {"service": "support-agent", "name": None},
    "detected_at": "2026-06-01T11:59:00.000+00:00",
    "expires_at": "2026-06-01T12:59:00.000+00:00",
    "system_message": None,
}


# A pause by the guard: the agent waits for an operator until PAUSE_UNTIL, then is killed.
PAUSE_UNTIL = "2026-06-01T12:05:00.000+00:00"
PAUSE: dict[str, Any] = {
    **BASE,
    "kind": "pause",
    "signal_id": "6" * 32,
    "pause_until": PAUSE_UNTIL,
    "pause_fallback": "kill",
}


def signed(record: dict[str, Any], key: str = "current") -> dict[str, Any]:
    return sign(record, KEYS[key].encode())


def text(record: dict[str, Any]) -> str:
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def with_(**changes: Any) -> dict[str, Any]:
    return {**BASE, **changes}


def deliver(name: str, new: bool = True) -> dict[str, Any]:
    """A sequence's step: the signal `name` delivered to the book, which records it (`new`) or
    not (false: an id it has already)."""
    return {"deliver": name, "new": new}


def signature_over(document_text: str, key: str = "current") -> str:
    """A signature over a record as the lax reader (last duplicate wins) sees it."""
    record = json.loads(document_text)
    return hmac.new(KEYS[key].encode(), canonical_json(record), hashlib.sha256).hexdigest()


def vector(
    name: str,
    value: str | bytes,
    verdict: str,
    *,
    keys: list[str] | None = None,
    signal: dict[str, Any] | None = None,
    python_lax: bool = False,
    note: str = "",
) -> dict[str, Any]:
    """`verdict`: "obey" (then `signal` holds what the agent reads) or the bad record's kind.
    `keys`: the agent's keys (names in KEYS); None obeys unsigned signals."""
    entry: dict[str, Any] = {"name": name, "note": note} if note else {"name": name}
    entry["keys"] = keys
    if isinstance(value, bytes):
        entry["value_base64"] = base64.b64encode(value).decode()
    else:
        entry["value"] = value
    entry["verdict"] = verdict
    if signal is not None:
        entry["signal"] = signal
    if python_lax:
        entry["python_lax"] = True
    return entry


def obeyed(
    name: str, record: dict[str, Any], keys: list[str] | None, note: str = ""
) -> dict[str, Any]:
    """The vector of a signal the agent obeys: it reads `record` as `seen` says."""
    return vector(name, text(record), "obey", keys=keys, signal=seen(record), note=note)


def refused(
    name: str,
    record: dict[str, Any],
    verdict: str = "invalid",
    note: str = "",
    *,
    key: str = "current",
) -> dict[str, Any]:
    """The vector of `record`, signed with `key`, that an agent holding the current key
    refuses as `verdict`."""
    return vector(name, text(signed(record, key)), verdict, keys=["current"], note=note)


def tampered(name: str, record: dict[str, Any], verdict: str, note: str = "") -> dict[str, Any]:
    """The vector of `record` as it stands (signed, then changed) for an agent holding the
    current key."""
    return vector(name, text(record), verdict, keys=["current"], note=note)


def seen(record: dict[str, Any]) -> dict[str, Any]:
    """What an obeyed signal must read as."""
    return {
        "kind": record["kind"],
        "trace_id": record["trace_id"],
        "signal_id": record["signal_id"],
        "rule": record["rule"],
        "reason": record["reason"],
        "system_message": record.get("system_message"),
        "expires_at": record["expires_at"],
        "pause_until": record.get("pause_until"),
        "pause_fallback": record.get("pause_fallback"),
        "scope": record.get("scope"),
        "conversation_id": record.get("conversation_id"),
        "agent_service": record["agent"]["service"],
        "agent_name": record["agent"]["name"],
        **({"tool": record["tool"]} if "tool" in record else {}),
    }


# Scoped kills: every trace of one conversation, or of one agent until its budget window frees.
CONVERSATION = "conv-7f3a"
CONVERSATION_KILL: dict[str, Any] = {
    **BASE,
    "signal_id": "a" * 32,
    "rule": "manual",
    "reason": "the conversation keeps asking for refunds",
    "operator": "oncall@example.com",
    "evidence": {"span_id": "0" * 16},
    "trace_id": "0" * 32,
    "scope": "conversation",
    "conversation_id": CONVERSATION,
}
AGENT_KILL: dict[str, Any] = {
    **BASE,
    "signal_id": "b" * 32,
    "rule": "agent_budget",
    "reason": "support-agent/triage spent 5000000 tokens in the last 1h",
    "evidence": {"span_id": "00f067aa0ba902b7", "tokens": 5_000_000},
    "agent": {"service": "support-agent", "name": "triage"},
    "scope": "agent",
    "expires_at": "2026-06-01T12:30:00.000+00:00",
}


# A tool contained by a fleet rule: every agent's calls to it are refused until a release
# issued after it, or its expiry.
TOOL = {"name": "search_docs", "server": "docs-mcp"}
CONTAIN: dict[str, Any] = {
    **BASE,
    "signal_id": "d" * 32,
    "trace_id": "0" * 32,
    "rule": "tool_failing",
    "reason": "search_docs on docs-mcp failed for 41 of 50 traces in the last 5m",
    "evidence": {"span_id": "0" * 16, "tool_name": "search_docs"},
    "agent": {"service": "(fleet)", "name": None},
    "expires_at": "2026-06-01T12:30:00.000+00:00",
    "scope": "tool",
    "tool": TOOL,
}
TOOL_RELEASE: dict[str, Any] = {
    **CONTAIN,
    "kind": "release",
    "signal_id": "1" * 31 + "d",
    "rule": "manual",
    "operator": "oncall@example.com",
    "reason": "docs-mcp answers again",
    "detected_at": "2026-06-01T11:59:30.000+00:00",
}


def _tool_vectors(ring: list[str]) -> list[dict[str, Any]]:
    """Tool signals: a contain is signed, expires and names its tool as every signal does."""
    contain = signed(CONTAIN)
    other_tool = signed(
        {
            **CONTAIN,
            "signal_id": "2" * 31 + "d",
            "rule": "manual",
            "operator": "oncall@example.com",
            "reason": "web_search returns spam",
            "tool": {"name": "web_search", "server": ""},
        }
    )
    recovery = signed(
        {**CONTAIN, "kind": "release", "signal_id": "3" * 31 + "d", "reason": "it answers again"}
    )
    release = signed(TOOL_RELEASE)

    without_tool = {k: v for k, v in CONTAIN.items() if k != "tool"}
    return [
        obeyed("a tool contain", contain, ring),
        obeyed("a contain of another tool, no server, by an operator", other_tool, ring),
        obeyed("a tool release", release, ring),
        obeyed("a tool release by its fleet rule (the tool recovered)", recovery, ring),
        refused(
            "an expired contain", {**CONTAIN, "expires_at": "2026-06-01T11:59:59.999Z"}, "expired"
        ),
        tampered(
            "forged: the contained tool changed after signing",
            {**contain, "tool": {"name": "delete_records", "server": "docs-mcp"}},
            "forged",
            "an attacker must not turn a contain onto another tool: the tool is signed",
        ),
        refused("a tool scope without its tool", without_tool),
        refused("a tool without the tool scope", {**BASE, "tool": TOOL}),
        refused("a tool without its server", {**CONTAIN, "tool": {"name": "search_docs"}}),
        refused("an empty tool name", {**CONTAIN, "tool": {"name": "", "server": ""}}),
        refused(
            "a tool name over 200 characters",
            {**CONTAIN, "tool": {"name": "t" * 201, "server": ""}},
        ),
        refused(
            "a tool server over 200 characters",
            {**CONTAIN, "tool": {"name": "search_docs", "server": "s" * 201}},
        ),
        refused("a fleet rule on a trace signal", {**without_tool, "scope": "trace"}),
        refused("a trace rule containing a tool", {**CONTAIN, "rule": "tool_loop"}),
        refused(
            "a tool downgrade",
            {**CONTAIN, "kind": "downgrade", "system_message": "slow down"},
            note="a scoped signal is a kill or a release",
        ),
    ]


def _tool_sequences() -> list[dict[str, Any]]:
    """Tool signals through the book. Steps: deliver, clock (as in `sequences`) and
    {"check": TRACE, "tool": NAME, "server": S, "expect": "pass" | "contained" | "killed",
    "reason": TEXT}: a check of the trace naming the tool about to be called (`server`
    absent: the caller does not know it, and a contain of the name on any server holds; no
    `tool`: no tool is named and no contain applies). A kill of the trace comes before a
    contain; the newest signal of a tool (by detected_at) holds; a contain without a server
    holds on every server; a contain lapses at its expires_at."""
    unsigned = ("key_id", "signature")
    web = {
        **CONTAIN,
        "signal_id": "4" * 31 + "d",
        "rule": "manual",
        "operator": "oncall@example.com",
        "reason": "web_search returns spam",
        "tool": {"name": "web_search", "server": ""},
    }
    signals = {
        "contain": signed(CONTAIN),
        "release": signed(TOOL_RELEASE),
        "old_release": signed(
            {
                **TOOL_RELEASE,
                "signal_id": "5" * 31 + "d",
                "detected_at": "2026-06-01T11:00:00.000+00:00",
            }
        ),
        "web_contain": signed(web),
        "kill": signed({k: v for k, v in BASE.items() if k not in unsigned}),
    }
    texts = {name: text(record) for name, record in signals.items()}
    other = "f" * 32

    def check(tool: str | None, expect: str, trace: str = TRACE, **more: Any) -> dict[str, Any]:
        return {"check": trace, **({"tool": tool} if tool else {}), **more, "expect": expect}

    return [
        {
            "name": "a contain refuses calls to its tool, and only those, until a release"
            " issued after it",
            "signals": texts,
            "steps": [
                check("search_docs", "pass"),
                deliver("contain"),
                deliver("contain", new=False),
                check("search_docs", "contained", server="docs-mcp", reason=CONTAIN["reason"]),
                check("search_docs", "contained", trace=other),
                check("search_docs", "pass", server="another-mcp"),
                check("fetch_page", "pass"),
                check(None, "pass"),
                deliver("old_release"),
                check("search_docs", "contained", server="docs-mcp"),
                deliver("release"),
                check("search_docs", "pass", server="docs-mcp"),
                check("search_docs", "pass"),
                deliver("contain", new=False),
                check("search_docs", "pass"),
            ],
        },
        {
            "name": "a contain without a server holds on every server until it expires; a kill"
            " of the trace comes first",
            "signals": texts,
            "steps": [
                deliver("web_contain"),
                check("web_search", "contained", server="any-mcp", reason=web["reason"]),
                check("web_search", "contained", server=""),
                check("web_search", "contained"),
                deliver("kill"),
                check("web_search", "killed", reason=BASE["reason"]),
                check("web_search", "contained", trace=other),
                {"clock": "2026-06-01T12:29:59.999Z"},
                check("web_search", "contained", trace=other),
                {"clock": "2026-06-01T12:30:00Z"},
                check("web_search", "pass", trace=other),
            ],
        },
    ]


def build() -> dict[str, Any]:
    ring = ["current"]
    rotating = ["current", "previous"]
    kill = signed(BASE)
    downgrade = signed(
        with_(
            kind="downgrade",
            signal_id="1" * 32,
            system_message="You called search_docs 4 times with the same arguments; stop.",
        )
    )
    release = signed(
        with_(
            kind="release",
            rule="manual",
            signal_id="2" * 32,
            reason="released by an operator",
            operator="oncall@example.com",
            evidence={"span_id": "0" * 16},
        )
    )
    # A rule every reader must know: the TypeScript and Go readers list the rules themselves.
    cycle_kill = signed(
        with_(rule="cycle", signal_id="9" * 32, reason="a round of 4 calls repeated 3 times")
    )
    # Money travels as whole micro-dollars: integers every reader holds exactly.
    cost_kill = signed(
        with_(
            rule="cost_budget",
            signal_id="8" * 32,
            reason="$2.6000 spent, over the budget of $2.5",
            evidence={
                "span_id": "00f067aa0ba902b7",
                "tokens": 360000,
                "cost_micro_usd": 2_600_000,
                "budget_micro_usd": 2_500_000,
            },
        )
    )
    pause = signed(PAUSE)
    pause_releasing = signed({**PAUSE, "signal_id": "5" * 32, "pause_fallback": "release"})
    unicode_reason = signed(
        with_(reason='résumé "quoted" \\ back\tslash \u2028 line sep \U0001f600 \x7f \x01')
    )
    conversation_kill = signed(CONVERSATION_KILL)
    agent_kill = signed(AGENT_KILL)
    conversation_release = signed(
        {**CONVERSATION_KILL, "kind": "release", "signal_id": "c" * 32, "reason": "released"}
    )
    vectors = [
        obeyed("kill", kill, ring),
        obeyed("a conversation kill", conversation_kill, ring),
        obeyed("an agent kill", agent_kill, ring),
        obeyed("a conversation release", conversation_release, ring),
        obeyed("a trace scope named outright", signed(with_(scope="trace")), ring),
        refused(
            "a conversation scope without its id",
            {k: v for k, v in CONVERSATION_KILL.items() if k != "conversation_id"},
        ),
        refused(
            "a conversation id without the conversation scope", with_(conversation_id=CONVERSATION)
        ),
        refused(
            "an agent scope without its service",
            {**AGENT_KILL, "agent": {"service": "", "name": "triage"}},
        ),
        refused("an empty conversation id", {**CONVERSATION_KILL, "conversation_id": ""}),
        refused(
            "a conversation id over 200 characters",
            {**CONVERSATION_KILL, "conversation_id": "c" * 201},
        ),
        refused(
            "a scoped downgrade",
            {**AGENT_KILL, "kind": "downgrade", "system_message": "slow down, please"},
            note="a scoped signal is a kill or a release",
        ),
        refused("an unknown scope", with_(scope="fleet")),
        *_tool_vectors(ring),
        obeyed("downgrade", downgrade, ring),
        obeyed("release", release, ring),
        obeyed("pause", pause, ring),
        obeyed("a cycle kill", cycle_kill, ring),
        obeyed("a cost budget kill, money in micro-dollars", cost_kill, ring),
        obeyed("pause whose fallback is release", pause_releasing, ring),
        *_pause_vectors(pause, ring, rotating),
        obeyed(
            "non-ASCII, escapes and U+2028 in a signed string",
            unicode_reason,
            ring,
            note="the canonical JSON escapes only quote, backslash and control characters",
        ),
        vector(
            "whitespace and key order do not change a signature",
            json.dumps(dict(reversed(list(kill.items()))), indent=2),
            "obey",
            keys=ring,
            signal=seen(kill),
        ),
        obeyed("signed with the previous key while rotating", signed(BASE, "previous"), rotating),
        refused("signed with the previous key after rotation", BASE, "unknown_key", key="previous"),
        vector("unknown key id", text(signed(BASE, "other")), "unknown_key", keys=ring),
        vector("unsigned, keys held", text(BASE), "unsigned", keys=ring),
        obeyed("unsigned, unsigned obeyed", BASE, None),
        tampered(
            "forged: a field changed after signing", {**kill, "reason": "something else"}, "forged"
        ),
        tampered("forged: signature not a string", {**kill, "signature": 12345}, "invalid"),
        tampered(
            "forged: signature in upper case",
            {**kill, "signature": kill["signature"].upper()},
            "forged",
        ),
        tampered(
            "key_id without signature",
            {**BASE, "key_id": key_id(KEYS["current"].encode())},
            "invalid",
        ),
        refused(
            "expired",
            with_(expires_at="2026-06-01T12:00:00Z"),
            "expired",
            "now == expires_at is expired",
        ),
        obeyed(
            "not yet expired, offset zone",
            signed(with_(expires_at="2026-06-01T14:00:01+02:00")),
            ring,
        ),
        refused("expired, offset zone", with_(expires_at="2026-06-01T13:59:59+02:00"), "expired"),
        refused("naive expires_at", with_(expires_at="2026-06-01T12:59:00")),
        refused("naive detected_at", with_(detected_at="2026-06-01T11:59:00")),
        refused("unparseable detected_at", with_(detected_at="yesterday")),
        refused(
            "expires_at on a day that does not exist", with_(expires_at="2026-02-30T12:00:00Z")
        ),
        refused("trailing newline in trace_id", with_(trace_id=TRACE + "\n")),
        refused("trailing newline in signal_id", with_(signal_id=SIGNAL + "\n")),
        refused("upper-case trace_id", with_(trace_id=TRACE.upper())),
        vector(
            "duplicate key: the last would be a kill",
            _duplicate_kind(),
            "not_json",
            keys=ring,
            note="a first-wins parser reads a downgrade, a last-wins one a kill: refused",
        ),
        vector(
            "big integer beyond 2**53",
            _with_raw_evidence('"hits":9007199254740993'),
            "invalid",
            keys=ring,
        ),
        vector(
            "huge integer",
            _with_raw_evidence('"tokens":' + "9" * 400),
            "invalid",
            keys=ring,
        ),
        vector(
            "integer written as a float",
            _with_raw_evidence('"hits":4.0'),
            "invalid",
            keys=ring,
        ),
        vector(
            "money written as a decimal fraction",
            _with_raw_evidence('"cost_micro_usd":2.6'),
            "invalid",
            keys=ring,
            note="dollars are whole micro-dollars: a fraction would read differently per language",
        ),
        vector(
            "schema_version written as a float",
            _raw_document(text(signed(BASE)).replace('"schema_version":2', '"schema_version":2.0')),
            "invalid",
            keys=ring,
        ),
        vector(
            "lone surrogate in a string",
            text(signed(with_(reason="x"))).replace(
                '"reason":"x"', '"reason":"lone \\ud800 surrogate"'
            ),
            "not_utf8",
            keys=ring,
        ),
        vector(
            "a surrogate pair written as escapes is one character",
            _raw_document(
                text(signed(with_(reason="x"))).replace('"reason":"x"', '"reason":"\\ud83d\\ude00"')
            ),
            "obey",
            keys=ring,
            signal=seen(with_(reason="\U0001f600")),
        ),
        vector("not UTF-8", b'{"kind":"kill","reason":"\xff"}', "not_utf8", keys=ring),
        vector("empty", b"", "empty", keys=ring),
        vector("not JSON", "kill 4bf92f3577b34da6a3ce929d0e0e4736", "not_json", keys=ring),
        vector("truncated JSON", text(kill)[:-10], "not_json", keys=ring),
        vector("NaN", text(kill).replace('"hits":4', '"hits":NaN'), "not_json", keys=ring),
        vector("byte order mark", "\ufeff" + text(kill), "not_json", keys=ring),
        vector("trailing garbage", text(kill) + " x", "not_json", keys=ring),
        vector("a JSON array", "[" + text(kill) + "]", "not_object", keys=ring),
        vector("a JSON string", '"kill"', "not_object", keys=ring),
        vector("nested too deep", '{"a":' * 9 + "1" + "}" * 9, "too_deep", keys=ring),
        vector("too large", '{"pad":"' + "x" * 70_000 + '"}', "too_large", keys=ring),
        refused(
            "release without an operator",
            {k: v for k, v in release.items() if k not in ("operator", "key_id", "signature")},
        ),
        refused(
            "release by a rule of the guard",
            with_(kind="release", signal_id="3" * 32, operator="oncall@example.com"),
        ),
        refused("downgrade without a system message", with_(kind="downgrade")),
        refused("unknown field", {**BASE, "priority": "high"}),
        refused("missing field", {k: v for k, v in BASE.items() if k != "reason"}),
        refused("wrong schema version", with_(schema_version=1)),
        refused("evidence hits below 1", with_(evidence={**BASE["evidence"], "hits": 0})),
    ]
    names = [entry["name"] for entry in vectors]
    assert len(names) == len(set(names)), "vector names must be unique"
    return {
        "description": (
            "Kill-signal records and the verdict every spanguard killswitch must reach on each"
            " (written by tests/support/signal_vectors.py, whose docstring gives the rules)."
            " verdict: 'obey' or the kind of bad record; keys: the names of the agent's keys"
            " (null: unsigned signals obeyed); value is the record's UTF-8 text, value_base64"
            " its bytes when they are not text; python_lax: the Python reader of this checkout"
            " does not decide it strictly yet. sequences: a book's answers, step by step;"
            " tool_sequences: checks naming the tool called, against tool signals;"
            " scope_resolution: what a check stands for; unguarded_checks: checks with no"
            " trace, counted and warned about once; stop_events: the span event a check that"
            " stops or steers the agent adds to the active span."
        ),
        "now": NOW,
        "keys": KEYS,
        "key_ids": {name: key_id(key.encode()) for name, key in KEYS.items()},
        "vectors": vectors,
        "sequences": [
            *_sequences(kill, downgrade, release),
            *_scope_sequences(),
            *_pause_sequences(kill, downgrade, release),
        ],
        "tool_sequences": _tool_sequences(),
        "scope_resolution": _scope_resolution(),
        "unguarded_checks": _unguarded_checks(),
        "stop_events": _stop_events(kill, downgrade),
    }


def _stop_events(kill: dict[str, Any], downgrade: dict[str, Any]) -> list[dict[str, Any]]:
    """What a check that stops or steers the agent records on the active span, alike in every
    language: `spanguard.stop` (a kill; a pause too) or `spanguard.downgrade` (when its message
    is handed over), with these five attributes; the AgentKilled carries the same values.

    Each case: deliver `signal` (read with the current key at `now`), check `check` inside an
    active span, and expect `expect` ("killed" or "message") and exactly `event` on that span;
    the same check again adds no second event."""
    conversation_kill = signed(CONVERSATION_KILL)

    def event(record: dict[str, Any], name: str = "spanguard.stop") -> dict[str, Any]:
        return {
            "name": name,
            "attributes": {
                "spanguard.rule": record["rule"],
                "spanguard.action": record["kind"],
                "spanguard.decision_id": record["signal_id"],
                "spanguard.scope": record.get("scope", "trace"),
                "spanguard.reason": record["reason"],
            },
        }

    return [
        {
            "name": "a kill of the trace",
            "signal": text(kill),
            "check": {"trace": TRACE},
            "expect": "killed",
            "event": event(kill),
        },
        {
            "name": "a downgrade, when its message is handed over",
            "signal": text(downgrade),
            "check": {"trace": TRACE},
            "expect": "message",
            "event": event(downgrade, "spanguard.downgrade"),
        },
        {
            "name": "a kill of the conversation",
            "signal": text(conversation_kill),
            "check": {"trace": TRACE, "conversation": CONVERSATION},
            "expect": "killed",
            "event": event(conversation_kill),
        },
    ]


def _pause_vectors(
    pause: dict[str, Any], ring: list[str], rotating: list[str]
) -> list[dict[str, Any]]:
    """A pause is signed, named by key id and expires as a kill does; its deadline and
    fallback are inside the signature."""
    unsigned_pause = {k: v for k, v in pause.items() if k not in ("key_id", "signature")}
    return [
        obeyed(
            "pause signed with the previous key while rotating",
            signed(unsigned_pause, "previous"),
            rotating,
        ),
        refused("pause signed with an unknown key", unsigned_pause, "unknown_key", key="other"),
        vector("pause unsigned, keys held", text(unsigned_pause), "unsigned", keys=ring),
        refused(
            "pause expired",
            {**unsigned_pause, "expires_at": "2026-06-01T11:59:59.999999Z"},
            "expired",
        ),
        tampered(
            "forged: pause_until moved after signing",
            {**pause, "pause_until": "2026-06-01T23:59:00.000+00:00"},
            "forged",
            "an attacker must not stretch a pause: pause_until is signed",
        ),
        tampered(
            "forged: pause_fallback changed after signing",
            {**pause, "pause_fallback": "release"},
            "forged",
        ),
        refused(
            "pause without pause_until",
            {k: v for k, v in unsigned_pause.items() if k != "pause_until"},
        ),
        refused(
            "pause without pause_fallback",
            {k: v for k, v in unsigned_pause.items() if k != "pause_fallback"},
        ),
        refused(
            "pause_fallback neither kill nor release",
            {**unsigned_pause, "pause_fallback": "downgrade"},
        ),
        refused("naive pause_until", {**unsigned_pause, "pause_until": "2026-06-01T12:05:00"}),
        refused(
            "pause_until on a day that does not exist",
            {**unsigned_pause, "pause_until": "2026-02-30T12:05:00Z"},
            note="the schema's pattern lets it through; no clock can tell when it comes",
        ),
        refused(
            "pause_until not a date-time", {**unsigned_pause, "pause_until": "in five minutes"}
        ),
    ]


def _duplicate_kind() -> str:
    """A signed kill (last `kind` wins) whose text also says downgrade first."""
    record = signed(BASE)
    document = text(record)
    return document.replace('"kind":"kill"', '"kind":"downgrade","kind":"kill"')


def _raw_document(document: str) -> str:
    """`document`, its own spelling of every value kept, signed as a lax reader parses it."""
    record = json.loads(document)
    record.pop("signature", None)
    record.pop("key_id", None)
    key = KEYS["current"].encode()
    named = {**record, "key_id": key_id(key)}
    signature = hmac.new(key, canonical_json(named), hashlib.sha256).hexdigest()
    body = _without_signature_fields(document)
    return body[:-1] + f',"key_id":"{named["key_id"]}","signature":"{signature}"}}'


def _without_signature_fields(document: str) -> str:
    for field in ("key_id", "signature"):
        marker = f'"{field}":"'
        start = document.find(marker)
        if start == -1:
            continue
        end = document.index('"', start + len(marker)) + 1
        if document[start - 1] == ",":  # the comma before the field, else the one after it
            document = document[: start - 1] + document[end:]
        else:
            document = document[:start] + document[end + 1 :]
    return document


def _with_raw_evidence(member: str) -> str:
    """BASE with one evidence member spelt exactly `member`, signed as the lax reader sees it."""
    name = member.split(":", 1)[0].strip('"')
    evidence = {k: v for k, v in BASE["evidence"].items() if k != name}
    document = text(with_(evidence=evidence))
    document = document.replace('"evidence":{', '"evidence":{' + member + ",", 1)
    return _raw_document(document)


def _sequences(
    kill: dict[str, Any], downgrade: dict[str, Any], release: dict[str, Any]
) -> list[dict[str, Any]]:
    """What a book of signals answers to an agent's checks, step by step (all signals valid).

    Steps: {"deliver": NAME} (one of `signals`; `new` says whether it was recorded, false for a
    duplicate id), {"check": TRACE, "expect": "pass" | "killed" | MESSAGE}; the pause sequences
    (`_pause_sequences`) add steps of their own."""
    second_kill = {**kill, "signal_id": "4" * 32, "reason": "killed again after release"}
    other_trace = {**kill, "trace_id": "f" * 32}
    signals = {
        "kill": kill,
        "downgrade": downgrade,
        "release": release,
        "second_kill": signed(
            {k: v for k, v in second_kill.items() if k not in ("key_id", "signature")}
        ),
        "other_trace_kill": signed(
            {k: v for k, v in other_trace.items() if k not in ("key_id", "signature")}
        ),
    }
    message = downgrade["system_message"]
    return [
        {
            "name": "a downgrade's message is read once, then a kill stays",
            "signals": {name: text(record) for name, record in signals.items()},
            "steps": [
                {"check": TRACE, "expect": "pass"},
                deliver("downgrade"),
                deliver("downgrade", new=False),
                {"check": TRACE, "expect": message},
                {"check": TRACE, "expect": "pass"},
                deliver("kill"),
                {"check": TRACE, "expect": "killed"},
                {"check": TRACE, "expect": "killed"},
                deliver("other_trace_kill"),
                {"check": "f" * 32, "expect": "killed"},
            ],
        },
        {
            "name": "a release lifts a kill; a redelivered old kill does not return; a new one does",
            "signals": {name: text(record) for name, record in signals.items()},
            "steps": [
                deliver("kill"),
                {"check": TRACE, "expect": "killed"},
                deliver("release"),
                {"check": TRACE, "expect": "pass"},
                deliver("kill", new=False),
                {"check": TRACE, "expect": "pass"},
                deliver("second_kill"),
                {"check": TRACE.upper(), "expect": "killed"},
            ],
        },
    ]


def _scope_sequences() -> list[dict[str, Any]]:
    """Conversation and agent kills through the book: a check names its trace and, when it
    has them, its conversation and agent (`conversation`, `agent`: {service, name})."""
    agent = {"service": "support-agent", "name": "triage"}
    other_agent = {"service": "support-agent", "name": "billing"}
    unsigned = ("key_id", "signature")
    signals = {
        "conversation_kill": signed(CONVERSATION_KILL),
        "conversation_release": signed(
            {**CONVERSATION_KILL, "kind": "release", "signal_id": "c" * 32, "reason": "released"}
        ),
        "old_conversation_release": signed(
            {
                **CONVERSATION_KILL,
                "kind": "release",
                "signal_id": "d" * 32,
                "reason": "released",
                "detected_at": "2026-06-01T11:00:00.000+00:00",
            }
        ),
        "agent_kill": signed(AGENT_KILL),
        "service_kill": signed(
            {
                **{k: v for k, v in AGENT_KILL.items() if k not in unsigned},
                "signal_id": "e" * 32,
                "agent": {"service": "support-agent", "name": None},
                "rule": "manual",
                "operator": "oncall@example.com",
                "reason": "every support agent stops",
                "expires_at": "2026-06-01T13:00:00.000+00:00",
                "evidence": {"span_id": "0" * 16},
                "trace_id": "0" * 32,
            }
        ),
    }
    texts = {name: text(record) for name, record in signals.items()}
    other = "f" * 32
    return [
        {
            "name": "a conversation kill stops every trace of that conversation, and only those,"
            " until a release issued after it",
            "signals": texts,
            "steps": [
                {"check": TRACE, "conversation": CONVERSATION, "expect": "pass"},
                deliver("conversation_kill"),
                deliver("conversation_kill", new=False),
                {
                    "check": TRACE,
                    "conversation": CONVERSATION,
                    "expect": "killed",
                    "reason": CONVERSATION_KILL["reason"],
                },
                {"check": other, "conversation": CONVERSATION, "expect": "killed"},
                {"check": other, "conversation": "another-conversation", "expect": "pass"},
                {"check": other, "expect": "pass"},
                deliver("old_conversation_release"),
                {"check": other, "conversation": CONVERSATION, "expect": "killed"},
                deliver("conversation_release"),
                {"check": other, "conversation": CONVERSATION, "expect": "pass"},
                deliver("conversation_kill", new=False),
                {"check": other, "conversation": CONVERSATION, "expect": "pass"},
            ],
        },
        {
            "name": "an agent kill stops that agent's traces until it expires; a null name"
            " stops every agent of the service",
            "signals": texts,
            "steps": [
                deliver("agent_kill"),
                {
                    "check": TRACE,
                    "agent": agent,
                    "expect": "killed",
                    "reason": AGENT_KILL["reason"],
                },
                {"check": other, "agent": agent, "expect": "killed"},
                {"check": other, "agent": other_agent, "expect": "pass"},
                {"check": other, "expect": "pass"},
                {"clock": "2026-06-01T12:29:59.999Z"},
                {"check": other, "agent": agent, "expect": "killed"},
                {"clock": "2026-06-01T12:30:00Z"},
                {"check": other, "agent": agent, "expect": "pass"},
                deliver("service_kill"),
                {"check": other, "agent": other_agent, "expect": "killed"},
                {
                    "check": other,
                    "agent": {"service": "another-service", "name": "triage"},
                    "expect": "pass",
                },
            ],
        },
    ]


def _scope_resolution() -> list[dict[str, Any]]:
    """Where a check finds the conversation and the agent it stands for; each language's client
    builds real OpenTelemetry baggage and a real SDK resource from a case and must reach
    `expect`.

    - `given`: what the check itself is passed; `switch`: what the KillSwitch was built with
      (`resource`: the resource it is given, the tracer provider's in Python);
    - `baggage`: the entries of the current OpenTelemetry baggage;
    - `span_resource` (when present): the check runs inside an active span of a real SDK
      tracer provider built with this resource (absent: no span is active);
    - the first source that names one wins: given, the switch's, then the baggage
      (`gen_ai.conversation.id`, then `session.id`, an empty value names nothing) for the
      conversation and a resource (`service.name`, with `gen_ai.agent.name` when set) for
      the agent: the switch's resource, else the active span's. An agent is taken whole from
      one source, never a service from one and a name from another; a resource without
      `service.name` names no agent."""
    triage = {"service": "support-agent", "name": "triage"}
    billing = {"service": "billing-agent", "name": None}
    resource = {"service.name": "support-agent", "gen_ai.agent.name": "triage"}

    def case(
        name: str,
        expect_conversation: str | None,
        expect_agent: dict[str, Any] | None,
        *,
        given: dict[str, Any] | None = None,
        switch: dict[str, Any] | None = None,
        baggage: dict[str, str] | None = None,
        span_resource: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        return {
            "name": name,
            "given": given or {},
            "switch": {"resource": {}, **(switch or {})},
            "baggage": baggage or {},
            **({"span_resource": span_resource} if span_resource is not None else {}),
            "expect": {"conversation": expect_conversation, "agent": expect_agent},
        }

    return [
        case("nothing names a scope", None, None),
        case(
            "the baggage's gen_ai.conversation.id",
            "conv-1",
            None,
            baggage={"gen_ai.conversation.id": "conv-1"},
        ),
        case("the baggage's session.id", "sess-1", None, baggage={"session.id": "sess-1"}),
        case(
            "gen_ai.conversation.id before session.id",
            "conv-1",
            None,
            baggage={"session.id": "sess-1", "gen_ai.conversation.id": "conv-1"},
        ),
        case(
            "an empty gen_ai.conversation.id names nothing: session.id",
            "sess-1",
            None,
            baggage={"gen_ai.conversation.id": "", "session.id": "sess-1"},
        ),
        case(
            "the switch's conversation before the baggage's",
            "conv-switch",
            None,
            switch={"conversation": "conv-switch"},
            baggage={"gen_ai.conversation.id": "conv-1"},
        ),
        case(
            "the check's conversation before the switch's",
            "conv-given",
            None,
            given={"conversation": "conv-given"},
            switch={"conversation": "conv-switch"},
            baggage={"gen_ai.conversation.id": "conv-1"},
        ),
        case(
            "the resource names the agent and its name",
            None,
            triage,
            switch={"resource": resource},
        ),
        case(
            "a resource with service.name only names every agent of the service",
            None,
            {"service": "support-agent", "name": None},
            switch={"resource": {"service.name": "support-agent"}},
        ),
        case(
            "a resource without service.name names no agent",
            None,
            None,
            switch={"resource": {"gen_ai.agent.name": "triage"}},
        ),
        case(
            "the switch's agent before the resource, whole: no name taken from the resource",
            None,
            billing,
            switch={"agent": billing, "resource": resource},
        ),
        case(
            "the check's agent before the switch's",
            "conv-1",
            triage,
            given={"agent": triage},
            switch={"agent": billing, "resource": {"service.name": "other"}},
            baggage={"gen_ai.conversation.id": "conv-1"},
        ),
        case(
            "baggage names no agent; the resource names no conversation",
            None,
            None,
            switch={"resource": {"session.id": "sess-1"}},
            baggage={"service.name": "support-agent", "gen_ai.agent.name": "triage"},
        ),
        case(
            "without a resource of the switch's, the active span's resource names the agent",
            None,
            triage,
            span_resource=resource,
        ),
        case(
            "the switch's resource before the active span's",
            None,
            {"service": "configured-agent", "name": None},
            switch={"resource": {"service.name": "configured-agent"}},
            span_resource=resource,
        ),
        case(
            "a switch's resource naming no agent leaves it to the active span's",
            None,
            triage,
            switch={"resource": {"gen_ai.agent.name": "billing"}},
            span_resource=resource,
        ),
        case(
            "the switch's agent before the active span's resource",
            None,
            billing,
            switch={"agent": billing},
            span_resource=resource,
        ),
        case(
            "the check's agent before the active span's resource; the span names no conversation",
            None,
            {"service": "support-agent", "name": "billing"},
            given={"agent": {"service": "support-agent", "name": "billing"}},
            span_resource={**resource, "session.id": "sess-1"},
        ),
    ]


def _unguarded_checks() -> list[dict[str, Any]]:
    """A check that finds no trace to check: no trace id given, and no active span.

    The guard cannot act on the trace, so it says so, and counts it: every such check adds one
    to the switch's unguarded count (Python `unguarded`, TypeScript `unguarded`, Go
    `Unguarded()`), and the first one only writes a warning through the switch's logger. The
    conversation and agent the check stands for are still checked: a kill of either raises
    first, and a check that raised stopped its tool call, so it is not counted.

    Steps: {"deliver": NAME, "new": BOOL} and {"check": TRACE or null, "conversation": ...,
    "agent": {service, name}, "expect": "pass" | "killed", "unguarded": COUNT after the step,
    "warnings": WARNINGS logged by the switch so far}; the clock is `now`."""
    other = "f" * 32
    signals = {
        "kill": signed(BASE),
        "conversation_kill": signed(CONVERSATION_KILL),
        "agent_kill": signed(AGENT_KILL),
    }
    texts = {name: text(record) for name, record in signals.items()}
    agent = {"service": "support-agent", "name": "triage"}

    def check(trace: str | None, expect: str, unguarded: int, **scope: Any) -> dict[str, Any]:
        return {"check": trace, **scope, "expect": expect, "unguarded": unguarded, "warnings": 1}

    return [
        {
            "name": "a check with no trace is counted each time, warned about once, and still"
            " checks its conversation and agent",
            "signals": texts,
            "steps": [
                check(None, "pass", 1),
                check(None, "pass", 2),
                check(TRACE, "pass", 2),
                deliver("kill"),
                check(TRACE, "killed", 2),
                # A kill of the trace cannot stop a check that does not name it.
                check(None, "pass", 3),
                deliver("conversation_kill"),
                check(None, "killed", 3, conversation=CONVERSATION),
                check(None, "pass", 4, conversation="another-conversation"),
                deliver("agent_kill"),
                check(None, "killed", 4, agent=agent),
                check(other, "killed", 4, agent=agent),
                check(other, "pass", 4),
                check(None, "pass", 5),
            ],
        },
        {
            "name": "a switch whose checks all find their trace never warns",
            "signals": texts,
            "steps": [
                {"check": TRACE, "expect": "pass", "unguarded": 0, "warnings": 0},
                deliver("kill"),
                {"check": TRACE, "expect": "killed", "unguarded": 0, "warnings": 0},
            ],
        },
    ]


def _pause_sequences(
    kill: dict[str, Any], downgrade: dict[str, Any], release: dict[str, Any]
) -> list[dict[str, Any]]:
    """A pause through the book, with the time given rather than slept (all signals valid).

    The clock starts at NOW. Steps, besides deliver and check:
    - {"clock": TIME}: the time from now on, for pause deadlines and for reading signals;
    - {"check": TRACE, "expect": "paused", "until": ..., "fallback": ...}: check() raises the
      paused error, carrying that deadline and fallback;
    - {"check" | "wait": TRACE, "expect": "killed", "reason": TEXT}: the kill carries TEXT;
    - {"wait": TRACE, "meanwhile": [STEP, ...], "expect": ...}: wait() on the trace, and while
      it waits the steps of `meanwhile` happen (a delivery, a clock change); `expect` is how
      the wait ends (a release returns what check() then returns: "pass" or a message). A
      runner gives such a wait a generous timeout of its own, so a wrong book fails, not hangs;
    - {"wait": TRACE, "timeout": 0, "expect": "paused"}: a wait that gives up at once raises
      the paused error again."""

    later = "2026-06-01T12:10:00.000+00:00"
    other = "e" * 32
    signals = {
        "pause": signed(PAUSE),
        "pause_releasing": signed({**PAUSE, "signal_id": "5" * 32, "pause_fallback": "release"}),
        "second_pause": signed(
            {**PAUSE, "signal_id": "7" * 32, "pause_until": later, "pause_fallback": "release"}
        ),
        "other_trace_pause": signed({**PAUSE, "signal_id": "8" * 32, "trace_id": other}),
        "kill": kill,
        "downgrade": downgrade,
        "release": release,
    }
    texts = {name: text(record) for name, record in signals.items()}
    paused = {"expect": "paused", "until": PAUSE_UNTIL, "fallback": "kill"}
    fallback_kill = (
        f"{PAUSE['reason']}; paused with no answer by {PAUSE_UNTIL}: the policy's fallback kills"
    )
    message = downgrade["system_message"]

    def wait_while(meanwhile: dict[str, Any], expect: str, **more: Any) -> dict[str, Any]:
        return {"wait": TRACE, "meanwhile": [meanwhile], "expect": expect, **more}

    return [
        {
            "name": "pause then release: checks raise paused, the wait returns on the release",
            "signals": texts,
            "steps": [
                {"check": TRACE, "expect": "pass"},
                deliver("pause"),
                {"check": TRACE, **paused},
                deliver("pause", new=False),
                deliver("downgrade"),
                {"check": TRACE, **paused},
                {"wait": TRACE, "timeout": 0, **paused},
                wait_while(deliver("release"), message),
                {"check": TRACE, "expect": "pass"},
                deliver("pause", new=False),
                {"check": TRACE, "expect": "pass"},
            ],
        },
        {
            "name": "pause then kill: the wait raises the kill; a later pause leaves the kill",
            "signals": texts,
            "steps": [
                deliver("pause"),
                {"check": TRACE, **paused},
                wait_while(deliver("kill"), "killed", reason=kill["reason"]),
                {"check": TRACE, "expect": "killed", "reason": kill["reason"]},
                deliver("second_pause"),
                {"check": TRACE, "expect": "killed", "reason": kill["reason"]},
                deliver("release"),
                {"check": TRACE, "expect": "pass"},
            ],
        },
        {
            "name": "pause then deadline, fallback kill: the wait raises a kill at pause_until",
            "signals": texts,
            "steps": [
                deliver("pause"),
                {"clock": "2026-06-01T12:04:59.999Z"},
                {"check": TRACE, **paused},
                wait_while({"clock": "2026-06-01T12:05:00Z"}, "killed", reason=fallback_kill),
                {"check": TRACE, "expect": "killed", "reason": fallback_kill},
                deliver("pause", new=False),
                {"check": TRACE, "expect": "killed", "reason": fallback_kill},
                deliver("release"),
                {"check": TRACE, "expect": "pass"},
            ],
        },
        {
            "name": "pause then deadline, fallback release: the wait returns at pause_until",
            "signals": texts,
            "steps": [
                deliver("pause_releasing"),
                {"check": TRACE, "expect": "paused", "until": PAUSE_UNTIL, "fallback": "release"},
                wait_while({"clock": "2026-06-01T12:05:00Z"}, "pass"),
                {"check": TRACE, "expect": "pass"},
                deliver("pause_releasing", new=False),
                {"check": TRACE, "expect": "pass"},
            ],
        },
        {
            "name": "a second pause replaces the first; a pause already past its deadline"
            " applies its fallback at the first check",
            "signals": texts,
            "steps": [
                deliver("pause"),
                deliver("second_pause"),
                {"check": TRACE, "expect": "paused", "until": later, "fallback": "release"},
                {"clock": "2026-06-01T12:05:00Z"},
                {"check": TRACE, "expect": "paused", "until": later, "fallback": "release"},
                {"clock": "2026-06-01T12:10:00Z"},
                {"check": TRACE, "expect": "pass"},
                deliver("other_trace_pause"),
                {"check": other, "expect": "killed", "reason": fallback_kill},
            ],
        },
    ]


def main() -> int:
    VECTORS.parent.mkdir(parents=True, exist_ok=True)
    VECTORS.write_text(json.dumps(build(), indent=2, ensure_ascii=True) + "\n")
    print(f"wrote {VECTORS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
