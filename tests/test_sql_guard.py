"""User SQL runs one read statement over loopwatch's tables, bounded (issue #24 §1).

Fast tier: the in-process chdb store (``local_store``), through ``DirectReader`` (what
``loopwatch query`` uses without a running ``up``) and an in-process ``StoreService``
with the runtime's ``PooledReader``. Slow tier: a subset of the corpus through the
session's running ``up`` (its store service and the ``loopwatch query`` CLI).
"""

from __future__ import annotations

import json
import secrets
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from clickhouse_connect.driver.client import Client

from loopwatch.core.config import Settings
from loopwatch.processors.jobs.deadletters import LIST_SQL
from loopwatch.store.clickhouse import connect
from loopwatch.store.reader import DirectReader, QueryError, ServiceReader
from loopwatch.store.service import StoreService
from tests.conftest import wait_for

CORPUS = Path(__file__).with_name("hostile_sql.jsonl")


def corpus() -> list[dict[str, Any]]:
    return [json.loads(line) for line in CORPUS.read_text().splitlines() if line.strip()]


@pytest.fixture()
def canary(tmp_path: Path) -> tuple[Path, str]:
    """A file holding a random secret: no answer may ever contain it."""
    secret = f"canary-{secrets.token_hex(12)}"
    path = tmp_path / "canary.txt"
    path.write_text(secret)
    return path, secret


@pytest.fixture()
def user_reader(local_store: tuple[Settings, Client]) -> DirectReader:
    """A user's reader on the in-process store, on a client of its own (default
    settings: the store's database is the default one)."""
    settings, _ = local_store
    return DirectReader(connect(settings))


def with_paths(text: str, canary: Path, out: Path) -> str:
    return text.replace("{canary}", str(canary)).replace("{out}", str(out))


def refusal(reader: Any, sql: str, parameters: dict[str, Any] | None = None) -> str:
    with pytest.raises(QueryError) as refused:
        reader.query(sql, parameters)
    message = str(refused.value)
    assert "\n" not in message, message
    return message


def seed_dead_letter(client: Client) -> str:
    """One dead letter, written by the pipeline's own (trusted) client."""
    letter = f"guard-{uuid.uuid4().hex[:12]}"
    client.insert("dead_letters", [[letter, "guard-test", "a reason", "{}", datetime.now(UTC)]],
                  column_names=["id", "source", "reason", "payload", "received_at"])
    return letter


def legitimate_answer_is_exact(reader: Any, letter: str) -> None:
    """What the next caller (``loopwatch dlq list``'s query) gets is its own rows."""
    rows = reader.query("SELECT id, source, reason FROM dead_letters FINAL WHERE id = {id:String}",
                        {"id": letter}).rows
    assert rows == [[letter, "guard-test", "a reason"]]
    assert reader.query("SELECT 42 AS answer").rows == [[42]]
    listed = reader.query(LIST_SQL, {"limit": 100000}).records()
    assert [row for row in listed if row["id"] == letter] != []


# -- the findings, one by one --------------------------------------------------------

@pytest.mark.parametrize("target", ["canary", "/proc/self/environ", "/etc/shadow"])
def test_file_function_returns_no_host_file(user_reader, canary, target):
    path = str(canary[0]) if target == "canary" else target
    message = refusal(user_reader, f"SELECT file('{path}')")
    assert message.startswith("query refused: function file() is not allowed"), message
    assert canary[1] not in message


@pytest.mark.parametrize("mode", ["", " APPEND", " TRUNCATE"])
def test_into_outfile_writes_no_file(user_reader, tmp_path, mode):
    target = tmp_path / "written.txt"
    message = refusal(user_reader, f"SELECT 'x' INTO OUTFILE '{target}'{mode}")
    assert message.startswith("query refused: INTO OUTFILE"), message
    assert not target.exists()


def test_several_statements_are_refused_and_the_next_caller_gets_its_own_rows(
        local_store, user_reader):
    _, client = local_store
    letter = seed_dead_letter(client)
    annotations = client.query("SELECT count() FROM annotations").result_rows[0][0]
    message = refusal(user_reader, "SELECT 'INJECTED' AS agent; DROP TABLE annotations")
    assert message.startswith("query refused: not one valid SQL statement"), message
    assert "Multi-statements are not allowed" in message
    assert client.query("SELECT count() FROM annotations").result_rows[0][0] == annotations
    legitimate_answer_is_exact(user_reader, letter)


