"""Read-only access for commands and tests, wherever the store lives.

A reader never shares a client with the pipeline's writer: in chdb a ``readonly``
setting can stick to a client after a rejected write.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any, Protocol

import httpx
import orjson
from clickhouse_connect.driver.client import Client

from loopwatch.core.config import Settings
from loopwatch.store.clickhouse import (
    QueryResult,
    clickhouse_time,
    connect,
    migrate,
)
from loopwatch.store.sqlguard import RefusedQuery, SqlGuard, StoreBusy, limit_hit

log = logging.getLogger(__name__)

#: between looks at a store service whose owner lives but does not answer yet
RETRY_PAUSE_S = 0.2


class QueryError(RuntimeError):
    """The store refused a query; the message is ClickHouse's."""


class Reader(Protocol):
    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> QueryResult: ...


def run_user_query(client: Client, sql: str, parameters: dict[str, Any] | None,
                   guard: SqlGuard) -> QueryResult:
    """A user's query: vetted by ``guard`` (:mod:`loopwatch.store.sqlguard`), then its
    canonical text run under the guard's limits. A refusal or a limit hit is a
    :class:`RefusedQuery` with one line saying which."""
    canonical = guard.vet(client, sql)
    try:
        result = client.query(canonical, parameters=parameters or {},
                              settings=guard.limits.engine_settings())
    except Exception as exc:
        hit = limit_hit(str(exc), guard.limits)
        if hit is not None:
            raise RefusedQuery(hit) from exc
        raise
    return QueryResult(list(result.column_names), [list(row) for row in result.result_rows])


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else repr(exc)


class DirectReader:
    """Runs user SQL on a client of its own, through the guard (one SELECT over the
    loopwatch database, bounded by the ``query_*`` settings)."""

    def __init__(self, client: Client, settings: Settings | None = None) -> None:
        self._client = client
        self._guard = SqlGuard(settings or Settings())

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> QueryResult:
        try:
            return run_user_query(self._client, sql, parameters, self._guard)
        except Exception as exc:
            resync(self._client)
            raise QueryError(_first_line(exc)) from exc


def resync(client: Client, attempts: int = 4) -> None:
    """Make sure the next query on ``client`` gets its own answer.

    A chdb query that fails mid-stream leaves the rest of its output on the handle, and
    the next query gets it (measured: after ``SELECT throwIf(number = 70000) FROM
    numbers(1e5)`` failed, ``SELECT 42`` returned two rows of zeros). So after a failure
    a fresh random token is queried until it comes back as itself.
    """
    for _ in range(attempts):
        token = uuid.uuid4().hex
        try:
            rows = client.query("SELECT {token:String}", parameters={"token": token},
                                settings={"readonly": 1}).result_rows
        except Exception:
            continue
        if [tuple(row) for row in rows] == [(token,)]:
            return
    raise QueryError("the store's reader is out of step after a failed query; "
                     "run the command again")


class PooledReader:
    """User SQL for many callers at once (the store service): up to
    ``query_concurrency`` reader clients, each running one query, so a heavy query holds
    up only its own client (chdb runs queries of separate clients of one process
    concurrently). Beyond the pool a caller waits ``query_busy_wait_s``, then is refused
    as busy. A client whose query failed in the engine is closed, not reused: a failed
    query must not leave state behind for the next caller.
    """

    def __init__(self, settings: Settings, connect_client: Callable[[], Client] | None = None
                 ) -> None:
        self._guard = SqlGuard(settings)
        self._connect = connect_client or (lambda: connect(settings))
        self._size = settings.query_concurrency
        self._wait_s = settings.query_busy_wait_s
        self._slots = threading.BoundedSemaphore(self._size)
        self._idle: list[Client] = []
        self._lock = threading.Lock()

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> QueryResult:
        if not self._slots.acquire(timeout=self._wait_s):
            raise StoreBusy(f"store busy: {self._size} queries are running "
                            "(LOOPWATCH_QUERY_CONCURRENCY); try again")
        client: Client | None = None
        try:
            with self._lock:
                client = self._idle.pop() if self._idle else None
            if client is None:
                client = self._connect()
            try:
                return run_user_query(client, sql, parameters, self._guard)
            except Exception as exc:
                spent, client = client, None
                spent.close()
                if isinstance(exc, RefusedQuery):
                    raise
                raise QueryError(_first_line(exc)) from exc
        finally:
            if client is not None:
                with self._lock:
                    self._idle.append(client)
            self._slots.release()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for client in idle:
            client.close()


