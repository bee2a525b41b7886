"""No input disables a guard: one table of bad inputs per surface that reads outside input.

Each surface gets its own table (a list of cases, one pytest parameter each) and one test that
runs every case through the real reader of that surface. A new surface adds a table here.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from spanguard.killswitch.client import KillSwitch
from spanguard.schemas.decision import (
    MAX_SIGNAL_BYTES,
    BadSignal,
    key_id,
    keyring,
    read_signal,
    sign,
)
from tests.support.spans import kill_signal

# -- the kill-signal topic (killswitch/client.py: read_signal) ----------------------------------

KEY = b"bad-input-test-signing-key"
KEYS = keyring(KEY)
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def _signal(**changes: Any) -> dict[str, Any]:
    record = kill_signal(TRACE).to_dict()
    record.update(changes)
    return record


def _signed(**changes: Any) -> bytes:
    return json.dumps(sign(_signal(**changes), KEY)).encode()


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"x": value}
    return value


def _tampered(**changes: Any) -> bytes:
    return json.dumps({**sign(_signal(), KEY), **changes}).encode()


def _unsigned(**changes: Any) -> bytes:
    return json.dumps(_signal(**changes)).encode()


def _v1_signed() -> bytes:
    """What a version 1 worker sent: no expiry, no key id."""
    record = {**_signal(), "schema_version": 1}
    del record["expires_at"]
    return json.dumps(sign(record, KEY)).encode()


PAST = "2026-01-01T00:00:00.000+00:00"


KILL_RECORDS: list[tuple[str, bytes | None, str]] = [
    ("no value (a tombstone)", None, "empty"),
    ("empty bytes", b"", "empty"),
    ("a JSON array", b"[]", "not_object"),
    ("JSON null", b"null", "not_object"),
    ("a JSON number", b"1", "not_object"),
    ("a JSON string", b'"kill"', "not_object"),
    ("not JSON", b"{", "not_json"),
    ("binary garbage", bytes(range(256)), "not_utf8"),
    ("UTF-16 JSON", json.dumps(_signal()).encode("utf-16"), "not_utf8"),
    (
        "NaN as a number",
        _signed(evidence={"span_id": "00f067aa0ba902b7", "hits": float("nan")}),
        "not_json",
    ),
    ("arrays nested past the decoder's depth", b"[" * 5000 + b"]" * 5000, "too_deep"),
    (
        "objects nested past a signal's depth",
        json.dumps(_signal(evidence=_nested(50))).encode(),
        "too_deep",
    ),
    ("larger than any signal", b" " * (MAX_SIGNAL_BYTES + 1), "too_large"),
    ("a lone surrogate escape", json.dumps(_signal(reason="\ud800")).encode(), "not_utf8"),
    ("an object that is no signal", b'{"kill": true}', "invalid"),
    ("trace id not hex", _signed(trace_id="x" * 32), "invalid"),
    ("trace id a number", _signed(trace_id=1), "invalid"),
    ("agent a string", _signed(agent="support-bot"), "invalid"),
    ("evidence an array", _signed(evidence=[]), "invalid"),
    ("an unknown kind", _signed(kind="pause"), "invalid"),
    ("a signature that is a number", _tampered(signature=1), "invalid"),
    ("a signature without its key id", _unsigned(signature="00" * 32), "invalid"),
    ("a key id without a signature", _unsigned(key_id=key_id(KEY)), "invalid"),
    ("an expiry that is no date", _signed(expires_at="soon"), "invalid"),
    (
        "an expiry on a day that does not exist",
        _signed(expires_at="2026-02-30T00:00:00Z"),
        "invalid",
    ),
    ("an expiry without a timezone", _signed(expires_at="2999-01-01T00:00:00"), "invalid"),
    ("no expiry (a version 1 signal)", _v1_signed(), "invalid"),
    ("unsigned", _unsigned(), "unsigned"),
    ("signed with another key", json.dumps(sign(_signal(), b"attacker")).encode(), "unknown_key"),
    (
        "another key's signature under our key id",
        json.dumps({**sign(_signal(), b"attacker"), "key_id": key_id(KEY)}).encode(),
        "forged",
    ),
    ("edited after signing", _tampered(reason="edited after signing"), "forged"),
    ("the key id edited after signing", _tampered(key_id="0" * 16), "unknown_key"),
    ("a non-ASCII signature", _tampered(signature="é" * 64), "forged"),
    ("signed, but expired", _signed(expires_at=PAST), "expired"),
    ("a detection time that is no date", _signed(detected_at="yesterday"), "invalid"),
    ("a detection time without a timezone", _signed(detected_at="2026-01-01T00:00:00"), "invalid"),
    (
        "a detection time on a day that does not exist",
        _signed(detected_at="2026-02-30T00:00:00Z"),
        "invalid",
    ),
    ("a trace id ending in a newline", _signed(trace_id=TRACE + "\n"), "invalid"),
    ("a signal id ending in a newline", _signed(signal_id="ab" * 16 + "\n"), "invalid"),
    ("a key id ending in a newline", _tampered(key_id=key_id(KEY) + "\n"), "invalid"),
    (
        "a span id ending in a newline",
        _signed(evidence={"span_id": "00f067aa0ba902b7\n"}),
        "invalid",
    ),
    (
        "a key given twice (the last says release)",
        b'{"kind": "kill", ' + _signed(kind="release", rule="manual", operator="a")[1:],
        "not_json",
    ),
    (
        "a kind given twice, signed as the first",
        _signed()[:-1] + b', "kind": "release"}',
        "not_json",
    ),
    (
        "a release of a rule, not an operator's",
        _signed(kind="release", operator="alice"),
        "invalid",
    ),
    ("a release naming no operator", _signed(kind="release", rule="manual"), "invalid"),
    (
        "a manual downgrade",
        _signed(kind="downgrade", rule="manual", operator="alice", system_message="slow down"),
        "invalid",
    ),
    (
        "a release issued a year ahead",
        _signed(
            kind="release",
            rule="manual",
            operator="alice",
            detected_at="2999-01-01T00:00:00.000+00:00",
        ),
        "invalid",
    ),
]


@pytest.mark.parametrize(
    ("value", "kind"), [case[1:] for case in KILL_RECORDS], ids=[case[0] for case in KILL_RECORDS]
)
def test_kill_signal_records(value, kind):
    with pytest.raises(BadSignal) as caught:
        read_signal(value, KEYS)
    assert caught.value.kind == kind
    assert len(caught.value.detail) < 260 and caught.value.detail.isprintable()


def test_the_release_reader_counts_every_bad_record_and_never_raises():
    """connectors/releases.py reads the kill topic with the worker's key: every bad record is
    counted and skipped; a release issued a year ahead cannot outrank the real ones."""
    import time

    from spanguard.config.settings import WorkerSettings
    from spanguard.connectors.releases import ReleaseReader

    reader = ReleaseReader(WorkerSettings(), KEY)
    now = time.time()
    for _, value, _ in KILL_RECORDS:
        assert reader.accept(value, now) is False
    assert reader.released == {}
    assert sum(reader.ignored.values()) == len(KILL_RECORDS)
    assert reader.accept(_signed(kind="release", rule="manual", operator="alice"), now) is True
    assert list(reader.released) == [TRACE]


def test_a_valid_signal_reads_after_every_bad_record():
    for _, value, _ in KILL_RECORDS:
        with pytest.raises(BadSignal):
            read_signal(value, KEYS)
    assert read_signal(_signed(), KEYS).trace_id == TRACE


def test_keys_rotate_without_a_flag_day():
    """Agents accept the old and the new key while the worker switches from one to the other."""
    old, new = b"the-old-signing-key-0123", b"the-new-signing-key-4567"
    both = keyring([old, new])
    for key in (old, new):
        assert read_signal(json.dumps(sign(_signal(), key)).encode(), both).trace_id == TRACE
    with pytest.raises(BadSignal) as caught:
        read_signal(json.dumps(sign(_signal(), old)).encode(), keyring(new))
    assert caught.value.kind == "unknown_key"


def test_unsigned_signals_only_when_told_and_never_expired_ones():
    assert read_signal(_unsigned(), None).trace_id == TRACE
    with pytest.raises(BadSignal, match="expired"):
        read_signal(_unsigned(expires_at=PAST), None)
    with pytest.raises(ValueError, match="no signing key"):
        KillSwitch("127.0.0.1:9", start=False)
    with pytest.raises(ValueError, match="not both"):
        KillSwitch("127.0.0.1:9", signing_key=KEY, allow_unsigned=True, start=False)
    KillSwitch("127.0.0.1:9", allow_unsigned=True, start=False)


# -- policy files (config/policy_file.py: load_policy; `spanguard policy check`) ---------------


def _alias_bomb(levels: int = 9) -> bytes:
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for level in range(1, levels):
        refs = ", ".join([f"*l{level - 1}"] * 9)
        lines.append(f"l{level}: &l{level} [{refs}]")
    return ("\n".join(lines) + "\n").encode()


POLICY_FILES: list[tuple[str, bytes, str]] = [
    ("a YAML alias bomb", _alias_bomb(), "more than 100000 values once its YAML aliases are"),
    ("an alias bomb under a real key", b"defaults:\n  volatile_keys: &k [a, b]\n"
     + _alias_bomb(), "once its YAML aliases are expanded"),
    ("a recursive alias", b"defaults: &d {goal: *d}\n", "a YAML alias refers to itself"),
    ("nested 100 levels", b"[" * 100 + b"]" * 100, "nested more than 32 levels"),
    ("nested past the YAML parser's depth", b"[" * 5000 + b"]" * 5000, "nested more than 32"),
    ("larger than any policy", b"# " + b"x" * (1024 * 1024) + b"\n", "larger than 1048576 bytes"),
    ("not UTF-8", b"defaults:\n  action: \xff\xfe\n", "not UTF-8 text (byte 0xff at offset 20)"),
    ("UTF-16", "defaults: {action: kill}\n".encode("utf-16"), "not UTF-8 text"),
    ("an integer key", b"defaults:\n  loop: {1: 2}\n", "field defaults.loop: key 1 (int) is not"),
    ("a boolean key", b"agents:\n  - match: {on: x}\n", "key True (bool) is not a string (YAML"),
    ("a null key", b"~: 1\n", "field (top level): key None (NoneType) is not a string"),
    ("a misspelt default", b"defaults:\n  tokenbudget: 100\n",
     "field defaults: unknown key 'tokenbudget' (did you mean 'token_budget'?)"),
    ("a misspelt section", b"default:\n  token_budget: 100\n",
     "field (top level): unknown key 'default' (did you mean 'defaults'?)"),
    ("a misspelt agent setting", b"agents:\n  - match: {a: b}\n    tokenbudget: 1\n",
     "field agents.0: unknown key 'tokenbudget' (did you mean 'token_budget'?)"),
    ("a misspelt loop key", b"defaults:\n  loop: {windw: 20}\n",
     "field defaults.loop: unknown key 'windw' (did you mean 'window'?)"),
    ("a misspelt goal key", b"defaults:\n  goal: {sample_rat: 0.5}\n",
     "unknown key 'sample_rat' (did you mean 'sample_rate'?)"),
    ("an unknown key like none", b"defaults:\n  zzz: 1\n", "unknown key 'zzz'; valid keys: action"),
    ("NaN sample rate", b"defaults:\n  goal: {sample_rate: .nan}\n",
     "field defaults.goal.sample_rate: nan is not a finite number"),
    ("infinite budget", b"defaults:\n  token_budget: .inf\n", "inf is not a finite number"),
    ("minus infinity", b"agents:\n  - match: {a: b}\n    goal: {min_confidence: -.inf}\n",
     "field agents.0.goal.min_confidence: -inf is not a finite number"),
    ("a duplicate key", b"defaults:\n  action: kill\n  action: downgrade\n",
     "key 'action' appears twice in one mapping (line 3)"),
    ("broken YAML", b"defaults: [\n", "not valid YAML: "),
    ("two YAML documents", b"defaults: {}\n---\nagents: []\n", "expected a single document"),
    ("a NUL byte", b"defaults:\x00\n", "not valid YAML: "),
    ("a Python object tag", b'!!python/object/apply:os.system ["true"]\n',
     "could not determine a constructor"),
    ("a list, not a mapping", b"- defaults\n", "field (top level): ['defaults'] is not of type"),
    ("a date as a budget", b"defaults:\n  token_budget: 2026-01-01\n",
     "field defaults.token_budget: datetime.date(2026, 1, 1) is not of type"),
    ("a threshold beyond its window", b"defaults:\n  loop: {window: 3, threshold: 4}\n",
     "threshold 4 can never be reached in a window of 3 calls"),
    ("a window with a decimal point", b"defaults: {loop: {window: 10.0, threshold: 4.0}}\n",
     "field defaults.loop.window: 10.0 is not of type 'integer' (a count is a whole number"),
    ("a budget with a decimal point", b"defaults: {token_budget: 1000.0}\n",
     "field defaults.token_budget: 1000.0 is not of type"),
    ("a tool's threshold with a decimal point", b"defaults: {tools: {t: {threshold: 3.0}}}\n",
     "field defaults.tools.t.threshold: 3.0 is not of type 'integer'"),
    ("a boolean as a window", b"defaults: {loop: {window: true}}\n",
     "field defaults.loop.window: True is not of type 'integer'"),
    ("a 5000-digit budget", b"defaults: {token_budget: " + b"9" * 5000 + b"}\n",
     "an integer of 5000 characters (line 1): out of range"),
    ("a 20-digit budget", b"defaults: {token_budget: 99999999999999999999}\n",
     "field defaults.token_budget: an integer out of range"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("data", "message"), [case[1:] for case in POLICY_FILES], ids=[case[0] for case in POLICY_FILES]
)
def test_policy_files(tmp_path, capsys, data, message):
    from spanguard.cli.main import main
    from spanguard.config.policy_file import load_policy
    from spanguard.errors import PolicyError

    path = tmp_path / "policy.yaml"
    path.write_bytes(data)
    with pytest.raises(PolicyError) as caught:
        load_policy(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)
    # The CI check and every command that takes a policy: exit 2, one line on stderr.
    assert main(["policy", "check", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("spanguard policy: bad policy: ") and message in line


@pytest.mark.parametrize("kind", ["a FIFO", "a character device", "a directory"])
def test_policy_paths_that_are_no_file(tmp_path, kind):
    """Refused at once: a FIFO with no writer would block the load for good (run in a thread
    here, so that a blocking load fails the test instead of hanging it)."""
    import os
    import threading

    from spanguard.config.policy_file import load_policy
    from spanguard.errors import PolicyError

    path = {"a FIFO": tmp_path / "fifo", "a character device": "/dev/zero",
            "a directory": tmp_path}[kind]  # fmt: skip
    if kind == "a FIFO":
        os.mkfifo(path)
    errors: list[str] = []

    def load() -> None:
        try:
            load_policy(path)
        except PolicyError as exc:
            errors.append(str(exc))

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    loader.join(timeout=10)
    if loader.is_alive():  # unblock the thread: open the FIFO for writing once
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    assert errors == [f"{path}: not a regular file ({kind}): not a policy"]


# -- replay lines (cli/replay.py; `spanguard replay`) ----------------------------


def _replay_line(**span_changes: Any) -> str:
    from spanguard.schemas.otlp import encode_json_line
    from tests.support.spans import AgentRecorder, encode

    agent = AgentRecorder("support-bot", "support")
    agent.tool("search_docs", {"query": "refund policy"})
    document = json.loads(encode_json_line(encode(agent.finished())))
    document["resourceSpans"][0]["scopeSpans"][0]["spans"][0].update(span_changes)
    return json.dumps(document)


def _kvlist(depth: int) -> dict[str, Any]:
    """An attribute whose value is a key-value list nested `depth` times."""
    value: dict[str, Any] = {"intValue": "1"}
    for _ in range(depth):
        value = {"kvlistValue": {"values": [{"key": "b", "value": value}]}}
    return {"key": "a", "value": value}


REPLAY_LINES: list[tuple[str, bytes, str]] = [
    ("cut short", b'{"resourceSpans": [ broken', "not JSON"),
    ("arrays nested past the decoder's depth", b"[" * 5000 + b"]" * 5000, "nested too deeply"),
    ("objects nested past the decoder's depth", b'{"a":' * 5000 + b"1" + b"}" * 5000,
     "nested too deeply"),
    ("attributes nested past protobuf's depth", _replay_line(attributes=[_kvlist(200)]).encode(),
     "too deep"),
    ("JSON null", b"null", "an OTLP/JSON request is an object"),
    ("a JSON array", b"[]", "an OTLP/JSON request is an object"),
    ("resourceSpans a number", b'{"resourceSpans": 5}', "not an OTLP/JSON trace request"),
    ("resourceSpans NaN", b'{"resourceSpans": NaN}', "not an OTLP/JSON trace request"),
    ("a span that is a number", b'{"resourceSpans": [{"scopeSpans": [{"spans": [1]}]}]}',
     "not an OTLP/JSON trace request"),
    ("a trace id that is a number", _replay_line(traceId=5).encode(), "must be a hex string"),
    ("a trace id that is not hex", _replay_line(traceId="zz" * 16).encode(), "is not hex"),
    ("a trace id of 3 bytes", _replay_line(traceId="abcdef").encode(), "3-byte trace id"),
    ("a time that is no number", _replay_line(startTimeUnixNano="soon").encode(),
     "not an OTLP/JSON trace request"),
    ("not UTF-8", b'{"resourceSpans": "\xff"}', "not JSON"),
    ("a lone surrogate, raw", _replay_line(name="\ud800").encode().replace(b"\\ud800", b"\xed\xa0\x80"),
     "Unpaired surrogate"),
    ("a lone surrogate escape", _replay_line(name="\ud800").encode(), "Unpaired surrogate"),
    ("a lone surrogate where a value object belongs",
     _replay_line(attributes=[{"key": "a", "value": "\ud800"}]).encode(),
     "a string that is not valid Unicode"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("line", "message"), [case[1:] for case in REPLAY_LINES], ids=[case[0] for case in REPLAY_LINES]
)
def test_replay_lines(line, message):
    """The broken line is reported with its number and skipped; the lines around it are read."""
    import io

    from spanguard.cli.replay import replay

    good = _replay_line().encode()
    out, err = io.StringIO(), io.StringIO()
    result = replay(["-"], stdin=io.BytesIO(good + b"\n" + line + b"\n" + good + b"\n"),
                    stdout=out, stderr=err)  # fmt: skip
    (report, summary) = err.getvalue().splitlines()
    assert report.startswith("-:2: skipped: ") and message in report, report
    assert (result.requests, result.skipped) == (2, 1)
    assert summary.startswith("replay: 2 requests, 1 broken inputs skipped")


def test_replay_exit_status_says_whether_a_line_was_broken(tmp_path, capsys):
    from spanguard.cli.main import main

    path = tmp_path / "spans.jsonl"
    path.write_bytes(_replay_line().encode() + b"\n")
    assert main(["replay", str(path)]) == 0
    path.write_bytes(_replay_line().encode() + b"\n" + REPLAY_LINES[0][1] + b"\n")
    assert main(["replay", str(path)]) == 1
    assert f"{path}:2: skipped: not JSON" in capsys.readouterr().err


def test_a_line_longer_than_any_request_is_skipped_unread(monkeypatch):
    """MAX_LINE_BYTES (64 MiB) lowered to 4 kB so the test need not write 64 MiB; the same code
    path reads the line in bounded pieces."""
    import io

    from spanguard.cli import replay as replay_module

    monkeypatch.setattr(replay_module, "MAX_LINE_BYTES", 4096)
    good = _replay_line().encode()
    long_line = b'{"resourceSpans": [' + b" " * 10_000 + b"]}"
    err = io.StringIO()
    result = replay_module.replay(
        ["-"], stdin=io.BytesIO(long_line + b"\n" + good + b"\n"), stdout=io.StringIO(), stderr=err
    )
    assert err.getvalue().splitlines()[0] == "-:1: skipped: longer than 4096 bytes"
    assert (result.requests, result.skipped) == (1, 1)


def test_a_compressed_protobuf_file_is_read_within_the_bound(tmp_path, monkeypatch):
    """A .pb.gz is decompressed no further than MAX_LINE_BYTES (lowered to 4 kB here; at
    64 MiB, 1.5 MB of gzip expanded to 1.5 GB in one call before), then skipped."""
    import gzip
    import io

    from spanguard.cli import replay as replay_module

    monkeypatch.setattr(replay_module, "MAX_LINE_BYTES", 4096)
    bomb = tmp_path / "bomb.pb.gz"
    bomb.write_bytes(gzip.compress(b"\0" * 10_000_000))
    err = io.StringIO()
    result = replay_module.replay([str(bomb)], stdout=io.StringIO(), stderr=err)
    assert err.getvalue().splitlines()[0] == f"{bomb}: skipped: larger than 4096 bytes"
    assert (result.requests, result.skipped) == (0, 1)


def test_a_flood_of_compressed_blank_lines_is_skipped_quickly(tmp_path):
    """20 MB of newlines gzip to 20 kB; read one line at a time they took seconds per MB."""
    import gzip
    import io
    import time

    from spanguard.cli.replay import replay

    flood = tmp_path / "flood.jsonl.gz"
    flood.write_bytes(gzip.compress(b"\n" * 20_000_000 + b"{\n" + _replay_line().encode() + b"\n"))
    err = io.StringIO()
    started = time.monotonic()
    result = replay([str(flood)], stdout=io.StringIO(), stderr=err)
    elapsed = time.monotonic() - started
    assert err.getvalue().splitlines()[0].startswith(f"{flood}:20000001: skipped: not JSON")
    assert (result.requests, result.skipped) == (1, 1)
    assert elapsed < 15, f"{elapsed:.1f}s for 20 MB of blank lines"


# -- OTLP messages on the input topic (spanguard/detection/pipeline.py: SpanPipeline.handle) ----


def metrics_request(name: str, kind: str) -> bytes:
    """A real ExportMetricsServiceRequest with one metric of `kind`, as an SDK exports it."""
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )
    from opentelemetry.proto.metrics.v1 import metrics_pb2 as m

    now = 1_764_748_800_000_000_000
    point = m.NumberDataPoint(start_time_unix_nano=now - 10**9, time_unix_nano=now, as_int=7)
    data = {
        "sum": {"sum": m.Sum(data_points=[point], aggregation_temporality=2, is_monotonic=True)},
        "gauge": {"gauge": m.Gauge(data_points=[m.NumberDataPoint(as_int=7)])},
        "histogram": {"histogram": m.Histogram(data_points=[m.HistogramDataPoint(count=3)])},
        "exponential_histogram": {
            "exponential_histogram": m.ExponentialHistogram(
                data_points=[m.ExponentialHistogramDataPoint(count=2)]
            )
        },
        "summary": {"summary": m.Summary(data_points=[m.SummaryDataPoint(count=1)])},
        "with_metadata": {
            "gauge": m.Gauge(data_points=[m.NumberDataPoint(as_int=7)]),
            "metadata": [{"key": "k", "value": {"string_value": "v"}}],
        },
    }[kind]
    metric = m.Metric(name=name, description="8 bytes!", unit="1", **data)
    request = ExportMetricsServiceRequest(
        resource_metrics=[m.ResourceMetrics(scope_metrics=[m.ScopeMetrics(metrics=[metric])])]
    )
    return request.SerializeToString()


def _logs_request() -> bytes:
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
    from opentelemetry.proto.logs.v1 import logs_pb2 as logs

    record = logs.LogRecord(
        time_unix_nano=1, trace_id=b"t" * 16, span_id=b"s" * 8, body={"string_value": "hello"},
        attributes=[{"key": "k", "value": {"string_value": "v"}}],
    )  # fmt: skip
    request = ExportLogsServiceRequest(
        resource_logs=[logs.ResourceLogs(scope_logs=[logs.ScopeLogs(log_records=[record])])]
    )
    return request.SerializeToString()


NAME16 = "sixteen-byte-nam"
NOT_TRACES = "not an OTLP ExportTraceServiceRequest: "

OTLP_MESSAGES: list[tuple[str, bytes | None, str]] = [
    ("no value", None, "empty message"),
    ("garbage", b"\x0a\xff\xff\xff\xff\x0f garbage", NOT_TRACES),
    ("a sum metric, 16-byte name", metrics_request(NAME16, "sum"), NOT_TRACES + "span field 7"),
    ("a gauge metric, 16-byte name", metrics_request(NAME16, "gauge"),
     NOT_TRACES + "no span has an end_time_unix_nano"),
    ("a histogram metric", metrics_request(NAME16, "histogram"), NOT_TRACES),
    ("an exponential histogram", metrics_request(NAME16, "exponential_histogram"),
     NOT_TRACES + "span field 10"),
    ("a summary metric", metrics_request(NAME16, "summary"), NOT_TRACES),
    ("a metric with metadata", metrics_request(NAME16, "with_metadata"),
     NOT_TRACES + "span field 12"),
    ("a logs request", _logs_request(), NOT_TRACES),
    ("a span with no trace id", b"\n\r\x12\x0b\x12\tA\x01\x00\x00\x00\x00\x00\x00\x00",
     "a span has a 0-byte trace id"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("value", "reason"),
    [case[1:] for case in OTLP_MESSAGES],
    ids=[case[0] for case in OTLP_MESSAGES],
)
def test_otlp_messages(value, reason):
    """Keyed as the Collector keys a trace (the hex of the 16-byte "trace id" a metric's name
    makes): still a dead letter with its reason, and no decision."""
    from spanguard.detection.guard import Guard
    from spanguard.detection.pipeline import SpanPipeline

    pipeline = SpanPipeline(Guard())
    outcome = pipeline.handle(NAME16.encode().hex().encode(), value)
    assert outcome.dead_letter is not None and outcome.dead_letter.startswith(reason)
    assert outcome.decisions == [] and outcome.repartition == []


def test_a_trace_request_still_passes_the_check():
    from spanguard.detection.guard import Guard
    from spanguard.detection.pipeline import SpanPipeline
    from tests.support.spans import AgentRecorder, encode

    agent = AgentRecorder("support-bot", "support")
    for _ in range(4):
        agent.tool("search_docs", {"query": "refund policy"})
    outcome = SpanPipeline(Guard()).handle(
        agent.trace_id.encode(), encode(agent.finished()).SerializeToString()
    )
    assert outcome.dead_letter is None and [d.rule for d in outcome.decisions] == ["tool_loop"]


# -- in-process mode (killswitch/processor.py, killswitch/signals.py) ---------------------------


def _run_in_thread(target: Any, seconds: float = 20.0) -> bool:
    """Run `target` in a daemon thread; whether it finished within `seconds` (a deadlocked
    thread fails the test instead of hanging it)."""
    import threading

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(timeout=seconds)
    return not worker.is_alive()


def test_a_logging_handler_that_starts_a_span_never_blocks_the_agent():
    """A log shipper whose HTTP call is traced: the guard's one-time warning about a tool span
    without arguments reaches a handler that ends a span of its own, in span.end()."""
    import logging

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from spanguard.killswitch import GuardingSpanProcessor

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    processor = GuardingSpanProcessor(SimpleSpanProcessor(exporter), tracer_provider=provider)
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("agent")

    from opentelemetry.context import Context

    class TracedShipper(logging.Handler):
        def handle(self, record: logging.LogRecord) -> bool:
            # Without the handler's lock, which logging.shutdown() takes at exit: a thread
            # deadlocked in emit must fail this test, not hang the interpreter's exit.
            self.emit(record)
            return True

        def emit(self, record: logging.LogRecord) -> None:
            # The shipper's request is a trace of its own (a root span), as from its thread.
            with tracer.start_as_current_span("POST /logs", context=Context()):
                pass

    shipper = TracedShipper()
    logger = logging.getLogger("spanguard")
    logger.addHandler(shipper)

    def agent() -> None:
        tool = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "search_docs"}
        with (
            tracer.start_as_current_span("invoke_agent support"),
            tracer.start_as_current_span("execute_tool search_docs", attributes=tool),
        ):
            pass

    try:
        assert _run_in_thread(agent), "span.end() deadlocked on the guard's own lock"
    finally:
        logger.removeHandler(shipper)
    names = sorted(span.name for span in exporter.get_finished_spans())
    assert names == ["POST /logs", "execute_tool search_docs", "invoke_agent support"]
    assert processor.guard.stats.missing_arguments == 1


def test_an_old_release_delivered_again_cannot_lift_a_newer_kill():
    """R1 lifts K1; other traces push R1's entry out of the bounded book; K2 kills the trace
    again; R1 redelivered (within its TTL) is older than K2 and must not lift it."""
    from dataclasses import replace
    from datetime import UTC, datetime, timedelta

    from spanguard.killswitch import AgentKilled, SignalBook

    book = SignalBook(max_traces=2)
    start = datetime.now(UTC)

    def at(seconds: int) -> str:
        return (start + timedelta(seconds=seconds)).isoformat(timespec="milliseconds")

    kill = kill_signal(TRACE)
    k1 = replace(kill, signal_id="01" * 16, detected_at=at(0))
    r1 = replace(kill, signal_id="02" * 16, kind="release", rule="manual", operator="alice",
                 detected_at=at(10))  # fmt: skip
    k2 = replace(kill, signal_id="03" * 16, detected_at=at(20))
    assert book.check(TRACE) is None
    book.deliver(k1)
    book.deliver(r1)
    assert book.check(TRACE) is None
    for number in range(1, 10):  # other traces this process runs push R1 out of the book
        assert book.check(f"{number:032x}") is None
    book.deliver(k2)
    assert book.deliver(r1) is True  # forgotten, so not a duplicate: read again
    with pytest.raises(AgentKilled) as caught:
        book.check(TRACE)
    assert caught.value.signal.signal_id == k2.signal_id
    # A release issued after K2 lifts it.
    book.deliver(replace(r1, signal_id="04" * 16, detected_at=at(30)))
    assert book.check(TRACE) is None


def test_killed_traces_are_forgotten_once_their_root_span_ends():
    """In-process state goes when the root span ends, the kills of its traces included: a
    long-running process that kills many traces keeps at most `max_traces` of them."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from spanguard.killswitch import AgentKilled, GuardingSpanProcessor

    provider = TracerProvider()
    processor = GuardingSpanProcessor(
        SimpleSpanProcessor(InMemorySpanExporter()), tracer_provider=provider, max_traces=5
    )
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("agent")
    killed = 0
    for _ in range(40):
        try:
            with tracer.start_as_current_span("invoke_agent support"):
                for _ in range(10):
                    processor.check()
                    with tracer.start_as_current_span(
                        "execute_tool search_docs",
                        attributes={"gen_ai.operation.name": "execute_tool",
                                    "gen_ai.tool.name": "search_docs",
                                    "gen_ai.tool.call.arguments": '{"q": "refund"}'},
                    ):  # fmt: skip
                        pass
        except AgentKilled:
            killed += 1
    assert killed == 40
    assert processor.signals.tracked_traces <= 5


