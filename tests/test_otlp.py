"""The OTLP receiver: span mapping with exact events per convention, the HTTP receiver
against the real broker and pipeline, and clients nobody here wrote (the OpenTelemetry
SDK's OTLP/HTTP exporter, and the openai instrumentation around the real openai client
talking to a tiny local OpenAI-compatible server) end to end into ClickHouse."""

from __future__ import annotations

import base64
import gzip
import json
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from email.message import Message  # headers by any case: uvicorn sends lower case
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import orjson
import pytest
from google.protobuf import json_format
from google.rpc import status_pb2
from kafka import KafkaConsumer, TopicPartition
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource as PbResource
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode

from loopwatch.core.config import Settings
from loopwatch.core.embedded.broker import free_port
from loopwatch.ingest.capture import Blob, PartRef, assemble_part, part_hash
from loopwatch.ingest.events import canonical_args_hash
from loopwatch.ingest.otlp.decode import PayloadError, Span, SpanEvent, decode_json, decode_protobuf
from loopwatch.ingest.otlp.mapping import map_spans
from loopwatch.ingest.otlp.server import OtlpReceiver
from loopwatch.ingest.otlp.settings import OtlpSettings
from loopwatch.ingest.sdk import Emitter
from loopwatch.ingest.wire import decode_message
from tests.conftest import PIPELINE_ENV, wait_for

TRACE = "0af7651916cd43dd8448eb211c80319c"
AGENT_SPAN, CHAT_SPAN, TOOL_SPAN, CHAT2_SPAN = ("a" * 16, "b" * 16, "c" * 16, "d" * 16)
T0 = 1_767_225_600_000_000_000  # 2026-01-01T00:00:00Z in ns
RESOURCE = {"service.name": "svc", "service.instance.id": "worker-7"}


def span(name: str, span_id: str, parent: str, attributes: dict[str, Any], start_ms: int,
         end_ms: int, *, status: int = 0, trace: str = TRACE,
         resource: dict[str, Any] | None = None, events: list[SpanEvent] | None = None
         ) -> Span:
    return Span(trace, span_id, parent, name, T0 + start_ms * 1_000_000,
                T0 + end_ms * 1_000_000, attributes,
                RESOURCE if resource is None else resource, "test", status, "", 0,
                events or [])


def eid(span_id: str, kind: str, trace: str = TRACE) -> str:
    return str(uuid.uuid5(uuid.UUID("6f0a6f1e-3c55-4c1b-9d7e-0c7a1d6b2f10"),
                          f"{trace}:{span_id}:{kind}"))


def dump(events: list[Any]) -> list[dict[str, Any]]:
    return [e.model_dump(mode="json", exclude_none=True) for e in events]


def base(span_id: str, kind: str, ts: str, parent: str | None, **extra: Any) -> dict[str, Any]:
    fields = {"event_id": eid(span_id, kind), "schema_version": "1.0", "ts": ts,
              "run_id": TRACE, "trace_id": TRACE, "span_id": span_id, "agent": "support",
              "agent_version": "", "task_type": "", "model": "", "prompt_version": "",
              "deployment": "", "traffic_slice": "prod", "worker_id": "worker-7",
              "event_type": kind}
    if parent is not None:
        fields["parent_span_id"] = parent
    return {**fields, **extra}


# -- mapping: one test per convention, with every field of every event --------------


def test_gen_ai_spans_map_to_a_run_with_exact_events():
    spans = [
        span("chat claude-sonnet-4", CHAT_SPAN, AGENT_SPAN, {
            "gen_ai.operation.name": "chat", "gen_ai.provider.name": "anthropic",
            "gen_ai.request.model": "claude-sonnet-4",
            "gen_ai.response.model": "claude-sonnet-4-20250514",
            "gen_ai.usage.input_tokens": 6400, "gen_ai.usage.output_tokens": 120,
            "gen_ai.usage.cache_read.input_tokens": 6000,
            "gen_ai.usage.cache_creation.input_tokens": 200,
            "gen_ai.response.finish_reasons": ["tool_use"],
            "gen_ai.response.time_to_first_chunk": 0.25,
        }, 100, 1100),
        span("execute_tool lookup_order", TOOL_SPAN, AGENT_SPAN, {
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "lookup_order",
            "gen_ai.tool.call.id": "call_1", "gen_ai.tool.call.arguments": '{"id": 7}',
        }, 1200, 1235),
        span("invoke_agent support", AGENT_SPAN, "", {
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "support",
            "gen_ai.agent.id": "asst_1", "gen_ai.agent.version": "3",
            "gen_ai.conversation.id": "conv-9", "gen_ai.request.model": "claude-sonnet-4",
            "gen_ai.usage.input_tokens": 99999, "loopwatch.task_type": "refund",
        }, 0, 2000),
    ]
    batch = map_spans(spans)
    context = {"agent_version": "3", "task_type": "refund", "agent_id": "asst_1",
               "conversation_id": "conv-9", "otel_convention": "gen_ai",
               "otel_agent_rank": 3, "otel_agent_named_at": 0}  # the root named it
    assert dump(batch.events) == [
        base(AGENT_SPAN, "run.start", "2026-01-01T00:00:00Z", None, **context,
             model="claude-sonnet-4"),
        base(CHAT_SPAN, "llm.call", "2026-01-01T00:00:01.100000Z", AGENT_SPAN, **context,
             model="claude-sonnet-4", provider="anthropic",
             response_model="claude-sonnet-4-20250514", purpose="agent", input_tokens=6400,
             output_tokens=120, cache_read_input_tokens=6000, cache_creation_input_tokens=200,
             cache_ttl="5m", token_convention="otel", latency_ms=1000.0, ttft_ms=250.0,
             attempt=1, stop_reason="tool_use", otel_operation="chat"),
        base(TOOL_SPAN, "tool.call", "2026-01-01T00:00:01.235000Z", AGENT_SPAN, **context,
             tool="lookup_order", args_hash=canonical_args_hash("lookup_order", {"id": 7}),
             latency_ms=35.0, timed_out=False, attempt=1, tool_call_id="call_1"),
        base(AGENT_SPAN, "run.end", "2026-01-01T00:00:02Z", None, **context,
             model="claude-sonnet-4", terminal_reason="model_done"),
    ]
    assert batch.conventions == {"gen_ai": 3}
    assert batch.unmapped == [] and batch.ignored == 0


