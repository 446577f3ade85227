"""The store service: how other processes reach a store that one process owns.

chdb allows a single process per data path. In the embedded default the process that
runs the processors owns it and serves read-only queries (and the few writes workers
need) over a Unix domain socket in the private data dir; it announces itself in
``<data_dir>/service.json``. With a ClickHouse server every process connects directly
and this service is only a convenience.

Who can reach it: only the owner's user. The socket is 0600 inside the 0700 data dir
(:mod:`loopwatch.ingest.privatefs`), so another local user cannot connect, and no browser can
reach a Unix socket at all. As a second line, a request must name the service's own
``Host`` (:data:`SERVICE_HOST`), carry no ``Origin`` or ``Sec-Fetch-*`` header (browsers
send them), and send its body with the content type its endpoint expects.

The server is uvicorn + starlette (ASGI), the stack of the web view and the OTLP
receiver: a maintained HTTP/1.1 implementation (h11) with keep-alive deadlines rather
than ``http.server``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
from clickhouse_connect.driver.client import Client
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from loopwatch.ingest.privatefs import FILE_MODE, private_dir, write_private
from loopwatch.store.reader import DirectReader, Reader

#: the ``Host`` every client of the service names (it is not a network name)
SERVICE_HOST = "loopwatch-store"
#: how an announcement names a Unix socket: ``unix:<absolute path>``
UNIX_SCHEME = "unix:"
#: headers only browsers send: a request carrying one came from a web page
BROWSER_HEADERS = (b"origin", b"sec-fetch-site", b"sec-fetch-mode")
JSON = "application/json"
OCTETS = "application/octet-stream"
#: sun_path is 108 bytes on Linux, with its terminating NUL
MAX_SOCKET_PATH = 107


def _json_default(value: Any) -> Any:
    return str(value)


def dumps(value: Any) -> bytes:
    return orjson.dumps(value, default=_json_default, option=orjson.OPT_NON_STR_KEYS)


class ServiceInUse(RuntimeError):
    """Another live process already serves this data dir's socket."""


def _reply(code: int, body: Any) -> Response:
    return Response(dumps(body), status_code=code, media_type=JSON)


def _error(code: int, message: str) -> Response:
    return _reply(code, {"error": message[:2000]})