@pytest.mark.parametrize("failing", [
    "SELECT 'INJECTED' AS agent, throwIf(number = 700000) FROM numbers(1000000)",
    "SELECT 'INJECTED' AS agent, number FROM numbers(1e7)",  # over the result limit
])
def test_a_query_failing_mid_stream_leaves_nothing_for_the_next_caller(
        local_store, user_reader, failing):
    """chdb hands the rest of a failed query's output to the next query on the same
    handle (measured: an error, raw Native bytes or the failed query's rows): the reader
    must resynchronise before anyone else uses it."""
    _, client = local_store
    letter = seed_dead_letter(client)
    message = refusal(user_reader, failing)
    assert "throwIf" in message or "LOOPWATCH_QUERY_MAX_RESULT_ROWS" in message, message
    legitimate_answer_is_exact(user_reader, letter)


def test_kill_query_is_refused(user_reader):
    assert refusal(user_reader, "KILL QUERY WHERE 1") == (
        "query refused: user SQL is readonly: one SELECT, not KILL QUERY")


def test_a_query_is_stopped_at_its_time_limit(local_store):
    settings, _ = local_store
    quick = settings.model_copy(update={"query_timeout_s": 1.0})
    message = refusal(DirectReader(connect(settings), quick),
                      "SELECT count() FROM numbers(1e12)")
    assert message == "query stopped: the query ran longer than LOOPWATCH_QUERY_TIMEOUT_S (1 s)"


def test_a_large_result_is_refused_not_held_in_memory(local_store):
    settings, _ = local_store
    small = settings.model_copy(update={"query_max_result_rows": 1000})
    message = refusal(DirectReader(connect(settings), small), "SELECT * FROM numbers(1e7)")
    assert message.startswith("query stopped: the result is larger than "
                              "LOOPWATCH_QUERY_MAX_RESULT_ROWS (1000 rows)"), message


def test_a_query_is_stopped_at_its_memory_limit(local_store):
    settings, _ = local_store
    small = settings.model_copy(update={"query_max_memory_bytes": 32 * 1024**2})
    message = refusal(DirectReader(connect(settings), small),
                      "SELECT groupArray(number) FROM numbers(1e8)")
    assert message == ("query stopped: the query needed more memory than "
                       f"LOOPWATCH_QUERY_MAX_MEMORY_BYTES ({32 * 1024**2} bytes)")


def test_limits_are_settings_with_the_documented_defaults():
    settings = Settings()
    assert (settings.query_timeout_s, settings.query_max_memory_bytes,
            settings.query_max_result_rows, settings.query_max_result_bytes) == (
        30.0, 2 * 1024**3, 1_000_000, 512 * 1024**2)


@pytest.mark.parametrize("clause", ["max_execution_time = 0", "readonly = 0",
                                    "max_result_rows = 0", "max_memory_usage = 0"])
def test_a_settings_clause_cannot_raise_a_limit(user_reader, clause):
    message = refusal(user_reader, f"SELECT count() FROM numbers(10) SETTINGS {clause}")
    assert message.startswith("query refused: a SETTINGS clause is not allowed"), message


def test_the_engine_refuses_a_setting_change_under_the_guards_own_settings(local_store):
    """The second line: what the guard lets through still runs under ``readonly=1``,
    where ClickHouse itself refuses any setting change (chdb has no settings profiles
    or constraints to do it with: ``CREATE SETTINGS PROFILE`` is ACCESS_DENIED)."""
    settings, _ = local_store
    from loopwatch.store.sqlguard import Limits

    client = connect(settings)
    with pytest.raises(Exception, match="READONLY"):
        client.query("SELECT 1 SETTINGS max_execution_time = 0",
                     settings=Limits.of(settings).engine_settings())