# -- settings (config/settings.py; every command that takes them) ----------------------------

KEY_ENV = {"SPANGUARD_SIGNING_KEY": "a-signing-key-of-32-characters!!"}

SETTINGS: list[tuple[str, dict[str, str], str]] = [
    ("a signal TTL of a nanosecond", {"SPANGUARD_SIGNAL_TTL": "1e-9"},
     "signal_ttl must be between 10 and 604800 seconds, not 1e-09"),
    ("a signal TTL of a year", {"SPANGUARD_SIGNAL_TTL": "31536000"},
     "signal_ttl must be between 10 and 604800 seconds"),
    ("metrics port 99999", {"SPANGUARD_METRICS_PORT": "99999"},
     "metrics_port must be between 1 and 65535, not 99999"),
    ("metrics port -1", {"SPANGUARD_METRICS_PORT": "-1"}, "metrics_port must be between 1 and"),
    ("a negative commit interval", {"SPANGUARD_COMMIT_INTERVAL": "-1"},
     "commit_interval must be a positive number of seconds, not -1.0"),
    ("a zero commit interval", {"SPANGUARD_COMMIT_INTERVAL": "0"},
     "commit_interval must be a positive number of seconds"),
    ("a negative scope hold", {"SPANGUARD_SCOPE_HOLD": "-0.5"},
     "scope_hold must be 0 or more seconds, not -0.5"),
    ("a scope hold of nan", {"SPANGUARD_SCOPE_HOLD": "nan"},
     "SPANGUARD_SCOPE_HOLD='nan' is not a finite number"),
    ("the kill topic is the input topic", {"SPANGUARD_KILL_TOPIC": "otlp_spans"},
     "input_topic and kill_topic name the same topic 'otlp_spans'"),
    ("a topic name with a space and a slash", {"SPANGUARD_INPUT_TOPIC": "bad topic/../x"},
     "input_topic 'bad topic/../x' is not a Kafka topic name"),
    ("a topic named ..", {"SPANGUARD_DETECTIONS_TOPIC": ".."}, "is not a Kafka topic name"),
    ("a signing key and unsigned signals", {"SPANGUARD_ALLOW_UNSIGNED": "true"},
     "sign, or send unsigned signals, not both"),
    ("a bootstrap port out of range", {"SPANGUARD_BOOTSTRAP": "127.0.0.1:99999"},
     "bootstrap must be HOST:PORT[,HOST:PORT...] with ports 1-65535"),
    ("a second bootstrap address without a port", {"SPANGUARD_BOOTSTRAP": "a:9092,b"},
     "bootstrap must be HOST:PORT"),
    ("a judge URL with a broken IPv6 host", {"SPANGUARD_JUDGE_URL": "http://[::1/v1",
                                             "SPANGUARD_JUDGE_MODEL": "m"},
     "SPANGUARD_JUDGE_URL is not a usable URL: Invalid IPv6 URL"),
    ("a judge URL with port 99999", {"SPANGUARD_JUDGE_URL": "http://127.0.0.1:99999/v1",
                                     "SPANGUARD_JUDGE_MODEL": "m"},
     "SPANGUARD_JUDGE_URL is not a usable URL: Port out of range"),
    ("a webhook URL with a broken IPv6 host", {"SPANGUARD_WEBHOOK_URL": "https://[::1/x"},
     "SPANGUARD_WEBHOOK_URL is not a usable URL"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("env", "message"), [case[1:] for case in SETTINGS], ids=[case[0] for case in SETTINGS]
)
def test_settings(monkeypatch, capsys, env, message):
    """One line and exit 2, before any connection: the bootstrap names a closed port, so a
    command that got past its settings would report a broker error instead."""
    from spanguard.cli.main import main

    for name in [name for name in __import__("os").environ if name.startswith("SPANGUARD_")]:
        monkeypatch.delenv(name)
    for name, value in {"SPANGUARD_BOOTSTRAP": "127.0.0.1:9", **KEY_ENV, **env}.items():
        monkeypatch.setenv(name, value)
    worker_only = "JUDGE" in message or "WEBHOOK" in message  # what `topics` does not read
    commands = [["worker"]] if worker_only else [["worker"], ["topics", "create"]]
    for command in commands:
        assert main(command) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"spanguard {command[0]}: bad setting: ") and message in line, line