def test_deprecated_gen_ai_names_and_exclusive_cache_counts():
    spans = [
        span("invoke_agent", AGENT_SPAN, "", {
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "support",
            "gen_ai.system": "anthropic"}, 0, 500),
        # no gen_ai.operation.name (older instrumentations): the span name says chat
        span("chat claude-3-5-haiku", CHAT_SPAN, AGENT_SPAN, {
            "gen_ai.system": "anthropic", "gen_ai.request.model": "claude-3-5-haiku",
            "gen_ai.usage.prompt_tokens": 400, "gen_ai.usage.completion_tokens": 50,
            "gen_ai.usage.cache_read_input_tokens": 6000,
            "gen_ai.usage.cache_creation_input_tokens": 0}, 10, 310),
    ]
    batch = map_spans(spans)
    call = dump(batch.events)[1]
    assert call == base(
        CHAT_SPAN, "llm.call", "2026-01-01T00:00:00.310000Z", AGENT_SPAN,
        otel_convention="gen_ai_deprecated", otel_agent_rank=3, otel_agent_named_at=0,
        model="claude-3-5-haiku", provider="anthropic",
        response_model="", purpose="agent", input_tokens=6400, output_tokens=50,
        cache_read_input_tokens=6000, cache_creation_input_tokens=0, cache_ttl="5m",
        token_convention="exclusive", latency_ms=300.0, attempt=1, otel_operation="chat")
    assert [e["event_type"] for e in dump(batch.events)] == ["run.start", "llm.call", "run.end"]
    assert batch.conventions == {"gen_ai_deprecated": 2}


def test_openinference_spans_map_like_gen_ai():
    oi_resource = {"service.name": "svc", "service.instance.id": "worker-7"}
    spans = [
        span("support", AGENT_SPAN, "", {"openinference.span.kind": "AGENT",
                                          "session.id": "s-1"}, 0, 3000,
             resource=oi_resource),
        span("ChatOpenAI", CHAT_SPAN, AGENT_SPAN, {
            "openinference.span.kind": "LLM", "llm.model_name": "gpt-4o",
            "llm.provider": "openai", "llm.token_count.prompt": 1200,
            "llm.token_count.completion": 80, "llm.token_count.total": 1280,
            "llm.token_count.prompt_details.cache_read": 1000,
            "llm.token_count.prompt_details.cache_write": 0, "llm.cost.total": 0.004},
             500, 1500, resource=oi_resource),
        span("search", TOOL_SPAN, AGENT_SPAN, {
            "openinference.span.kind": "TOOL", "tool.name": "search",
            "input.value": '{"q": "refund"}', "output.value": "3 results"}, 1600, 1700,
             status=2, resource=oi_resource,
             events=[SpanEvent("exception", T0, {"exception.type": "TimeoutError"})]),
        span("RunnableSequence", "e" * 16, AGENT_SPAN, {
            "openinference.span.kind": "CHAIN", "llm.token_count.prompt": 1200},
             400, 1550, resource=oi_resource),
    ]
    batch = map_spans(spans)
    # The agent span's name ("support") is no agent name: the service's is (issue 26).
    context = {"agent": "svc", "conversation_id": "s-1", "otel_convention": "openinference",
               "otel_agent_rank": 1, "otel_agent_named_at": 0}  # the root's service
    assert dump(batch.events) == [
        base(AGENT_SPAN, "run.start", "2026-01-01T00:00:00Z", None, **context),
        base(CHAT_SPAN, "llm.call", "2026-01-01T00:00:01.500000Z", AGENT_SPAN, **context,
             model="gpt-4o", provider="openai", response_model="", purpose="agent",
             input_tokens=1200, output_tokens=80, cache_read_input_tokens=1000,
             cache_creation_input_tokens=0, cache_ttl="5m", token_convention="otel",
             cost_usd=0.004, latency_ms=1000.0, attempt=1, otel_operation="LLM"),
        base(TOOL_SPAN, "tool.call", "2026-01-01T00:00:01.700000Z", AGENT_SPAN, **context,
             tool="search", args_hash=canonical_args_hash("search", {"q": "refund"}),
             latency_ms=100.0, timed_out=False, error_type="TimeoutError", result_size_bytes=9,
             attempt=1),
        base(AGENT_SPAN, "run.end", "2026-01-01T00:00:03Z", None, **context,
             terminal_reason="model_done"),
    ]
    assert batch.conventions == {"openinference": 4}