@pytest.mark.parametrize("sql, reason", [
    ("SELECT " + "(" * 100_000 + "1" + ")" * 100_000, "Maximum parse depth"),
    ("SELECT 1" + " " * 5_000_000 + "-- padding", "Max query size exceeded"),
    ("SELECT " + ",".join(["1"] * 200_000), "Max query size exceeded"),
    ("SELECT 1\x00; DROP TABLE annotations", "Syntax error"),
    ("", "Empty query"),
    ("-- only a comment", "Empty query"),
])
def test_malformed_or_oversized_sql_is_refused_by_the_parser(local_store, user_reader, sql,
                                                             reason):
    _, client = local_store
    letter = seed_dead_letter(client)
    message = refusal(user_reader, sql)
    assert message.startswith("query refused: not one valid SQL statement"), message[:200]
    assert reason in message
    legitimate_answer_is_exact(user_reader, letter)


# -- the corpus ------------------------------------------------------------------------

def test_the_corpus_is_large_and_varied():
    entries = corpus()
    assert len(entries) >= 200
    kinds = {entry["expect"] for entry in entries}
    assert {"file()", "function", "table function", "INTO OUTFILE", "statement", "SETTINGS",
            "database", "parameter", "readonly"} <= kinds


def run_corpus(reader: Any, entries: list[dict[str, Any]], canary: tuple[Path, str],
               out: Path) -> list[str]:
    """Every entry refused in one line naming what (or, for a comment trick, answered
    with exactly the visible part); returns the problems found."""
    problems = []
    for entry in entries:
        sql = with_paths(entry["sql"], canary[0], out)
        try:
            result = reader.query(sql, entry.get("parameters"))
        except QueryError as exc:
            message = str(exc)
            if "rows" in entry:
                problems.append(f"{sql!r} failed: {message}")
            elif (not message.startswith("query refused:") or "\n" in message
                  or entry["expect"] not in message or canary[1] in message):
                problems.append(f"{sql!r}: {message}")
            continue
        expected = [[with_paths(value, canary[0], out) if isinstance(value, str) else value
                     for value in row] for row in entry.get("rows", [])]
        if "rows" not in entry or result.rows != expected or canary[1] in repr(result.rows):
            problems.append(f"{sql!r} ran: {result.rows!r}")
    return problems


def test_every_hostile_statement_is_refused_and_nothing_leaks_or_is_written(
        local_store, user_reader, canary, tmp_path):
    _, client = local_store
    out = tmp_path / "out"
    out.mkdir()
    letter = seed_dead_letter(client)
    tables = client.query("SELECT name FROM system.tables WHERE database = 'loopwatch' "
                          "ORDER BY name").result_rows
    problems = run_corpus(user_reader, corpus(), canary, out)
    assert problems == []
    assert list(out.iterdir()) == []
    assert canary[0].read_text() == canary[1]
    assert client.query("SELECT name FROM system.tables WHERE database = 'loopwatch' "
                        "ORDER BY name").result_rows == tables
    legitimate_answer_is_exact(user_reader, letter)


# -- internal callers pass the guard ---------------------------------------------------

def internal_statements() -> Iterator[tuple[str, str]]:
    """Every statement loopwatch itself sends through a user reader."""
    from loopwatch import cli, demo, report, runtime
    from loopwatch.dashboards.macros import QueryWindow, expand
    from loopwatch.dashboards.panels import ANNOTATION, PANELS, VARIABLES
    from loopwatch.detectors.playbooks import load_playbooks
    from loopwatch.ingest.importers import delivery
    from loopwatch.investigations import investigations
    from loopwatch.processors.replay import economics, recording
    from loopwatch.scenarios import live

    for name, investigation in investigations().items():
        yield f"investigation {name}", investigation.sql
    for name, book in load_playbooks().items():
        for step in book.steps:
            if step.sql:
                yield f"playbook {name}: {step.title}", step.sql
    now = datetime.now(UTC)
    window = QueryWindow(now - timedelta(hours=6), now, 60)
    for panel in [*PANELS, ANNOTATION]:
        yield f"panel {getattr(panel, 'id', 'annotation')}", expand(panel.sql, window, {}).sql
    for name, variable in VARIABLES.items():
        if variable.sql:
            yield f"variable {name}", variable.sql
    for module in (report, runtime, demo, cli, live, recording, economics, delivery):
        for name, value in vars(module).items():
            if name.endswith("_SQL") and isinstance(value, str):
                yield f"{module.__name__}.{name}", value.format(
                    parts="capture_parts", blobs="capture_blobs"
                ) if "{parts}" in value else value
    yield "deadletters.LIST_SQL", LIST_SQL