def test_a_judge_on_a_port_out_of_range_is_refused_when_built_and_shown_safely():
    from spanguard.config.settings import redact_url
    from spanguard.connectors.judge import OpenAICompatibleJudge
    from spanguard.errors import SettingsError

    with pytest.raises(SettingsError, match="Port out of range"):
        OpenAICompatibleJudge("http://127.0.0.1:99999/v1", "model")
    assert redact_url("http://u:p@127.0.0.1:99999/v1?k=s") == "http://127.0.0.1:(bad port)/v1"
    assert redact_url("http://[::1/v1") == "(not a URL)"


# -- spans that would dodge the rules (spanguard/detection) -------------------------------------


def _nested_arguments(depth: int, leaf: str = "refund policy") -> dict[str, Any]:
    value: dict[str, Any] = {"query": leaf}
    for step in range(depth):
        value = {"a": value, "timestamp": step}  # a volatile key at every level
    return value


@pytest.mark.parametrize("depth", [60, 990])
def test_deeply_nested_arguments_still_make_a_loop(depth):
    """Arguments nested past the JSON decoder's or the canonical form's depth: the span is
    not dropped, and identical calls key identically."""
    from spanguard.detection.guard import Guard
    from tests.support.spans import AgentRecorder, encode

    # As text, written without recursion (json.dumps would hit the test's own stack limit).
    text = '{"a": ' * depth + '{"query": "refund policy"}' + ', "timestamp": 1}' * depth
    agent = AgentRecorder("support-bot", "support")
    for _ in range(4):
        agent.tool("search_docs", text)
    guard = Guard()
    decisions = guard.process(encode(agent.finished()).SerializeToString())
    assert guard.stats.malformed_spans == 0
    assert [decision.rule for decision in decisions] == ["tool_loop"]