def test_wrapper_spans_never_count_tokens_again():
    """Agent, workflow and chain spans carry totals; a model-call span wrapping another
    (two instrumentations of one call) yields to the inner one: each token counts once."""
    usage = {"gen_ai.usage.input_tokens": 500, "gen_ai.usage.output_tokens": 50}
    spans = [
        span("invoke_workflow triage", "f" * 16, "", {
            "gen_ai.operation.name": "invoke_workflow", **usage}, 0, 900),
        span("invoke_agent support", AGENT_SPAN, "f" * 16, {
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "support",
            **usage}, 10, 890),
        span("invoke_agent helper", "9" * 16, AGENT_SPAN, {
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "helper",
            **usage}, 20, 500),
        span("LangChain LLM", CHAT_SPAN, "9" * 16, {
            "openinference.span.kind": "LLM", "llm.token_count.prompt": 300,
            "llm.token_count.completion": 30}, 30, 400),
        span("chat gpt-4o", CHAT2_SPAN, CHAT_SPAN, {
            "gen_ai.operation.name": "chat", "gen_ai.request.model": "gpt-4o",
            "gen_ai.usage.input_tokens": 300, "gen_ai.usage.output_tokens": 30}, 40, 390),
        span("chat gpt-4o", "1" * 16, AGENT_SPAN, {
            "gen_ai.operation.name": "chat", "gen_ai.request.model": "gpt-4o",
            "gen_ai.usage.input_tokens": 200, "gen_ai.usage.output_tokens": 20}, 510, 880),
    ]
    events = map_spans(spans).events
    calls = [e for e in events if e.event_type == "llm.call"]
    assert [(c.span_id, c.input_tokens, c.output_tokens, c.agent) for c in calls] == [
        (CHAT2_SPAN, 300, 30, "support"), ("1" * 16, 200, 20, "support")]
    assert [(e.event_type, e.span_id) for e in events if e.event_type.startswith("run")] == [
        ("run.start", AGENT_SPAN), ("run.end", AGENT_SPAN)]  # the nested agent is no run


def test_a_trace_without_agent_span_is_a_run_from_its_root():
    spans = [span("POST /answer", AGENT_SPAN, "", {"http.route": "/answer"}, 0, 700,
                  status=2),
             span("chat gpt-4o", CHAT_SPAN, AGENT_SPAN, {
                 "gen_ai.operation.name": "chat", "gen_ai.usage.input_tokens": 10}, 5, 600),
             span("GET /health", "1" * 16, "", {}, 0, 1, trace="1" * 32)]
    batch = map_spans(spans)
    assert [(e.event_type, e.agent) for e in batch.events] == [
        ("run.start", "svc"), ("llm.call", "svc"), ("run.end", "svc")]
    end = batch.events[-1]
    assert (end.terminal_reason, end.error_type) == ("crash", "_OTHER")  # type: ignore[attr-defined]
    assert batch.ignored == 1


def test_a_partly_unmappable_batch_maps_the_rest_and_dead_letters_each_with_its_reason():
    elsewhere = "e" * 16  # a parent exported in another batch
    spans = [
        span("chat gpt-4o", CHAT_SPAN, "", {"gen_ai.operation.name": "chat",
                                             "gen_ai.usage.input_tokens": 10}, 0, 5),
        span("execute_tool", TOOL_SPAN, elsewhere, {"gen_ai.operation.name": "execute_tool"},
             1, 2),
        span("chat gpt-4o", CHAT2_SPAN, elsewhere, {"gen_ai.operation.name": "chat",
                                                     "gen_ai.usage.output_tokens": "lots"}, 1, 2),
        span("chat gpt-4o", "1" * 16, "", {"gen_ai.operation.name": "chat"}, 0, 5,
             trace="xyz"),
        span("chat gpt-4o", "2" * 16, elsewhere, {"gen_ai.operation.name": "chat",
                                                   "gen_ai.usage.input_tokens": -3}, 1, 2),
    ]
    batch = map_spans(spans)
    assert [(e.event_type, e.span_id) for e in batch.events] == [
        ("run.start", CHAT_SPAN), ("llm.call", CHAT_SPAN), ("run.end", CHAT_SPAN)]
    assert [u.reason for u in batch.unmapped] == [
        "tool span without a tool name (gen_ai.tool.name / tool.name)",
        "gen_ai.usage.output_tokens is not a non-negative integer: 'lots'",
        "invalid trace id 'xyz'",
        "gen_ai.usage.input_tokens is not a non-negative integer: -3",
    ]
    # the processors dead-letter these messages themselves, keeping our reason
    letter = decode_message(batch.unmapped[0].to_message(), 100_000).dead[0]
    assert "tool span without a tool name" in letter.reason
    assert letter.run_id == TRACE
    assert orjson.loads(letter.payload)["otlp_span"]["spanId"] == TOOL_SPAN


