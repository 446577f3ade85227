"""Issue 26 item 1, the processors' half: a trace's rows end under one agent whatever the
order and batching of its spans, a revised row replaces the one it revises, and
redelivery never counts a call twice.

Real mapping (:func:`loopwatch.ingest.otlp.mapping.map_spans`, one call per export request), real
pipeline, real sink and real chdb (the session's in-process store, a database per
test); Kafka adds nothing to attribution, so each request's events are handed to the
pipeline as one message, one batch per request, as the processors would read them.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson
import pytest
from clickhouse_connect.driver.client import Client

from loopwatch.core.config import Settings
from loopwatch.ingest.otlp.decode import Span
from loopwatch.ingest.otlp.mapping import map_spans
from loopwatch.ingest.wire import encode_envelope
from loopwatch.processors.attribution import revision_row
from loopwatch.processors.jobs.reprocess import MemoryRunStore
from loopwatch.processors.pipeline import Pipeline, RawMessage, Work
from loopwatch.runtime import _insert_action
from loopwatch.store.clickhouse import connect
from loopwatch.store.remote_sink import encode_batch
from loopwatch.store.revisions import REVISIONS_TABLE, revise
from loopwatch.store.sink import ClickHouseSink, RowBatch
from tests.stores import fresh_store

T0 = 1_767_225_600_000_000_000  # 2026-01-01T00:00:00Z in ns
ROOT, OUTER, INNER, CHAT, TOOL = "1" * 16, "2" * 16, "3" * 16, "4" * 16, "5" * 16
CHAT_ATTRIBUTES = {"gen_ai.operation.name": "chat", "gen_ai.request.model": "gpt-4o",
                   "gen_ai.usage.input_tokens": 1200, "gen_ai.usage.output_tokens": 80,
                   "gen_ai.usage.cache_read.input_tokens": 1000}
TOOL_ATTRIBUTES = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "lookup",
                   "gen_ai.tool.call.arguments": '{"id": 7}'}


class Trace:
    """One agent run as spans: a root naming ``bot`` (service ``svc``) and, under it, a
    chat and a tool call, exported by a child service ``child-svc``."""

    def __init__(self, root_attributes: dict[str, Any] | None = None) -> None:
        self.trace = uuid.uuid4().hex
        root = {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "bot"}
        self.root_attributes = root if root_attributes is None else root_attributes

    def span(self, name: str, span_id: str, parent: str, attributes: dict[str, Any],
             start_ms: int, end_ms: int, service: str) -> Span:
        return Span(self.trace, span_id, parent, name, T0 + start_ms * 1_000_000,
                    T0 + end_ms * 1_000_000, attributes, {"service.name": service}, "test",
                    0, "", 0, [])

    def root(self) -> Span:
        return self.span("invoke_agent bot", ROOT, "", self.root_attributes, 0, 3000, "svc")

    def chat(self) -> Span:
        return self.span("chat gpt-4o", CHAT, ROOT, CHAT_ATTRIBUTES, 100, 1100, "child-svc")

    def tool(self) -> Span:
        return self.span("execute_tool lookup", TOOL, ROOT, TOOL_ATTRIBUTES, 1200, 1300,
                         "child-svc")


def _store(local_store: tuple[Settings, Client]) -> tuple[Settings, Client]:
    return fresh_store(local_store, "rev")


@pytest.fixture()
def store(local_store: tuple[Settings, Client]) -> Any:
    settings, client = _store(local_store)
    yield settings, client
    client.command(f"DROP DATABASE {settings.database}")


@pytest.fixture(scope="module")
def shared_store(local_store: tuple[Settings, Client]) -> Any:
    """One store for the hostile-input cases, which read only their own trace's rows
    (a fresh store each is ~0.4 s of CPU, and these are eleven cases)."""
    settings, client = _store(local_store)
    yield settings, client
    client.command(f"DROP DATABASE {settings.database}")


def _message(spans: list[Span], offset: int) -> RawMessage:
    return RawMessage("loopwatch.events", 0, offset, encode_envelope(map_spans(spans).events))


def _deliver(pipeline: Pipeline, sink: ClickHouseSink, requests: list[list[Span]],
             first_offset: int = 0) -> None:
    """One export request per batch, in order."""
    for offset, spans in enumerate(requests, start=first_offset):
        sink.write_batch(pipeline.process([_message(spans, offset)]).rows)


def _rows(client: Client, trace: str) -> dict[str, Any]:
    one = {"t": trace}
    return {
        "llm_calls": client.query("SELECT agent, agent_rank, input_tokens FROM llm_calls "
                                  "FINAL WHERE run_id = {t:String}", parameters=one
                                  ).result_rows,
        "tool_calls": client.query("SELECT agent, agent_rank, tool FROM tool_calls FINAL "
                                   "WHERE run_id = {t:String}", parameters=one).result_rows,
        "runs": client.query("SELECT agent, llm_calls, tool_calls, input_tokens, "
                             "cache_read_input_tokens, outcome FROM runs FINAL WHERE "
                             "run_id = {t:String}", parameters=one).result_rows,
    }


def _metrics(client: Client, agents: list[str]) -> list[tuple[Any, ...]]:
    return client.query(
        "SELECT agent, sum(calls), sum(cache_read_input_tokens), sum(uncached_input_tokens) "
        "FROM cache_metrics_1m WHERE agent IN {a:Array(String)} GROUP BY agent ORDER BY agent",
        parameters={"a": agents}).result_rows


def test_children_stored_before_their_root_are_revised_to_the_root_agent(store):
    """SimpleSpanProcessor's order: each child alone in its request, before the root.
    Before the root, the calls are under their own service (rank 0); once it came,
    under its agent name (rank 3), one row each, and so is the run."""
    settings, client = store
    trace = Trace()
    pipeline, sink = Pipeline(settings, MemoryRunStore()), ClickHouseSink(client)
    _deliver(pipeline, sink, [[trace.chat()], [trace.tool()]])
    assert _rows(client, trace.trace) == {
        "llm_calls": [("child-svc", 0, 1200)], "tool_calls": [("child-svc", 0, "lookup")],
        "runs": [("child-svc", 1, 1, 1200, 1000, "")]}
    _deliver(pipeline, sink, [[trace.root()]], first_offset=2)
    assert _rows(client, trace.trace) == {
        "llm_calls": [("bot", 3, 1200)], "tool_calls": [("bot", 3, "lookup")],
        "runs": [("bot", 1, 1, 1200, 1000, "success")]}
    assert _metrics(client, ["bot", "child-svc", "svc"]) == [("bot", 1, 1000, 200)]
    assert client.query("SELECT agent, calls FROM tool_metrics_1m").result_rows == [("bot", 1)]


def test_redelivery_and_a_lost_state_never_count_a_call_twice(store):
    """After the revision: the same requests again (a redelivered batch: duplicates);
    then again to a processor that lost the run's state (its rows come back at rank 0,
    and lose to the revised rows whatever the insert order); a revision applied twice.
    One row per call, exact sums, under the root's agent."""
    settings, client = store
    trace = Trace()
    pipeline, sink = Pipeline(settings, MemoryRunStore()), ClickHouseSink(client)
    requests = [[trace.chat()], [trace.tool()], [trace.root()]]
    _deliver(pipeline, sink, requests)
    _deliver(pipeline, sink, requests)
    assert pipeline.counters.duplicates == 4  # run.start, run.end and the two calls
    expected = {"llm_calls": [("bot", 3, 1200)], "tool_calls": [("bot", 3, "lookup")],
                "runs": [("bot", 1, 1, 1200, 1000, "success")]}
    assert _rows(client, trace.trace) == expected
    forgetful = Pipeline(settings, MemoryRunStore())
    _deliver(forgetful, sink, requests[:2])
    assert _rows(client, trace.trace)["llm_calls"] == [("bot", 3, 1200)]
    assert _rows(client, trace.trace)["tool_calls"] == [("bot", 3, "lookup")]
    state = pipeline.store.get(trace.trace)
    assert state is not None
    revise(client, [revision_row(state)])
    revise(client, [revision_row(state)])
    assert _rows(client, trace.trace)["llm_calls"] == [("bot", 3, 1200)]
    assert _metrics(client, ["bot", "child-svc", "svc"]) == [("bot", 1, 1000, 200)]
    for table in ("llm_calls", "tool_calls"):
        client.command(f"OPTIMIZE TABLE {table} FINAL")
        assert client.query(f"SELECT agent, agent_rank FROM {table}").result_rows == [
            ("bot", 3)], table


