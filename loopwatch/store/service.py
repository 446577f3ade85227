"""The store service: how other processes reach a store that one process owns.

chdb allows a single process per data path. In the embedded default the process that
runs the processors owns it and serves read-only queries over loopback HTTP; it
announces itself in ``<data_dir>/service.json``. With a ClickHouse server every process
connects directly and this service is only a convenience.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import orjson
from clickhouse_connect.driver.client import Client

from loopwatch.store.reader import DirectReader, Reader


def _json_default(value: Any) -> Any:
    return str(value)


def dumps(value: Any) -> bytes:
    return orjson.dumps(value, default=_json_default, option=orjson.OPT_NON_STR_KEYS)


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
        host: str = "127.0.0.1",
        port: int = 0,
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
        handler = self._handler_class()
        self._server = ThreadingHTTPServer((host, port), handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="store-service")

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self, announce: dict[str, Any]) -> str:
        self._thread.start()
        self._service_file.parent.mkdir(parents=True, exist_ok=True)
        temporary = self._service_file.with_suffix(".tmp")
        temporary.write_bytes(dumps({"url": self.url, "pid": os.getpid(), **announce}))
        temporary.replace(self._service_file)
        return self.url

    def stop(self) -> None:
        self._service_file.unlink(missing_ok=True)
        self._server.shutdown()
        self._server.server_close()

    def query(self, sql: str, parameters: dict[str, Any]) -> dict[str, Any]:
        """A user's query, through the guard (no global lock: each runs on a reader
        client of its own, so a heavy one holds up neither other queries nor writes)."""
        result = self._reader.query(sql, parameters)
        return {"columns": result.columns, "rows": result.rows}

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        service = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                return

            def _reply(self, code: int, body: Any) -> None:
                data = dumps(body)
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._reply(200, {"ok": True, **service._status()})
                else:
                    self._reply(404, {"error": f"no such endpoint {self.path}"})

            def do_POST(self) -> None:
                name = self.path.removeprefix("/admin/")
                action = service._actions.get(name)
                raw_action = service._raw_actions.get(name)
                if self.path != "/query" and action is None and raw_action is None:
                    self._reply(404, {"error": f"no such endpoint {self.path}"})
                    return
                try:
                    length = int(self.headers.get("Content-Length", "0"))
                    data = self.rfile.read(length)
                    if raw_action is not None:
                        result = raw_action(data)
                    elif action is not None:
                        result = action(orjson.loads(data))
                    else:
                        body = orjson.loads(data)
                        result = service.query(str(body["sql"]),
                                               dict(body.get("parameters") or {}))
                except Exception as exc:
                    message = str(exc).strip().splitlines()
                    self._reply(400, {"error": (message[0] if message else repr(exc))[:2000]})
                    return
                self._reply(200, result)

        return Handler