# -- decoding: protobuf and OTLP/JSON to the same spans --------------------------------


def _pb_request() -> bytes:
    def kv(key: str, value: AnyValue) -> KeyValue:
        return KeyValue(key=key, value=value)

    pb_span = trace_pb2.Span(
        trace_id=bytes.fromhex(TRACE), span_id=bytes.fromhex(CHAT_SPAN),
        parent_span_id=bytes.fromhex(AGENT_SPAN), name="chat gpt-4o",
        start_time_unix_nano=T0, end_time_unix_nano=T0 + 5_000_000,
        attributes=[kv("gen_ai.operation.name", AnyValue(string_value="chat")),
                    kv("gen_ai.usage.input_tokens", AnyValue(int_value=12)),
                    kv("temperature", AnyValue(double_value=0.5)),
                    kv("stream", AnyValue(bool_value=False)),
                    kv("gen_ai.response.finish_reasons", AnyValue(array_value=ArrayValue(
                        values=[AnyValue(string_value="stop")])))],
        status=trace_pb2.Status(code=trace_pb2.Status.STATUS_CODE_ERROR, message="boom"),
        events=[trace_pb2.Span.Event(time_unix_nano=T0, name="exception", attributes=[
            kv("exception.type", AnyValue(string_value="ValueError"))])],
    )
    request = ExportTraceServiceRequest(resource_spans=[trace_pb2.ResourceSpans(
        resource=PbResource(attributes=[kv("service.name", AnyValue(string_value="svc"))]),
        scope_spans=[trace_pb2.ScopeSpans(spans=[pb_span])])])
    return request.SerializeToString()


OTLP_JSON = {"resourceSpans": [{
    "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "svc"}}]},
    "scopeSpans": [{"scope": {"name": ""}, "spans": [{
        "traceId": TRACE, "spanId": CHAT_SPAN, "parentSpanId": AGENT_SPAN,
        "name": "chat gpt-4o", "kind": 0,
        "startTimeUnixNano": str(T0), "endTimeUnixNano": str(T0 + 5_000_000),
        "attributes": [
            {"key": "gen_ai.operation.name", "value": {"stringValue": "chat"}},
            {"key": "gen_ai.usage.input_tokens", "value": {"intValue": "12"}},
            {"key": "temperature", "value": {"doubleValue": 0.5}},
            {"key": "stream", "value": {"boolValue": False}},
            {"key": "gen_ai.response.finish_reasons",
             "value": {"arrayValue": {"values": [{"stringValue": "stop"}]}}}],
        "status": {"code": 2, "message": "boom"},
        "events": [{"timeUnixNano": str(T0), "name": "exception", "attributes": [
            {"key": "exception.type", "value": {"stringValue": "ValueError"}}]}],
    }]}]}]}


def test_protobuf_and_json_decode_to_the_same_span():
    from_pb = decode_protobuf(_pb_request())
    from_json = decode_json(orjson.dumps(OTLP_JSON))
    assert from_pb.spans == from_json.spans and from_json.bad == []
    assert from_pb.spans[0] == Span(
        TRACE, CHAT_SPAN, AGENT_SPAN, "chat gpt-4o", T0, T0 + 5_000_000,
        {"gen_ai.operation.name": "chat", "gen_ai.usage.input_tokens": 12,
         "temperature": 0.5, "stream": False, "gen_ai.response.finish_reasons": ["stop"]},
        {"service.name": "svc"}, "", 2, "boom", 0,
        [SpanEvent("exception", T0, {"exception.type": "ValueError"})])


def test_json_spans_that_cannot_be_read_are_kept_apart_and_bodies_that_cannot_raise():
    document = json.loads(json.dumps(OTLP_JSON))
    spans = document["resourceSpans"][0]["scopeSpans"][0]["spans"]
    spans.append({**spans[0], "spanId": "not-an-id"})
    decoded = decode_json(orjson.dumps(document))
    assert len(decoded.spans) == 1
    assert decoded.bad[0].reason == ("resourceSpans[0].scopeSpans[0].spans[1]: spanId "
                                     "'not-an-id' is neither 16 hex digits nor base64 of 8 "
                                     "bytes")
    with pytest.raises(PayloadError, match="malformed JSON"):
        decode_json(b"{nope")
    with pytest.raises(PayloadError, match="resourceSpans is not a list"):
        decode_json(b'{"resourceSpans": 3}')
    with pytest.raises(PayloadError, match="malformed protobuf"):
        decode_protobuf(b"\xff\xff\xff")


# -- the receiver against the real broker and pipeline ---------------------------------


def _settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path, max_message_bytes=int(
        PIPELINE_ENV["LOOPWATCH_MAX_MESSAGE_BYTES"]))


