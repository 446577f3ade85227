"""Which agent an OTLP trace's rows are stored under (issue 26, item 1): one rule for
runs, model calls and tool calls, whatever the batching, the order spans arrive in and
the protocol, with the stock OpenTelemetry SDK exporters (HTTP and gRPC) against the
real receiver, broker and pipeline (``up``); the per-minute views and the dashboards'
panels then see one agent per trace, with exact token sums, also after redelivery.

Each scenario tags its resource with a unique ``loopwatch.deployment`` (or uses agent
names of its own), so the shared session store can be asked exactly which agents that
trace's rows landed under."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcSpanExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from loopwatch.core.config import Settings
from loopwatch.core.embedded.broker import free_port
from loopwatch.dashboards.macros import expand
from loopwatch.dashboards.panels import PANELS
from loopwatch.ingest.otlp.mapping import map_spans
from loopwatch.ingest.otlp.server import OtlpReceiver
from loopwatch.ingest.otlp.settings import OtlpSettings
from tests.conftest import PIPELINE_ENV, wait_for
from tests.test_dashboards import window_for
from tests.test_otlp import AGENT_SPAN, CHAT2_SPAN, CHAT_SPAN, span

GEN_AI_CHAT = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai",
               "gen_ai.request.model": "gpt-4o", "gen_ai.usage.input_tokens": 1200,
               "gen_ai.usage.output_tokens": 80, "gen_ai.usage.cache_read.input_tokens": 1000}
GEN_AI_TOOL = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "lookup",
               "gen_ai.tool.call.arguments": '{"id": 7}'}
OI_LLM = {"openinference.span.kind": "LLM", "llm.model_name": "gpt-4o",
          "llm.provider": "openai", "llm.token_count.prompt": 1200,
          "llm.token_count.completion": 80, "llm.token_count.prompt_details.cache_read": 1000}
OI_TOOL = {"openinference.span.kind": "TOOL", "tool.name": "lookup",
           "input.value": '{"id": 7}'}


@pytest.fixture()
def receiver(broker: Any, pipeline: Any, tmp_path: Path) -> Iterator[OtlpReceiver]:
    settings = Settings(data_dir=tmp_path,
                        max_message_bytes=int(PIPELINE_ENV["LOOPWATCH_MAX_MESSAGE_BYTES"]))
    running = OtlpReceiver(settings, broker.bootstrap, "127.0.0.1", free_port(),
                           limits=OtlpSettings(max_body_bytes=64 * 1024))
    running.start()
    assert running.serve_grpc(0) is not None
    yield running
    running.stop()


def _exporter(receiver: OtlpReceiver, protocol: str) -> SpanExporter:
    """The stock exporter of ``protocol`` (``http`` or ``grpc``) for ``receiver``."""
    if protocol == "grpc":
        return GrpcSpanExporter(endpoint=receiver.grpc_address, insecure=True)
    return OTLPSpanExporter(endpoint=f"{receiver.url}/v1/traces")


def _export(exporter: SpanExporter, service: str, deployment: str, simple: bool,
            root: tuple[str, dict[str, Any]], chat: dict[str, Any],
            tool: dict[str, Any]) -> None:
    """One agent run through the stock SDK: ``SimpleSpanProcessor`` exports each span as
    it ends (both children before their root, one request each); ``BatchSpanProcessor``
    sends the trace in one request."""
    provider = TracerProvider(resource=Resource.create(
        {"service.name": service, "loopwatch.deployment": deployment}))
    provider.add_span_processor(SimpleSpanProcessor(exporter) if simple
                                else BatchSpanProcessor(exporter, schedule_delay_millis=60_000))
    tracer = provider.get_tracer("attribution-under-test")
    with tracer.start_as_current_span(root[0], attributes=root[1]):
        with tracer.start_as_current_span("chat gpt-4o", attributes=chat):
            pass
        with tracer.start_as_current_span("lookup", attributes=tool):
            pass
    assert provider.force_flush(30_000)
    provider.shutdown()


def _agents(reader: Any, deployment: str) -> dict[str, list[str]]:
    where = {"d": deployment}
    return {table: [row[0] for row in reader.query(
                f"SELECT DISTINCT agent FROM {table} WHERE deployment = {{d:String}} "
                "ORDER BY agent", where).rows]
            for table in ("runs FINAL", "llm_calls FINAL", "tool_calls FINAL",
                          "cache_metrics_1m")}


GEN_AI_ROOT = ("invoke_agent otel-bot", {"gen_ai.operation.name": "invoke_agent",
                                         "gen_ai.agent.name": "otel-bot"})
OI_ROOT = ("agent", {"openinference.span.kind": "AGENT"})

OI_NAMED_ROOT = ("agent", {"openinference.span.kind": "AGENT", "agent.name": "oi-agent"})


def _wait_stored(reader: Any, deployment: str, calls: int = 2) -> None:
    wait_for(lambda: reader.query(
        "SELECT count() FROM runs FINAL WHERE deployment = {d:String} AND status = 'closed'",
        {"d": deployment}).scalar() == 1, 120, what="the run closed")
    wait_for(lambda: reader.query(
        "SELECT (SELECT count() FROM llm_calls FINAL WHERE deployment = {d:String}) + "
        "(SELECT count() FROM tool_calls FINAL WHERE deployment = {d:String})",
        {"d": deployment}).scalar() >= calls, 120, what="both calls stored")


def _revised(reader: Any, deployment: str, expected: str) -> bool:
    """Whether every row of the deployment's trace is under ``expected`` (a revision
    is written with the batch that raised the claim, but is a statement of its own)."""
    return all(agents == [expected] for agents in _agents(reader, deployment).values())


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize(("service", "root", "chat", "tool", "simple", "expected"), [
    pytest.param("otel-bot-svc", GEN_AI_ROOT, GEN_AI_CHAT, GEN_AI_TOOL, True, "otel-bot",
                 id="gen_ai-simple-child-before-root"),
    pytest.param("otel-bot-svc", GEN_AI_ROOT, GEN_AI_CHAT, GEN_AI_TOOL, False, "otel-bot",
                 id="gen_ai-one-batch"),
    pytest.param("oi-bot", OI_ROOT, OI_LLM, OI_TOOL, True, "oi-bot",
                 id="openinference-simple-child-before-root"),
    pytest.param("oi-bot", OI_ROOT, OI_LLM, OI_TOOL, False, "oi-bot",
                 id="openinference-one-batch"),
    pytest.param("oi-bot", OI_NAMED_ROOT, OI_LLM, OI_TOOL, True, "oi-agent",
                 id="openinference-named-simple-child-before-root"),
])
def test_every_row_of_a_trace_has_the_trace_agent(receiver, reader, service, root, chat,
                                                    tool, simple, expected, protocol):
    deployment = f"attr-{uuid.uuid4().hex[:10]}"
    _export(_exporter(receiver, protocol), service, deployment, simple, root, chat, tool)
    _wait_stored(reader, deployment)
    wait_for(lambda: _revised(reader, deployment, expected), 60, what="the rows revised")
    assert _agents(reader, deployment) == {
        "runs FINAL": [expected], "llm_calls FINAL": [expected],
        "tool_calls FINAL": [expected], "cache_metrics_1m": [expected]}
    metrics = reader.query(
        "SELECT agent, calls, cache_read_input_tokens, uncached_input_tokens FROM cache_metrics_1m "
        "WHERE deployment = {d:String}", {"d": deployment}).rows
    assert metrics == [[expected, 1, 1000, 200]]


class _Recorded:
    """A trace recorded by the stock SDK, to export in groups of our choosing."""

    def __init__(self, service: str, deployment: str) -> None:
        memory = InMemorySpanExporter()
        provider = TracerProvider(resource=Resource.create(
            {"service.name": service, "loopwatch.deployment": deployment}))
        provider.add_span_processor(SimpleSpanProcessor(memory))
        tracer = provider.get_tracer("attribution-under-test")
        with tracer.start_as_current_span(GEN_AI_ROOT[0], attributes=GEN_AI_ROOT[1]):
            with tracer.start_as_current_span("chat gpt-4o", attributes=GEN_AI_CHAT):
                pass
            with tracer.start_as_current_span("lookup", attributes=GEN_AI_TOOL):
                pass
        provider.shutdown()
        self.chat, self.tool, self.root = memory.get_finished_spans()
        assert self.root.parent is None

    @staticmethod
    def send(exporter: SpanExporter, spans: list[ReadableSpan]) -> None:
        assert exporter.export(spans) == SpanExportResult.SUCCESS
        exporter.shutdown()


def test_several_requests_root_last_then_redelivered_count_once(receiver, reader):
    """The children in one gRPC request, the root last in an HTTP one; then the whole
    trace again (an exporter's retry after a lost answer), root first this time. The
    rows are revised to the root's agent and each call is counted once: the run's
    counters, the per-minute views and the tables' FINAL rows alike."""
    deployment = f"attr-{uuid.uuid4().hex[:10]}"
    trace = _Recorded("otel-bot-svc", deployment)
    _Recorded.send(_exporter(receiver, "grpc"), [trace.chat, trace.tool])
    wait_for(lambda: reader.query(
        "SELECT count() FROM llm_calls FINAL WHERE deployment = {d:String}",
        {"d": deployment}).scalar() == 1, 120, what="the children stored")
    assert _agents(reader, deployment)["llm_calls FINAL"] == ["otel-bot-svc"]
    _Recorded.send(_exporter(receiver, "http"), [trace.root])
    _wait_stored(reader, deployment)
    wait_for(lambda: _revised(reader, deployment, "otel-bot"), 60, what="the rows revised")
    since = reader.query("SELECT toString(now64(3))").scalar()
    _Recorded.send(_exporter(receiver, "grpc"), [trace.root])
    _Recorded.send(_exporter(receiver, "http"), [trace.chat, trace.tool])
    # the redelivered calls are rewritten (stamped with the run's agent, so the same rows)
    wait_for(lambda: reader.query(
        "SELECT (SELECT count() FROM llm_calls WHERE deployment = {d:String} AND "
        "ingested_at > {t:DateTime64(3)}) > 0 AND (SELECT count() FROM tool_calls WHERE "
        "deployment = {d:String} AND ingested_at > {t:DateTime64(3)}) > 0",
        {"d": deployment, "t": since}).scalar() == 1, 120, what="the redelivery stored")
    assert _agents(reader, deployment) == {
        "runs FINAL": ["otel-bot"], "llm_calls FINAL": ["otel-bot"],
        "tool_calls FINAL": ["otel-bot"], "cache_metrics_1m": ["otel-bot"]}
    where = {"d": deployment}
    assert reader.query(
        "SELECT agent, calls, cache_read_input_tokens, uncached_input_tokens FROM "
        "cache_metrics_1m WHERE deployment = {d:String}", where).rows == [
        ["otel-bot", 1, 1000, 200]]
    assert reader.query("SELECT agent, llm_calls, tool_calls, input_tokens, outcome FROM "
                        "runs FINAL WHERE deployment = {d:String}", where).rows == [
        ["otel-bot", 1, 1, 1200, "success"]]
    assert reader.query("SELECT count(), sum(input_tokens) FROM llm_calls FINAL WHERE "
                        "deployment = {d:String}", where).rows == [[1, 1200]]


def test_two_agents_are_two_agents_in_the_views_and_the_dashboards(receiver, reader):
    """The issue's report: a GenAI trace and an OpenInference trace exported span by
    span (SimpleSpanProcessor) showed four agents in ``cache_metrics_1m`` (each run's
    agent and its service). Now two, in the view and in the dashboards' panels, with
    exact sums and rates; the services' names are nowhere."""
    tag = uuid.uuid4().hex[:8]
    bot, bot_service, oi, oi_service = (f"bot-{tag}", f"bot-svc-{tag}", f"oi-{tag}",
                                        f"oi-svc-{tag}")
    everyone = sorted([bot, bot_service, oi, oi_service])
    deployments = {bot: f"attr-{tag}-a", oi: f"attr-{tag}-b"}
    gen_ai_root = (f"invoke_agent {bot}", {**GEN_AI_ROOT[1], "gen_ai.agent.name": bot})
    oi_root = ("agent", {**OI_NAMED_ROOT[1], "agent.name": oi})
    _export(_exporter(receiver, "http"), bot_service, deployments[bot], True, gen_ai_root,
            GEN_AI_CHAT, GEN_AI_TOOL)
    _export(_exporter(receiver, "grpc"), oi_service, deployments[oi], True, oi_root,
            OI_LLM, OI_TOOL)
    for agent, deployment in deployments.items():
        _wait_stored(reader, deployment)
        wait_for(lambda d=deployment, a=agent: _revised(reader, d, a), 60,
                 what="the rows revised")
    assert reader.query(
        "SELECT agent, sum(calls), sum(cache_read_input_tokens), sum(uncached_input_tokens), "
        "round(sum(cache_read_input_tokens) / sum(cache_read_input_tokens + "
        "uncached_input_tokens), 4) FROM cache_metrics_1m WHERE agent IN {a:Array(String)} "
        "GROUP BY agent ORDER BY agent", {"a": everyone}).rows == [
        [bot, 1, 1000, 200, 0.8333], [oi, 1, 1000, 200, 0.8333]]
    assert reader.query(
        "SELECT agent, sum(calls) FROM tool_metrics_1m WHERE agent IN {a:Array(String)} "
        "GROUP BY agent ORDER BY agent", {"a": everyone}).rows == [[bot, 1], [oi, 1]]
    panels = {panel.id: panel for panel in PANELS}

    def panel(name: str, agents: list[str]) -> list[dict[str, Any]]:
        expanded = expand(panels[name].sql, window_for(panels[name].tier), {"agent": agents})
        return reader.query(expanded.sql, expanded.parameters).records()

    rates: dict[str, set[float]] = {}
    for record in panel("cache_hit_rate", everyone):
        rates.setdefault(record["agent"], set()).add(round(record["cache_hit_rate"], 4))
    assert rates == {bot: {0.8333}, oi: {0.8333}}
    costs = dict(reader.query(
        "SELECT agent, sum(cost_usd) FROM cache_metrics_1m WHERE agent IN {a:Array(String)} "
        "GROUP BY agent", {"a": everyone}).rows)
    assert costs[bot] > 0 and costs[oi] > 0
    spend = {name: panel("spend_now", [name])[0]["spend_usd"] for name in everyone}
    assert spend == {bot: costs[bot], oi: costs[oi], bot_service: 0, oi_service: 0}


def test_one_agent_per_trace_in_a_batch_whoever_names_it():
    """The root names no agent; its agent span does: every row of the trace takes that
    name, also a call beside the agent span and one naming a sub-agent of its own."""
    chat = {"gen_ai.operation.name": "chat", "gen_ai.usage.input_tokens": 10}
    spans = [
        span("chat gpt-4o", CHAT_SPAN, "f" * 16, chat, 10, 20),
        span("chat gpt-4o", CHAT2_SPAN, AGENT_SPAN, {**chat, "gen_ai.agent.name": "helper"},
             30, 40),
        span("invoke_agent support", AGENT_SPAN, "f" * 16, {
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "support"}, 25, 50),
        span("invoke_workflow triage", "f" * 16, "", {
            "gen_ai.operation.name": "invoke_workflow"}, 0, 60),
    ]
    assert [(e.event_type, e.span_id, e.agent) for e in map_spans(spans).events] == [
        ("run.start", AGENT_SPAN, "support"), ("llm.call", CHAT_SPAN, "support"),
        ("llm.call", CHAT2_SPAN, "support"), ("run.end", AGENT_SPAN, "support")]


def test_each_request_says_how_far_it_decided_the_agent():
    """The receiver is stateless: each event carries its request's claim (rank, and the
    naming span's start for a non-root name). A child alone: its own service, rank 0;
    the root alone: its name, rank 3 (its service, rank 1, without one); a non-root
    agent span: rank 2 at its start; ``loopwatch.agent`` on the root: rank 4; on a
    child: that row's own agent, no claim at all."""
    chat = {"gen_ai.operation.name": "chat", "gen_ai.usage.input_tokens": 10}
    child = span("chat gpt-4o", CHAT_SPAN, AGENT_SPAN, chat, 10, 20, resource={
        "service.name": "child-svc"})
    named_root = span("invoke_agent support", AGENT_SPAN, "", {
        "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "support"}, 0, 50)
    plain_root = span("invoke_workflow", AGENT_SPAN, "", {
        "gen_ai.operation.name": "invoke_workflow"}, 0, 50, resource={"service.name": "wf"})
    sub_agent = span("invoke_agent helper", CHAT2_SPAN, AGENT_SPAN, {
        "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "helper"}, 5, 40)
    explicit_root = span("invoke_agent support", AGENT_SPAN, "", {
        "gen_ai.operation.name": "invoke_agent", "loopwatch.agent": "pinned"}, 0, 50)
    explicit_child = span("chat gpt-4o", CHAT_SPAN, AGENT_SPAN, {
        **chat, "loopwatch.agent": "mine"}, 10, 20)

    def claims(spans: list[Any]) -> list[tuple[str, str, Any, Any]]:
        return [(e.event_type, e.agent, (e.__pydantic_extra__ or {}).get("otel_agent_rank"),
                 (e.__pydantic_extra__ or {}).get("otel_agent_named_at"))
                for e in map_spans(spans).events]

    start = 1_767_225_600_000_000_000 + 5_000_000
    assert claims([child]) == [("llm.call", "child-svc", 0, 0)]
    assert claims([named_root]) == [("run.start", "support", 3, 0), ("run.end", "support", 3, 0)]
    assert claims([plain_root]) == [("run.start", "wf", 1, 0), ("run.end", "wf", 1, 0)]
    assert claims([sub_agent]) == [("run.start", "helper", 2, start),
                                   ("run.end", "helper", 2, start)]
    assert claims([child, plain_root]) == [("run.start", "wf", 1, 0),
                                           ("llm.call", "wf", 1, 0), ("run.end", "wf", 1, 0)]
    assert claims([explicit_root]) == [("run.start", "pinned", 4, 0),
                                       ("run.end", "pinned", 4, 0)]
    assert claims([explicit_child]) == [("llm.call", "mine", None, None)]
