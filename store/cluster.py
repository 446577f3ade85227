"""ClickHouse-cluster DDL rendered from the single-node migrations.

The migrations in ``store/migrations`` stay the one definition of the schema.
For a sharded, replicated ClickHouse cluster this module rewrites them:

- every table becomes ``<name>_local`` created ``ON CLUSTER`` with the replicated form
  of its engine (``ReplacingMergeTree(version)`` ->
  ``ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}',
  '{replica}', version)``), plus a ``Distributed`` table under the original name, so
  processors, detectors, Grafana and the views read and write the names they know;
- rows are sharded by a stable key: ``run_id`` where the table has it (one run's rows
  stay on one shard, so ``FINAL`` deduplicates within a shard), else the table's
  dedup key (see :data:`SHARDING_KEYS`);
- views are created ``ON CLUSTER`` over the Distributed tables;
- a ``Null`` table (an insert-only entry point, e.g. ``events_in``) is created as it is
  on every node, and the materialized view that splits its inserts writes ``TO`` the
  Distributed table, so each node's inserts are sharded like any other rows;
- ``ALTER TABLE`` (a later migration) runs ``ON CLUSTER`` on ``<name>_local``, and also
  on the Distributed table when it changes columns (``ADD/MODIFY/DROP/RENAME/COMMENT
  COLUMN``), so both keep the same columns; other actions (``MATERIALIZE``, ``MODIFY
  TTL``, ...) concern the stored parts and run on ``_local`` only; ``ADD COLUMN ...
  ALIAS`` renders like any ADD (the Distributed table computes the alias itself); a
  ``RENAME COLUMN`` is not repeatable once an ALIAS takes the old name back, so a
  cluster that has applied it must not be given it again (the migration runner skips
  it on one node, see :func:`loopwatch.store.schema_versions.rename_done`);
- a rebuild (a table ``t`` re-keyed by migration ``NNN``: ``t_vNNN`` created, filled
  from ``t``, exchanged with it and dropped, see
  :mod:`loopwatch.store.schema_versions`) creates ``t_vNNN_local`` and its front, copies
  through the fronts (a synchronous Distributed insert, so the copy is complete when
  the statement returns), exchanges the ``_local`` tables ``ON CLUSTER`` and makes the
  front of ``t`` again over the new columns. The new local table's replica path is
  ``{uuid}``-based, so it stays unique after the exchange renames the table. A cluster
  that has applied the rebuild skips it when the file is run again, as a RENAME;
- a retention section sets TTLs on the ``_local`` tables (the defaults of
  :data:`loopwatch.store.retention.RETENTION`, which single-node ``migrate`` applies too);
- the views :mod:`loopwatch.store.event_views` generates (for the default settings and
  the shipped price table) are rendered like the migrations' own, after them, in place
  of migration 006's ``events_in_split`` (dropped first, for a cluster that has it), and
  recorded with their hash: a processor whose settings render other views re-creates
  them on the node it writes to;
- a last section records every migration in ``schema_migrations``
  (:mod:`loopwatch.store.schema_versions`), replicated to every node, so the processors'
  own ``migrate`` finds the cluster up to date and applies nothing.

``python -m loopwatch.store.cluster --cluster NAME [--database loopwatch]`` prints the
DDL; ``deploy/clickhouse/cluster.sql`` is that output for ``--cluster loopwatch``.
``single_node=True`` renders the same objects for one server without Keeper or a
cluster (plain engines; the name table is a pass-through ``Buffer`` over the local
table), which the tests execute on chdb.

>>> ddl = render_cluster_ddl("prod", "loopwatch")
>>> ddl[0]
'CREATE DATABASE IF NOT EXISTS loopwatch ON CLUSTER prod'
>>> [s for s in ddl if "loopwatch.runs ON CLUSTER" in s][0].split("ENGINE = ")[1]
"Distributed('prod', 'loopwatch', 'runs_local', cityHash64(run_id))"
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass

from loopwatch.core.config import Settings
from loopwatch.store import event_views
from loopwatch.store.retention import RETENTION, Retention
from loopwatch.store.schema_versions import (
    REBUILT,
    RECORD_COLUMNS,
    RECORD_TABLE,
    RECORD_TAIL,
    checksum,
    migrations,
    statements,
)

__all__ = ["RETENTION", "Retention", "render_cluster_ddl", "render_sql"]

#: Where each replica keeps its part of a table in Keeper; ClickHouse fills the macros.
REPLICA_PATH = "'/clickhouse/tables/{shard}/{database}/{table}', '{replica}'"
LOCAL_SUFFIX = "_local"

#: Sharding keys that differ from the default (``run_id``, else the ORDER BY columns).
#: ``dead_letters`` has a ``run_id`` (often empty), but its rows are replaced by ``id``,
#: and a replaced row must land on the shard of the row it replaces.
SHARDING_KEYS: dict[str, str] = {
    "dead_letters": "id", "capture_blobs": "hash", "capture_staging_blobs": "hash"}


_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TABLE = re.compile(
    r"^CREATE TABLE IF NOT EXISTS (?P<name>\w+)\s*\((?P<columns>.*)\)\s*"
    r"ENGINE\s*=\s*(?P<engine>\w+)(?:\((?P<args>[^)]*)\))?\s*(?P<tail>.*)$",
    re.DOTALL,
)
_VIEW = re.compile(r"^CREATE OR REPLACE VIEW (?P<name>\w+) AS\s*(?P<query>.*)$", re.DOTALL)
_MATERIALIZED_VIEW = re.compile(
    r"^CREATE MATERIALIZED VIEW IF NOT EXISTS (?P<name>\w+) TO (?P<target>\w+) AS\s*"
    r"(?P<query>.*)$", re.DOTALL)
_REBUILD_COPY = re.compile(
    r"^INSERT INTO (?P<new>\w+)_v(?P<number>\d{3}) \((?P<columns>[^)]*)\)\s*SELECT "
    r"(?P<select>.*) FROM (?P<source>\w+)$", re.DOTALL)
_REBUILD_SWAP = re.compile(r"^EXCHANGE TABLES (?P<new>\w+_v\d{3}) AND (?P<table>\w+)$")
_REBUILD_DROP = re.compile(r"^DROP TABLE IF EXISTS (?P<new>\w+_v\d{3})$")
#: where a rebuilt table keeps its replicas in Keeper: by the table's UUID (which ON
#: CLUSTER gives every replica alike), since the exchange renames it
REBUILD_REPLICA_PATH = "'/clickhouse/tables/{uuid}/{shard}', '{replica}'"
_ALTER = re.compile(r"^ALTER TABLE (?P<name>\w+)\s+(?P<action>.*)$", re.DOTALL)
#: ALTER actions on a table's columns, which its Distributed front table must follow
_COLUMN_ACTION = re.compile(r"^(ADD|MODIFY|DROP|RENAME|COMMENT) COLUMN\b")
#: where the migration record is replicated: one replica set over the whole cluster
RECORD_PATH = "'/clickhouse/tables/all/{database}/" + RECORD_TABLE + "', '{replica}'"
#: the settings the cluster DDL renders the generated views for: the defaults, whatever
#: the environment of whoever renders the file says
DEFAULTS = Settings.model_construct()
#: where the generated views' record is replicated, likewise
VIEWS_RECORD_PATH = ("'/clickhouse/tables/all/{database}/" + event_views.RECORD
                     + "', '{replica}'")
#: engines that store nothing: created as written on every node, never replicated
_STORELESS = frozenset({"Null"})
_ORDER_BY = re.compile(r"ORDER BY\s+(\((?P<many>[^)]*)\)|(?P<one>\w+))")
_TTL = re.compile(r"^\s*TTL\b", re.MULTILINE)
_SOURCE = re.compile(r"\b(FROM|JOIN)\s+(\w+)\b")


@dataclass(frozen=True)
class Table:
    name: str
    columns: str  # the column list as written, without the outer parentheses
    engine: str
    args: str
    tail: str  # PARTITION BY / ORDER BY / TTL ...

    @property
    def column_names(self) -> list[str]:
        names = []
        for line in self.columns.splitlines():
            token = line.strip().split(" ", 1)[0].strip(",")
            if token:
                names.append(token)
        return names

    @property
    def order_by(self) -> list[str]:
        match = _ORDER_BY.search(self.tail)
        if match is None:
            raise ValueError(f"table {self.name} has no ORDER BY")
        if match.group("one"):
            return [match.group("one")]
        return [part.strip() for part in match.group("many").split(",") if part.strip()]

    @property
    def sharding_key(self) -> str:
        if self.name in SHARDING_KEYS:
            columns = [SHARDING_KEYS[self.name]]
        elif "run_id" in self.column_names:
            columns = ["run_id"]
        else:
            columns = self.order_by
        return f"cityHash64({', '.join(columns)})"

    @property
    def has_own_ttl(self) -> bool:
        return bool(_TTL.search(self.tail))


@dataclass(frozen=True)
class View:
    name: str
    query: str


@dataclass(frozen=True)
class MaterializedView:
    name: str
    target: str
    query: str


@dataclass(frozen=True)
class Alter:
    table: str
    action: str

    @property
    def changes_columns(self) -> bool:
        return bool(_COLUMN_ACTION.match(self.action))

    @property
    def renames_column(self) -> bool:
        return self.action.startswith("RENAME COLUMN")


@dataclass
class Rebuild:
    """Migration ``number`` re-keys ``table``: ``definition`` is its new form (named
    ``table``), ``columns`` and ``select`` the copy's column list and SELECT list."""

    table: str
    number: str
    definition: Table
    columns: str = ""
    select: str = ""
    swapped: bool = False

    @property
    def new(self) -> str:
        return f"{self.table}_v{self.number}"