def test_the_earliest_named_span_wins_in_any_batching(store):
    """The root names no agent (a workflow, service ``wf-svc``); an outer agent span
    (started first) names ``support``, a sub-agent inside it ``helper``. In one request,
    or one span per request in the order SimpleSpanProcessor exports them (innermost
    first, root last), or the root first: every row of the trace is ``support``'s."""
    settings, client = store
    orders = {}
    for batching in ("one", "simple", "root-first"):
        trace = Trace({"gen_ai.operation.name": "invoke_workflow"})
        outer = trace.span("invoke_agent support", OUTER, ROOT, {
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "support"},
            10, 2900, "agents-svc")
        inner = trace.span("invoke_agent helper", INNER, OUTER, {
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "helper"},
            50, 1500, "agents-svc")
        chat = trace.span("chat gpt-4o", CHAT, INNER, CHAT_ATTRIBUTES, 100, 1100, "llm-svc")
        root = trace.span("invoke_workflow", ROOT, "", trace.root_attributes, 0, 3000,
                          "wf-svc")
        spans = [chat, inner, outer, root]
        requests = {"one": [spans], "simple": [[s] for s in spans],
                    "root-first": [[root], [chat], [inner], [outer]]}[batching]
        _deliver(Pipeline(settings, MemoryRunStore()), ClickHouseSink(client), requests)
        orders[batching] = _rows(client, trace.trace)
    expected = {"llm_calls": [("support", 2, 1200)], "tool_calls": [],
                "runs": [("support", 1, 0, 1200, 1000, "success")]}
    assert orders == {"one": expected, "simple": expected, "root-first": expected}