class ServiceUnreachable(ConnectionError):
    """The store service did not answer (not running, gone, or too slow)."""


#: a request body goes to the socket in pieces of this size, under the ~208 KB a socket
#: buffers by default. httpcore's synchronous write hands a ``bytes`` body to
#: ``socket.send`` whole and re-slices whatever the socket did not take, copying the
#: rest of the body after every send: quadratic past the socket's buffer. An extra
#: worker's insert batches are tens of MB: a 20 MB body cost the sending thread
#: 104-116 ms of CPU whole, 9.5-10.5 ms in 128 KB pieces (docs/performance.md).
BODY_PIECE_BYTES = 128 << 10


def body_pieces(data: bytes) -> Iterator[bytes]:
    """``data`` in :data:`BODY_PIECE_BYTES` pieces, each copied once.

    >>> [len(piece) for piece in body_pieces(bytes(BODY_PIECE_BYTES * 2 + 5))]
    [131072, 131072, 5]
    """
    view = memoryview(data)
    for start in range(0, len(data), BODY_PIECE_BYTES):
        yield bytes(view[start:start + BODY_PIECE_BYTES])


class ServiceReader:
    """Queries a running ``loopwatch up`` over its store service (a Unix socket, whose
    address the data dir's ``service.json`` names as ``unix:<path>``).

    ``follow`` (the data dir's settings) is for long-lived clients, the extra workers: a
    request the service refuses to connect is tried once more at the address the data
    dir's announcement names now (the socket lives in the data dir, so it moves only
    when that path is too long for a socket and ``up`` binds a temporary one).
    """

    def __init__(self, url: str, timeout_s: float = 60.0, follow: Settings | None = None
                 ) -> None:
        self._timeout_s = timeout_s
        self._follow = follow
        self._client: httpx.Client | None = None
        self.url = url

    @property
    def url(self) -> str:
        return self._url

    @url.setter
    def url(self, value: str) -> None:
        value = value.rstrip("/")
        if value != getattr(self, "_url", None):
            self._url, self._client = value, None

    def _http(self) -> httpx.Client:
        """One keep-alive client per address; ``unix:<path>`` goes over that socket."""
        client = self._client
        if client is None:
            from loopwatch.store.service import SERVICE_HOST, UNIX_SCHEME

            if self.url.startswith(UNIX_SCHEME):
                transport = httpx.HTTPTransport(uds=self.url.removeprefix(UNIX_SCHEME))
                base = f"http://{SERVICE_HOST}"
            else:
                transport, base = httpx.HTTPTransport(), self.url
            client = self._client = httpx.Client(
                transport=transport, base_url=base,
                timeout=httpx.Timeout(self._timeout_s, connect=5.0))
        return client

    def _request(self, method: str, path: str, data: bytes | None = None,
                 content_type: str | None = None, timeout_s: float | None = None) -> bytes:
        headers = {"Content-Type": content_type} if content_type else {}
        content: bytes | Iterator[bytes] | None = data
        if data is not None and len(data) > BODY_PIECE_BYTES:
            # with the length given, httpx sends the pieces as one plain body, not chunked
            content, headers["Content-Length"] = body_pieces(data), str(len(data))
        try:
            response = self._http().request(
                method, path, content=content, headers=headers,
                timeout=httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s)
        except httpx.TransportError as exc:
            raise ServiceUnreachable(f"the store service at {self.url} did not answer: "
                                     f"{exc or type(exc).__name__}") from exc
        if response.status_code != 200:
            try:
                message = str(orjson.loads(response.content).get("error"))
            except (orjson.JSONDecodeError, AttributeError):
                message = f"HTTP {response.status_code}"
            raise QueryError(message)
        return response.content

    def health(self) -> dict[str, Any]:
        return dict(orjson.loads(self._followed("GET", "/health", timeout_s=5.0)))

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return dict(orjson.loads(self.send(path, orjson.dumps(body, default=str),
                                           "application/json")))

    def send(self, path: str, data: bytes, content_type: str) -> bytes:
        """POST ``data`` and return the answer; the service's refusal is a
        :class:`QueryError` with its message, no answer a :class:`ServiceUnreachable`."""
        return self._followed("POST", path, data, content_type)

    def _followed(self, method: str, path: str, data: bytes | None = None,
                  content_type: str | None = None, timeout_s: float | None = None) -> bytes:
        """A request, tried once more where the followed announcement names the service
        now when this address refused to connect (once that service answers:
        :func:`await_service`)."""
        try:
            return self._request(method, path, data, content_type, timeout_s)
        except ServiceUnreachable as exc:
            if not isinstance(exc.__cause__, httpx.ConnectError) or self._follow is None:
                raise
            announced = await_service(self._follow, self._follow.broker_wait_s)
            if announced is None:
                raise
            if announced["url"].rstrip("/") != self.url:
                log.warning("the store service moved from %s to %s", self.url,
                            announced["url"])
                self.url = announced["url"]
            return self._request(method, path, data, content_type, timeout_s)

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


