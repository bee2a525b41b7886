"""Seeded mutation fuzzing, one test per surface that reads outside input.

Each test starts from valid input (a signed kill signal, a policy, an OTLP request, the
worker's settings), mutates it at random (bytes flipped, cut or repeated; values swapped for
values of other types, huge, non-finite or nested) and checks the surface's contract: a result
or that surface's own error, never another exception. The seeds are fixed, so a failure
reproduces; FUZZ_SEED=<n> runs another sequence. Each surface runs for a bounded number of
cases, a few seconds in all.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from spanguard.errors import SpanguardError
from spanguard.schemas.decision import BadSignal, keyring, read_signal, sign
from tests.support.spans import AgentRecorder, encode, kill_signal

SEED = int(os.environ.get("FUZZ_SEED", "20261203"))
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
KEY = b"fuzzing-signing-key-0123456789"

# Values of every JSON/YAML type, the edges included.
ODD_VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 2**63, -(2**63), 10**40, 0.5, 4.0, 1e308, -0.0,
    float("inf"), float("nan"), "", "x", "\n", "a" * 5000, "\ud800", "é", "2026-02-30T00:00:00Z",
    "yesterday", [], [1, [2, [3]]], {}, {"a": {"b": {"c": {}}}}, TRACE + "\n",
]  # fmt: skip


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    """One to four byte-level edits: flip, insert, delete, cut, repeat a slice."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        if not out:
            out += bytes([rng.randrange(256)])
            continue
        at = rng.randrange(len(out))
        edit = rng.randrange(5)
        if edit == 0:
            out[at] ^= 1 << rng.randrange(8)
        elif edit == 1:
            out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif edit == 2:
            del out[at : at + rng.randint(1, 8)]
        elif edit == 3:
            del out[at:]
        else:
            piece = out[at : at + rng.randint(1, 32)]
            out[at:at] = piece * rng.randint(1, 50)
    return bytes(out)


def mutate_value(rng: random.Random, document: Any) -> Any:
    """A deep copy of `document` with one value somewhere replaced by an odd one (or a key
    added, or a container emptied)."""
    document = json.loads(json.dumps(document))
    paths: list[tuple[Any, Any]] = []
    stack = [document]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            paths.append((node, key))
            if isinstance(value, dict | list):
                stack.append(value)
    if not paths:
        return rng.choice(ODD_VALUES)
    container, key = rng.choice(paths)
    if isinstance(container, dict) and rng.random() < 0.15:
        container[rng.choice(["zzz", "kind", "rule", key])] = rng.choice(ODD_VALUES)
    else:
        container[key] = rng.choice(ODD_VALUES)
    return document


def run_cases(
    seed: int, cases: int, make: Callable[[random.Random], Any], check: Callable[[Any], None]
) -> None:
    rng = random.Random(seed)
    for number in range(cases):
        case = make(rng)
        try:
            check(case)
        except AssertionError:
            raise
        except Exception as exc:  # the contract broken: show the case that did it
            raise AssertionError(f"case {number} (seed {seed}): {exc!r} on {case!r:.600}") from exc


# -- kill signals ---------------------------------------------------------------------------


def test_fuzz_kill_signals():
    keys = keyring(KEY)
    record = sign(kill_signal(TRACE).to_dict(), KEY)
    release = sign(
        {**kill_signal(TRACE).to_dict(), "kind": "release", "rule": "manual", "operator": "a"},
        KEY,
    )
    valid = [json.dumps(record).encode(), json.dumps(release).encode()]

    def make(rng: random.Random) -> bytes:
        base = rng.choice(valid)
        if rng.random() < 0.5:
            return mutate_bytes(rng, base)
        mutated = mutate_value(rng, json.loads(base))
        if rng.random() < 0.5 and isinstance(mutated, dict):  # signed after the edit
            # A lone surrogate cannot be signed: such a record goes as edited, unsigned.
            with contextlib.suppress(UnicodeEncodeError):
                mutated = sign(mutated, KEY)
        return json.dumps(mutated, allow_nan=True).encode("utf-8", "surrogatepass")

    def check(value: bytes) -> None:
        try:
            signal = read_signal(value, keys)
        except BadSignal as bad:
            assert bad.detail.isprintable() and len(bad.detail) < 260
            return
        assert re.fullmatch("[0-9a-f]{32}", signal.trace_id)
        assert signal.kind in ("kill", "downgrade", "release")
        assert signal.kind != "release" or (signal.rule == "manual" and signal.operator)

    run_cases(SEED, 3000, make, check)


# -- policy files ---------------------------------------------------------------------------

POLICY = {
    "defaults": {
        "loop": {"window": 10, "threshold": 4},
        "polling": {"window": 30, "threshold": 20, "tools": ["job_status"]},
        "no_progress": {"threshold": 4, "action": "flag"},
        "tools": {"sleep": {"exempt": True}, "search": {"threshold": 3}},
        "fold": {"search": ["case"]},
        "token_budget": 100000,
        "goal": {"enabled": False, "sample_rate": 0.5},
    },
    "agents": [{"match": {"service.name": "support-bot"}, "loop": {"window": 20}}],
}


