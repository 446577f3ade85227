"""Hostile input at the OTLP receiver: its decode and mapping functions (in-process,
hypothesis) and its HTTP server on the session broker (random bodies, content types and
encodings), with a known-good OTLP export sent after the garbage and stored exactly."""

from __future__ import annotations

import gzip
import json
import random
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ingest.events import EventBase
from ingest.otlp.decode import DecodedRequest, PayloadError, decode_json, decode_protobuf
from ingest.otlp.mapping import map_spans
from ingest.otlp.server import OtlpReceiver
from ingest.otlp.settings import OtlpSettings
from ingest.wire import exact_json
from loopwatch.config import Settings
from loopwatch.embedded.broker import free_port
from tests.test_hostile_pipeline import ODD_STRINGS, json_values
from tests.test_otlp import RUN_SQL, _agent_spans, _otlp_json, _wait_closed, post

EXAMPLES = 150
HTTP_BODIES = 400
TRIED: dict[str, int] = {}

TRACE = "0af7651916cd43dd8448eb211c80319c"
GOOD_SPAN = {"traceId": TRACE, "spanId": "a" * 16, "name": "chat gpt-4o",
             "startTimeUnixNano": "1767225600000000000", "endTimeUnixNano": "1767225601000000000",
             "attributes": [{"key": "gen_ai.operation.name", "value": {"stringValue": "chat"}},
                            {"key": "gen_ai.usage.input_tokens", "value": {"intValue": "10"}}]}


@pytest.fixture(scope="module", autouse=True)
def summary() -> Iterator[None]:
    yield
    print("\nhostile input at the OTLP receiver: "
          + ", ".join(f"{name} {count}" for name, count in TRIED.items()))


def count(name: str) -> None:
    TRIED[name] = TRIED.get(name, 0) + 1


@st.composite
def hostile_document(draw: st.DrawFn) -> Any:
    """An OTLP/JSON request with parts replaced by random JSON, odd strings or nothing."""
    span: dict[str, Any] = dict(GOOD_SPAN)
    for _ in range(draw(st.integers(0, 4))):
        key = draw(st.sampled_from([*GOOD_SPAN, "parentSpanId", "status", "events", "kind"]))
        span[key] = draw(json_values | st.sampled_from(ODD_STRINGS))
    attributes = draw(st.lists(st.fixed_dictionaries(
        {"key": st.sampled_from(["gen_ai.usage.input_tokens", "gen_ai.agent.name",
                                 "gen_ai.operation.name", "gen_ai.request.model",
                                 "loopwatch.task_type", *ODD_STRINGS[:4]]),
         "value": json_values | st.builds(
             lambda kind, value: {kind: value},
             st.sampled_from(["stringValue", "intValue", "doubleValue", "boolValue",
                              "arrayValue", "kvlistValue", "bytesValue"]), json_values)}),
        max_size=4))
    if attributes:
        span["attributes"] = attributes
    spans = draw(st.lists(st.just(span), min_size=1, max_size=3))
    shape = draw(st.sampled_from(["full", "no_scope", "bad_resource", "top"]))
    if shape == "top":
        return draw(json_values)
    scope: Any = {"scopeSpans": [{"spans": spans}]}
    if shape == "no_scope":
        scope = {"scopeSpans": draw(json_values)}
    if shape == "bad_resource":
        scope["resource"] = {"attributes": draw(json_values)}
    return {"resourceSpans": [scope]}


def _map(decoded: DecodedRequest) -> None:
    batch = map_spans(decoded.spans, decoded.bad)
    for event in batch.events:
        assert isinstance(event, EventBase)
    for unmapped in batch.unmapped:
        assert unmapped.reason


@hypothesis_settings(max_examples=EXAMPLES, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(document=hostile_document())
def test_any_otlp_json_document_decodes_or_is_refused_with_a_reason(document):
    """Property: a JSON body either decodes (then mapping never raises, every span it
    cannot map is dead-lettered with a reason) or is refused with PayloadError."""
    try:
        decoded = decode_json(exact_json(document))  # its integers reach past 64 bits
    except PayloadError as exc:
        assert str(exc)
    else:
        _map(decoded)
    count("JSON documents")


@hypothesis_settings(max_examples=EXAMPLES, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.too_slow])
@given(body=st.binary(max_size=400))
def test_any_bytes_decode_or_are_refused_with_a_reason(body):
    """Property: random bytes as protobuf or JSON: decoded and mapped, or PayloadError."""
    for decode in (decode_protobuf, decode_json):
        try:
            decoded = decode(body)
        except PayloadError as exc:
            assert str(exc)
        else:
            _map(decoded)
    count("byte bodies (x2 decoders)")


@pytest.mark.parametrize("where", ["resource", "scope"])
def test_a_resource_or_scope_that_is_not_an_object_is_refused_with_a_reason(where):
    scope_spans: dict[str, Any] = {"spans": [GOOD_SPAN]}
    resource_spans: dict[str, Any] = {"scopeSpans": [scope_spans]}
    (resource_spans if where == "resource" else scope_spans)[where] = 1
    with pytest.raises(PayloadError):
        decode_json(orjson.dumps({"resourceSpans": [resource_spans]}))