def test_the_canonical_form_is_bounded_and_still_tells_calls_apart():
    from spanguard.detection.canonical import MAX_CANONICAL_DEPTH, args_hash

    volatile = frozenset({"timestamp"})
    deep = _nested_arguments(20_000)
    assert args_hash(deep, volatile) == args_hash(_nested_arguments(20_000), volatile)
    assert args_hash(deep, volatile) != args_hash(_nested_arguments(20_000, "other"), volatile)
    # Shallow arguments keep the plain canonical form (hashes recorded before stay valid).
    shallow = _nested_arguments(MAX_CANONICAL_DEPTH - 2)
    assert args_hash(shallow, volatile) == args_hash(_nested_arguments(MAX_CANONICAL_DEPTH - 2),
                                                     volatile)  # fmt: skip


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_usage_that_is_no_finite_number_costs_only_that_attribute(bad):
    """The span's output tokens still count towards the budget."""
    from spanguard.detection.guard import Guard
    from spanguard.schemas.policy import Policy
    from tests.support.spans import AgentRecorder, encode

    agent = AgentRecorder("support-bot", "support")
    agent.chat(input_tokens=bad, output_tokens=600)  # type: ignore[arg-type]
    agent.chat(input_tokens=100, output_tokens=600)
    guard = Guard(Policy.from_mapping({"defaults": {"token_budget": 1000}}))
    decisions = guard.process(encode(agent.finished()).SerializeToString())
    assert guard.stats.malformed_spans == 0
    assert [(d.rule, d.spend.tokens) for d in decisions] == [("token_budget", 1300)]