def test_explicit_agents_are_never_revised_and_sdk_events_make_no_claim(store):
    """A span's own ``loopwatch.agent`` wins over the rule and stays; an SDK event (no
    claim) is stored as its emitter named it, in a run a claim never touches."""
    settings, client = store
    trace = Trace()
    pinned = trace.span("chat gpt-4o", CHAT, ROOT, {**CHAT_ATTRIBUTES,
                                                     "loopwatch.agent": "pinned"},
                        100, 1100, "child-svc")
    pipeline, sink = Pipeline(settings, MemoryRunStore()), ClickHouseSink(client)
    _deliver(pipeline, sink, [[pinned], [trace.tool()], [trace.root()]])
    rows = _rows(client, trace.trace)
    assert (rows["llm_calls"], rows["tool_calls"]) == ([("pinned", 4, 1200)],
                                                      [("bot", 3, "lookup")])


@pytest.mark.parametrize("rank", ["3", 99, -1, True, None, 2.0])
def test_a_claim_that_is_no_rank_is_no_claim(shared_store, rank):
    """Hostile input: an event whose claim extras are not a rank (a producer writing
    Kafka directly) claims nothing: it is stored as it says, rank 4, and revises
    nothing of the run's rows that have a claim."""
    settings, client = shared_store
    trace = Trace()
    pipeline, sink = Pipeline(settings, MemoryRunStore()), ClickHouseSink(client)
    _deliver(pipeline, sink, [[trace.chat()]])
    forged = {"event_type": "tool.call", "run_id": trace.trace, "agent": "intruder'; --",
              "tool": "t", "otel_agent_rank": rank, "otel_agent_named_at": 0,
              "ts": "2026-01-01T00:00:01.200Z"}
    value = orjson.dumps({"envelope_version": 1, "events": [forged]})
    sink.write_batch(pipeline.process([RawMessage("loopwatch.events", 0, 9, value)]).rows)
    rows = _rows(client, trace.trace)
    assert rows["llm_calls"] == [("child-svc", 0, 1200)]
    assert rows["tool_calls"] == [("intruder'; --", 4, "t")]


