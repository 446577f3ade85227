"""OTLP over gRPC: the stock OpenTelemetry gRPC exporter into the real ``up`` (its
receivers on the session broker), stored exactly as the same spans over OTLP/HTTP;
auth, size and concurrency limits, and hostile calls against in-process receivers on
the session broker (or on no broker at all, to hold requests in flight)."""

from __future__ import annotations

import gzip
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest
from google.rpc.error_details_pb2 import RetryInfo
from kafka import KafkaConsumer, TopicPartition
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcSpanExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpSpanExporter,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator

from loopwatch.core.config import Settings
from loopwatch.core.embedded.broker import free_port
from loopwatch.ingest.otlp.grpc_server import EXPORT_METHOD, RETRY_INFO_KEY
from loopwatch.ingest.otlp.server import OtlpReceiver
from loopwatch.ingest.otlp.settings import OtlpSettings
from tests.conftest import PIPELINE_ENV, wait_for


class _Ids(IdGenerator):
    """Span ids 1, 2, 3... and one fixed trace id: the same script gives the same ids
    but for the trace, so two exports of it can be compared row by row."""

    def __init__(self, trace_id: int) -> None:
        self.trace_id = trace_id
        self.next = 0

    def generate_span_id(self) -> int:
        self.next += 1
        return self.next

    def generate_trace_id(self) -> int:
        return self.trace_id


def _export_run(agent: str, exporter: SpanExporter, trace_id: int, t0: int) -> None:
    """One agent run at fixed times (ns from ``t0``): two chats, one with cache reads,
    and a tool call, each span exported as it ends (SimpleSpanProcessor)."""
    provider = TracerProvider(resource=Resource.create({"service.name": agent}),
                              id_generator=_Ids(trace_id))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("agent-under-test")
    ms = 1_000_000
    root = tracer.start_span("invoke_agent " + agent, start_time=t0, attributes={
        "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": agent,
        "gen_ai.request.model": "gpt-4o"})
    with trace.use_span(root, end_on_exit=False):
        for index, (start, end, attributes) in enumerate([
                (10, 900, {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai",
                           "gen_ai.request.model": "gpt-4o", "gen_ai.usage.input_tokens": 1200,
                           "gen_ai.usage.output_tokens": 80,
                           "gen_ai.usage.cache_read.input_tokens": 1000}),
                (910, 950, {"gen_ai.operation.name": "execute_tool",
                            "gen_ai.tool.name": "lookup",
                            "gen_ai.tool.call.arguments": '{"id": 7}'}),
                (960, 1500, {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai",
                             "gen_ai.request.model": "gpt-4o", "gen_ai.usage.input_tokens": 300,
                             "gen_ai.usage.output_tokens": 20})]):
            name = "execute_tool lookup" if index == 1 else "chat gpt-4o"
            tracer.start_span(name, start_time=t0 + start * ms,
                              attributes=attributes).end(end_time=t0 + end * ms)
    root.end(end_time=t0 + 2000 * ms)
    provider.shutdown()


def _rows(reader: Any, agent: str, trace: str) -> dict[str, list[str]]:
    """Every stored row of the agent's run in the tables spans feed, as JSON text with
    the agent and trace written as placeholders and where it arrived (time, partition,
    offset) left out."""
    tables = {
        "events": "* EXCEPT (event_id, ingested_at, kafka_partition, kafka_offset)",
        "llm_calls": "* EXCEPT (event_id, ingested_at)",
        "tool_calls": "* EXCEPT (event_id, ingested_at)",
        "runs": "* EXCEPT (ingested_at, version, state)",
    }
    out = {}
    for table, columns in tables.items():
        result = reader.query(f"SELECT {columns} FROM {table} FINAL WHERE agent = {{a:String}}",
                              {"a": agent})
        rows = [orjson.dumps(dict(zip(result.columns, row, strict=True)),
                             option=orjson.OPT_SORT_KEYS).decode()
                .replace(trace, "<trace>").replace(agent, "<agent>") for row in result.rows]
        out[table] = sorted(rows)
    return out