BAD_PRICED_SPANS = [
    pytest.param({"gen_ai.request.model": "m" * 1_000_000}, id="a megabyte model name"),
    pytest.param({"gen_ai.request.model": ""}, id="an empty model name"),
    pytest.param(
        {"gen_ai.request.model": "gpt-4o", "gen_ai.provider.name": "x" * 100_000},
        id="a huge provider",
    ),
    pytest.param({"gen_ai.request.model": ["gpt-4o", "o3"]}, id="a list for a model"),
    pytest.param({"gen_ai.usage.cache_read.input_tokens": 10**15}, id="cache counts past input"),
    pytest.param({"gen_ai.usage.cache_read.input_tokens": float("nan")}, id="a NaN cache count"),
    pytest.param({"gen_ai.conversation.id": "c" * 1_000_000}, id="a megabyte conversation id"),
    pytest.param({"gen_ai.conversation.id": ""}, id="an empty conversation id"),
    pytest.param({"gen_ai.conversation.id": 42}, id="a number for a conversation id"),
]


@pytest.mark.parametrize("extra", BAD_PRICED_SPANS)
def test_a_bad_price_or_conversation_attribute_costs_only_its_span(extra, caplog):
    """The priced span after it still counts; the guard holds a few hundred bytes for it."""
    from spanguard.detection.conversation import ConversationGuard
    from spanguard.detection.guard import Guard
    from spanguard.schemas.policy import Policy
    from tests.support.spans import AgentRecorder, encode

    policy = Policy.from_mapping(
        {
            "defaults": {
                "usd_budget": 0.01,
                "prices": {"gpt-4o": {"input_mtok": 10, "output_mtok": 10}},
                "conversation": {"enabled": True},
            }
        }
    )
    agent = AgentRecorder("support-bot", "support")
    agent.chat(input_tokens=100, output_tokens=100, **extra)
    agent.chat(input_tokens=1_000, output_tokens=1_000)  # $0.02: over the budget
    guard = Guard(policy, conversations=ConversationGuard(policy))
    with caplog.at_level("WARNING"):
        decisions = guard.process(encode(agent.finished()).SerializeToString())
    assert guard.stats.malformed_spans == 0
    assert [d.rule for d in decisions] == ["cost_budget"]
    state = guard.states[agent.trace_id]
    assert len(state.to_bytes()) < 2_000
    assert all(len(record.getMessage()) < 1_000 for record in caplog.records)


