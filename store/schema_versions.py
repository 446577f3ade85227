"""Versioned migrations: each numbered file in ``store/migrations`` is applied
once to a store and recorded there (:data:`RECORD_TABLE`: name, checksum, applied_at).

Rules for whoever changes the schema:

- a change is a new file ``NNN_what.sql``; an applied file is never edited (its checksum
  is recorded, and ``migrate`` refuses a store whose record disagrees with the file);
  the :data:`BASELINE` files are pinned by ``tests/test_migrations.py``;
- a migration is recorded only after all its statements ran, so a crash in the middle
  runs it again: every statement must be idempotent (``IF NOT EXISTS``, ``IF EXISTS``,
  ``CREATE OR REPLACE``, ``MODIFY``);
- views hold no data: a changed view is ``CREATE OR REPLACE VIEW`` in a new migration.
  A materialized view cannot be replaced in place: drop and create it in one migration;
- ``ALTER TABLE`` is fine: :mod:`loopwatch.store.cluster` renders it ``ON CLUSTER``.
  ``RENAME COLUMN IF EXISTS a TO b`` is the one ALTER ClickHouse cannot repeat once
  ``a`` is back (as the ALIAS a renamed column keeps for a release): the runner skips a
  rename whose new name the table has, as done (:func:`rename_done`);
- a sorting key cannot lose a column in place: such a table ``t`` is rebuilt by the
  migration ``NNN`` as ``CREATE TABLE IF NOT EXISTS t_vNNN`` (the new definition),
  ``INSERT INTO t_vNNN (...) SELECT ... FROM t``, ``EXCHANGE TABLES t_vNNN AND t``,
  ``DROP TABLE IF EXISTS t_vNNN``. The runner skips the copy and the exchange once
  ``t`` has the new sorting key (:func:`rebuild_done`), so the four can run again
  after a crash between any two of them; :mod:`loopwatch.store.cluster` renders them.

A store created before versioning (by a build that re-ran :data:`BASELINE` at every
start and kept no record) is recognised by its tables and adopted: the baseline is run
once more, as every start of that build did (all of it is idempotent, and fills in what
an older store may lack), recorded as ``baseline``, and only the later migrations are
applied. On a ClickHouse cluster the DDL comes from ``deploy/clickhouse/cluster.sql``,
which records what it applied in the same table (replicated on every node).
"""

from __future__ import annotations

import hashlib
import logging
import re
from importlib import resources

from clickhouse_connect.driver.client import Client

log = logging.getLogger(__name__)

RECORD_TABLE = "schema_migrations"
#: the record's columns (the cluster DDL creates the same table, replicated)
RECORD_COLUMNS = ("    name        String,\n    checksum    String,\n"
                  "    applied_at  DateTime64(3, 'UTC'),\n    how         LowCardinality(String)")
#: the record's table settings after ``ENGINE = <engine>``: one row per migration
RECORD_TAIL = "ORDER BY name"

#: Every migration a store had before versioning; frozen (tests pin their checksums).
BASELINE = ("001_tables.sql", "002_metric_views.sql", "003_alerts.sql", "004_gauges.sql",
            "005_capture.sql", "006_events_in.sql")
#: A baseline table: present without a record, it marks a store made before versioning.
BASELINE_MARKER = "events"


class MigrationError(RuntimeError):
    """The store's recorded schema disagrees with this build's migrations."""


def migrations() -> list[tuple[str, str]]:
    """(name, sql) for every migration, in order."""
    folder = resources.files("loopwatch.store").joinpath("migrations")
    return sorted(
        (entry.name, entry.read_text())
        for entry in folder.iterdir()
        if entry.name.endswith(".sql")
    )


def statements(sql: str) -> list[str]:
    """Split a migration into statements (no `;` inside our DDL strings)."""
    lines = [line for line in sql.splitlines() if not line.lstrip().startswith("--")]
    return [part.strip() for part in "\n".join(lines).split(";") if part.strip()]


def checksum(sql: str) -> str:
    """sha256 of a migration's text, as recorded.

    >>> checksum("SELECT 1")[:12]
    'e004ebd5b553'
    """
    return hashlib.sha256(sql.encode()).hexdigest()


def record_ddl(database: str) -> str:
    return (f"CREATE TABLE IF NOT EXISTS {database}.{RECORD_TABLE}\n(\n{RECORD_COLUMNS}\n)\n"
            f"ENGINE = ReplacingMergeTree(applied_at)\n{RECORD_TAIL}")