@pytest.mark.parametrize("revision", [
    {"run_id": 7, "agent": "x", "agent_rank": 3, "since_ms": 0, "until_ms": 1},
    {"run_id": "r", "agent": "x", "agent_rank": 5, "since_ms": 0, "until_ms": 1},
    {"run_id": "r", "agent": "x", "agent_rank": 3, "since_ms": "0", "until_ms": 1},
    {"run_id": "r", "agent": "x", "agent_rank": True, "since_ms": 0, "until_ms": 1},
    ["r", "x", 3],
])
def test_a_malformed_revision_over_the_store_service_is_refused(shared_store, revision):
    """Hostile input on the owner's insert endpoint: a revision that is not one is a
    clear refusal (the service answers 400 with it) and revises nothing."""
    settings, client = shared_store
    trace = Trace()
    _deliver(Pipeline(settings, MemoryRunStore()), ClickHouseSink(client), [[trace.chat()]])
    insert = _insert_action(lambda: connect(settings))
    with pytest.raises(ValueError, match=r"^an agent revision needs "):
        insert(encode_batch(RowBatch({REVISIONS_TABLE: [revision]})))
    assert _rows(client, trace.trace)["llm_calls"] == [("child-svc", 0, 1200)]
    good = {"run_id": trace.trace, "agent": "bot", "agent_rank": 3,
            "since_ms": T0 // 1_000_000, "until_ms": T0 // 1_000_000 + 5000}
    assert insert(encode_batch(RowBatch({REVISIONS_TABLE: [good]}))) == {"tables": 1}
    assert _rows(client, trace.trace)["llm_calls"] == [("bot", 3, 1200)]


def test_one_batch_revises_many_runs_each_to_its_own_agent(store):
    """A batch that raises several runs' claims revises them in one statement per
    table: each run's rows take its own agent, and no other run's rows move."""
    settings, client = store
    traces = [Trace({"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": name})
              for name in ("alpha", "beta", "gamma")]
    bystander = Trace()
    pipeline, sink = Pipeline(settings, MemoryRunStore()), ClickHouseSink(client)
    _deliver(pipeline, sink, [[t.chat(), t.tool()] for t in [*traces, bystander]])
    work = pipeline.process([_message([t.root() for t in traces], 10)])
    assert [row["agent"] for row in work.rows.tables[REVISIONS_TABLE]] == [
        "alpha", "beta", "gamma"]
    sink.write_batch(work.rows)
    assert [(_rows(client, t.trace)["llm_calls"], _rows(client, t.trace)["tool_calls"])
            for t in [*traces, bystander]] == [
        ([("alpha", 3, 1200)], [("alpha", 3, "lookup")]),
        ([("beta", 3, 1200)], [("beta", 3, "lookup")]),
        ([("gamma", 3, 1200)], [("gamma", 3, "lookup")]),
        ([("child-svc", 0, 1200)], [("child-svc", 0, "lookup")])]


def _calls(client: Client) -> dict[str, list[tuple[Any, ...]]]:
    """Every column of the call tables but ``ingested_at``, FINAL."""
    return {table: client.query(
        f"SELECT * EXCEPT ingested_at FROM {table} FINAL ORDER BY event_id").result_rows
        for table in ("llm_calls", "tool_calls")}


@pytest.fixture()
def two_stores(local_store: tuple[Settings, Client]) -> Any:
    """Two fresh stores: one fed as a test batches the requests, one each request apart."""
    stores = [_store(local_store), _store(local_store)]
    yield stores
    for settings, client in stores:
        client.command(f"DROP DATABASE {settings.database}")


def _last_batch(settings: Settings, client: Client, requests: list[list[Span]],
                together: int) -> tuple[Work, ClickHouseSink]:
    """Each request but the last ``together`` in a batch of its own, written; those in
    one batch, folded and settled: its work (not written yet) and the sink."""
    pipeline, sink = Pipeline(settings, MemoryRunStore()), ClickHouseSink(client)
    _deliver(pipeline, sink, requests[:-together])
    first = len(requests) - together
    work = pipeline.process([_message(spans, offset) for offset, spans
                             in enumerate(requests[first:], start=first)])
    return work, sink


def test_a_claim_raised_in_the_batch_of_the_runs_first_rows_patches_them_no_revision(
        two_stores):
    """A trace whose children and root reach the processors in one batch (the OTLP
    burst's traces that straddle two export requests): its rows take the root's agent
    before they are written, with no revision statement and no row written twice. A
    trace first folded in the batch before: its rows are written again under the root's
    agent, no statement either. A run stored two batches before is revised by a
    statement. What is stored equals, column for column, what delivering each request
    in a batch of its own (every claim revised) stores."""
    fresh, recent, older = Trace(), Trace(), Trace()
    requests = [[older.chat(), older.tool()], [recent.chat(), recent.tool()],
                [fresh.chat(), fresh.tool()], [fresh.root(), recent.root(), older.root()]]
    (settings, client), (apart_settings, apart_client) = two_stores
    work, sink = _last_batch(settings, client, requests, together=2)
    assert [row["run_id"] for row in work.rows.tables[REVISIONS_TABLE]] == [older.trace]
    again = {table: sorted((row["run_id"], row["agent"], row["agent_rank"])
                           for row in work.rows.tables[table])
             for table in ("llm_calls", "tool_calls")}
    assert again == {table: sorted([(fresh.trace, "bot", 3), (recent.trace, "bot", 3)])
                     for table in ("llm_calls", "tool_calls")}
    sink.write_batch(work.rows)
    _deliver(Pipeline(apart_settings, MemoryRunStore()), ClickHouseSink(apart_client),
             requests)
    for trace in (fresh, recent, older):
        assert _rows(client, trace.trace) == {
            "llm_calls": [("bot", 3, 1200)], "tool_calls": [("bot", 3, "lookup")],
            "runs": [("bot", 1, 1, 1200, 1000, "success")]}
    assert _calls(client) == _calls(apart_client)
    for table in ("llm_calls", "tool_calls"):  # every row written, merged or not
        ranks = client.query(f"SELECT run_id, groupArray(agent_rank) FROM (SELECT "
                             f"run_id, agent_rank FROM {table} ORDER BY agent_rank) "
                             "GROUP BY run_id").result_rows
        assert dict(ranks) == {fresh.trace: [3], recent.trace: [0, 3],
                               older.trace: [0, 3]}


def test_a_run_first_folded_in_the_batch_before_is_written_again_not_revised(two_stores):
    """A trace's first calls in one batch, then another call and its root in the next:
    the first batch's rows are written again under the root's agent and the new call's
    row is patched before it is written, with no revision statement; the tables end as
    delivering each request in a batch of its own (every claim revised) leaves them."""
    trace = Trace()
    later = trace.span("chat gpt-4o", "6" * 16, ROOT, CHAT_ATTRIBUTES, 1400, 1500,
                       "child-svc")
    requests = [[trace.chat(), trace.tool()], [later], [trace.root()]]
    (settings, client), (apart_settings, apart_client) = two_stores
    work, sink = _last_batch(settings, client, requests, together=2)
    assert REVISIONS_TABLE not in work.rows.tables
    assert [(row["agent"], row["agent_rank"]) for row in
            work.rows.tables["llm_calls"] + work.rows.tables["tool_calls"]] == [
        ("bot", 3)] * 3
    sink.write_batch(work.rows)
    _deliver(Pipeline(apart_settings, MemoryRunStore()), ClickHouseSink(apart_client),
             requests)
    assert _rows(client, trace.trace)["llm_calls"] == [("bot", 3, 1200)] * 2
    assert _calls(client) == _calls(apart_client)