@pytest.fixture()
def receiver(broker, pipeline, tmp_path) -> Iterator[OtlpReceiver]:
    running = OtlpReceiver(_settings(tmp_path), broker.bootstrap, "127.0.0.1", free_port(),
                           limits=OtlpSettings(max_body_bytes=64 * 1024))
    running.start()
    yield running
    running.stop()


def post(url: str, body: bytes, content_type: str = "application/x-protobuf",
         headers: dict[str, str] | None = None) -> tuple[int, Message, bytes]:
    request = urllib.request.Request(f"{url}/v1/traces", data=body, method="POST",
                                     headers={"Content-Type": content_type, **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()


def _agent_spans(agent: str, exporter: Any) -> TracerProvider:
    """A tracer provider whose spans go to ``exporter``: one agent run, two chats (one
    with cache reads), a tool call; the agent span's own usage totals must not count."""
    provider = TracerProvider(resource=Resource.create({"service.name": agent}))
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=60_000))
    tracer = provider.get_tracer("agent-under-test")
    with tracer.start_as_current_span("invoke_agent " + agent, attributes={
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": agent,
            "gen_ai.request.model": "gpt-4o", "gen_ai.usage.input_tokens": 123456}):
        with tracer.start_as_current_span("chat gpt-4o", attributes={
                "gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai",
                "gen_ai.request.model": "gpt-4o", "gen_ai.usage.input_tokens": 1200,
                "gen_ai.usage.output_tokens": 80,
                "gen_ai.usage.cache_read.input_tokens": 1000}):
            pass
        with tracer.start_as_current_span("execute_tool lookup", attributes={
                "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "lookup",
                "gen_ai.tool.call.arguments": '{"id": 7}'}):
            pass
        with tracer.start_as_current_span("chat gpt-4o", attributes={
                "gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai",
                "gen_ai.request.model": "gpt-4o", "gen_ai.usage.input_tokens": 300,
                "gen_ai.usage.output_tokens": 20}):
            pass
    return provider


RUN_SQL = ("SELECT outcome, llm_calls, tool_calls, input_tokens, output_tokens, "
           "cache_read_input_tokens FROM runs FINAL WHERE agent = {a:String}")
CLOSED_SQL = "SELECT count() FROM runs FINAL WHERE agent = {a:String} AND status = 'closed'"


def _wait_closed(reader: Any, agent: str, runs: int = 1) -> None:
    wait_for(lambda: reader.query(CLOSED_SQL, {"a": agent}).scalar() >= runs, 90,
             what=f"{runs} closed runs of {agent}")


def test_otel_sdk_protobuf_exporter_end_to_end_with_exact_tokens(receiver, reader, agent):
    exporter = OTLPSpanExporter(endpoint=f"{receiver.url}/v1/traces")
    provider = _agent_spans(agent, exporter)
    assert provider.force_flush(30_000)
    provider.shutdown()
    _wait_closed(reader, agent)
    assert reader.query(RUN_SQL, {"a": agent}).rows == [["success", 2, 1, 1500, 100, 1000]]
    calls = reader.query("SELECT model, provider, input_tokens, output_tokens, "
                         "cache_read_input_tokens, uncached_input_tokens FROM llm_calls FINAL "
                         "WHERE agent = {a:String} ORDER BY input_tokens", {"a": agent}).rows
    assert calls == [["gpt-4o", "openai", 300, 20, 0, 300],
                     ["gpt-4o", "openai", 1200, 80, 1000, 200]]
    conventions = reader.query(
        "SELECT DISTINCT extras['otel_convention'] FROM events WHERE agent = {a:String}",
        {"a": agent}).rows
    assert conventions == [['"gen_ai"']]
    assert receiver.stats.conventions["gen_ai"] == 4