def _announced_by_the_living(settings: Settings) -> dict[str, Any] | None:
    """The data dir's announcement if it names a live process, answering or not; an
    announcement that is no JSON object with an integer pid names nobody."""
    try:
        announced = orjson.loads(settings.service_file.read_bytes())
    except (FileNotFoundError, orjson.JSONDecodeError):
        return None
    if not isinstance(announced, dict) or type(announced.get("pid")) is not int:
        return None
    return announced if _alive(announced["pid"]) else None


def await_service(settings: Settings, timeout_s: float) -> dict[str, Any] | None:
    """The announcement of a live ``up`` that answers, waiting up to ``timeout_s`` while
    the announcing process lives but does not answer yet: too busy for its health check
    on a loaded machine, or re-executing itself after losing its embedded broker (its
    pid and announcement stay, its socket is rebound). No announcement, or a dead pid,
    is an answer at once: nobody is coming back."""
    deadline = time.monotonic() + timeout_s
    while True:
        announced = running_service(settings)
        if (announced is not None or _announced_by_the_living(settings) is None
                or time.monotonic() >= deadline):
            return announced
        time.sleep(RETRY_PAUSE_S)


def running_service(settings: Settings) -> dict[str, Any] | None:
    """The announcement of a live ``loopwatch up`` on this data dir, if there is one."""
    announced = _announced_by_the_living(settings)
    if announced is None:
        return None
    try:
        ServiceReader(announced["url"]).health()
    except (OSError, QueryError):
        return None
    return announced


def store_health(reader: Reader) -> str | None:
    """None when the store behind ``reader`` answers, else one line saying why not: the
    store service's own health, or a trivial query for a reader of its own."""
    try:
        if isinstance(reader, ServiceReader):
            reader.health()
        else:
            reader.query("SELECT 1")
    except ServiceUnreachable as exc:
        return f"unreachable: {exc}"
    except (OSError, QueryError) as exc:
        return f"failing: {_first_line(exc)}"
    return None


def open_reader(settings: Settings, follow: bool = False) -> Reader:
    """The reader for ``settings``' store: its ClickHouse server, the store service of a
    running ``up`` on the data dir, or the embedded store itself. ``follow`` is for
    long-lived callers (``loopwatch serve``): a service reader then re-reads the data
    dir's announcement when its address stops answering, so it outlives a restart of
    ``up`` even when the restarted one binds another socket."""
    if settings.clickhouse_url:
        return DirectReader(connect(settings, server=settings.clickhouse_reader_url), settings)
    announced = running_service(settings)
    if announced is not None:
        return ServiceReader(announced["url"], follow=settings if follow else None)
    try:
        migrate(settings)
        return DirectReader(connect(settings), settings)
    except Exception as exc:
        raise QueryError(
            f"cannot open the embedded store at {settings.chdb_path}: {exc}. "
            "If another loopwatch process owns it, it must be running `loopwatch up`."
        ) from exc
