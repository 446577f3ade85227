"""The web view's HTTP server: a static page and JSON endpoints, stdlib only.

Endpoints: ``/api/panels`` (the catalog), ``/api/panel/<id>?from=&to=&agent=...``,
``/api/alerts``, ``/api/runs/<run_id>``, ``/api/annotations``, ``/api/variables``,
``/api/health``, ``/api/replay/<run_id>``, ``/api/economics?agent=``;
``/runs/<run_id>`` redirects into the page's drill-down so alert links
(``LOOPWATCH_LINK_BASE_URL``) land there. Everything else is a file under ``static/``.

It binds 127.0.0.1 unless told otherwise: the page shows what agents did, so it is a
local tool (put an authenticating proxy in front to share it). With a token
(``LOOPWATCH_WEB_TOKEN``, or ``token=``) every request, static files included, needs
``Authorization: Bearer <token>`` or the ``loopwatch_token`` cookie; a browser gets the
cookie by opening any page once with ``?token=<token>`` (then redirected without it).
Without them: 401 (JSON for ``/api/``, a short page saying how for the rest).
"""

from __future__ import annotations

import hmac
import mimetypes
import threading
from collections.abc import Callable
from http.cookies import SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

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


COOKIE = "loopwatch_token"
TOKEN_PAGE = (b"<!doctype html><title>loopwatch</title><p>This loopwatch web view needs its "
              b"token: open this address with <code>?token=&lt;token&gt;</code> once, or send "
              b"<code>Authorization: Bearer &lt;token&gt;</code>.</p>")


def configured_token() -> str | None:
    """``web_token`` from the settings (environment or ``LOOPWATCH_CONFIG_FILE``)."""
    from loopwatch.config import load_settings

    return load_settings().web_token or None


def make_handler(api: WebApi, token: str | None = None) -> type[BaseHTTPRequestHandler]:
    """A request handler class bound to ``api``; ``token`` set = bearer auth required."""
    expected = f"Bearer {token}".encode() if token else b""

    class Handler(BaseHTTPRequestHandler):
        server_version = "loopwatch-web"

        def _admitted(self, path: str, params: dict[str, list[str]]) -> bool:
            """True to go on; False when the request has been answered (401, or the
            redirect that trades ``?token=`` for the cookie)."""
            if not token:
                return True
            given = self.headers.get("Authorization", "").encode()
            cookies = SimpleCookie(self.headers.get("Cookie", ""))
            if COOKIE in cookies:
                given = given or f"Bearer {cookies[COOKIE].value}".encode()
            if hmac.compare_digest(given, expected):
                return True
            offered = params.get("token", [""])[0]
            if offered and hmac.compare_digest(offered.encode(), token.encode()):
                rest = urlencode([(k, v) for k, vs in params.items() if k != "token"
                                  for v in vs], doseq=True)
                self._send(302, b"", "text/plain", {
                    "Location": quote(path) + (f"?{rest}" if rest else ""),
                    "Set-Cookie": f"{COOKIE}={token}; HttpOnly; SameSite=Strict; Path=/",
                    "Cache-Control": "no-store"})
                return False
            challenge = {"WWW-Authenticate": 'Bearer realm="loopwatch"',
                         "Cache-Control": "no-store"}
            if path.startswith("/api/"):
                self._send(401, _dumps({"error": "missing or wrong bearer token"}),
                           "application/json", challenge)
            else:
                self._send(401, TOKEN_PAGE, "text/html; charset=utf-8", challenge)
            return False

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
            if not self._admitted(path, params):
                return
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
            if route.startswith("replay/"):
                return api.replay(route[len("replay/"):])
            if route == "economics":
                return api.economics(params)
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


def make_server(reader: Reader, host: str = "127.0.0.1", port: int = 8765,
                token: str | None = None) -> ThreadingHTTPServer:
    """``token=None``: the configured ``web_token`` (none configured: no auth)."""
    token = configured_token() if token is None else token
    server = ThreadingHTTPServer((host, port), make_handler(WebApi(reader), token or None))
    server.daemon_threads = True
    return server


def _url(server: ThreadingHTTPServer) -> str:
    host, port = server.server_address[:2]
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else str(host)
    return f"http://{shown}:{port}/"


def serve_in_thread(reader: Reader, host: str = "127.0.0.1", port: int = 0,
                    token: str | None = None) -> tuple[str, Callable[[], None]]:
    """Start the page in a daemon thread (for ``loopwatch demo``/``up``); returns its URL
    and a function that stops it. ``port=0`` picks a free port."""
    server = make_server(reader, host, port, token)
    thread = threading.Thread(target=server.serve_forever, name="loopwatch-web", daemon=True)
    thread.start()

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    return _url(server), stop


def serve_forever(reader: Reader, host: str = "127.0.0.1", port: int = 8765,
                  on_ready: Callable[[str], None] | None = None,
                  token: str | None = None) -> None:
    """Serve until interrupted (``loopwatch serve``)."""
    server = make_server(reader, host, port, token)
    if on_ready is not None:
        on_ready(_url(server))
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
