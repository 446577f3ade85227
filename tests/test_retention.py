"""Retention on the single-node store: TTLs per table from one source of truth, applied
at migrate time with the settings' overrides, and the size cap on the data directory.

Real chdb: the session's in-process store, each test in a database of its own (a chdb
client's current database is its own, so the shared ``loopwatch`` database is untouched).
"""

from __future__ import annotations

import logging
import os
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from clickhouse_connect.driver.client import Client

from loopwatch.core.config import Settings
from loopwatch.store.clickhouse import migrate
from loopwatch.store.retention import (
    CAPTURE_TABLES,
    RETENTION,
    apply_retention,
    current_ttls,
    retention_for,
)
from loopwatch.store.sizecap import enforce_size_cap
from tests.stores import fresh_store

MIB = 1024 * 1024


def store(local_store: tuple[Settings, Client], **overrides) -> tuple[Settings, Client]:
    return fresh_store(local_store, "ret", **overrides)


def test_every_table_gets_its_ttl_with_overrides_and_a_restart_changes_nothing(local_store):
    """The defaults of RETENTION, ``retention_days`` overriding one table and
    ``capture_retention_days`` the kept-payload tables; migrating again (every start)
    alters nothing; tables with their own TTL in the migrations keep it."""
    settings, client = store(local_store, retention_days={"events": 3, "runs": 400},
                             capture_retention_days=14)
    ttls = current_ttls(client, settings.database)
    expected = {table: rule.normalized() for table, rule in RETENTION.items()}
    expected["events"] = "ingested_at + toIntervalDay(3)"
    expected["runs"] = "ingested_at + toIntervalDay(400)"
    for table in CAPTURE_TABLES:
        expected[table] = f"{RETENTION[table].column} + toIntervalDay(14)"
    assert {table: ttls[table] for table in RETENTION} == expected
    assert ttls["pipeline_gauges"] == "ts + toIntervalDay(30)"
    assert ttls["capture_staging"] == "staged_at + toIntervalDay(7)"
    assert apply_retention(client, settings) == {}
    migrate(settings)
    assert current_ttls(client, settings.database) == ttls
    longer = Settings(data_dir=settings.data_dir, database=settings.database,
                      retention_days={"events": 10}, capture_retention_days=14)
    assert apply_retention(client, longer) == {"events": 10, "runs": 180}


def test_an_unknown_table_or_an_impossible_retention_is_refused():
    """A typo would silently keep the default; past 100 years a row stored late in
    DateTime64's range would outlive it."""
    with pytest.raises(ValueError, match="no retention rule"):
        retention_for(Settings(retention_days={"evnets": 3}))
    with pytest.raises(ValueError, match=r"must be 1\.\.36500 \(got 36501\)"):
        retention_for(Settings(retention_days={"events": 36501}))
    assert retention_for(Settings(retention_days={"events": 36500}))["events"].days == 36500


def test_the_ttl_drops_rows_stored_longer_ago_than_the_retention(local_store):
    """Retention counts from ``ingested_at``: a row stored 6 days ago is gone after a
    merge under a 5-day retention, one stored 4 days ago stays, whatever their event
    times (the kept one is dated 1900, which the old event-time TTL expired at once)."""
    _settings, client = store(local_store, retention_days={"events": 5})
    now = datetime.now(UTC)
    client.insert("events", [
        [uuid.uuid4(), "step", "old", "a", now, "{}", now - timedelta(days=6)],
        [uuid.uuid4(), "step", "new", "a", datetime(1900, 1, 1, tzinfo=UTC), "{}",
         now - timedelta(days=4)]],
        column_names=["event_id", "event_type", "run_id", "agent", "ts", "payload",
                      "ingested_at"])
    client.command("OPTIMIZE TABLE events FINAL")
    assert client.query("SELECT run_id, toString(ts) FROM events").result_rows == [
        ("new", "1900-01-01 00:00:00.000")]


def test_the_longest_retention_does_not_wrap(local_store):
    """``toDateTime(ts) + INTERVAL 36500 DAY`` wrapped past 2106 and expired every row at
    once, hence the old 10,000-day bound; the DateTime64 TTL keeps a row stored now."""
    _settings, client = store(local_store, retention_days={"events": 36500, "runs": 36500})
    client.insert("events", [[uuid.uuid4(), "step", "kept", "a", datetime.now(UTC), "{}"]],
                  column_names=["event_id", "event_type", "run_id", "agent", "ts", "payload"])
    client.command("OPTIMIZE TABLE events FINAL")
    assert client.query("SELECT run_id FROM events").result_rows == [("kept",)]