def test_every_internal_statement_passes_the_guard(local_store):
    from loopwatch.store.sqlguard import RefusedQuery, SqlGuard

    settings, _ = local_store
    guard, client = SqlGuard(settings), connect(settings)
    refused = []
    statements = list(internal_statements())
    for name, sql in statements:
        try:
            guard.vet(client, sql)
        except RefusedQuery as exc:
            refused.append(f"{name}: {exc}")
    assert refused == []
    assert len(statements) > 50


class _CountingClient:
    """The real chdb client, counting the queries sent through it (not a mock: every
    call reaches the engine)."""

    def __init__(self, client: Client) -> None:
        self.client, self.queries = client, 0

    def query(self, *args: Any, **kwargs: Any) -> Any:
        self.queries += 1
        return self.client.query(*args, **kwargs)


def test_a_vetted_statement_is_remembered_and_a_refused_one_vetted_each_time(local_store):
    from loopwatch.store.sqlguard import VETTED_KEPT, RefusedQuery, SqlGuard

    settings, _ = local_store
    guard, client = SqlGuard(settings), _CountingClient(connect(settings))
    lookup = "SELECT state FROM runs FINAL WHERE run_id IN {run_ids:Array(String)}"
    first = guard.vet(client, lookup)
    after_first = client.queries  # the parse, and the catalog's first reads
    assert guard.vet(client, lookup) == first
    assert client.queries == after_first
    hostile = "SELECT * FROM file('/etc/passwd')"
    for attempt in range(2):
        with pytest.raises(RefusedQuery):
            guard.vet(client, hostile)
        assert client.queries == after_first + attempt + 1  # parsed again each time
    for number in range(VETTED_KEPT):  # a full memory starts over: bounded
        guard.vet(client, f"SELECT {number} AS n")
    before = client.queries
    guard.vet(client, lookup)
    assert client.queries == before + 1


# -- concurrency: a heavy query holds up only its own reader ---------------------------

@pytest.fixture()
def service(local_store: tuple[Settings, Client], tmp_path: Path,
            request: pytest.FixtureRequest) -> Iterator[StoreService]:
    """A store service with a pool of 2 and a query timeout of 8 s (or the test's
    ``indirect`` parameter)."""
    from loopwatch.store.reader import PooledReader

    settings, _ = local_store
    timeout = float(getattr(request, "param", 8.0))
    tuned = settings.model_copy(update={"query_timeout_s": timeout, "query_concurrency": 2,
                                        "query_busy_wait_s": 0.0})
    pool = PooledReader(tuned)
    running = StoreService(pool, lambda: {}, tmp_path / "service.json")
    running.start({})
    yield running
    running.stop()
    pool.close()


def heavy_running(client: Client, marker: str) -> bool:
    return bool(client.query("SELECT count() FROM system.processes WHERE query LIKE "
                             "{m:String} AND query NOT LIKE '%system.processes%'",
                             parameters={"m": f"%{marker}%"}).result_rows[0][0])