class Guard:
    """Refuses what no loopwatch client sends before any endpoint sees it: a foreign
    ``Host`` (421), a browser's request (403)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        refusal: Response | None = None
        if headers.get(b"host", b"").decode("latin-1") != SERVICE_HOST:
            refusal = _error(421, f"this is the loopwatch store service; Host must be "
                                  f"{SERVICE_HOST!r}")
        elif any(name in headers for name in BROWSER_HEADERS):
            refusal = _error(403, "the store service does not serve web pages")
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)


def bindable_socket(wanted: Path) -> Path:
    """``wanted``, or where a socket can be bound when ``wanted`` is longer than a Unix
    socket path may be: a fresh private folder of the system's temporary dir (the
    announcement names it, so clients find it all the same)."""
    if len(os.fsencode(wanted)) <= MAX_SOCKET_PATH:
        return wanted
    return Path(tempfile.mkdtemp(prefix="loopwatch-")) / wanted.name


def bind_private(path: Path) -> socket.socket:
    """A listening Unix socket at ``path``, 0600 in a 0700 folder. A socket file left by
    a killed owner is replaced; one a live process answers on is not."""
    private_dir(path.parent)
    if path.exists():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(2)
            probe.connect(str(path))
        except OSError:
            path.unlink(missing_ok=True)  # nobody listens: stale
        else:
            raise ServiceInUse(f"another loopwatch process serves {path}")
        finally:
            probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
        os.chmod(path, FILE_MODE)
        listener.listen(128)
        listener.setblocking(False)
    except BaseException:
        listener.close()
        raise
    return listener


class StoreService:
    """Serves ``GET /health``, ``POST /query`` ({sql, parameters}) and admin actions.

    Admin actions (``POST /admin/<name>``) are the few writes other processes need from
    the owner, e.g. ``dlq-replay`` and ``reprocess``; each takes and returns JSON. Raw
    actions take the request body as bytes (bulk rows, which are not worth a JSON
    envelope) and return JSON.
    """

    def __init__(
        self,
        reader: Reader | Client,
        status: Callable[[], dict[str, Any]],
        service_file: Path,
        socket_path: Path | None = None,
        actions: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] | None = None,
        raw_actions: dict[str, Callable[[bytes], dict[str, Any]]] | None = None,
    ) -> None:
        # user SQL: a PooledReader (the runtime's) runs several at once, each guarded;
        # a bare client is one guarded reader
        self._reader: Reader = DirectReader(reader) if isinstance(reader, Client) else reader
        self._actions = actions or {}
        self._raw_actions = raw_actions or {}
        self._status = status
        self._service_file = service_file
        wanted = socket_path or service_file.with_name("service.sock")
        self.socket_path = bindable_socket(wanted)
        self._temporary = self.socket_path.parent if self.socket_path != wanted else None
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"{UNIX_SCHEME}{self.socket_path}"

    def start(self, announce: dict[str, Any]) -> str:
        """Listen, wait until the server serves, then announce it (0600)."""
        import uvicorn

        listener = bind_private(self.socket_path)
        config = uvicorn.Config(self._app(), log_level="warning", access_log=False,
                                lifespan="off", timeout_keep_alive=30,
                                timeout_graceful_shutdown=5)
        self._server = server = uvicorn.Server(config)
        self._thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]},
                                        daemon=True, name="store-service")
        self._thread.start()
        while not server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the store service did not start on {self.socket_path}")
            self._thread.join(0.02)
        # started_at tells one announcement from the next at the same socket (an `up` that
        # re-executed itself after losing its broker keeps its pid and its socket path)
        write_private(self._service_file, dumps({"url": self.url, "socket": str(self.socket_path),
                                                 "pid": os.getpid(), "started_at": time.time(),
                                                 **announce}))
        return self.url

    def stop(self) -> None:
        self._service_file.unlink(missing_ok=True)
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(10)
        self.socket_path.unlink(missing_ok=True)
        if self._temporary is not None:
            with contextlib.suppress(OSError):
                self._temporary.rmdir()

    def query(self, sql: str, parameters: dict[str, Any]) -> dict[str, Any]:
        """A user's query, through the guard (no global lock: each runs on a reader
        client of its own, so a heavy one holds up neither other queries nor writes)."""
        result = self._reader.query(sql, parameters)
        return {"columns": result.columns, "rows": result.rows}

    def _app(self) -> ASGIApp:
        service = self

        def expects(content_type: str, handle: Callable[[bytes], Any]
                    ) -> Callable[[Request], Awaitable[Response]]:
            async def endpoint(request: Request) -> Response:
                given = request.headers.get("content-type", "").split(";")[0].strip()
                if given != content_type:
                    return _error(415, f"{request.url.path} takes {content_type}, "
                                       f"not {given or 'no content type'}")
                try:
                    data = await request.body()
                except ClientDisconnect:  # hung up mid-body: nothing to act on, and the
                    # answer goes nowhere (uvicorn drops it), but no traceback is logged
                    return _error(400, "the request ended before its body")
                try:
                    result = await run_in_threadpool(handle, data)
                except Exception as exc:
                    message = str(exc).strip().splitlines()
                    return _error(400, message[0] if message else repr(exc))
                return _reply(200, result)
            return endpoint

        def query(data: bytes) -> dict[str, Any]:
            body = orjson.loads(data)
            return service.query(str(body["sql"]), dict(body.get("parameters") or {}))

        async def health(request: Request) -> Response:
            return _reply(200, {"ok": True, **await run_in_threadpool(service._status)})

        async def admin(request: Request) -> Response:
            name = request.path_params["name"]
            if name in service._raw_actions:
                endpoint = expects(OCTETS, service._raw_actions[name])
            elif name in service._actions:
                action = service._actions[name]
                endpoint = expects(JSON, lambda data: action(orjson.loads(data)))
            else:
                return _error(404, f"no such endpoint {request.url.path}")
            return await endpoint(request)

        async def not_found(request: Request, exc: Exception) -> Response:
            return _error(getattr(exc, "status_code", 404),
                          f"no such endpoint {request.method} {request.url.path}")

        app = Starlette(routes=[
            Route("/health", health, methods=["GET"]),
            Route("/query", expects(JSON, query), methods=["POST"]),
            Route("/admin/{name}", admin, methods=["POST"]),
        ], exception_handlers={404: not_found, 405: not_found})
        return Guard(app)

