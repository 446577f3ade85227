"""A fresh, migrated database per test in the session's in-process chdb store, cheaply.

chdb opens one engine path per process, so tests that need a store of their own get a
database of their own in ``local_store``'s engine. Migrating one from scratch runs every
migration (about 80 statements, table rebuilds among them: ~0.85 s of CPU on the
Intel Xeon of 2026-12-06); instead one database per engine is migrated for real (the template)
and each fresh database, ``local_store``'s own among them, is created from the
template's final definitions, with the template's migration record, then ``migrate()``d
(which finds every migration recorded and only sets the TTLs the test's settings ask
for: ~0.45 s). The copy checks itself: its definitions must be the template's, object
for object, or the test fails.
"""

from __future__ import annotations

import uuid
from typing import Any

from clickhouse_connect.driver.client import Client

from loopwatch.core.config import Settings
from loopwatch.store.clickhouse import connect, migrate
from loopwatch.store.schema_versions import RECORD_TABLE
from loopwatch.store.tables import GENERATED_VIEWS

#: what a migrated store records about itself: copied from the template with the
#: definitions (the generated views' record too, so the copy's migrate re-creates none)
_RECORDS = (RECORD_TABLE, GENERATED_VIEWS)

_TEMPLATES: dict[str, str] = {}  # chdb path -> the migrated template database


def _definitions(client: Client, database: str) -> list[tuple[str, str, str]]:
    """(name, engine, CREATE statement) of every object in ``database``, the database's
    name in each statement replaced by a placeholder so two databases compare."""
    rows = client.query(
        "SELECT name, engine, create_table_query FROM system.tables "
        "WHERE database = {d:String} AND NOT is_temporary AND name NOT LIKE '.inner%' "
        "ORDER BY name", parameters={"d": database}).result_rows
    return [(name, engine, query.replace(f"{database}.", "{db}."))
            for name, engine, query in rows]


def _template(base: Settings, client: Client) -> str:
    """The engine's migrated template database (``base.data_dir``'s), made once."""
    key = str(base.chdb_path)
    if key not in _TEMPLATES:
        name = f"lw_template_{uuid.uuid4().hex[:12]}"
        template = migrate(Settings(data_dir=base.data_dir, database=name))
        stray = [table for table, engine, _ in _definitions(client, name)
                 if table not in _RECORDS and "View" not in engine and int(template.query(
                     f"SELECT count() FROM {name}.`{table}`").result_rows[0][0])]
        # copying rows into a table a materialized view reads would double the view's
        assert not stray, f"migrations left rows in {stray}: tests/stores.py copies none"
        _TEMPLATES[key] = name
    return _TEMPLATES[key]


def migrated_store(settings: Settings, client: Client | None = None) -> Client:
    """``migrate(settings)`` of a database that does not exist yet, from the template of
    ``settings.data_dir``'s engine (``client``: one on that engine, if there is one):
    the database exactly as a migration from scratch leaves it, and a client using it."""
    client = client or connect(settings, database="")
    template = _template(settings, client)
    database = settings.database
    wanted = _definitions(client, template)
    client.command(f"CREATE DATABASE {database}")
    pending = [query.replace("{db}.", f"{database}.") for _, _, query in wanted]
    while pending:  # a view is created once what it reads exists
        failed: list[str] = []
        errors: list[Exception] = []
        for query in pending:
            try:
                client.command(query)
            except Exception as exc:  # retried after the others, then raised
                failed.append(query)
                errors.append(exc)
        if len(failed) == len(pending):
            raise errors[0]
        pending = failed
    for record in _RECORDS:
        client.command(f"INSERT INTO {database}.{record} SELECT * FROM {template}.{record}")
    copied = _definitions(client, database)
    assert copied == wanted, "the copied database differs from the migrated template"
    return migrate(settings)


def fresh_store(local_store: tuple[Settings, Client], prefix: str,
                **overrides: Any) -> tuple[Settings, Client]:
    """Settings for a new database ``<prefix>_<random>`` in ``local_store``'s engine and
    its client: the database exactly as ``migrate(settings)`` leaves a new one."""
    base, client = local_store
    settings = Settings(data_dir=base.data_dir, database=f"{prefix}_{uuid.uuid4().hex[:8]}",
                        **overrides)
    return settings, migrated_store(settings, client)