# -- outbound HTTP: the pager, the webhook (connectors/outbound.py) ------------------------------

PAGER_KEY = "R0uT1nGk3yS3cR3tV4lu3F0rT3sts42x"
WEBHOOK_PATH = "/hooks/XXXXsecretXXXX"
DETECTION = {
    "decision_id": "6a19b10dab573a231a78e69ba7700f09",
    "trace_id": TRACE,
    "span_id": "00f067aa0ba902b7",
    "rule": "tool_loop",
    "action": "kill",
    "reason": "search_docs called 4x in last 4 steps",
    "agent": {"service": "support-bot"},
    "detected_at": "2026-12-03T07:14:26.502+00:00",
    "autonomous": True,
}


@pytest.fixture
def webhook_server():
    from tests.support.webhook_server import WebhookServer

    with WebhookServer() as running:
        yield running


@pytest.fixture
def pager_server():
    from tests.support.pagerduty_server import EventsApiServer

    with EventsApiServer() as running:
        yield running


def _webhook(server: Any, sleeps: list[float], **flags: Any) -> Any:
    from spanguard.alerting.webhook import Webhook
    from spanguard.config.settings import WebhookSettings

    environ = {"SPANGUARD_WEBHOOK_URL": server.url + WEBHOOK_PATH}
    settings = WebhookSettings.from_sources({"ca_file": server.ca_bundle, **flags}, environ)
    return Webhook(settings, sleep=sleeps.append, jitter=lambda: 1.0)