SchemaObject = Table | View | MaterializedView | Alter | Rebuild


def _rebuild_step(objects: list[SchemaObject], migration: str, statement: str) -> bool:
    """Take a rebuild's statement (see :class:`Rebuild`); False if it is none."""
    if rebuilt := REBUILT.match(statement):
        table = _TABLE.match(statement)
        assert table is not None
        objects.append(Rebuild(rebuilt["table"], rebuilt["number"], Table(
            rebuilt["table"], table["columns"].strip("\n"), table["engine"],
            (table["args"] or "").strip(), table["tail"].strip())))
        return True
    pending = objects[-1] if objects and isinstance(objects[-1], Rebuild) else None
    copy, swap, drop = (_REBUILD_COPY.match(statement), _REBUILD_SWAP.match(statement),
                        _REBUILD_DROP.match(statement))
    if not (copy or swap or drop):
        return False
    if pending is None or (copy and (copy["new"] != pending.table
                                     or copy["source"] != pending.table)) \
            or (swap and (swap["new"], swap["table"]) != (pending.new, pending.table)) \
            or (drop and (drop["new"] != pending.new or not pending.swapped)):
        raise ValueError(f"{migration}: a rebuild is CREATE TABLE IF NOT EXISTS t_vNNN, "
                         "INSERT INTO t_vNNN (...) SELECT ... FROM t, EXCHANGE TABLES "
                         f"t_vNNN AND t, DROP TABLE IF EXISTS t_vNNN: {statement[:80]!r}")
    if copy:
        pending.columns, pending.select = copy["columns"], copy["select"].strip()
    pending.swapped = pending.swapped or bool(swap)
    return True