CLOSED_SQL = "SELECT count() FROM runs FINAL WHERE agent = {a:String} AND status = 'closed'"


def _wait_closed(reader: Any, agent: str) -> None:
    wait_for(lambda: reader.query(CLOSED_SQL, {"a": agent}).scalar() >= 1, 120,
             what=f"the run of {agent} closed")


def test_stock_grpc_exporter_into_up_stores_the_same_rows_as_http(pipeline, reader, agent):
    grpc_address, http_url = pipeline.info["otlp_grpc"], pipeline.info["otlp_url"]
    assert grpc_address and http_url
    t0 = time.time_ns()
    over_http, over_grpc = f"{agent}-http", f"{agent}-grpc"
    _export_run(over_http, HttpSpanExporter(endpoint=f"{http_url}/v1/traces"), 0xA1, t0)
    _export_run(over_grpc, GrpcSpanExporter(endpoint=grpc_address, insecure=True), 0xB2, t0)
    _wait_closed(reader, over_http)
    _wait_closed(reader, over_grpc)
    http_rows = _rows(reader, over_http, f"{0xA1:032x}")
    grpc_rows = _rows(reader, over_grpc, f"{0xB2:032x}")
    assert {table: len(rows) for table, rows in grpc_rows.items()} == {
        "events": 5, "llm_calls": 2, "tool_calls": 1, "runs": 1}
    assert grpc_rows == http_rows
    run = reader.query("SELECT outcome, llm_calls, tool_calls, input_tokens, output_tokens, "
                       "cache_read_tokens FROM runs FINAL WHERE agent = {a:String}",
                       {"a": over_grpc}).rows
    assert run == [["success", 2, 1, 1500, 100, 1000]]


# -- in-process receivers on the session broker ---------------------------------------


def _settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path, max_message_bytes=int(
        PIPELINE_ENV["LOOPWATCH_MAX_MESSAGE_BYTES"]))


def _receiver(tmp_path: Path, bootstrap: str, token: str | None = None,
              **limits: Any) -> OtlpReceiver:
    receiver = OtlpReceiver(_settings(tmp_path), bootstrap, "127.0.0.1", free_port(), token,
                            limits=OtlpSettings(**limits))
    receiver.start()
    assert receiver.serve_grpc(0) is not None
    return receiver


@pytest.fixture()
def receiver(broker, pipeline, tmp_path) -> Iterator[OtlpReceiver]:
    running = _receiver(tmp_path, broker.bootstrap, max_body_bytes=64 * 1024)
    yield running
    running.stop()


def _channel(receiver: OtlpReceiver) -> grpc.Channel:
    address = receiver.grpc_address
    assert address is not None
    return grpc.insecure_channel(address)


def _spans(agent: str) -> ExportTraceServiceRequest:
    memory = InMemorySpanExporter()
    _export_run(agent, memory, int.from_bytes(agent.encode()[-16:].rjust(16, b"\0"), "big"),
                time.time_ns())
    return encode_spans(list(memory.get_finished_spans()))


def _call(receiver: OtlpReceiver, request: Any, *, metadata: Any = None,
          compression: grpc.Compression | None = None) -> grpc.RpcError | bytes:
    """The raw Export call (bytes in, bytes out); the RpcError when refused."""
    with _channel(receiver) as channel:
        export = channel.unary_unary(EXPORT_METHOD)
        body = request if isinstance(request, bytes) else request.SerializeToString()
        try:
            return bytes(export(body, timeout=60, metadata=metadata, compression=compression))
        except grpc.RpcError as error:
            return error


def _stored(reader: Any, agent: str) -> int:
    return int(reader.query("SELECT count() FROM events FINAL WHERE agent = {a:String}",
                            {"a": agent}).scalar())