def _otlp_json(spans: list[Any]) -> bytes:
    """OTLP/JSON from the SDK's own encoder via protobuf's JSON mapping, with the ids
    turned to hex as the OTLP/JSON spec requires."""
    document = json_format.MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    for resource_spans in document["resourceSpans"]:
        for scope_spans in resource_spans["scopeSpans"]:
            for item in scope_spans["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in item:
                        item[key] = base64.b64decode(item[key]).hex()
    return orjson.dumps(document)


def test_otlp_json_gzipped_end_to_end_with_exact_tokens(receiver, reader, agent):
    memory = InMemorySpanExporter()
    _agent_spans(agent, memory).force_flush()
    body = gzip.compress(_otlp_json(list(memory.get_finished_spans())))
    status, headers, answer = post(receiver.url, body, "application/json",
                                   {"Content-Encoding": "gzip"})
    assert (status, headers["Content-Type"], answer) == (200, "application/json", b"{}")
    _wait_closed(reader, agent)
    assert reader.query(RUN_SQL, {"a": agent}).rows == [["success", 2, 1, 1500, 100, 1000]]


def test_200_only_after_the_broker_acknowledged(receiver, broker, agent):
    memory = InMemorySpanExporter()
    _agent_spans(agent, memory).force_flush()
    body = encode_spans(list(memory.get_finished_spans())).SerializeToString()
    consumer = KafkaConsumer(bootstrap_servers=broker.bootstrap)
    partitions = [TopicPartition("loopwatch.events", p) for p in range(4)]
    try:
        before = sum(consumer.end_offsets(partitions).values())
        status, _, answer = post(receiver.url, body)
        after = sum(consumer.end_offsets(partitions).values())  # no waiting in between
    finally:
        consumer.close()
    assert (status, answer) == (200, b"")
    assert after > before


def test_partial_batch_answers_partial_success_and_dead_letters_the_rest(
        receiver, reader, agent):
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": agent}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("chat m", attributes={
            "gen_ai.operation.name": "chat", "gen_ai.usage.input_tokens": 7}), \
            tracer.start_as_current_span("execute_tool", attributes={
                "gen_ai.operation.name": "execute_tool"}):
        pass
    body = encode_spans(list(memory.get_finished_spans())).SerializeToString()
    status, _, answer = post(receiver.url, body)
    assert status == 200
    response = ExportTraceServiceResponse.FromString(answer)
    assert response.partial_success.rejected_spans == 1
    assert "tool span without a tool name" in response.partial_success.error_message
    trace_id = memory.get_finished_spans()[0].context.trace_id.to_bytes(16, "big").hex()
    _wait_closed(reader, agent)
    assert reader.query("SELECT input_tokens FROM runs FINAL WHERE agent = {a:String}",
                        {"a": agent}).rows == [[7]]
    reasons = wait_for(lambda: reader.query(
        "SELECT reason FROM dead_letters FINAL WHERE run_id = {r:String}",
        {"r": trace_id}).rows, 60, what="the dead letter")
    assert len(reasons) == 1
    assert "unmapped OTLP span: tool span without a tool name" in reasons[0][0]


def test_bad_payloads_get_400_with_the_reason(receiver):
    status, _, answer = post(receiver.url, b"\xff\xff\xff")
    rpc = status_pb2.Status.FromString(answer)  # OTLP/HTTP: a google.rpc.Status body
    assert (status, rpc.code) == (400, 3)
    assert rpc.message.startswith("malformed protobuf ExportTraceServiceRequest")
    status, headers, answer = post(receiver.url, b"[1, 2", "application/json")
    assert (status, headers["Content-Type"]) == (400, "application/json")
    assert orjson.loads(answer)["message"].startswith("malformed JSON")
    status, _, answer = post(receiver.url, b"\x1f\x8b not gzip", "application/json",
                             {"Content-Encoding": "gzip"})
    assert status == 400 and b"malformed gzip body" in answer
    status, _, answer = post(receiver.url, b"{}", "text/plain")
    assert status == 415


def test_bodies_over_the_limit_get_413_before_and_after_decompression(receiver):
    status, _, answer = post(receiver.url, b"0" * (64 * 1024 + 1), "application/json")
    assert status == 413 and b"over the 65536-byte limit" in orjson.loads(answer)[
        "message"].encode()
    bomb = gzip.compress(b" " * (10 * 1024 * 1024))
    status, _, answer = post(receiver.url, bomb, "application/json",
                             {"Content-Encoding": "gzip"})
    assert status == 413 and "after decompression" in orjson.loads(answer)["message"]


def test_bearer_token_auth(broker, pipeline, tmp_path):
    receiver = OtlpReceiver(_settings(tmp_path), broker.bootstrap, "127.0.0.1", free_port(),
                            token="s3cret", limits=OtlpSettings())
    receiver.start()
    try:
        body = ExportTraceServiceRequest().SerializeToString()
        status, headers, _ = post(receiver.url, body)
        assert (status, headers["WWW-Authenticate"]) == (401, 'Bearer realm="loopwatch"')
        assert post(receiver.url, body, headers={"Authorization": "Bearer nope"})[0] == 401
        assert post(receiver.url, body, headers={"Authorization": "Bearer s3cret"})[0] == 200
    finally:
        receiver.stop()


def test_busy_receiver_answers_429_with_retry_after(receiver):
    for _ in range(receiver.limits.max_inflight):
        receiver._admission.acquire()
    try:
        status, headers, _ = post(receiver.url, ExportTraceServiceRequest().SerializeToString())
    finally:
        for _ in range(receiver.limits.max_inflight):
            receiver._admission.release()
    assert (status, headers["Retry-After"]) == (429, "2")
    assert post(receiver.url, ExportTraceServiceRequest().SerializeToString())[0] == 200


def test_unreachable_broker_answers_503_with_retry_after(tmp_path):
    receiver = OtlpReceiver(_settings(tmp_path), f"127.0.0.1:{free_port()}", "127.0.0.1",
                            free_port(), limits=OtlpSettings(publish_timeout_s=2))
    receiver.start()
    try:
        status, headers, answer = post(receiver.url, _pb_request())
    finally:
        receiver.stop()
    assert (status, headers["Retry-After"]) == (503, "2")
    assert b"broker did not acknowledge" in answer


# -- the openai instrumentation around the real openai client -------------------------


