"""The detection core's fast paths read exactly what the plain algorithm reads.

adapt_span asks the attribute map for the keys it needs after a gate of the keys that can make
a span an event; the plain algorithm intersects every key of the span with the wanted set
first. Both are run here over every span of every instrumentation fixture and of the benchmark
corpus, with and without a token budget and policy match keys: the events must be equal. The
canonical JSON encoder made once and the JSON scanner without whitespace handling must give
what json.dumps and json.loads give.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from bench.corpus import build_corpus
from spanguard.detection.canonical import _canonical_json, args_hash, canonicalize
from spanguard.detection.conventions.adapt import adapt_read, adapt_span, reading_of
from spanguard.detection.conventions.decoding import decode_arguments, literal_or_text
from spanguard.detection.conventions.keys import (
    CONVERSATION_KEY_SET,
    PRICE_KEYS,
    USAGE_KEYS,
    WANTED_KEYS,
)
from spanguard.schemas.otlp import decode_json_line
from spanguard.schemas.otlp_view import parse_view, view_of
from spanguard.schemas.policy import DEFAULT_VOLATILE_KEYS

FIXTURES = Path(__file__).parents[1] / "fixtures" / "instrumentation"
MATCH_KEYS = frozenset({"deployment.environment", "gen_ai.system", "tenant"})


def _views():
    """(scope name, span view) of every fixture span and of a small benchmark corpus."""
    for path in sorted(FIXTURES.glob("*/*/*.json.gz")):
        request = decode_json_line(gzip.decompress(path.read_bytes()))
        yield from _spans(view_of(request))
    yield from _spans(view_of(_shapes_request()))
    for data in build_corpus(2_000, 40).requests:
        yield from _spans(parse_view(data))


# Spans that only one gate key lets through: a tool span by its name and tool name alone
# (pydantic-ai, strands' legacy conventions), the bare `execute_tool`, usage alone (an agent
# span's aggregate, OpenInference's counts), the agent's name alone (for match keys).
SHAPES = [
    ("execute_tool search", {"gen_ai.tool.name": "search", "tool_arguments": '{"q": 1}'}),
    ("running tool", {"gen_ai.tool.name": "search", "tool_arguments": '{"q": 2}'}),
    ("Tool: search", {"tool.name": "search", "tool.parameters": '{"q": 3}'}),
    ("execute_tool", {"gen_ai.tool.call.arguments": '{"q": 4}'}),
    ("agent run", {"gen_ai.aggregated_usage.input_tokens": 10}),
    ("llm", {"llm.token_count.prompt": 5, "llm.token_count.completion": 6}),
    ("invoke_agent", {"gen_ai.agent.name": "support", "tenant": "acme"}),
    ("POST", {"http.request.method": "POST", "tenant": "acme"}),
    # A priced chat in a conversation, an agent naming its thread, a web session on HTTP.
    (
        "chat",
        {
            "gen_ai.operation.name": "chat",
            "gen_ai.usage.input_tokens": 7,
            "gen_ai.usage.output_tokens": 3,
            "gen_ai.request.model": "gpt-4o",
            "session.id": "thread-1",
        },
    ),
    ("invoke_agent", {"gen_ai.operation.name": "invoke_agent", "gen_ai.conversation.id": "c-1"}),
    ("GET", {"http.request.method": "GET", "session.id": "web-1"}),
]


def _shapes_request():
    request = ExportTraceServiceRequest()
    spans = request.resource_spans.add().scope_spans.add().spans
    for index, (name, attributes) in enumerate(SHAPES):
        span = spans.add(trace_id=b"t" * 16, span_id=bytes([index]) * 8, name=name)
        span.end_time_unix_nano = 1
        for key, value in attributes.items():
            any_value = AnyValue(int_value=value) if isinstance(value, int) else None
            any_value = any_value or AnyValue(string_value=value)
            span.attributes.append(KeyValue(key=key, value=any_value))
    return request


def _spans(view):
    for resource_spans in view.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                yield scope_spans.scope.name, span


@pytest.fixture(scope="module")
def views():
    return list(_views())


@pytest.mark.parametrize(
    "wanted",
    [
        WANTED_KEYS,
        WANTED_KEYS - USAGE_KEYS,
        WANTED_KEYS | MATCH_KEYS,
        WANTED_KEYS | PRICE_KEYS | CONVERSATION_KEY_SET,
        WANTED_KEYS - USAGE_KEYS | CONVERSATION_KEY_SET,
    ],
    ids=["budget", "no-budget", "match-keys", "priced-conversations", "conversations"],
)
@pytest.mark.parametrize("match", [False, True])
def test_the_gated_map_reading_equals_the_plain_intersection(views, wanted, match):
    reading = reading_of(wanted)
    everything = tuple(sorted(wanted))
    # The plain algorithm: any wanted key lets a span through, the present keys are a set.
    plain = reading._replace(
        gate=everything,
        gate_with_agent=everything,
        gate_set=wanted,
        gate_set_with_agent=wanted,
        whole=False,
    )
    events = 0
    for scope, span in views:
        fast = adapt_read(span, reading, match, scope)
        assert fast == adapt_read(span, plain, match, scope), (scope, span.name)
        assert fast == adapt_span(span, wanted, match=match, scope=scope)
        events += fast is not None
    assert events > 1000  # the fixtures and the corpus hold tool calls and usage
    shapes = [
        adapt_read(span, reading, match, "") for _, span in _spans(view_of(_shapes_request()))
    ]
    assert sum(event is not None for event in shapes) >= 4 + (wanted != WANTED_KEYS - USAGE_KEYS)


def test_conversations_and_models_are_read_only_when_wanted():
    # The fast reading asks the span's own map: keys it holds but nobody wants stay unread.
    chat, agent, web = [span for _, span in _spans(view_of(_shapes_request()))][-3:]
    assert reading_of(WANTED_KEYS).whole
    plain = adapt_span(chat, WANTED_KEYS)
    assert (plain.tokens, plain.conversation_id, plain.request_model) == (10, None, None)
    assert adapt_span(agent, WANTED_KEYS) is None
    wanted = WANTED_KEYS | PRICE_KEYS | CONVERSATION_KEY_SET
    assert reading_of(wanted).whole
    priced = adapt_span(chat, wanted)
    assert (priced.conversation_id, priced.request_model, priced.input_tokens) == (
        "thread-1",
        "gpt-4o",
        7,
    )
    assert priced.match_attributes is None  # match off: price keys are no match attributes
    assert adapt_span(agent, wanted).conversation_id == "c-1"
    assert adapt_span(web, wanted) is None  # a web session on a plain HTTP span is no chat
    matched = adapt_span(chat, wanted, match=True).match_attributes
    assert matched == {"gen_ai.request.model": "gpt-4o", "session.id": "thread-1"}


def test_a_wanted_set_without_convention_keys_reads_only_those_it_has():
    # Without the argument keys a tool call's arguments are not recorded: the set path.
    wanted = WANTED_KEYS - {"gen_ai.tool.call.arguments"}
    assert not reading_of(wanted).whole
    (span,) = [span for _, span in _spans(view_of(_tool_request()))]
    assert adapt_span(span, WANTED_KEYS).arguments == {"query": "refund policy"}
    assert repr(adapt_span(span, wanted).arguments) == "MISSING"


def _tool_request():
    request = ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add()
    span.trace_id, span.span_id, span.name = b"t" * 16, b"s" * 8, "execute_tool search"
    span.end_time_unix_nano = 1
    for key, value in (
        ("gen_ai.operation.name", "execute_tool"),
        ("gen_ai.tool.name", "search"),
        ("gen_ai.tool.call.arguments", '{"query": "refund policy"}'),
    ):
        span.attributes.append(KeyValue(key=key, value=AnyValue(string_value=value)))
    return request


VALUES = [
    {"query": "refund policy", "page": 2, "exact": True, "score": 0.5, "none": None},
    {"b": [1, 2.0, {"z": "é", "a": "e\u0301"}], "a": {"nested": ["x", None, False]}},
    ["list", "at", "top", 1e300, -0.0, 10**30],
    'a bare string with "quotes" and \\ and \n and \u2603 and \ud800',
    {"nan": math.nan, "inf": math.inf, "-inf": -math.inf},
    {"object": object.__name__, "bytes-like": "YWJj"},
    {},
    [],
    7,
    None,
]


@pytest.mark.parametrize("value", VALUES, ids=range(len(VALUES)))
def test_the_canonical_json_is_json_dumps(value):
    assert _canonical_json(value) == json.dumps(value, sort_keys=True, default=str)
    canonical = json.dumps(canonicalize(value, DEFAULT_VOLATILE_KEYS), sort_keys=True, default=str)
    expected = hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    assert args_hash(value, DEFAULT_VOLATILE_KEYS) == expected


def test_the_canonical_json_of_what_json_has_not_is_its_str():
    class Thing:
        def __str__(self) -> str:
            return "thing"

    assert _canonical_json({"x": Thing()}) == '{"x": "thing"}'


TEXTS = [
    '{"query": "refund policy"}',
    '  {"query": "refund policy"}  ',
    '{"query": "refund policy"}\n',
    '{"query": 1} trailing',
    "refund policy",
    "123abc",
    "123",
    "",
    "   ",
    "\ufeff{}",
    "[1, 2",
    "null",
    "NaN",
    '"quoted"',
    "{'python': 'repr', 'n': (1, 2)}",
    "[" * 100_000 + "]" * 100_000,
]


def _reference(text: str, python_repr: bool):
    """decode_arguments as it was: json.loads first (what is not JSON, read as it still is)."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    except RecursionError:
        return {"_raw": text}
    return literal_or_text(text, python_repr=python_repr)