def test_fuzz_policies():
    from spanguard.errors import PolicyError
    from spanguard.schemas.policy import Policy

    valid = yaml.safe_dump(POLICY).encode()

    def make(rng: random.Random) -> bytes:
        if rng.random() < 0.4:
            return mutate_bytes(rng, valid)
        document = mutate_value(rng, POLICY)
        try:
            return yaml.dump(document, allow_unicode=True).encode("utf-8", "surrogatepass")
        except (yaml.YAMLError, UnicodeError):
            return valid

    def check(data: bytes) -> None:
        try:
            policy = Policy.from_yaml(data, source="fuzz")
        except PolicyError as exc:
            assert "\n" not in " ".join(str(exc).split("\n")[:1])
            return
        for settings in (policy.defaults, *(rule.policy for rule in policy.rules)):
            for count in (settings.loop.window, settings.loop.threshold, settings.polling.window,
                          settings.no_progress.threshold):  # fmt: skip
                assert type(count) is int and 1 <= count <= 1000
            budget = settings.token_budget
            assert budget is None or (type(budget) is int and budget >= 1)
            assert math.isfinite(settings.goal.sample_rate)

    run_cases(SEED + 1, 600, make, check)


# -- OTLP spans: the input topic and replay --------------------------------------------------


def _requests() -> list[bytes]:
    agent = AgentRecorder("support-bot", "support")
    for step in range(4):
        agent.tool("search_docs", {"query": "refund policy", "timestamp": step})
        agent.chat(input_tokens=300, output_tokens=40)
    return [encode(agent.finished()).SerializeToString()]


def test_fuzz_otlp_messages():
    from spanguard.detection.guard import Guard
    from spanguard.detection.pipeline import SpanPipeline

    valid = _requests()
    pipeline = SpanPipeline(Guard())

    def check(value: bytes) -> None:
        outcome = pipeline.handle(TRACE.encode(), value)  # never raises: a dead letter at worst
        assert outcome.dead_letter is None or isinstance(outcome.dead_letter, str)

    run_cases(SEED + 2, 1500, lambda rng: mutate_bytes(rng, rng.choice(valid)), check)


def test_fuzz_replay_lines():
    import io

    from spanguard.cli.replay import replay
    from spanguard.schemas.otlp import decode_protobuf, encode_json_line

    line = encode_json_line(decode_protobuf(_requests()[0])).encode()
    document = json.loads(line)

    def make(rng: random.Random) -> bytes:
        if rng.random() < 0.5:
            return mutate_bytes(rng, line).replace(b"\n", b" ")
        return json.dumps(mutate_value(rng, document)).encode("utf-8", "surrogatepass")

    def check(data: bytes) -> None:
        err = io.StringIO()
        result = replay(["-"], stdin=io.BytesIO(data + b"\n" + line + b"\n"),
                        stdout=io.StringIO(), stderr=err)  # fmt: skip
        assert result.requests + result.skipped in (2, 1)  # the good line is always read
        assert result.requests >= 1

    run_cases(SEED + 3, 400, make, check)


# -- settings -------------------------------------------------------------------------------


def test_fuzz_settings():
    from spanguard.config.settings import REGISTRY, GoalSettings, WebhookSettings, WorkerSettings

    # Secret files are read by config/secrets.py, fuzzed with it; here the plain settings.
    entries = [
        e
        for e in REGISTRY
        if e.owner in ("WorkerSettings", "GoalSettings") and not e.env.endswith("_FILE")
    ]
    texts = ["", " ", "0", "-1", "1e-9", "99999", "1e400", "nan", "inf", "true", "maybe",
             "127.0.0.1:99999", "http://[::1/v1", "http://127.0.0.1:99999/v1", "bad topic/../x",
             "otlp_spans", "x" * 300, "\x00", "é", "3.5", "65535", "10"]  # fmt: skip

    def make(rng: random.Random) -> dict[str, str]:
        chosen = rng.sample(entries, rng.randint(1, 4))
        return {entry.env: rng.choice(texts) for entry in chosen}

    def check(environ: dict[str, str]) -> None:
        for cls in (WorkerSettings, GoalSettings):
            try:
                settings = cls.from_sources({}, environ)
            except SpanguardError:
                continue
            repr(settings)
            if isinstance(settings, WorkerSettings):
                assert 1 <= settings.metrics_port <= 65535
                assert 10 <= settings.signal_ttl <= 7 * 24 * 3600
                assert settings.kill_topic != settings.input_topic

    run_cases(SEED + 4, 1500, make, check)
    with pytest.raises(SpanguardError):
        WebhookSettings.from_sources({}, {"SPANGUARD_WEBHOOK_URL": "http://[::1/x"})
