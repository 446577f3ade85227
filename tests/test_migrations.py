"""Versioned migrations (issue 25): numbered, applied once, recorded in the store; a store
created by main before versioning (tests/fixtures/main_store: its frozen DDL and a
scripted set of rows, loaded as main's writers wrote them) is upgraded keeping every
row; the cluster DDL renders the ALTERs ``ON CLUSTER`` and records what it applied.

The fixture is DDL text rather than a chdb directory: it is small, reviewable, and does
not depend on the on-disk format of the chdb build that wrote it. Real chdb: the
session's in-process store, a database per test.
"""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from clickhouse_connect.driver.client import Client

from loopwatch.core.config import Settings
from loopwatch.store.clickhouse import connect, migrate
from loopwatch.store.cluster import render_cluster_ddl
from loopwatch.store.retention import RETENTION, current_ttls
from loopwatch.store.schema_versions import (
    BASELINE,
    RECORD_TABLE,
    MigrationError,
    apply_migrations,
    checksum,
    migrations,
    statements,
)
from loopwatch.store.tables import EVENTS, GENERATED_VIEWS, LABELS, LLM_CALLS, RUNS, TOOL_CALLS

FIXTURE = Path(__file__).parent / "fixtures" / "main_store"

#: The migrations of every store made before versioning. They are frozen: a change to
#: the schema is a new migration, never an edit of one that stores have applied.
BASELINE_SHA256 = {
    "001_tables.sql": "e3eb8a4006cd5d08606a007182ef47cbc4937cd0bda877df524507ad971a83f8",
    "002_metric_views.sql": "9202fdc6febff65a49b7334e231875c16badce7fb29714e8e008eb114c1a6938",
    "003_alerts.sql": "37bc19c79eb3199bcb64b0204509850f6121b43f116fb0bf1ec75e7afa8fbc04",
    "004_gauges.sql": "a6963d27e10ec99944d4c6c38dd585655525418ebab2439840cf24d124065cab",
    "005_capture.sql": "01a58ad02ece43531633d61c90745016f754a71fda3813c1ee4be3c81ba4d1b2",
    "006_events_in.sql": "207a5e23d2e481f2f69a034dde938b1e4d8af2aa25817e02bb091bedf6006573",
}
NEW = ["007_ingested_at.sql", "008_minutes.sql", "009_cache_token_names.sql",
       "010_agent_revisions.sql", "011_cache_prefix_hashes.sql",
       "012_retry_amplification.sql", "013_merge_base.sql"]
#: columns later migrations added (empty for old rows): not main's
ADDED = {"llm_calls": ("tools_hash", "history_hash")}
#: tables that gained ingested_at in 007 (events had it)
GAINED = ("llm_calls", "tool_calls", "runs", "labels", "annotations")
#: tables rebuilt by 010 with agent_rank (0 for the rows they had)
REKEYED = ("llm_calls", "tool_calls")


def _settings(local_store: tuple[Settings, Client]) -> Settings:
    base, _ = local_store
    return Settings(data_dir=base.data_dir, database=f"mig_{uuid.uuid4().hex[:8]}")


def _records(client: Client, database: str) -> list[tuple[str, str, str]]:
    return [tuple(row) for row in client.query(
        f"SELECT name, checksum, how FROM {database}.{RECORD_TABLE} FINAL ORDER BY name"
    ).result_rows]


def _load_main_store(settings: Settings) -> Client:
    """A database as main's migrate() left it, with the fixture's rows."""
    client = connect(settings, database="")
    client.command(f"CREATE DATABASE {settings.database}")
    client.command(f"USE {settings.database}")
    schema = (FIXTURE / "schema.sql").read_text().replace("{database}", settings.database)
    for statement in statements(schema):
        client.command(statement)
    for statement in statements((FIXTURE / "rows.sql").read_text()):
        client.command(statement)
    return client