@pytest.mark.parametrize("python_repr", [False, True])
@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_decoding_arguments_is_json_loads_first(text, python_repr):
    decoded = decode_arguments(text, python_repr=python_repr)
    expected = _reference(text, python_repr)
    if isinstance(expected, float) and math.isnan(expected):
        assert isinstance(decoded, float) and math.isnan(decoded)
    else:
        assert decoded == expected and type(decoded) is type(expected)


def _any_values():
    """An AnyValue of every kind, with the defaults a oneof member reads as when unset."""
    yield AnyValue()
    for text in ("", "x", " 12 ", "12", "{}", '{"q": 1}', "null"):
        yield AnyValue(string_value=text)
    for number in (0, 1, -3, 2**62):
        yield AnyValue(int_value=number)
    for number in (0.0, 2.5, -1.0, math.inf, math.nan):
        yield AnyValue(double_value=number)
    yield AnyValue(bool_value=False)
    yield AnyValue(bool_value=True)
    yield AnyValue(bytes_value=b"")
    yield AnyValue(bytes_value=b"\x00ab")
    array = AnyValue()
    array.array_value.values.add(string_value="a")
    array.array_value.values.add(int_value=0)
    yield array
    yield AnyValue(array_value={})
    kvlist = AnyValue()
    kvlist.kvlist_value.values.add(key="k", value=AnyValue(string_value=""))
    yield kvlist


