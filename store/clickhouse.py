"""Opening ClickHouse: embedded chdb under the data dir, or a server over HTTP(S).

chdb lets one process own a data path. In the embedded default that owner is the
process running the processors (``loopwatch up``); everybody else reaches the store
through its service (:mod:`loopwatch.store.service`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, overload
from urllib.parse import urlparse

import clickhouse_connect
from clickhouse_connect.driver.client import Client

from loopwatch.core.config import Settings
from loopwatch.ingest.privatefs import private_dir
from loopwatch.store import event_views
from loopwatch.store.retention import apply_retention
from loopwatch.store.schema_versions import apply_migrations
from loopwatch.store.schema_versions import migrations as migrations  # cluster.py, tests
from loopwatch.store.schema_versions import statements as statements

READONLY_SETTINGS = {"readonly": 1}


@dataclass(frozen=True)
class QueryResult:
    columns: list[str]
    rows: list[list[Any]]

    def records(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, row, strict=True)) for row in self.rows]

    def scalar(self) -> Any:
        return self.rows[0][0] if self.rows and self.rows[0] else None


def clickhouse_time(value: datetime) -> str:
    """A datetime as ClickHouse parses a DateTime64 parameter or JSON value: UTC, no offset.

    >>> from datetime import UTC, timedelta, timezone
    >>> clickhouse_time(datetime(2026, 1, 1, 13, tzinfo=timezone(timedelta(hours=1))))
    '2026-01-01 12:00:00.000'
    """
    if value.tzinfo is not None:
        value = value.astimezone(UTC).replace(tzinfo=None)
    return value.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


@overload
def read_time(value: datetime | str) -> datetime: ...
@overload
def read_time(value: None) -> None: ...
def read_time(value: datetime | str | None) -> datetime | None:
    """A time as a query returns it (UTC, but without a zone: a ``datetime`` from a
    client, ISO text through the store service) made aware, so it compares with
    ``datetime.now(UTC)``; the inverse of :func:`clickhouse_time`.

    >>> read_time(datetime(2026, 1, 1)).isoformat(), read_time(None)
    ('2026-01-01T00:00:00+00:00', None)
    >>> read_time("2026-01-01 00:00:00.250").isoformat()
    '2026-01-01T00:00:00.250000+00:00'
    """
    if value is None:
        return None
    moment = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def connect(settings: Settings, database: str | None = None, server: str | None = None
            ) -> Client:
    """A new client; ``database=None`` connects to the loopwatch database, ``server``
    (a URL like ``clickhouse_url``) to a server as another user."""
    database = settings.database if database is None else database
    if server or settings.clickhouse_url:
        url = urlparse(server or settings.clickhouse_url or "")
        return clickhouse_connect.get_client(
            host=url.hostname or "localhost",
            port=url.port or (8443 if url.scheme == "https" else 8123),
            username=url.username or "default",
            password=url.password or "",
            secure=url.scheme == "https",
            database=database or (url.path.strip("/") or "default"),
        )
    private_dir(settings.chdb_path)
    client = clickhouse_connect.get_client(dsn=f"chdb://{settings.chdb_path}")
    if database:
        client.command(f"USE {database}")
    return client


def migrate(settings: Settings) -> Client:
    """Create the database, apply the migrations it has not recorded yet
    (:mod:`loopwatch.store.schema_versions`), the views generated for ``settings``
    (:mod:`loopwatch.store.event_views`) and the retention TTLs
    (:mod:`loopwatch.store.retention`); safe to run at every start."""
    bootstrap = connect(settings, database="")
    bootstrap.command(f"CREATE DATABASE IF NOT EXISTS {settings.database}")
    client = connect(settings) if settings.clickhouse_url else bootstrap
    if not settings.clickhouse_url:
        client.command(f"USE {settings.database}")
    apply_migrations(client, settings.database)
    event_views.install(client, settings)
    if settings.apply_retention:
        apply_retention(client, settings)
    return client


def run_query(client: Client, sql: str, parameters: dict[str, Any] | None = None,
              readonly: bool = False) -> QueryResult:
    result = client.query(
        sql, parameters=parameters or {}, settings=READONLY_SETTINGS if readonly else None
    )
    return QueryResult(list(result.column_names), [list(row) for row in result.result_rows])