def _exists(client: Client, database: str, table: str) -> bool:
    return bool(client.query(
        "SELECT count() FROM system.tables WHERE database = {d:String} AND name = {t:String}",
        parameters={"d": database, "t": table}).result_rows[0][0])


def recorded(client: Client, database: str) -> dict[str, str]:
    """Migration name -> checksum, for every migration the store records as applied."""
    rows = client.query(f"SELECT name, argMax(checksum, applied_at) FROM {database}."
                        f"{RECORD_TABLE} GROUP BY name").result_rows
    return {name: digest for name, digest in rows}


def _record(client: Client, database: str, name: str, sql: str, how: str) -> None:
    client.command(
        f"INSERT INTO {database}.{RECORD_TABLE} (name, checksum, applied_at, how) "
        "VALUES ({n:String}, {c:String}, now64(3), {h:String})",
        parameters={"n": name, "c": checksum(sql), "h": how})


_RENAME = re.compile(r"^ALTER TABLE (?P<table>\w+) RENAME COLUMN IF EXISTS \w+ TO "
                     r"(?P<new>\w+)$")


def rename_done(client: Client, statement: str) -> bool:
    """Whether ``statement`` is a column rename whose new name the table already has."""
    rename = _RENAME.match(statement)
    return rename is not None and bool(client.query(
        "SELECT count() FROM system.columns WHERE database = currentDatabase() AND "
        "table = {t:String} AND name = {c:String}",
        parameters={"t": rename["table"], "c": rename["new"]}).result_rows[0][0])


#: the new table of a rebuild, and its sorting key
REBUILT = re.compile(r"^CREATE TABLE IF NOT EXISTS (?P<table>\w+)_v(?P<number>\d{3})\s*\("
                     r".*\bORDER BY\s+\((?P<key>[^)]*)\)", re.DOTALL)
_REBUILD_STEP = re.compile(r"^(?:INSERT INTO (?P<copy>\w+)_v\d{3}\b|"
                           r"EXCHANGE TABLES (?P<swap>\w+)_v\d{3} AND )")


def rebuild_keys(sql: str) -> dict[str, str]:
    """Table -> the sorting key a migration's rebuild gives it (``ts, event_id``).

    >>> rebuild_keys("CREATE TABLE IF NOT EXISTS t_v010 (a UInt8) ENGINE = M ORDER BY (a, b)")
    {'t': 'a, b'}
    """
    found = {}
    for statement in statements(sql):
        if rebuilt := REBUILT.match(statement):
            found[rebuilt["table"]] = ", ".join(
                part.strip() for part in rebuilt["key"].split(","))
    return found


def rebuild_done(client: Client, statement: str, keys: dict[str, str]) -> bool:
    """Whether ``statement`` is the copy or the exchange of a rebuild whose table
    already has its new sorting key (``keys``: :func:`rebuild_keys` of the migration)."""
    step = _REBUILD_STEP.match(statement)
    if step is None:
        return False
    table = step["copy"] or step["swap"]
    current = client.query(
        "SELECT sorting_key FROM system.tables WHERE database = currentDatabase() AND "
        "name = {t:String}", parameters={"t": table}).result_rows
    return bool(current) and current[0][0] == keys.get(table)


def _run(client: Client, sql: str) -> None:
    keys = rebuild_keys(sql)
    for statement in statements(sql):
        if not rename_done(client, statement) and not rebuild_done(client, statement, keys):
            client.command(statement)


def apply_migrations(client: Client, database: str) -> list[str]:
    """Apply every migration the store has not recorded, in order, recording each;
    return their names (``[]``: the store was up to date). ``client``'s current
    database must be ``database`` (the migrations name their tables unqualified)."""
    known = dict(migrations())
    if not _exists(client, database, RECORD_TABLE):
        adopt = _exists(client, database, BASELINE_MARKER)
        client.command(record_ddl(database))
        if adopt:
            for name in BASELINE:
                _run(client, known[name])
                _record(client, database, name, known[name], "baseline")
            log.info("store %s predates versioned migrations: adopted at %s",
                     database, BASELINE[-1])
    done = recorded(client, database)
    for name, digest in done.items():
        if name in known and digest != checksum(known[name]):
            raise MigrationError(
                f"migration {name} was applied to store {database} with another text "
                f"(checksum {digest[:12]}, file {checksum(known[name])[:12]}); a migration "
                "is never edited once released: add a new one")
    applied = []
    for name, sql in known.items():
        if name not in done:
            _run(client, sql)
            _record(client, database, name, sql, "applied")
            applied.append(name)
    if applied:
        log.info("store %s: applied %s", database, ", ".join(applied))
    return applied