def test_export_returns_only_after_the_broker_acknowledged(receiver, broker, agent):
    body = _spans(agent)
    consumer = KafkaConsumer(bootstrap_servers=broker.bootstrap)
    partitions = [TopicPartition("loopwatch.events", p) for p in range(4)]
    try:
        before = sum(consumer.end_offsets(partitions).values())
        with _channel(receiver) as channel:
            answer = TraceServiceStub(channel).Export(body, timeout=60)
        after = sum(consumer.end_offsets(partitions).values())  # no waiting in between
    finally:
        consumer.close()
    assert answer == ExportTraceServiceResponse()
    assert after > before
    assert (receiver.stats.accepted, receiver.stats.events) == (1, 5)


def test_partial_batch_answers_partial_success(receiver, reader, agent):
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": agent}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("chat m", attributes={
            "gen_ai.operation.name": "chat", "gen_ai.usage.input_tokens": 7}), \
            tracer.start_as_current_span("execute_tool", attributes={
                "gen_ai.operation.name": "execute_tool"}):
        pass
    with _channel(receiver) as channel:
        answer = TraceServiceStub(channel).Export(
            encode_spans(list(memory.get_finished_spans())), timeout=60)
    assert answer.partial_success.rejected_spans == 1
    assert answer.partial_success.error_message == (
        "1 spans dead-lettered: tool span without a tool name (gen_ai.tool.name / tool.name)")
    _wait_closed(reader, agent)
    assert reader.query("SELECT input_tokens FROM runs FINAL WHERE agent = {a:String}",
                        {"a": agent}).rows == [[7]]


