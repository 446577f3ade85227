"""The web view's HTTP server: a static page and JSON endpoints, stdlib only.

Endpoints: ``/api/panels`` (the catalog), ``/api/panel/<id>?from=&to=&agent=...``,
``/api/alerts``, ``/api/runs/<run_id>``, ``/api/annotations``, ``/api/variables``,
``/api/health``; ``/runs/<run_id>`` redirects into the page's drill-down so alert links
(``LOOPWATCH_LINK_BASE_URL``) land there. Everything else is a file under ``static/``.

It binds 127.0.0.1 unless told otherwise: the page shows what agents did, so it is a
local tool (put an authenticating proxy in front to share it).
"""

from __future__ import annotations

import mimetypes
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

import orjson

from dashboards.macros import MacroError
from dashboards.web.api import BadRequest, NotFound, WebApi, catalog
from loopwatch.store.reader import QueryError, Reader

STATIC = Path(__file__).resolve().parent / "static"
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data:; object-src 'none'; base-uri 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def _dumps(body: Any) -> bytes:
    return orjson.dumps(body, default=str, option=orjson.OPT_NON_STR_KEYS)


def make_handler(api: WebApi) -> type[BaseHTTPRequestHandler]:
    """A request handler class bound to ``api``."""

    class Handler(BaseHTTPRequestHandler):
        server_version = "loopwatch-web"

        def log_message(self, format: str, *args: Any) -> None:
            return

        def _send(self, code: int, body: bytes, content_type: str,
                  extra: dict[str, str] | None = None) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for name, value in {**SECURITY_HEADERS, **(extra or {})}.items():
                self.send_header(name, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, code: int, body: Any) -> None:
            self._send(code, _dumps(body), "application/json",
                       {"Cache-Control": "no-store"})

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            parts = urlsplit(self.path)
            path = unquote(parts.path)
            params = parse_qs(parts.query, keep_blank_values=True)
            try:
                if path.startswith("/api/"):
                    self._json(200, self._api(path[len("/api/"):], params))
                elif path.startswith("/runs/"):
                    target = "/#/run/" + quote(path[len("/runs/"):], safe="")
                    self._send(302, b"", "text/plain", {"Location": target})
                else:
                    self._static(path)
            except BadRequest as exc:
                self._json(400, {"error": str(exc)})
            except NotFound as exc:
                self._json(404, {"error": str(exc)})
            except (QueryError, MacroError) as exc:
                self._json(502, {"error": f"query failed: {exc}"})
            except Exception as exc:  # keep serving; say what broke
                self._json(500, {"error": f"{type(exc).__name__}: {exc}"})

        def _api(self, route: str, params: dict[str, list[str]]) -> Any:
            if route == "health":
                return {"ok": True}
            if route == "panels":
                return catalog()
            if route.startswith("panel/"):
                return api.panel(route[len("panel/"):], params)
            if route == "alerts":
                return api.alerts(params)
            if route.startswith("runs/"):
                return api.run(route[len("runs/"):], params)
            if route == "annotations":
                return api.annotations(params)
            if route == "variables":
                return api.variables()
            raise NotFound(f"no endpoint /api/{route}")

        def _static(self, path: str) -> None:
            relative = "index.html" if path in ("", "/") else path.lstrip("/")
            if relative.startswith("static/"):
                relative = relative[len("static/"):]
            file = (STATIC / relative).resolve()
            if not file.is_relative_to(STATIC) or not file.is_file():
                raise NotFound(f"no such page {path}")
            content_type = mimetypes.guess_type(file.name)[0] or "application/octet-stream"
            if content_type.startswith("text/") or file.suffix == ".js":
                content_type += "; charset=utf-8"
            self._send(200, file.read_bytes(), content_type, {"Cache-Control": "no-cache"})

    return Handler


def make_server(reader: Reader, host: str = "127.0.0.1", port: int = 8765
                ) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), make_handler(WebApi(reader)))
    server.daemon_threads = True
    return server


def _url(server: ThreadingHTTPServer) -> str:
    host, port = server.server_address[:2]
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else str(host)
    return f"http://{shown}:{port}/"


def serve_in_thread(reader: Reader, host: str = "127.0.0.1", port: int = 0
                    ) -> tuple[str, Callable[[], None]]:
    """Start the page in a daemon thread (for ``loopwatch demo``/``up``); returns its URL
    and a function that stops it. ``port=0`` picks a free port."""
    server = make_server(reader, host, port)
    thread = threading.Thread(target=server.serve_forever, name="loopwatch-web", daemon=True)
    thread.start()

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    return _url(server), stop


def serve_forever(reader: Reader, host: str = "127.0.0.1", port: int = 8765,
                  on_ready: Callable[[str], None] | None = None) -> None:
    """Serve until interrupted (``loopwatch serve``)."""
    server = make_server(reader, host, port)
    if on_ready is not None:
        on_ready(_url(server))
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