def _tables(client: Client, database: str) -> list[str]:
    return [name for (name,) in client.query(
        "SELECT name FROM system.tables WHERE database = {d:String} AND "
        "endsWith(engine, 'MergeTree') AND name NOT IN {r:Array(String)} ORDER BY name",
        parameters={"d": database, "r": [RECORD_TABLE, GENERATED_VIEWS]}).result_rows]


def _contents(client: Client, database: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table (the columns main had, by position: a renamed column
    keeps its place; ALIAS columns store nothing), sorted."""
    found = {}
    for table in _tables(client, database):
        columns = ", ".join(f"toString(`{name}`)" for (name,) in client.query(
            "SELECT name FROM system.columns WHERE database = {d:String} AND "
            "table = {t:String} AND NOT (name = 'ingested_at' AND table IN {g:Array(String)})"
            " AND NOT (name = 'agent_rank' AND table IN {k:Array(String)})"
            " AND default_kind != 'ALIAS' AND name NOT IN {added:Array(String)}"
            " ORDER BY position",
            parameters={"d": database, "t": table, "g": list(GAINED), "k": list(REKEYED),
                        "added": list(ADDED.get(table, ()))}
        ).result_rows)
        found[table] = sorted(tuple(row) for row in client.query(
            f"SELECT {columns} FROM {database}.{table}").result_rows)
    return found


def test_the_baseline_migrations_are_frozen():
    """Editing a released migration in place never reaches existing stores (001 was,
    twice): its checksum is pinned here, and migrate refuses a store that recorded
    another text. Migration names are numbered, unique and in order."""
    texts = dict(migrations())
    assert {name: checksum(texts[name]) for name in BASELINE} == BASELINE_SHA256
    names = list(texts)
    numbers = [int(re.match(r"^(\d{3})_[a-z0-9_]+\.sql$", name)[1]) for name in names]
    assert numbers == list(range(1, len(names) + 1)), names
    assert names[len(BASELINE):] == NEW


def test_a_new_store_applies_each_migration_once_and_records_it(local_store):
    settings = _settings(local_store)
    client = migrate(settings)
    assert _records(client, settings.database) == [
        (name, checksum(sql), "applied") for name, sql in migrations()]
    migrate(settings)
    assert apply_migrations(client, settings.database) == []
    assert client.query(f"SELECT count() FROM {settings.database}.{RECORD_TABLE}"
                        ).result_rows == [(len(migrations()),)]


def test_the_tables_every_event_writes_merge_ten_parts_at_a_time(local_store):
    """013: the tables each event writes a row to take ClickHouse's merge selector base
    10 (fewer, wider merges: docs/performance.md); every other table keeps the default."""
    settings = _settings(local_store)
    client = migrate(settings)
    found = {name: (re.search(r"\bmerge_selector_base = (\d+)", engine) or [None, None])[1]
             for name, engine in client.query(
                 "SELECT name, engine_full FROM system.tables WHERE database = {d:String} "
                 "AND endsWith(engine, 'MergeTree')", parameters={"d": settings.database}
             ).result_rows}
    per_event = {EVENTS, LLM_CALLS, TOOL_CALLS, LABELS, RUNS}
    assert per_event < set(found)
    assert found == {name: "10" if name in per_event else None for name in found}
    client.command(f"DROP DATABASE {settings.database}")


def test_a_store_made_by_main_is_upgraded_and_keeps_every_row(local_store):
    settings = _settings(local_store)
    old = _load_main_store(settings)
    before = _contents(old, settings.database)
    assert {table: len(rows) for table, rows in before.items()} == {
        "alerts": 1, "annotations": 1, "capture_blobs": 1, "capture_decisions": 1,
        "capture_parts": 1, "capture_staging": 1, "capture_staging_blobs": 1,
        "dead_letters": 1, "events": 3, "labels": 1, "llm_calls": 2, "pipeline_gauges": 1,
        "rule_evaluations": 1, "runs": 3, "tool_calls": 1}
    started = datetime.now(UTC).replace(tzinfo=None)
    client = migrate(settings)
    upgraded = datetime.now(UTC).replace(tzinfo=None)

    assert _records(client, settings.database) == [
        *((name, BASELINE_SHA256[name], "baseline") for name in BASELINE),
        *((name, checksum(dict(migrations())[name]), "applied") for name in NEW)]
    assert _contents(client, settings.database) == before
    for table in GAINED:  # old rows: the time of the upgrade, written once
        sql = f"SELECT DISTINCT ingested_at FROM {table} ORDER BY ingested_at"
        stamps = client.query(sql).result_rows
        assert stamps and all(started <= stamp <= upgraded for (stamp,) in stamps), table
        assert client.query(sql).result_rows == stamps, f"{table}.ingested_at is " \
            "evaluated at each read"
    ttls = current_ttls(client, settings.database)
    assert {table: ttls[table] for table in RETENTION} == {
        table: rule.normalized() for table, rule in RETENTION.items()}
    assert ttls["pipeline_gauges"] == "ts + toIntervalDay(30)"
    minutes = client.query("SELECT (SELECT toTypeName(minute) FROM outcomes_1m LIMIT 1), "
                           "(SELECT toTypeName(minute) FROM tool_metrics_1m LIMIT 1)")
    assert minutes.result_rows == [("Nullable(DateTime64(3, 'UTC'))", "DateTime64(3, 'UTC')")]
    assert client.query("SELECT run_id, outcome, version FROM runs FINAL ORDER BY run_id"
                        ).result_rows == [("fx-run-0", "wrong", 3), ("fx-run-1", "success", 2)]

    assert apply_migrations(client, settings.database) == []
    migrate(settings)
    assert len(_records(client, settings.database)) == len(BASELINE) + len(NEW)
    for table in _tables(client, settings.database):
        client.command(f"OPTIMIZE TABLE {table} FINAL")
    after = _contents(client, settings.database)
    before["runs"] = [row for row in before["runs"] if row[9] != "running"]  # FINAL: v1 gone
    assert after == before, "a TTL merge dropped an upgraded row"


def test_a_migration_edited_after_it_was_applied_is_refused(local_store):
    settings = _settings(local_store)
    client = migrate(settings)
    client.command(f"INSERT INTO {settings.database}.{RECORD_TABLE} (name, checksum, "
                   "applied_at, how) VALUES ('001_tables.sql', 'e1ded', now64(3) + 1, 'x')")
    with pytest.raises(MigrationError, match=r"^migration 001_tables\.sql was applied to "
                       rf"store {settings.database} with another text \(checksum e1ded, "):
        migrate(settings)


def test_the_single_node_cluster_ddl_upgrades_and_records_what_it_applied(local_store):
    """The cluster form (here its single-node rendering, which chdb runs) creates the
    tables, applies the ALTERs to the local and the front tables, and records every
    migration: the processors' migrate then applies nothing."""
    settings = _settings(local_store)
    client = connect(settings, database="")
    for statement in render_cluster_ddl("unused", settings.database, single_node=True):
        client.command(statement)
    for table in (*GAINED, "events"):
        for name in (table, f"{table}_local"):
            default = client.query(
                "SELECT default_expression FROM system.columns WHERE database = {d:String}"
                " AND table = {t:String} AND name = 'ingested_at'",
                parameters={"d": settings.database, "t": name}).result_rows
            assert default == [("now64(3)",)], name
    for name in ("llm_calls", "llm_calls_local", "runs", "runs_local"):
        assert _kinds(client, settings.database, name) == {
            "cache_read_input_tokens": ("", ""), "cache_creation_input_tokens": ("", ""),
            "cache_read_tokens": ("ALIAS", "cache_read_input_tokens"),
            "cache_creation_tokens": ("ALIAS", "cache_creation_input_tokens")}, name
    assert [name for name, _digest, how in _records(client, settings.database)
            if how == "cluster.sql"] == [name for name, _ in migrations()]
    migrated = connect(settings)
    assert apply_migrations(migrated, settings.database) == []
    ttl = client.query("SELECT engine_full FROM system.tables WHERE database = {d:String} "
                       "AND name = 'llm_calls_local'", parameters={"d": settings.database}
                       ).result_rows[0][0]
    assert "TTL ingested_at + toIntervalDay(180)" in ttl
    for name in ("llm_calls_local", "tool_calls_local"):  # 010's rebuild, by exchange
        assert client.query(
            "SELECT sorting_key, engine FROM system.tables WHERE database = {d:String} AND "
            "name = {t:String}", parameters={"d": settings.database, "t": name}
        ).result_rows == [("ts, event_id", "ReplacingMergeTree")], name
    assert client.query("SELECT count() FROM system.tables WHERE database = {d:String} AND "
                        "name LIKE '%v010%'", parameters={"d": settings.database}
                        ).result_rows == [(0,)]
    client.command(f"INSERT INTO {settings.database}.llm_calls (event_id, ts, run_id, agent, "
                   "agent_rank) VALUES (generateUUIDv4(), now64(3), 'r', 'a', 2)")
    assert client.query(f"SELECT agent_rank FROM {settings.database}.llm_calls_local"
                        ).result_rows == [(2,)]
    client.command(f"DROP DATABASE {settings.database}")


def test_the_cluster_ddl_alters_local_and_distributed_tables_on_cluster():
    ddl = render_cluster_ddl("prod", "lw")
    for table in ("llm_calls", "tool_calls"):  # 010's rebuild
        at = ddl.index(f"EXCHANGE TABLES lw.{table}_v010_local AND lw.{table}_local "
                       "ON CLUSTER prod")
        assert "ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{uuid}/{shard}', " \
               "'{replica}', agent_rank)" in ddl[at - 3]
        assert ddl[at - 1].startswith(f"INSERT INTO lw.{table}_v010 (event_id, ts, ")
        assert ddl[at - 1].endswith(f"FROM lw.{table}\nSETTINGS insert_distributed_sync = 1")
        assert ddl[at + 1:at + 5] == [
            f"DROP TABLE IF EXISTS lw.{table} ON CLUSTER prod",
            f"CREATE TABLE lw.{table} ON CLUSTER prod AS lw.{table}_local\nENGINE = "
            f"Distributed('prod', 'lw', '{table}_local', cityHash64(run_id))",
            f"DROP TABLE IF EXISTS lw.{table}_v010 ON CLUSTER prod",
            f"DROP TABLE IF EXISTS lw.{table}_v010_local ON CLUSTER prod"]
    column = ("ADD COLUMN IF NOT EXISTS ingested_at DateTime64(3, 'UTC') DEFAULT now64(3) "
              "CODEC(ZSTD(1))")
    for table in GAINED:
        assert f"ALTER TABLE lw.{table}_local ON CLUSTER prod {column}" in ddl
        assert f"ALTER TABLE lw.{table} ON CLUSTER prod {column}" in ddl
        assert (f"ALTER TABLE lw.{table}_local ON CLUSTER prod MATERIALIZE COLUMN "
                "ingested_at SETTINGS mutations_sync = 2") in ddl
        assert not any(s.startswith(f"ALTER TABLE lw.{table} ON CLUSTER prod MATERIALIZE")
                       for s in ddl), "a mutation on a Distributed table"
    for table in ("llm_calls", "runs"):
        for name in (f"{table}_local", table):
            assert (f"ALTER TABLE lw.{name} ON CLUSTER prod RENAME COLUMN IF EXISTS "
                    "cache_read_tokens TO cache_read_input_tokens") in ddl
            assert (f"ALTER TABLE lw.{name} ON CLUSTER prod ADD COLUMN IF NOT EXISTS "
                    "cache_read_tokens UInt64 ALIAS cache_read_input_tokens") in ddl
    assert "ALTER TABLE lw.pipeline_gauges_local ON CLUSTER prod MODIFY TTL ts + INTERVAL " \
           "30 DAY" in ddl
    record = next(s for s in ddl if s.startswith(f"CREATE TABLE IF NOT EXISTS lw.{RECORD_TABLE}"))
    assert "ReplicatedReplacingMergeTree('/clickhouse/tables/all/{database}/" \
           "schema_migrations', '{replica}', applied_at)" in record


#: the prompt-cache token columns 009 renames to the SDK's names (old -> new)
RENAMED = {"cache_read_tokens": "cache_read_input_tokens",
           "cache_creation_tokens": "cache_creation_input_tokens"}


def _kinds(client: Client, database: str, table: str) -> dict[str, tuple[str, str]]:
    return {name: (kind, expression) for name, kind, expression in client.query(
        "SELECT name, default_kind, default_expression FROM system.columns WHERE database = "
        "{d:String} AND table = {t:String} AND name LIKE 'cache\\_%\\_tokens'",
        parameters={"d": database, "t": table}).result_rows}


def test_the_cache_token_columns_take_the_sdk_names_and_keep_the_old_as_aliases(local_store):
    """Issue 26 item 15: a store made by main (cache columns under the old names, with
    values) upgrades to the SDK's names; the old names read the same values as ALIAS
    columns; the per-minute view answers under both; 009 can run again (a crash after
    its statements, before its record); a fresh store has the same columns."""
    settings = _settings(local_store)
    old = _load_main_store(settings)
    old.command("INSERT INTO llm_calls (event_id, ts, run_id, agent, model, cache_read_tokens,"
                " cache_creation_tokens, uncached_input_tokens) VALUES "
                "(generateUUIDv4(), now64(3), 'fx-cache', 'fx-cache', 'm', 800, 200, 100), "
                "(generateUUIDv4(), now64(3), 'fx-cache', 'fx-cache', 'm', 300, 0, 50)")
    old.command("INSERT INTO runs (run_id, agent, status, started_ts, last_event_ts, "
                "cache_read_tokens, cache_creation_tokens, version) VALUES "
                "('fx-cache', 'fx-cache', 'running', now64(3), now64(3), 1100, 200, 1)")
    client = migrate(settings)

    expected = {new: ("", "") for new in RENAMED.values()} | {
        old_name: ("ALIAS", new) for old_name, new in RENAMED.items()}
    assert _kinds(client, settings.database, "llm_calls") == expected
    assert _kinds(client, settings.database, "runs") == expected
    both = ("cache_read_input_tokens, cache_read_tokens, cache_creation_input_tokens, "
            "cache_creation_tokens")
    assert client.query(f"SELECT {both} FROM llm_calls WHERE run_id = 'fx-cache' "
                        "ORDER BY cache_read_input_tokens").result_rows == [
        (300, 300, 0, 0), (800, 800, 200, 200)]
    assert client.query(f"SELECT {both} FROM runs FINAL WHERE run_id = 'fx-cache'"
                        ).result_rows == [(1100, 1100, 200, 200)]
    assert client.query(f"SELECT {both}, round(cache_hit_rate, 4) FROM cache_metrics_1m "
                        "WHERE agent = 'fx-cache'").result_rows == [
        (1100, 1100, 200, 200, round(1100 / 1450, 4))]
    client.command("INSERT INTO llm_calls (event_id, ts, run_id, agent, cache_read_input_tokens)"
                   " VALUES (generateUUIDv4(), now64(3), 'fx-new', 'fx-cache', 7)")
    assert client.query("SELECT cache_read_tokens FROM llm_calls WHERE run_id = 'fx-new'"
                        ).result_rows == [(7,)]

    client.command(f"DELETE FROM {RECORD_TABLE} WHERE name = '009_cache_token_names.sql'")
    assert apply_migrations(client, settings.database) == ["009_cache_token_names.sql"]
    assert _kinds(client, settings.database, "llm_calls") == expected
    assert client.query(f"SELECT {both} FROM runs FINAL WHERE run_id = 'fx-cache'"
                        ).result_rows == [(1100, 1100, 200, 200)]

    fresh = _settings(local_store)
    fresh_client = migrate(fresh)
    assert _kinds(fresh_client, fresh.database, "llm_calls") == expected
    assert _kinds(fresh_client, fresh.database, "runs") == expected
    for database in (settings.database, fresh.database):
        client.command(f"DROP DATABASE {database}")


def _keys(client: Client, database: str) -> dict[str, tuple[str, str]]:
    return {name: (key, engine.split(" ORDER BY")[0]) for name, key, engine in client.query(
        "SELECT name, sorting_key, engine_full FROM system.tables WHERE database = {d:String}"
        " AND name IN ('llm_calls', 'tool_calls', 'llm_calls_v010', 'tool_calls_v010') "
        "ORDER BY name", parameters={"d": database}).result_rows}


REKEYED_TABLES = {"llm_calls": ("ts, event_id", "ReplacingMergeTree(agent_rank) PARTITION BY "
                                "toYYYYMM(ts)"),
                  "tool_calls": ("ts, event_id", "ReplacingMergeTree(agent_rank) PARTITION BY "
                                 "toYYYYMM(ts)")}


def test_010_rekeys_the_call_tables_and_can_run_again_after_a_crash(local_store):
    """Issue 26 item 1: llm_calls and tool_calls are keyed by (ts, event_id) with
    agent_rank as the version, so a revised row replaces the row it revises; the rows a
    store had keep their values (rank 0). A crash after the exchange, before the old
    table was dropped (or before the record), is repaired by running 010 again: the
    copy and the exchange are skipped, nothing is swapped back or copied twice."""
    settings = _settings(local_store)
    old = _load_main_store(settings)
    assert _keys(old, settings.database)["llm_calls"][0] == "agent, ts, event_id"
    client = migrate(settings)
    assert _keys(client, settings.database) == REKEYED_TABLES
    rows = "SELECT run_id, agent, agent_rank, input_tokens FROM llm_calls FINAL ORDER BY run_id"
    assert client.query(rows).result_rows == [("fx-run-0", "fx-agent", 0, 7),
                                              ("fx-run-1", "fx-agent", 0, 120)]
    # the crash: the old table still beside the new one, 010 not recorded
    client.command("CREATE TABLE llm_calls_v010 (event_id UUID, ts DateTime64(3, 'UTC'), "
                   "agent String) ENGINE = ReplacingMergeTree ORDER BY (agent, ts, event_id)")
    client.command(f"DELETE FROM {RECORD_TABLE} WHERE name = '010_agent_revisions.sql'")
    assert apply_migrations(client, settings.database) == ["010_agent_revisions.sql"]
    assert _keys(client, settings.database) == REKEYED_TABLES
    assert client.query(rows).result_rows == [("fx-run-0", "fx-agent", 0, 7),
                                              ("fx-run-1", "fx-agent", 0, 120)]
    assert client.query("SELECT count() FROM llm_calls").result_rows == [(2,)]
    # a revised row replaces the row it revises, whichever comes last
    client.command("INSERT INTO llm_calls SELECT * REPLACE ('fx-bot' AS agent, 3 AS agent_rank)"
                   " FROM llm_calls WHERE run_id = 'fx-run-1'")
    client.command("INSERT INTO llm_calls SELECT * REPLACE (1 AS agent_rank) FROM llm_calls "
                   "FINAL WHERE run_id = 'fx-run-0'")
    client.command("INSERT INTO llm_calls SELECT * REPLACE ('fx-svc' AS agent, 0 AS agent_rank)"
                   " FROM llm_calls WHERE run_id = 'fx-run-1' AND agent_rank = 3")
    assert client.query(rows).result_rows == [("fx-run-0", "fx-agent", 1, 7),
                                              ("fx-run-1", "fx-bot", 3, 120)]
    client.command(f"DROP DATABASE {settings.database}")