def _add(objects: list[SchemaObject], where: str, statement: str) -> None:
    if _rebuild_step(objects, where, statement):
        return
    if table := _TABLE.match(statement):
        objects.append(Table(table["name"], table["columns"].strip("\n"),
                             table["engine"], (table["args"] or "").strip(),
                             table["tail"].strip()))
    elif view := _VIEW.match(statement):
        objects.append(View(view["name"], view["query"].strip()))
    elif feed := _MATERIALIZED_VIEW.match(statement):
        objects.append(MaterializedView(feed["name"], feed["target"],
                                        feed["query"].strip()))
    elif alter := _ALTER.match(statement):
        if not any(isinstance(obj, Table) and obj.name == alter["name"]
                   for obj in objects):
            raise ValueError(f"{where}: ALTER of unknown table {alter['name']}")
        objects.append(Alter(alter["name"], alter["action"].strip()))
    else:
        raise ValueError(
            f"{where}: cluster.py cannot render this statement yet; teach it "
            f"(store/cluster.py): {statement.splitlines()[0]!r}")


def schema_objects() -> list[SchemaObject]:
    """Every table, view, ALTER and rebuild of the migrations, in migration order, then
    the generated views (:mod:`loopwatch.store.event_views`, for the default settings
    and the shipped price table) in place of the views they replace."""
    objects: list[SchemaObject] = []
    for migration, sql in migrations():
        for statement in statements(sql):
            _add(objects, migration, statement)
    objects = [obj for obj in objects if not (isinstance(obj, MaterializedView)
                                              and obj.name in event_views.REPLACED)]
    for statement in event_views.render(DEFAULTS).creates:
        _add(objects, "store/event_views.py", statement)
    return objects


def _check_identifier(kind: str, value: str) -> str:
    if not _IDENT.match(value):
        raise ValueError(f"{kind} must be a plain identifier, got {value!r}")
    return value


def _replicated(table: Table, path: str = REPLICA_PATH) -> str:
    if not table.engine.endswith("MergeTree") or table.engine.startswith("Replicated"):
        raise ValueError(f"table {table.name}: cannot replicate engine {table.engine}")
    args = path + (f", {table.args}" if table.args else "")
    return f"Replicated{table.engine}({args})"