def test_wrong_or_missing_token_is_unauthenticated_and_stores_nothing(
        broker, pipeline, reader, tmp_path, agent):
    receiver = _receiver(tmp_path, broker.bootstrap, token="s3cret")
    refused, accepted = f"{agent}-refused", f"{agent}-accepted"
    try:
        for metadata in (None, (("authorization", "Bearer nope"),),
                         (("authorization", "s3cret"),)):
            error = _call(receiver, _spans(refused), metadata=metadata)
            assert isinstance(error, grpc.RpcError)
            assert (error.code(), error.details()) == (
                grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        exporter = GrpcSpanExporter(endpoint=receiver.grpc_address, insecure=True,
                                    headers={"authorization": "Bearer s3cret"})
        _export_run(accepted, exporter, 0xC3, time.time_ns())
        _wait_closed(reader, accepted)
        assert (receiver.stats.rejected[401], receiver.stats.accepted) == (3, 4)
    finally:
        receiver.stop()
    assert (_stored(reader, accepted), _stored(reader, refused)) == (5, 0)


def test_oversized_messages_are_refused_before_and_after_decompression(receiver):
    big = _spans("big")
    big.resource_spans[0].scope_spans[0].spans[0].name = "x" * (64 * 1024)
    error = _call(receiver, big)
    assert isinstance(error, grpc.RpcError)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in error.details() and str(64 * 1024) in error.details()
    error = _call(receiver, big, compression=grpc.Compression.Gzip)  # ~1 KiB on the wire
    assert isinstance(error, grpc.RpcError)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in error.details()
    assert len(gzip.compress(big.SerializeToString())) < 4096
    assert receiver.stats.accepted == 0 and receiver.stats.events == 0
    assert _call(receiver, ExportTraceServiceRequest()) == b""  # still serving


def test_garbage_and_foreign_methods_get_clean_errors_and_the_server_keeps_serving(
        receiver):
    error = _call(receiver, b"\xff\xff\xff")
    assert isinstance(error, grpc.RpcError)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("malformed protobuf ExportTraceServiceRequest")
    with _channel(receiver) as channel:
        for method in ("/opentelemetry.proto.collector.metrics.v1.MetricsService/Export",
                       "/x.Y/Z", "/opentelemetry.proto.collector.trace.v1.TraceService/Nope"):
            try:
                channel.unary_unary(method)(b"", timeout=30)
            except grpc.RpcError as foreign:
                assert foreign.code() == grpc.StatusCode.UNIMPLEMENTED
            else:
                raise AssertionError(f"{method} answered")
    host, port = str(receiver.grpc_address).rsplit(":", 1)
    for junk in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x00" * 4096, b"PRI * HTTP/2.0"):
        with socket.create_connection((host, int(port)), timeout=30) as raw:
            raw.sendall(junk)
            raw.shutdown(socket.SHUT_WR)
            raw.settimeout(30)
            while raw.recv(4096):  # the server answers what it can and closes
                pass
    assert receiver.stats.rejected[400] == 1 and receiver.stats.accepted == 0
    assert _call(receiver, ExportTraceServiceRequest()) == b""


def test_in_flight_bound_is_resource_exhausted_with_retry_info_for_both_transports(
        broker, pipeline, tmp_path):
    """Two real exports held in flight (the test holds the lock decoding takes, so they
    stay admitted for as long as it likes), then a third over gRPC and one over HTTP
    while they are held: both refused, and the held two complete once let go."""
    receiver = _receiver(tmp_path, broker.bootstrap, max_inflight=2)
    try:
        with _channel(receiver) as channel:
            export = channel.unary_unary(EXPORT_METHOD)
            with receiver.core._cpu:
                held = [export.future(_spans(f"held-{n}").SerializeToString(), timeout=120)
                        for n in range(2)]
                wait_for(lambda: receiver.inflight == 2, 60, what="two exports in flight")
                try:
                    export(ExportTraceServiceRequest().SerializeToString(), timeout=60)
                except grpc.RpcError as busy:
                    assert (busy.code(), busy.details()) == (
                        grpc.StatusCode.RESOURCE_EXHAUSTED, "busy: 2 requests in flight")
                    info = RetryInfo.FromString(
                        dict(busy.trailing_metadata())[RETRY_INFO_KEY])
                    assert info.retry_delay.seconds == 2
                else:
                    raise AssertionError("a third export was admitted")
                request = urllib.request.Request(
                    f"{receiver.url}/v1/traces", method="POST",
                    data=ExportTraceServiceRequest().SerializeToString(),
                    headers={"Content-Type": "application/x-protobuf"})
                with pytest.raises(urllib.error.HTTPError) as http_busy:
                    urllib.request.urlopen(request, timeout=60)
                assert http_busy.value.code == 429
                assert not any(future.done() for future in held)
            assert [future.result() for future in held] == [b"", b""]
    finally:
        receiver.stop()
    assert receiver.stats.rejected[429] == 2
    assert (receiver.stats.accepted, receiver.stats.events) == (2, 10)


def test_open_calls_beyond_max_receiving_are_refused_by_grpc_not_queued(
        broker, pipeline, tmp_path):
    """Two calls held open (admitted, waiting on the decode lock the test holds), with
    MAX_RECEIVING 2 and MAX_INFLIGHT 4: a third, on its own connection, is refused by
    grpc before its message is read, rather than waiting for a thread."""
    receiver = _receiver(tmp_path, broker.bootstrap, max_receiving=2, max_inflight=4)
    try:
        # its own connection: channels to one target share one by default, where
        # HTTP/2's stream limit (also MAX_RECEIVING) keeps a third call in the client
        other = grpc.insecure_channel(str(receiver.grpc_address),
                                      options=[("grpc.use_local_subchannel_pool", 1)])
        with _channel(receiver) as channel, other:
            with receiver.core._cpu:
                held = [channel.unary_unary(EXPORT_METHOD).future(
                    _spans(f"open-{n}").SerializeToString(), timeout=120) for n in range(2)]
                wait_for(lambda: receiver.inflight == 2, 60, what="two calls open")
                with pytest.raises(grpc.RpcError) as refused:
                    other.unary_unary(EXPORT_METHOD)(b"", timeout=60)
                assert not any(future.done() for future in held)
            assert [future.result() for future in held] == [b"", b""]
    finally:
        receiver.stop()
    assert (refused.value.code(), refused.value.details()) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!")
    assert receiver.stats.accepted == 2


def test_unreachable_broker_is_unavailable_with_retry_info(tmp_path):
    receiver = _receiver(tmp_path, f"127.0.0.1:{free_port()}", publish_timeout_s=2)
    try:
        error = _call(receiver, _spans("nobroker"))
    finally:
        receiver.stop()
    assert isinstance(error, grpc.RpcError)
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details().startswith("broker did not acknowledge")
    info = RetryInfo.FromString(dict(error.trailing_metadata())[RETRY_INFO_KEY])
    assert info.retry_delay.seconds == 2
    assert (receiver.stats.rejected[503], receiver.stats.accepted) == (1, 0)


def test_a_taken_grpc_port_is_reported_not_shared(broker, pipeline, tmp_path):
    first = _receiver(tmp_path / "a", broker.bootstrap)
    second = OtlpReceiver(_settings(tmp_path / "b"), broker.bootstrap, "127.0.0.1",
                          free_port(), limits=OtlpSettings())
    try:
        port = int(str(first.grpc_address).rsplit(":", 1)[1])
        assert second.serve_grpc(port) is None and second.grpc_address is None
    finally:
        second.stop()
        first.stop()


def test_grpc_port_setting(monkeypatch):
    monkeypatch.setenv("LOOPWATCH_OTLP_GRPC_PORT", "off")
    assert OtlpSettings().grpc_port is None
    monkeypatch.setenv("LOOPWATCH_OTLP_GRPC_PORT", "0")
    assert OtlpSettings().grpc_port == 0
    monkeypatch.delenv("LOOPWATCH_OTLP_GRPC_PORT")
    assert OtlpSettings().grpc_port == 4317
    monkeypatch.setenv("LOOPWATCH_OTLP_GRPC_PORT", "70000")
    with pytest.raises(ValueError, match="less than or equal to 65535"):
        OtlpSettings()


SERVE = [sys.executable, "-m", "loopwatch.cli", "ingest", "serve"]


def _serve(broker: Any, tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "LOOPWATCH_KAFKA_BOOTSTRAP": broker.bootstrap,
           "LOOPWATCH_DATA_DIR": str(tmp_path), "COLUMNS": "200"}
    return subprocess.Popen([*SERVE, "--port", "0", *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _lines_until(process: subprocess.Popen[str], marker: str) -> list[str]:
    assert process.stdout is not None
    lines = []
    for line in process.stdout:
        lines.append(line.rstrip())
        if marker in line:
            return lines
    raise AssertionError(f"{marker!r} never printed: {lines}")


def test_ingest_serve_runs_grpc_beside_http_and_can_turn_it_off(broker, pipeline, reader,
                                                                  tmp_path, agent):
    serving = _serve(broker, tmp_path / "on", "--grpc-port", "0")
    try:
        lines = _lines_until(serving, "OTLP/gRPC receiver:")
        address = lines[-1].split("OTLP/gRPC receiver: ", 1)[1].strip()
        exporter = GrpcSpanExporter(endpoint=address, insecure=True)
        _export_run(agent, exporter, 0xD4, time.time_ns())
        _wait_closed(reader, agent)
    finally:
        serving.send_signal(signal.SIGINT)
        assert serving.wait(60) == 0
    assert _stored(reader, agent) == 5
    off = _serve(broker, tmp_path / "off", "--grpc-port", "off")
    try:
        lines = _lines_until(off, "OTLP/HTTP receiver:")
    finally:
        off.send_signal(signal.SIGINT)
        rest, _ = off.communicate(timeout=60)
    assert "gRPC" not in "\n".join(lines) + rest and off.returncode == 0
    refused = subprocess.run([*SERVE, "--grpc-port", "nope"], capture_output=True,
                             text=True, timeout=60,
                             env={**os.environ, "LOOPWATCH_DATA_DIR": str(tmp_path / "x")})
    assert refused.returncode == 2
    assert "invalid OTLP setting" in refused.stdout + refused.stderr
