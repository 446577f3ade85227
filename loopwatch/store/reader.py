"""Read-only access for commands and tests, wherever the store lives.

A reader never shares a client with the pipeline's writer: in chdb a ``readonly``
setting can stick to a client after a rejected write.
"""

from __future__ import annotations

import logging
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

log = logging.getLogger(__name__)


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
    """Queries a running ``loopwatch up`` over its loopback store service.

    ``follow`` (the data dir's settings) is for long-lived clients, the extra workers: a
    request the service refuses to connect is tried once more at the URL the data dir's
    announcement names now, since a restarted ``loopwatch up`` listens on a new port.
    """

    def __init__(self, url: str, timeout_s: float = 60.0, follow: Settings | None = None
                 ) -> None:
        self.url = url.rstrip("/")
        self._timeout_s = timeout_s
        self._follow = follow

    def health(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
            return dict(orjson.loads(response.read()))

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return dict(orjson.loads(self.send(path, orjson.dumps(body, default=str),
                                           "application/json")))

    def send(self, path: str, data: bytes, content_type: str) -> bytes:
        """POST ``data`` and return the answer; the service's refusal is a
        :class:`QueryError` with its message."""
        try:
            return self._send_once(path, data, content_type)
        except urllib.error.URLError:
            if not self._moved():
                raise
            return self._send_once(path, data, content_type)

    def _send_once(self, path: str, data: bytes, content_type: str) -> bytes:
        request = urllib.request.Request(f"{self.url}{path}", data=data,
                                         headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as response:
                return bytes(response.read())
        except urllib.error.HTTPError as exc:
            raise QueryError(orjson.loads(exc.read()).get("error", str(exc))) from exc

    def _moved(self) -> bool:
        """Whether the followed announcement now names another live service (then
        this reader uses it from now on)."""
        announced = running_service(self._follow) if self._follow is not None else None
        if announced is None or announced["url"].rstrip("/") == self.url:
            return False
        log.warning("the store service moved from %s to %s", self.url, announced["url"])
        self.url = announced["url"].rstrip("/")
        return True

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