def test_a_span_time_beyond_any_date_is_dead_lettered():
    document = {"resourceSpans": [{"scopeSpans": [{"spans": [
        dict(GOOD_SPAN, startTimeUnixNano=str(2**70), endTimeUnixNano=str(2**70))]}]}]}
    decoded = decode_json(orjson.dumps(document))
    batch = map_spans(decoded.spans, decoded.bad)
    assert len(batch.unmapped) == 1


def test_an_int_value_beyond_int64_costs_its_span_with_the_reason():
    """OTLP's intValue is an int64: in JSON, where nothing stops a bigger one, it is
    refused for its span, as a protobuf body could not carry it."""
    spans = [dict(GOOD_SPAN, attributes=[{"key": "order", "value": {"intValue": value}}])
             for value in ("9223372036854775807", "9223372036854775808", str(-(2**63) - 1))]
    decoded = decode_json(orjson.dumps({"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]}))
    assert [span.attributes["order"] for span in decoded.spans] == [2**63 - 1]
    assert [bad.reason for bad in decoded.bad] == [
        "resourceSpans[0].scopeSpans[0].spans[1]: intValue '9223372036854775808' is "
        "outside int64",
        "resourceSpans[0].scopeSpans[0].spans[2]: intValue '-9223372036854775809' is "
        "outside int64"]


@pytest.fixture(scope="module")
def hostile_receiver(broker, pipeline, tmp_path_factory) -> Iterator[OtlpReceiver]:
    folder: Path = tmp_path_factory.mktemp("hostile-otlp")
    running = OtlpReceiver(Settings(data_dir=folder, max_message_bytes=200_000),
                           broker.bootstrap, "127.0.0.1", free_port(),
                           limits=OtlpSettings(max_body_bytes=64 * 1024))
    running.start()
    yield running
    running.stop()


def _random_body(rng: random.Random) -> tuple[bytes, str, dict[str, str]]:
    kind = rng.random()
    if kind < 0.3:
        body = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 300)))
    elif kind < 0.6:
        span = dict(GOOD_SPAN, **{rng.choice(list(GOOD_SPAN)): rng.choice(
            [*ODD_STRINGS, None, [], {}, -1, 2**53, "x" * 70_000])})
        body = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}).encode()
    elif kind < 0.7:
        body = b'{"resourceSpans": ' + b"[" * rng.choice([10, 300, 3000]) + b"]"
    elif kind < 0.8:
        body = b"\x1f\x8b" + bytes(rng.randrange(256) for _ in range(50))  # not really gzip
    elif kind < 0.9:
        body = gzip.compress(b"\x00" * 200_000)  # a small bomb: 64 KB limit after inflating
    else:
        body = zlib.compress(orjson.dumps({"resourceSpans": [{"scopeSpans": [
            {"spans": [dict(GOOD_SPAN, traceId=rng.choice(ODD_STRINGS))]}]}]}))
    content_type = rng.choice(["application/json", "application/x-protobuf", "text/plain",
                               "application/json; charset=utf-8", ""])
    encoding = {}
    if body[:2] == b"\x1f\x8b":
        encoding = {"Content-Encoding": "gzip"}
    elif kind >= 0.9:
        encoding = {"Content-Encoding": rng.choice(["deflate", "br", "gzip"])}
    return body, content_type, encoding


def test_http_receiver_answers_garbage_with_4xx_and_still_stores_a_good_export_exactly(
        hostile_receiver, reader, agent):
    """Fuzz: 400 random requests (bytes, broken OTLP/JSON, 3000-deep arrays, fake and
    real gzip bombs, odd content types and encodings): every answer is 200 (a valid
    request, its unmappable spans dead-lettered) or a 4xx with a reason; never a 500;
    the server keeps answering, and a good OTLP/JSON export afterwards is stored
    exactly."""
    rng = random.Random(8)
    statuses: dict[int, int] = {}
    for _ in range(HTTP_BODIES):
        body, content_type, headers = _random_body(rng)
        status, _, answer = post(hostile_receiver.url, body, content_type, headers)
        statuses[status] = statuses.get(status, 0) + 1
        assert status in (200, 400, 413, 415), (status, answer[:200])
        if status != 200:
            assert answer  # the reason, as google.rpc.Status or JSON
    assert sum(statuses.values()) == HTTP_BODIES
    assert 500 not in hostile_receiver.stats.rejected
    memory = InMemorySpanExporter()
    _agent_spans(agent, memory).force_flush()
    status, _, answer = post(hostile_receiver.url, _otlp_json(list(memory.get_finished_spans())),
                             "application/json")
    assert (status, answer) == (200, b"{}")
    _wait_closed(reader, agent)
    assert reader.query(RUN_SQL, {"a": agent}).rows == [["success", 2, 1, 1500, 100, 1000]]
    TRIED["HTTP requests"] = HTTP_BODIES + 1
    TRIED.update({f"HTTP {code}": n for code, n in sorted(statuses.items())})