def _plain(table: Table) -> str:
    return f"{table.engine}({table.args})" if table.args else table.engine


def _sections(cluster: str, database: str, single_node: bool
              ) -> list[tuple[str, list[str]]]:
    _check_identifier("cluster", cluster)
    _check_identifier("database", database)
    on_cluster = "" if single_node else f" ON CLUSTER {cluster}"
    objects = schema_objects()
    known = {obj.name for obj in objects if not isinstance(obj, Alter | Rebuild)}
    tables = {obj.name: obj for obj in objects if isinstance(obj, Table)}

    def qualify(query: str) -> str:
        return _SOURCE.sub(
            lambda m: f"{m[1]} {database}.{m[2]}" if m[2] in known else m[0], query)

    def front(table: Table) -> str:
        local = f"{table.name}{LOCAL_SUFFIX}"
        if single_node:
            # No cluster on one server: a pass-through Buffer (flushes every insert at
            # once) stands in for Distributed, with the same name, columns and FINAL.
            engine = f"Buffer('{database}', '{local}', 1, 0, 0, 0, 0, 0, 0)"
        else:
            engine = f"Distributed('{cluster}', '{database}', '{local}', {table.sharding_key})"
        return (f"CREATE TABLE IF NOT EXISTS {database}.{table.name}{on_cluster} "
                f"AS {database}.{local}\nENGINE = {engine}")

    def rebuild(step: Rebuild) -> list[str]:
        local = f"{step.table}{LOCAL_SUFFIX}"
        new_local = f"{step.new}{LOCAL_SUFFIX}"
        definition = step.definition
        engine = _plain(definition) if single_node else _replicated(
            definition, REBUILD_REPLICA_PATH)
        tables[step.table] = definition
        new_front = Table(step.new, definition.columns, definition.engine, definition.args,
                          definition.tail)
        # one node has no Distributed table to insert through: the copy goes to _local
        into = new_local if single_node else step.new
        sync = "" if single_node else "\nSETTINGS insert_distributed_sync = 1"
        return [
            f"CREATE TABLE IF NOT EXISTS {database}.{new_local}{on_cluster}\n"
            f"(\n{definition.columns}\n)\nENGINE = {engine}\n{definition.tail}",
            front(new_front),
            f"INSERT INTO {database}.{into} ({step.columns})\nSELECT {step.select} "
            f"FROM {database}.{step.table}{sync}",
            f"EXCHANGE TABLES {database}.{new_local} AND {database}.{local}{on_cluster}",
            f"DROP TABLE IF EXISTS {database}.{step.table}{on_cluster}",
            front(definition).replace("CREATE TABLE IF NOT EXISTS ", "CREATE TABLE ", 1),
            f"DROP TABLE IF EXISTS {database}.{step.new}{on_cluster}",
            f"DROP TABLE IF EXISTS {database}.{new_local}{on_cluster}",
        ]

    schema = [f"CREATE DATABASE IF NOT EXISTS {database}{on_cluster}",
              *(f"DROP VIEW IF EXISTS {database}.{name}{on_cluster}"
                for name in event_views.REPLACED)]
    for obj in objects:
        if isinstance(obj, Rebuild):
            schema.extend(rebuild(obj))
            continue
        if isinstance(obj, Alter):
            if tables[obj.table].engine in _STORELESS:
                targets = [obj.table]
            else:
                targets = [f"{obj.table}{LOCAL_SUFFIX}"] + (
                    [obj.table] if obj.changes_columns else [])
            for target in targets:
                if single_node and target == obj.table and obj.renames_column:
                    # a Buffer cannot rename a column: it holds nothing, so it is
                    # made again over the renamed local table
                    schema.extend([f"DROP TABLE IF EXISTS {database}.{target}",
                                   front(tables[obj.table])])
                else:
                    schema.append(f"ALTER TABLE {database}.{target}{on_cluster} "
                                  f"{obj.action}")
            continue
        if isinstance(obj, View):
            schema.append(f"CREATE OR REPLACE VIEW {database}.{obj.name}{on_cluster} AS\n"
                          f"{qualify(obj.query)}")
            continue
        if isinstance(obj, MaterializedView):
            schema.append(f"CREATE MATERIALIZED VIEW IF NOT EXISTS {database}.{obj.name}"
                          f"{on_cluster} TO {database}.{obj.target} AS\n{qualify(obj.query)}")
            continue
        if obj.engine in _STORELESS:
            schema.append(f"CREATE TABLE IF NOT EXISTS {database}.{obj.name}{on_cluster}\n"
                          f"(\n{obj.columns}\n)\nENGINE = {_plain(obj)}")
            continue
        local = f"{obj.name}{LOCAL_SUFFIX}"
        engine = _plain(obj) if single_node else _replicated(obj)
        schema.append(f"CREATE TABLE IF NOT EXISTS {database}.{local}{on_cluster}\n"
                      f"(\n{obj.columns}\n)\nENGINE = {engine}\n{obj.tail}")
        schema.append(front(obj))
    retention = [
        f"ALTER TABLE {database}.{obj.name}{LOCAL_SUFFIX}{on_cluster} "
        f"MODIFY TTL {RETENTION[obj.name].ttl()}"
        for obj in objects if isinstance(obj, Table) and obj.name in RETENTION
    ]
    engine = ("ReplacingMergeTree(applied_at)" if single_node
              else f"ReplicatedReplacingMergeTree({RECORD_PATH}, applied_at)")
    views_engine = ("ReplacingMergeTree(applied_at)" if single_node
                    else f"ReplicatedReplacingMergeTree({VIEWS_RECORD_PATH}, applied_at)")
    values = ", ".join(f"('{name}', '{checksum(sql)}', now64(3), 'cluster.sql')"
                       for name, sql in migrations())
    rendered = event_views.render(DEFAULTS)
    record = [f"CREATE TABLE IF NOT EXISTS {database}.{RECORD_TABLE}{on_cluster}\n"
              f"(\n{RECORD_COLUMNS}\n)\nENGINE = {engine}\n{RECORD_TAIL}",
              f"INSERT INTO {database}.{RECORD_TABLE} (name, checksum, applied_at, how) "
              f"VALUES {values}",
              f"CREATE TABLE IF NOT EXISTS {database}.{event_views.RECORD}{on_cluster}\n"
              f"(\n{event_views.RECORD_COLUMNS}\n)\nENGINE = {views_engine}\n"
              f"{event_views.RECORD_TAIL}",
              f"INSERT INTO {database}.{event_views.RECORD} (name, content_hash, "
              f"applied_at) VALUES ('{event_views.RECORD_NAME}', "
              f"'{rendered.content_hash}', now64(3)), ('{event_views.STRUCTURE_NAME}', "
              f"'{rendered.structure_hash}', now64(3))"]
    return [("schema", schema), ("retention", retention), ("migrations applied", record)]