class _FakeOpenAI(BaseHTTPRequestHandler):
    """An OpenAI-compatible /chat/completions with fixed usage per model."""

    usage: ClassVar[dict[str, tuple[int, int, int]]] = {
        "gpt-4o-mini": (900, 40, 512), "gpt-4o": (2100, 130, 0)}

    def log_message(self, format: str, *args: Any) -> None:
        return

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt, completion, cached = self.usage[body["model"]]
        answer = json.dumps({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 1767225600,
            "model": body["model"] + "-2024-08-06",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {
                "role": "assistant", "content": "done"}}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion,
                      "prompt_tokens_details": {"cached_tokens": cached}},
        }).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)


@pytest.fixture()
def fake_openai() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02},
                     daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_openai_instrumentation_end_to_end_with_exact_tokens(receiver, reader, agent,
                                                             fake_openai):
    """opentelemetry-instrumentation-openai-v2 wraps the real openai client; the app
    adds only its agent span. (This version records no cached tokens for chat.)"""
    from openai import OpenAI
    from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor

    provider = TracerProvider(resource=Resource.create({"service.name": agent}))
    provider.add_span_processor(BatchSpanProcessor(
        OTLPSpanExporter(endpoint=f"{receiver.url}/v1/traces"), schedule_delay_millis=60_000))
    instrumentor = OpenAIInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    try:
        client = OpenAI(base_url=fake_openai, api_key="test-key", max_retries=0)
        tracer = provider.get_tracer("my-agent")
        with tracer.start_as_current_span(f"invoke_agent {agent}", attributes={
                "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": agent}) as run:
            for model in ("gpt-4o-mini", "gpt-4o"):
                client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "refund order 7"}])
            run.set_status(Status(StatusCode.OK))
        assert provider.force_flush(30_000)
    finally:
        instrumentor.uninstrument()
        provider.shutdown()
    _wait_closed(reader, agent)
    assert reader.query(RUN_SQL, {"a": agent}).rows == [["success", 2, 0, 3000, 170, 0]]
    assert reader.query(
        "SELECT model, response_model, input_tokens, output_tokens, stop_reason "
        "FROM llm_calls FINAL WHERE agent = {a:String} ORDER BY input_tokens",
        {"a": agent}).rows == [
        ["gpt-4o-mini", "gpt-4o-mini-2024-08-06", 900, 40, "stop"],
        ["gpt-4o", "gpt-4o-2024-08-06", 2100, 130, "stop"]]
    assert receiver.stats.conventions == {"gen_ai": 3}


# -- content capture (docs/capture.md) -------------------------------------------------

CONTENT_SPANS = ("e" * 16, "f" * 16, "1" * 16)


def _content_spans() -> list[Span]:
    """One model span per way GenAI content is recorded, and a tool span with content."""
    current, older, indexed = CHAT_SPAN, CHAT2_SPAN, CONTENT_SPANS[0]
    chat = {"gen_ai.operation.name": "chat", "gen_ai.request.model": "gpt-4o"}
    return [
        span("chat gpt-4o", current, AGENT_SPAN, {
            **chat,
            "gen_ai.system_instructions": '[{"type": "text", "content": "Be brief."}]',
            "gen_ai.input.messages": '[{"role": "user", "parts": [{"type": "text", '
                                     '"content": "mail ann@example.com"}]}]',
            "gen_ai.output.messages": '[{"role": "assistant", "parts": [{"type": "text", '
                                      '"content": "ok"}], "finish_reason": "stop"}]',
        }, 10, 20),
        span("chat gpt-4o", older, AGENT_SPAN, {
            **chat, "gen_ai.prompt": "Summarise: hi", "gen_ai.completion": "hi!"}, 30, 40),
        span("chat gpt-4o", indexed, AGENT_SPAN, {
            **chat, "gen_ai.prompt.0.role": "system", "gen_ai.prompt.0.content": "sys",
            "gen_ai.prompt.1.role": "user", "gen_ai.prompt.1.content": "q",
            "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": "a"},
            50, 60),
        span("chat gpt-4o", CONTENT_SPANS[1], AGENT_SPAN, chat, 70, 80, events=[
            SpanEvent("gen_ai.system.message", T0, {"content": "sys"}),
            SpanEvent("gen_ai.user.message", T0, {"content": "q2"}),
            SpanEvent("gen_ai.choice", T0, {"index": 0, "finish_reason": "stop",
                                            "message": '{"role": "assistant", '
                                                       '"content": "a2"}'}),
        ]),
        span("execute_tool lookup", TOOL_SPAN, AGENT_SPAN, {
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "lookup",
            "gen_ai.tool.call.arguments": '{"id": 7, "key": "api_key=abcd1234efgh"}',
            "gen_ai.tool.call.result": "found 1 order for bo@example.org"}, 90, 95),
        span("chat gpt-4o", CONTENT_SPANS[2], AGENT_SPAN, chat, 96, 99),  # no content
        span("invoke_agent support", AGENT_SPAN, "", {
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "support"}, 0, 100),
    ]