MONTHS = [(datetime(2026, 1, 15, tzinfo=UTC), 1500), (datetime(2026, 2, 15, tzinfo=UTC), 1000),
          (datetime(2026, 3, 15, tzinfo=UTC), 500)]


def filled(local_store, cap: int) -> tuple[Settings, Client]:
    """A store with events and llm_calls in three months (1500, 1000, 500 rows each,
    1.2 kB of random payload per event), TTLs long so only the cap removes data."""
    settings, client = store(local_store, data_dir_max_bytes=cap,
                             retention_days={"events": 3650, "llm_calls": 3650})
    for ts, rows in MONTHS:
        events = [[uuid.uuid4(), "llm.call", f"r{ts.month}-{i}", "a", ts, os.urandom(600).hex()]
                  for i in range(rows)]
        client.insert("events", events, column_names=["event_id", "event_type", "run_id",
                                                      "agent", "ts", "payload"])
        client.insert("llm_calls", [[row[0], row[4], row[2], "a", 10] for row in events],
                      column_names=["event_id", "ts", "run_id", "agent", "input_tokens"])
    return settings, client


def months_left(client: Client, table: str) -> list[tuple[int, int]]:
    return [tuple(row) for row in client.query(
        f"SELECT toYYYYMM(ts) AS m, count() FROM {table} GROUP BY m ORDER BY m").result_rows]


def part_bytes(client: Client, database: str, month: str) -> int:
    return int(client.query(
        "SELECT sum(bytes_on_disk) FROM system.parts WHERE database = {d:String} AND active "
        "AND partition_id = {m:String}", parameters={"d": database, "m": month}
    ).result_rows[0][0])


def test_under_the_cap_nothing_is_dropped(local_store):
    settings, client = filled(local_store, 64 * MIB)
    report = enforce_size_cap(settings, client, size_bytes=64 * MIB)
    assert (report.dropped, report.still_over) == ([], False)
    assert months_left(client, "events") == [(202601, 1500), (202602, 1000), (202603, 500)]


def test_over_the_cap_the_oldest_month_goes_first_with_a_warning_and_a_record(
        local_store, caplog):
    """Over the cap by less than the oldest month's bytes: exactly that month is dropped,
    in every capped table, logged as a warning and recorded in pipeline_gauges."""
    settings, client = filled(local_store, 1 * MIB)
    oldest = part_bytes(client, settings.database, "202601")
    with caplog.at_level(logging.WARNING, logger="loopwatch.store.sizecap"):
        report = enforce_size_cap(settings, client, size_bytes=1 * MIB + oldest - 1)
    assert [(t, p, r) for t, p, r, _b in report.dropped] == [
        ("events", "202601", 1500), ("llm_calls", "202601", 1500)]
    assert report.dropped_bytes == oldest and not report.still_over
    assert months_left(client, "events") == [(202602, 1000), (202603, 500)]
    assert months_left(client, "llm_calls") == [(202602, 1000), (202603, 500)]
    assert "dropped the oldest partitions events 202601, llm_calls 202601 (3000 rows" \
        in caplog.text
    gauges = client.query("SELECT name, value FROM pipeline_gauges ORDER BY name").result_rows
    assert gauges == [("size_cap_dropped_bytes", float(oldest)),
                      ("size_cap_dropped_partitions", 2.0)]


def test_a_tiny_cap_on_the_real_directory_keeps_only_the_newest_month(local_store, caplog):
    """The real chdb directory (well over 1 MiB) against a 1 MiB cap: every month but the
    newest is dropped, and the report says the cap could not be met."""
    settings, client = filled(local_store, 1 * MIB)
    with caplog.at_level(logging.WARNING, logger="loopwatch.store.sizecap"):
        report = enforce_size_cap(settings, client)
    assert report.size_bytes > 1 * MIB
    assert [(t, p) for t, p, _r, _b in report.dropped] == [
        ("events", "202601"), ("llm_calls", "202601"),
        ("events", "202602"), ("llm_calls", "202602")]
    assert report.dropped_rows == 5000 and report.still_over
    assert months_left(client, "events") == [(202603, 500)]
    assert "still over its cap" in caplog.text