def render_cluster_ddl(cluster: str, database: str, *, single_node: bool = False
                       ) -> list[str]:
    """The statements that create loopwatch's schema on ClickHouse cluster ``cluster``.

    ``single_node=True``: the same objects without ``ON CLUSTER``, replication or
    ``Distributed`` (for one server or chdb; ``cluster`` is then unused).
    """
    return [statement for _title, section in _sections(cluster, database, single_node)
            for statement in section]


def render_sql(cluster: str, database: str = "loopwatch") -> str:
    """The whole file ``python -m loopwatch.store.cluster`` prints (comments included)."""
    lines = [
        "-- Generated by `python -m loopwatch.store.cluster "
        f"--cluster {cluster} --database {database}`",
        "-- from store/migrations/*.sql; do not edit, re-render after a migration.",
        "-- Tables are <name>_local (Replicated*MergeTree) + <name> (Distributed); run it",
        "-- once against any node: every statement is ON CLUSTER and idempotent, except",
        "-- RENAME COLUMN and a table rebuild (INSERT ... EXCHANGE TABLES), which a cluster",
        "-- that has applied them must skip (docs/operations.md).",
        "",
    ]
    for title, section in _sections(cluster, database, single_node=False):
        lines.append(f"-- {title}")
        if title == "retention":
            lines.extend(f"--   {name}: {rule.days} days by {rule.column} ({rule.why})"
                         for name, rule in RETENTION.items())
        lines.append("")
        lines.extend(f"{statement};\n" for statement in section)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loopwatch.store.cluster",
        description="Print loopwatch's ClickHouse-cluster DDL (ON CLUSTER, Replicated, "
                    "Distributed, retention TTLs), rendered from the migrations.")
    parser.add_argument("--cluster", required=True, help="cluster name from remote_servers")
    parser.add_argument("--database", default="loopwatch", help="database (default loopwatch)")
    args = parser.parse_args(argv)
    try:
        sys.stdout.write(render_sql(args.cluster, args.database))
    except ValueError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
