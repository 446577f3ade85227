"""Read-only access for commands and tests, wherever the store lives.

A reader never shares a client with the pipeline's writer: in chdb a ``readonly``
setting can stick to a client after a rejected write.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from datetime import datetime
from typing import Any, Protocol

import orjson
from clickhouse_connect.driver.client import Client

from loopwatch.config import Settings
from loopwatch.store.clickhouse import (
    QueryResult,
    clickhouse_time,
    connect,
    migrate,
    run_query,
)


class QueryError(RuntimeError):
    """The store refused a query; the message is ClickHouse's."""


class Reader(Protocol):
    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> QueryResult: ...


class DirectReader:
    def __init__(self, client: Client) -> None:
        self._client = client

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> QueryResult:
        try:
            return run_query(self._client, sql, parameters, readonly=True)
        except Exception as exc:
            raise QueryError(str(exc).strip().splitlines()[0]) from exc


class ServiceReader:
    """Queries a running ``loopwatch up`` over its loopback store service."""

    def __init__(self, url: str, timeout_s: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self._timeout_s = timeout_s

    def health(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
            return dict(orjson.loads(response.read()))

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{self.url}{path}", data=orjson.dumps(body, default=str),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as response:
                return dict(orjson.loads(response.read()))
        except urllib.error.HTTPError as exc:
            raise QueryError(orjson.loads(exc.read()).get("error", str(exc))) from exc

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> QueryResult:
        wire = {key: _wire_value(value) for key, value in (parameters or {}).items()}
        payload = self.post("/query", {"sql": sql, "parameters": wire})
        return QueryResult(payload["columns"], payload["rows"])


def _wire_value(value: Any) -> Any:
    """Datetimes cross the wire as ClickHouse reads them."""
    return clickhouse_time(value) if isinstance(value, datetime) else value


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running_service(settings: Settings) -> dict[str, Any] | None:
    """The announcement of a live ``loopwatch up`` on this data dir, if there is one."""
    try:
        announced = dict(orjson.loads(settings.service_file.read_bytes()))
    except (FileNotFoundError, orjson.JSONDecodeError):
        return None
    if not _alive(int(announced.get("pid", -1))):
        return None
    try:
        ServiceReader(announced["url"]).health()
    except OSError:
        return None
    return announced


def open_reader(settings: Settings) -> Reader:
    if settings.clickhouse_url:
        return DirectReader(connect(settings))
    announced = running_service(settings)
    if announced is not None:
        return ServiceReader(announced["url"])
    try:
        migrate(settings)
        return DirectReader(connect(settings))
    except Exception as exc:
        raise QueryError(
            f"cannot open the embedded store at {settings.chdb_path}: {exc}. "
            "If another loopwatch process owns it, it must be running `loopwatch up`."
        ) from exc