def _pager(server: Any, sleeps: list[float], **overrides: Any) -> Any:
    from spanguard.alerting.pagerduty import Pager
    from spanguard.config.settings import PagerSettings

    environ = {"SPANGUARD_PAGERDUTY_ROUTING_KEY": PAGER_KEY,
               "SPANGUARD_PAGERDUTY_URL": server.url, "SSL_CERT_FILE": server.ca_bundle}  # fmt: skip
    return Pager(PagerSettings.from_env(environ, **overrides), sleep=sleeps.append)


def test_the_webhook_retries_408_as_the_pager_and_the_judge_do(webhook_server):
    sleeps: list[float] = []
    webhook_server.script(408)
    result = _webhook(webhook_server, sleeps).notify(DETECTION)
    assert (result.status, result.attempts) == ("delivered", 2)
    assert sleeps == [0.5]


def test_the_webhook_reads_retry_after_as_an_http_date(webhook_server):
    from email.utils import formatdate

    from tests.support.https_receiver import Fault

    sleeps: list[float] = []
    when = formatdate(__import__("time").time() + 20, usegmt=True)
    webhook_server.script(Fault(status=503, headers={"Retry-After": when}))
    result = _webhook(webhook_server, sleeps).notify(DETECTION)
    assert (result.status, result.attempts) == ("delivered", 2)
    (delay,) = sleeps
    assert 15 <= delay <= 20, delay  # the server's date (less the time the test took), not 0.5


