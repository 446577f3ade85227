"""Hostile input at the OTLP receiver: its decode and mapping functions (in-process,
hypothesis) and its HTTP server on the session broker (random bodies, content types and
encodings), with a known-good OTLP export sent after the garbage and stored exactly."""

from __future__ import annotations

import contextlib
import gzip
import json
import random
import socket
import threading
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from google.rpc import status_pb2
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from loopwatch.core.config import Settings
from loopwatch.core.embedded.broker import free_port
from loopwatch.ingest.events import EventBase
from loopwatch.ingest.otlp.decode import DecodedRequest, PayloadError, decode_json, decode_protobuf
from loopwatch.ingest.otlp.mapping import map_spans
from loopwatch.ingest.otlp.server import OtlpReceiver
from loopwatch.ingest.otlp.settings import OtlpSettings
from loopwatch.ingest.structs import encode_claim
from loopwatch.ingest.wire import exact_json
from tests.conftest import wait_for
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


def _as_sent(event: Any) -> tuple[dict[str, Any], list[str]]:
    """What the receiver's emitter sends for an event (a model or the receiver's struct),
    read back: its fields, and the order of its extras (which the store keeps)."""
    if isinstance(event, EventBase):
        line = event.__pydantic_serializer__.to_json(event, exclude_none=True)
        return orjson.loads(line), list(event.__pydantic_extra__ or {})
    return orjson.loads(encode_claim(event)), list(event.__pydantic_extra__)


def _map(decoded: DecodedRequest) -> None:
    """Mapped as models and as the receiver maps (structs where msgspec takes them):
    the same events, sent as the same JSON, and the same dead letters with the same
    reasons."""
    batch = map_spans(decoded.spans, decoded.bad)
    for event in batch.events:
        assert isinstance(event, EventBase)
    for unmapped in batch.unmapped:
        assert unmapped.reason
    received = map_spans(decoded.spans, decoded.bad, structs=True)
    assert [_as_sent(event) for event in received.events] == [
        _as_sent(event) for event in batch.events]
    assert [u.reason for u in received.unmapped] == [u.reason for u in batch.unmapped]


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


def _attribute(key: str, value: Any) -> dict[str, Any]:
    kind = "intValue" if isinstance(value, int) else (
        "doubleValue" if isinstance(value, float) else "stringValue")
    return {"key": key, "value": {kind: str(value) if kind == "intValue" else value}}


#: spans the contract refuses, or takes only as pydantic does, at the receiver's build
EDGE_SPANS = {
    "tokens past the contract's bound": [("gen_ai.usage.input_tokens", 10**12 + 1)],
    "a negative reported cost": [("gen_ai.usage.cost", -1.5)],
    "an agent name over 256 characters": [("gen_ai.agent.name", "x" * 300)],
    "a 256-character agent name": [("gen_ai.agent.name", "y" * 256)],
    "a worker given as a number": [("loopwatch.worker_id", 7)],
    "a time to first chunk below zero": [("gen_ai.response.time_to_first_chunk", -0.5)],
    "odd strings": [("gen_ai.request.model", "\u2028\x00 é \U0001F600"),
                    ("gen_ai.conversation.id", '"q\\'), ("gen_ai.agent.id", "")],
    "an http status out of range": [("http.response.status_code", 700)],
}