EXPECTED_CONTENT = {
    CHAT_SPAN: {"prompt": [{"role": "system", "parts": [{"type": "text",
                                                         "content": "Be brief."}]},
                           {"role": "user", "parts": [{"type": "text",
                                                       "content": "mail [REDACTED:email]"}]}],
                "response": [{"role": "assistant", "parts": [{"type": "text", "content": "ok"}],
                              "finish_reason": "stop"}]},
    CHAT2_SPAN: {"prompt": "Summarise: hi", "response": "hi!"},
    CONTENT_SPANS[0]: {"prompt": [{"role": "system", "content": "sys"},
                                  {"role": "user", "content": "q"}],
                       "response": [{"role": "assistant", "content": "a"}]},
    CONTENT_SPANS[1]: {"prompt": [{"role": "system", "content": "sys"},
                                  {"role": "user", "content": "q2"}],
                       "response": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": "a2"}}]},
    TOOL_SPAN: {"args": {"id": 7, "key": "api_key=[REDACTED:api_key]"},
                "output": "found 1 order for [REDACTED:email]"},
}


def test_span_content_in_every_convention_becomes_redacted_capture_messages(tmp_path):
    with Emitter("127.0.0.1:1", spool_dir=tmp_path) as emitter:
        batch = map_spans(_content_spans(), capture=emitter.capture_message)
    by_span = {event.span_id: event for event in batch.events}
    found = {by_span_id: {name: assemble_part(ref, message.blobs)
                          for name, ref in message.parts.items()}
             for message in batch.captures
             for by_span_id in [next(span_id for span_id, event in by_span.items()
                                     if str(event.event_id) == message.event_id)]}
    assert found == EXPECTED_CONTENT
    assert [message.parts[name].redactions for message in batch.captures
            for name in message.parts] == [1, 0, 0, 0, 0, 0, 0, 0, 1, 1]
    assert (batch.captures[0].run_id, batch.captures[0].agent) == (TRACE, "support")
    for message in batch.captures:
        event = next(e for e in batch.events if str(e.event_id) == message.event_id)
        if event.event_type == "llm.call":
            assert event.prompt_hash == part_hash(message.parts["prompt"])
            assert event.response_bytes == message.parts["response"].bytes
    assert by_span[CONTENT_SPANS[2]].prompt_hash is None  # no content, no capture
    assert len(batch.captures) == 5


def test_otel_sdk_exporter_span_content_is_captured_redacted_end_to_end(receiver, reader,
                                                                         agent):
    exporter = OTLPSpanExporter(endpoint=f"{receiver.url}/v1/traces")
    provider = TracerProvider(resource=Resource.create({"service.name": agent}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("agent-under-test")
    messages = [{"role": "user", "parts": [{"type": "text",
                                            "content": "card 4111 1111 1111 1111 please"}]}]
    with tracer.start_as_current_span("invoke_agent " + agent, attributes={
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": agent}) as root:
        with tracer.start_as_current_span("chat gpt-4o", attributes={
                "gen_ai.operation.name": "chat", "gen_ai.request.model": "gpt-4o",
                "gen_ai.input.messages": json.dumps(messages),
                "gen_ai.output.messages": '[{"role": "assistant", "parts": '
                                          '[{"type": "text", "content": "Done."}]}]'}):
            pass
        with tracer.start_as_current_span("execute_tool charge", attributes={
                "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "charge",
                "gen_ai.tool.call.arguments": '{"amount": 12.5}',
                "gen_ai.tool.call.result": "declined"}):
            pass
        root.set_status(Status(StatusCode.ERROR))
    provider.shutdown()
    _wait_closed(reader, agent)
    run_id = reader.query("SELECT run_id FROM runs FINAL WHERE agent = {a:String}",
                          {"a": agent}).scalar()
    # Each span is its own export, so the run can be decided before the tool span's
    # bodies are staged; later passes copy them and update the decision's count.
    decided = wait_for(lambda: [row for row in reader.query(
        "SELECT keep, reason, parts FROM capture_decisions FINAL WHERE run_id = {r:String}",
        {"r": run_id}).rows if row[2] == 4], 90, what="a capture decision counting 4 parts")
    assert decided == [[1, "failure:hard_error", 4]]
    parts = reader.query("SELECT part, encoding, hashes, bytes, redactions FROM capture_parts "
                         "FINAL WHERE run_id = {r:String} ORDER BY ts, part", {"r": run_id}
                         ).records()
    hashes = [digest for part in parts for digest in part["hashes"]]
    blobs = {digest: Blob(encoding=encoding, body=body) for digest, encoding, body in
             reader.query("SELECT hash, encoding, body FROM capture_blobs FINAL "
                          "WHERE hash IN {h:Array(String)}", {"h": hashes}).rows}
    values = {part["part"]: assemble_part(PartRef(encoding=part["encoding"],
                                                  hashes=part["hashes"], bytes=part["bytes"]),
                                          blobs) for part in parts}
    assert values == {
        "prompt": [{"role": "user", "parts": [{"type": "text",
                                               "content": "card [REDACTED:card_number] please"}]}],
        "response": [{"role": "assistant", "parts": [{"type": "text", "content": "Done."}]}],
        "args": {"amount": 12.5}, "output": "declined"}
    assert sorted(part["redactions"] for part in parts) == [0, 0, 0, 1]