def test_a_page_answered_a_byte_a_second_ends_at_the_attempts_deadline(pager_server):
    """timeout=1: the whole attempt, not each read (the drip never lets a read time out)."""
    import time

    from tests.support.https_receiver import Fault

    pager_server.script(Fault(status=400, body=b'{"message": "' + b"x" * 60 + b'"}', drip=0.25))
    pager = _pager(pager_server, [], timeout=1.0, max_attempts=1)
    started = time.monotonic()
    result = pager.page(DETECTION)
    elapsed = time.monotonic() - started
    pager.close()
    assert result.status == "failed", result  # cut at the deadline: a failure worth a retry
    assert elapsed < 6, f"one attempt took {elapsed:.1f}s"


def test_a_compressed_or_huge_error_body_is_never_inflated_or_kept(pager_server):
    import gzip

    from tests.support.https_receiver import Fault

    bomb = gzip.compress(b'{"message": "' + b"x" * 50_000_000 + b'"}')
    errors = {"status": "invalid event", "message": "Event object is invalid",
              "errors": [f"error number {n}" for n in range(100_000)]}  # fmt: skip
    pager_server.script(
        Fault(status=400, body=bomb, headers={"Content-Encoding": "gzip"}),
        Fault(status=400, body=json.dumps(errors).encode()),
    )
    pager = _pager(pager_server, [], max_attempts=1)
    try:
        bombed, listed = pager.page(DETECTION), pager.page(DETECTION)
    finally:
        pager.close()
    assert (bombed.status, bombed.http_status) == ("rejected", 400)
    assert "xxxx" not in (bombed.error or "")
    assert (listed.status, listed.http_status) == ("rejected", 400)
    assert len(listed.error or "") <= 300 and len(listed.errors) <= 11


def test_a_secret_echoed_by_a_server_is_scrubbed_from_the_error(pager_server):
    from tests.support.https_receiver import Fault

    echo = {"message": f"bad key {PAGER_KEY}", "errors": ["Authorization: Bearer sk-live-123"]}
    pager_server.script(Fault(status=400, body=json.dumps(echo).encode()))
    pager = _pager(pager_server, [], max_attempts=1)
    try:
        result = pager.page(DETECTION)
    finally:
        pager.close()
    assert result.status == "rejected"
    text = f"{result.error} {result.errors}"
    assert PAGER_KEY not in text and "sk-live-123" not in text and "***" in text


# -- outbound HTTP: the judge (connectors/judge.py) ------------------------------------------------


def test_a_judge_that_echoes_the_authorization_header_never_puts_the_key_in_an_error(caplog):
    import asyncio
    import logging

    from spanguard.connectors.judge import OpenAICompatibleJudge
    from spanguard.errors import JudgeError
    from spanguard.goal.invocations import InvocationEnd
    from tests.support.chat_server import ChatServer, Reply

    key = "sk-live-0123456789abcdef"
    echo = {"error": {"message": f"invalid key in 'Authorization: Bearer {key}'"}}
    case = InvocationEnd(TRACE, "00f067aa0ba902b7", "support-bot", "support",
                         request="refund?", answer="30 days", instructions=None)  # fmt: skip
    caplog.set_level(logging.DEBUG)
    with ChatServer() as server:
        server.script(Reply(status=401, body=json.dumps(echo).encode()))

        async def run() -> JudgeError:
            async with OpenAICompatibleJudge(server.base_url, "model", key) as judge:
                with pytest.raises(JudgeError) as caught:
                    await judge.judge(case)
                return caught.value

        error = asyncio.run(run())
    assert error.kind == "rejected" and "HTTP 401" in str(error)
    assert key not in str(error) and "Bearer ***" in str(error)
    assert key not in caplog.text


def test_a_webhook_answered_a_byte_a_second_ends_at_the_attempts_deadline(webhook_server):
    """The status line and headers dripped: every read returns within the client's per-read
    timeout, so only the attempt's own deadline can end it."""
    import time

    from tests.support.https_receiver import Fault

    webhook_server.script(Fault(status=200, drip=0.3, drip_headers=True))
    webhook = _webhook(webhook_server, [], timeout="1", max_attempts="1")
    started = time.monotonic()
    result = webhook.notify(DETECTION)
    elapsed = time.monotonic() - started
    webhook.close()
    assert result.status == "failed", result
    assert elapsed < 6, f"one attempt took {elapsed:.1f}s"