def start_heavy(reader: ServiceReader, marker: str) -> tuple[threading.Thread, dict[str, str]]:
    outcome: dict[str, str] = {}

    def run() -> None:
        try:
            reader.query(f"SELECT count() AS {marker} FROM numbers(1e12)")
            outcome["result"] = "finished"
        except QueryError as exc:
            outcome["result"] = str(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def kill_heavy(client: Client, marker: str) -> None:
    client.command(f"KILL QUERY WHERE query LIKE '%{marker}%' "
                   "AND query NOT LIKE '%system.processes%' SYNC")


CANCELLED = "query stopped: the query was cancelled (KILL QUERY, or the store stopping)"


@pytest.mark.parametrize("service", [600.0], indirect=True, ids=["timeout 600 s"])
def test_a_heavy_query_holds_up_neither_other_queries_nor_the_pipelines_writes(
        local_store, service):
    """The heavy query outlasts a query, an insert and a query beside it, however busy the
    machine (a timeout of 8 s did not, at a load of 6-8): it runs until the test kills it,
    and its reader is told so in one line."""
    _, writer = local_store
    reader = ServiceReader(service.url)
    marker = f"heavy_{uuid.uuid4().hex[:8]}"
    thread, outcome = start_heavy(reader, marker)
    wait_for(lambda: heavy_running(writer, marker), 60, what="the heavy query to run")
    assert reader.query("SELECT 42 AS answer").rows == [[42]]
    letter = seed_dead_letter(writer)  # a pipeline commit: an insert through the writer
    assert reader.query("SELECT count() FROM dead_letters WHERE id = {id:String}",
                        {"id": letter}).rows == [[1]]
    assert heavy_running(writer, marker), "the overlap is not proven: the heavy one ended"
    kill_heavy(writer, marker)
    thread.join(120)
    assert outcome["result"] == CANCELLED
    assert reader.query("SELECT 42 AS answer").rows == [[42]]


@pytest.mark.parametrize("service", [600.0], indirect=True, ids=["timeout 600 s"])
def test_beyond_the_pool_a_query_is_refused_as_busy(local_store, service):
    _, writer = local_store
    reader = ServiceReader(service.url)
    markers = [f"busy_{uuid.uuid4().hex[:8]}" for _ in range(2)]
    started = [start_heavy(reader, marker) for marker in markers]
    wait_for(lambda: all(heavy_running(writer, marker) for marker in markers), 60,
             what="both heavy queries to run")
    message = refusal(reader, "SELECT 42")
    assert message == "store busy: 2 queries are running (LOOPWATCH_QUERY_CONCURRENCY); try again"
    for (thread, outcome), marker in zip(started, markers, strict=True):
        kill_heavy(writer, marker)
        thread.join(120)
        assert outcome["result"] == CANCELLED
    assert reader.query("SELECT 42 AS answer").rows == [[42]]


# -- slow tier: the running `up` -------------------------------------------------------

SUBSET_KINDS = ("file()", "function", "table function", "INTO OUTFILE", "statement",
                "SETTINGS", "database", "parameter", "readonly")


def corpus_subset() -> list[dict[str, Any]]:
    """A few entries of each kind, and every comment trick that must answer."""
    chosen: list[dict[str, Any]] = []
    for kind in SUBSET_KINDS:
        chosen.extend([entry for entry in corpus() if entry["expect"] == kind][:4])
    chosen.extend(entry for entry in corpus() if "rows" in entry)
    return chosen


def test_the_running_services_query_endpoint_refuses_the_corpus(
        pipeline, reader, canary, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert run_corpus(reader, corpus_subset(), canary, out) == []
    assert list(out.iterdir()) == []
    assert reader.query("SELECT 42 AS answer").rows == [[42]]


def test_loopwatch_query_refuses_in_one_line_and_the_store_keeps_answering(
        pipeline, canary, tmp_path):
    from tests.test_cli import loopwatch

    target = tmp_path / "written.txt"
    for sql, expected in [
        (f"SELECT file('{canary[0]}')", "query refused: function file() is not allowed"),
        (f"SELECT 'x' INTO OUTFILE '{target}' APPEND", "query refused: INTO OUTFILE"),
        ("SELECT 'INJECTED' AS agent; DROP TABLE annotations", "Multi-statements"),
        ("KILL QUERY WHERE 1", "query refused: user SQL is readonly: one SELECT, not KILL"),
        ("SELECT * FROM system.users", "outside the loopwatch database"),
        ("SELECT 1 SETTINGS max_execution_time = 0", "SETTINGS clause is not allowed"),
        ("SELECT 1 FORMAT JSON", "FORMAT is not allowed"),
    ]:
        result = loopwatch("query", sql, env=pipeline.env)
        assert result.returncode == 1, (sql, result.stdout, result.stderr)
        assert expected in result.stderr, (sql, result.stderr)
        assert canary[1] not in result.stdout + result.stderr
        assert "Traceback" not in result.stderr
    assert not target.exists()
    listed = loopwatch("dlq", "list", "--json", env=pipeline.env)
    assert listed.returncode == 0, listed.stderr
    assert "INJECTED" not in listed.stdout