@pytest.mark.parametrize("name", sorted(EDGE_SPANS))
def test_the_receiver_builds_edge_spans_as_the_contract_says(name: str):
    """The receiver builds its events with msgspec where the contract allows; a span at
    or past a bound maps (or is dead-lettered, with pydantic's reason) exactly as the
    models do, also under an agent root and as a tool call."""
    extra = [_attribute(key, value) for key, value in EDGE_SPANS[name]]
    chat = dict(GOOD_SPAN, attributes=GOOD_SPAN["attributes"] + extra,
                parentSpanId="b" * 16)
    tool = dict(GOOD_SPAN, spanId="c" * 16, parentSpanId="b" * 16, name="execute_tool t",
                attributes=[_attribute("gen_ai.operation.name", "execute_tool"),
                            _attribute("gen_ai.tool.name", "t"), *extra])
    root = dict(GOOD_SPAN, spanId="b" * 16, name="invoke_agent",
                attributes=[_attribute("gen_ai.operation.name", "invoke_agent"), *extra])
    for spans in ([chat], [chat, tool, root]):
        decoded = decode_json(orjson.dumps({"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]}))
        assert len(decoded.spans) == len(spans)
        _map(decoded)


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


# -- slow clients: slowloris headers, slow bodies, connection floods ------------------

TOKEN = "slow-t0ken"
HEAD = b"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\n"
BODY_HEAD = (HEAD + b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
             b"Content-Type: application/x-protobuf\r\nContent-Length: 100000\r\n\r\n")


class SlowClients:
    """Loopback connections that hold a receiver: header lines or body bytes trickled
    every ``every_s`` from one thread, at most ``rounds`` times (bounded in count and
    time), until ``close()``."""

    def __init__(self, url: str, every_s: float = 5.0, rounds: int = 60) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.address = (host, int(port))
        self.headers: list[socket.socket] = []
        self.bodies: list[socket.socket] = []
        self.every_s, self.rounds = every_s, rounds
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._trickle, daemon=True)

    def open(self, head: bytes, count: int, into: list[socket.socket]) -> None:
        for _ in range(count):
            sock = socket.create_connection(self.address, timeout=10)
            sock.sendall(head)
            into.append(sock)

    def _trickle(self) -> None:
        for _ in range(self.rounds):
            if self.stop.wait(self.every_s):
                return
            for sock, data in [*((s, b"X-Slow: 1\r\n") for s in self.headers),
                               *((s, b"x") for s in self.bodies)]:
                with contextlib.suppress(OSError):
                    sock.sendall(data)

    def open_count(self, sockets: list[socket.socket]) -> int:
        """How many of ``sockets`` the server has not closed (a peek, never blocking)."""
        alive = 0
        for sock in sockets:
            sock.setblocking(False)
            try:
                alive += sock.recv(1, socket.MSG_PEEK) != b""
            except BlockingIOError:
                alive += 1
            except OSError:
                pass
            finally:
                sock.setblocking(True)
        return alive

    def close(self) -> None:
        self.stop.set()
        for sock in [*self.headers, *self.bodies]:
            sock.close()


def _receiver(broker: Any, folder: Path, token: str | None = TOKEN, header_timeout_s: float = 600,
              **limits: Any) -> OtlpReceiver:
    running = OtlpReceiver(
        Settings(data_dir=folder, max_message_bytes=200_000,
                 http_header_timeout_s=header_timeout_s),
        broker.bootstrap, "127.0.0.1", free_port(), token, limits=OtlpSettings(**limits))
    running.start()
    return running


def test_a_real_exporter_is_served_while_128_slow_header_and_4_slow_body_clients_hold_on(
        broker, pipeline, reader, agent, tmp_path):
    """The finding: 128 unauthenticated clients trickling header lines every 5 s filled
    every connection (exporters got 503), and 4 authenticated slow bodies held every
    in-flight slot (429). Default limits (128 connections, 4 in flight), deadlines far
    away so the slow clients are all still there: the 4 slow bodies each evict the
    longest-waiting header client and hold a receive slot, not an in-flight one; the
    OpenTelemetry SDK's exporter is served, overlapping them, and its run is stored
    exactly."""
    receiver = _receiver(broker, tmp_path, body_timeout_s=600)
    slow = SlowClients(receiver.url)
    try:
        slow.open(HEAD, 128, slow.headers)
        wait_for(lambda: receiver.server.connection_states()["awaiting_headers"] == 128, 60,
                 what="128 slow-header connections held")
        slow.open(BODY_HEAD + b"xx", 4, slow.bodies)
        wait_for(lambda: receiver.receiving == 4, 60, what="4 slow bodies being received")
        slow.thread.start()
        assert receiver.server.connection_states() == {"awaiting_headers": 124, "in_request": 4}
        assert receiver.server.stats.evicted == 4

        memory = InMemorySpanExporter()
        _agent_spans(agent, memory).force_flush()
        exporter = OTLPSpanExporter(endpoint=f"{receiver.url}/v1/traces", timeout=60,
                                    headers={"Authorization": f"Bearer {TOKEN}"})
        assert exporter.export(list(memory.get_finished_spans())) == SpanExportResult.SUCCESS
        exporter.shutdown()

        assert receiver.receiving == 4  # overlap: the slow bodies were held all along
        assert slow.open_count(slow.bodies) == 4
        assert slow.open_count(slow.headers) == 123  # one more made room for the exporter
        assert (receiver.stats.accepted, receiver.stats.spans) == (1, 4)
    finally:
        slow.close()
        receiver.stop()
    _wait_closed(reader, agent)
    assert reader.query(RUN_SQL, {"a": agent}).rows == [["success", 2, 1, 1500, 100, 1000]]


def _complete(answer: bytes) -> bool:
    head, separator, body = answer.partition(b"\r\n\r\n")
    lengths = [int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
               if line.startswith(b"content-length:")]
    return bool(separator) and len(body) >= (lengths[0] if lengths else 0)


def _answer(sock: socket.socket, rounds: int, every_s: float, data: bytes) -> bytes:
    """Send ``data`` every ``every_s`` (at most ``rounds`` times) until the server
    answers or closes; returns what it sent (b"" = closed without a word)."""
    sock.settimeout(every_s)
    for _ in range(rounds):
        try:
            answer = sock.recv(65536)
        except TimeoutError:
            with contextlib.suppress(OSError):
                sock.sendall(data)
            continue
        while answer and not _complete(answer):  # the rest of the answer
            more = sock.recv(65536)
            if not more:
                break
            answer += more
        return answer
    raise AssertionError(f"still held after {rounds} x {every_s}s")


def test_slow_headers_and_idle_connections_are_cut_at_the_header_deadline(broker, tmp_path):
    """Header deadline 1 s: a client trickling a header line every 0.2 s gets 408 and
    is closed (it had 300 lines, 60 s, to send); a connection that never sends a byte,
    and a keep-alive connection idle after its response, are closed too."""
    receiver = _receiver(broker, tmp_path, token=None, header_timeout_s=1)
    host, port = receiver.url.removeprefix("http://").rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(HEAD)
            answer = _answer(sock, 300, 0.2, b"X-Slow: 1\r\n")
        assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
        assert answer.endswith(b"\r\n\r\nrequest headers not complete within 1s\n")
        with socket.create_connection((host, int(port))) as sock:
            assert _answer(sock, 300, 0.2, b"") == b""
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(HEAD.replace(b"\r\n", b"\r\nContent-Type: application/x-protobuf\r\n"
                                      b"Content-Length: 0\r\n", 1) + b"\r\n")
            first = _answer(sock, 300, 0.2, b"")
            assert first.startswith(b"HTTP/1.1 200 OK\r\n")
            assert _answer(sock, 300, 0.2, b"") == b""  # then idle: closed
        assert receiver.server.stats.header_timeouts >= 2
    finally:
        receiver.stop()


def test_a_slow_body_is_cut_at_its_deadline_and_its_slot_freed(broker, tmp_path):
    """Body deadline 1 s, one receive slot: a body trickled a byte every 0.2 s gets 408
    (as google.rpc.Status) and is closed; its slot is free again and the next request
    is served."""
    receiver = _receiver(broker, tmp_path, body_timeout_s=1, max_receiving=1)
    host, port = receiver.url.removeprefix("http://").rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(BODY_HEAD)
            answer = _answer(sock, 300, 0.2, b"x")
        assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
        assert b"\r\nconnection: close\r\n" in answer
        status = status_pb2.Status.FromString(answer.split(b"\r\n\r\n", 1)[1])
        assert (status.code, status.message) == (4, "body not received within 1s")
        assert receiver.receiving == 0
        assert post(receiver.url, b"", headers={"Authorization": f"Bearer {TOKEN}"})[0] == 200
        assert receiver.stats.rejected[408] == 1
    finally:
        receiver.stop()


def test_bodies_being_received_are_capped_and_the_rest_refused_before_their_body(
        broker, tmp_path):
    """Two receive slots held by slow bodies: a third request gets 429 + Retry-After
    from its headers alone (its body is never sent) and its connection is closed; an
    unauthenticated one gets 401 before its body, whatever Content-Length it claims."""
    receiver = _receiver(broker, tmp_path, body_timeout_s=600, max_receiving=2)
    slow = SlowClients(receiver.url)
    try:
        slow.open(BODY_HEAD, 2, slow.bodies)
        wait_for(lambda: receiver.receiving == 2, 60, what="2 slow bodies being received")
        for head, expected in ((BODY_HEAD, b"HTTP/1.1 429 Too Many Requests\r\n"),
                               (BODY_HEAD.replace(TOKEN.encode(), b"wrong").replace(
                                   b"100000", b"999999999"), b"HTTP/1.1 401 Unauthorized\r\n")):
            with socket.create_connection(slow.address) as sock:
                sock.sendall(head)
                answer = _answer(sock, 300, 0.2, b"")
                assert answer.startswith(expected), answer
                assert b"\r\nconnection: close\r\n" in answer
                assert sock.recv(1) == b""
        assert receiver.stats.rejected[429] == 1 and receiver.stats.rejected[401] == 1
    finally:
        slow.close()
        receiver.stop()


def test_when_every_connection_is_inside_a_request_a_new_one_gets_503(broker, tmp_path):
    receiver = _receiver(broker, tmp_path, body_timeout_s=600, max_receiving=3,
                         max_connections=3)
    slow = SlowClients(receiver.url)
    try:
        slow.open(BODY_HEAD, 3, slow.bodies)
        wait_for(lambda: receiver.receiving == 3, 60, what="3 slow bodies being received")
        with socket.create_connection(slow.address) as sock:
            answer = _answer(sock, 300, 0.2, b"")
        assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
        assert b"\r\nretry-after: 2\r\n" in answer
        assert receiver.server.stats.refused == 1 and slow.open_count(slow.bodies) == 3
    finally:
        slow.close()
        receiver.stop()


def test_without_a_token_a_foreign_host_is_refused_and_with_one_any_host_is_served(
        broker, tmp_path):
    """DNS rebinding: without a token a page rebinding attacker.example to 127.0.0.1
    could post spans; refused with 421. With a token (deployments bind 0.0.0.0 and are
    reached by service names) the token is the check."""
    for token, expected in ((None, 421), (TOKEN, 200)):
        receiver = _receiver(broker, tmp_path / str(expected), token=token)
        try:
            request = urllib.request.Request(
                f"{receiver.url}/v1/traces", data=b"", method="POST",
                headers={"Host": "attacker.example", "Authorization": f"Bearer {TOKEN}",
                         "Content-Type": "application/x-protobuf"})
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    status = response.status
            except urllib.error.HTTPError as error:
                status, body = error.code, error.read()
                assert body == (b"Host 'attacker.example' is not a name of this loopwatch "
                                b"server; allow it with LOOPWATCH_HTTP_ALLOWED_HOSTS\n")
            assert status == expected
        finally:
            receiver.stop()