def _kind_first_text(value):
    """conventions._text as it was: the value's kind asked first."""
    from spanguard.schemas.otlp import any_value_to_python

    kind = value.WhichOneof("value")
    if kind == "string_value":
        return value.string_value
    if kind is None:
        return ""
    python = any_value_to_python(value)
    if isinstance(python, bool):
        return "true" if python else "false"
    return python if isinstance(python, str) else json.dumps(python, sort_keys=True)


def _kind_first_int(value):
    kind = value.WhichOneof("value")
    if kind == "int_value":
        return value.int_value if value.int_value > 0 else 0
    if kind == "double_value":
        return max(int(value.double_value), 0) if math.isfinite(value.double_value) else None
    if kind == "string_value" and value.string_value.strip().isdigit():
        return int(value.string_value)
    return None


def _kind_first_decode(value, python_repr):
    from spanguard.detection.conventions.events import MISSING
    from spanguard.schemas.otlp import any_value_to_python

    kind = value.WhichOneof("value")
    if kind == "string_value":
        return decode_arguments(value.string_value, python_repr=python_repr)
    if kind is None:
        return MISSING
    return any_value_to_python(value)


@pytest.mark.parametrize("value", list(_any_values()), ids=str)
def test_reading_the_string_first_equals_asking_the_kind_first(value):
    # The hot path reads string_value (int_value for counts) before WhichOneof: an unset
    # oneof member reads as its default, so a non-empty one is the value's kind.
    from spanguard.detection.conventions.decoding import _decode_value
    from spanguard.detection.conventions.values import _first_int, _text

    def same(left, right):
        if isinstance(right, float) and math.isnan(right):
            return isinstance(left, float) and math.isnan(left)
        return left == right and type(left) is type(right)

    assert same(_text(value), _kind_first_text(value))
    attributes = {"count": value}
    assert same(_first_int(attributes, attributes, ("count",)), _kind_first_int(value))
    for python_repr in (False, True):
        decoded = _decode_value(value, python_repr=python_repr)
        expected = _kind_first_decode(value, python_repr)
        assert same(decoded, expected) or repr(decoded) == repr(expected)
