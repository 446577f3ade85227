"""The web view's HTTP server: a static page and JSON endpoints (Starlette on uvicorn).

Endpoints: ``/api/panels`` (the catalog), ``/api/panel/<id>?from=&to=&agent=...``,
``/api/alerts``, ``/api/runs/<run_id>``, ``/api/annotations``, ``/api/variables``,
``/api/health`` (503 ``{"ok": false, "store": "unreachable: ..."}`` while the
store does not answer), ``/api/replay/<run_id>``, ``/api/economics?agent=``, ``/api/advice?agent=``;
``/runs/<run_id>`` redirects into the page's drill-down so alert links
(``LOOPWATCH_LINK_BASE_URL``) land there. Everything else is a file under ``static/``
(Starlette's ``StaticFiles``: nothing outside it, symlinks out of it included, 404).

It binds 127.0.0.1 unless told otherwise: the page shows what agents did, so it is a
local tool (put an authenticating proxy in front to share it). It answers only to its
own host names (``LOOPWATCH_HTTP_ALLOWED_HOSTS`` adds some; anything else is 421), so
a page elsewhere cannot rebind its DNS name to 127.0.0.1 and read it. With a token
(``LOOPWATCH_WEB_TOKEN``, or ``token=``) every request, static files included, needs
``Authorization: Bearer <token>`` or the ``loopwatch_token`` cookie; a browser gets the
cookie by opening any page once with ``?token=<token>`` (then redirected without it).
Without them: 401 (JSON for ``/api/``, a short page saying how for the rest).
Connections get the header deadline and cap of :mod:`loopwatch.core.httpserver`.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlencode

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loopwatch.core.httpserver import ConnectionLimits, HostCheck, Server, allowed_hosts
from loopwatch.dashboards.macros import MacroError
from loopwatch.dashboards.web.api import BadRequest, NotFound, WebApi, catalog
from loopwatch.store.reader import QueryError, Reader, ServiceUnreachable

STATIC = Path(__file__).resolve().parent / "static"
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data:; object-src 'none'; base-uri 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
_SECURITY = [(name.lower().encode(), value.encode()) for name, value in SECURITY_HEADERS.items()]


def _dumps(body: Any) -> bytes:
    return orjson.dumps(body, default=str, option=orjson.OPT_NON_STR_KEYS)


COOKIE = "loopwatch_token"
TOKEN_PAGE = (b"<!doctype html><title>loopwatch</title><p>This loopwatch web view needs its "
              b"token: open this address with <code>?token=&lt;token&gt;</code> once, or send "
              b"<code>Authorization: Bearer &lt;token&gt;</code>.</p>")


def configured_token() -> str | None:
    """``web_token`` from the settings (environment or ``LOOPWATCH_CONFIG_FILE``)."""
    from loopwatch.core.config import load_settings

    return load_settings().web_token or None


def _json(code: int, body: Any) -> Response:
    return Response(_dumps(body), code, {"Cache-Control": "no-store"},
                    media_type="application/json")


class _SecurityHeaders:
    """Every response, refusals included, carries the CSP and friends."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *_SECURITY]
            await send(message)

        await self.app(scope, receive, send_with_headers)


class _TokenGate:
    """Bearer token or cookie on every request; ``?token=`` trades for the cookie."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        given = request.headers.get("Authorization", "").encode()
        if COOKIE in request.cookies:
            given = given or f"Bearer {request.cookies[COOKIE]}".encode()
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        await self._refusal(request)(scope, receive, send)

    def _refusal(self, request: Request) -> Response:
        params = request.query_params.multi_items()
        offered = request.query_params.get("token", "")
        path = request.url.path
        if offered and hmac.compare_digest(offered.encode(), self.token.encode()):
            rest = urlencode([(k, v) for k, v in params if k != "token"])
            return Response(b"", 302, {
                "Location": quote(path) + (f"?{rest}" if rest else ""),
                "Set-Cookie": f"{COOKIE}={self.token}; HttpOnly; SameSite=Strict; Path=/",
                "Cache-Control": "no-store"}, media_type="text/plain")
        challenge = {"WWW-Authenticate": 'Bearer realm="loopwatch"', "Cache-Control": "no-store"}
        if path.startswith("/api/"):
            return Response(_dumps({"error": "missing or wrong bearer token"}), 401, challenge,
                            media_type="application/json")
        return Response(TOKEN_PAGE, 401, challenge, media_type="text/html")


class _Static(StaticFiles):
    """``static/`` with revalidation on every load (the page changes with loopwatch)."""

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers["Cache-Control"] = "no-cache"
        return response


def make_app(api: WebApi, token: str | None = None, allowed: frozenset[str] | None = None,
             static: Path = STATIC) -> ASGIApp:
    """The web view as an ASGI app; ``allowed`` Host names (None: any), ``token`` set =
    bearer auth required, ``static`` the directory of the page."""

    def api_endpoint(request: Request) -> Response:
        params = parse_qs(request.url.query, keep_blank_values=True)
        if request.path_params["route"] == "health":
            problem = api.store_problem()
            return (_json(200, {"ok": True, "store": "ok"}) if problem is None
                    else _json(503, {"ok": False, "store": problem}))
        try:
            return _json(200, _route(api, request.path_params["route"], params))
        except BadRequest as exc:
            return _json(400, {"error": str(exc)})
        except NotFound as exc:
            return _json(404, {"error": str(exc)})
        except ServiceUnreachable as exc:
            return _json(503, {"error": f"store unreachable: {exc}"})
        except (QueryError, MacroError) as exc:
            return _json(502, {"error": f"query failed: {exc}"})
        except Exception as exc:  # keep serving; say what broke
            return _json(500, {"error": f"{type(exc).__name__}: {exc}"})

    def run_link(request: Request) -> Response:
        target = "/#/run/" + quote(request.path_params["run_id"], safe="")
        return RedirectResponse(target, 302)

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        detail = f"no such page {request.url.path}" if status == 404 else str(exc)
        return _json(status, {"error": detail})

    app: ASGIApp = Starlette(
        routes=[Route("/api/{route:path}", api_endpoint, methods=["GET"]),
                Route("/runs/{run_id:path}", run_link, methods=["GET"]),
                Mount("/static", _Static(directory=static)),
                Mount("/", _Static(directory=static, html=True))],
        exception_handlers={HTTPException: http_error})
    if token:
        app = _TokenGate(app, token)
    return _SecurityHeaders(HostCheck(app, allowed))


def _route(api: WebApi, route: str, params: dict[str, list[str]]) -> Any:
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
    if route == "advice":
        return api.advice(params)
    raise NotFound(f"no endpoint /api/{route}")


def make_server(reader: Reader, host: str = "127.0.0.1", port: int = 8765,
                token: str | None = None, static: Path = STATIC) -> Server:
    """``token=None``: the configured ``web_token`` (none configured: no auth). Host
    names, header deadline and connection cap come from the settings."""
    from loopwatch.core.config import load_settings

    settings = load_settings()
    token = settings.web_token if token is None else token
    app = make_app(WebApi(reader), token or None,
                   allowed_hosts(host, settings.http_allowed_hosts), static)
    return Server(app, host, port, ConnectionLimits(
        settings.http_header_timeout_s, settings.web_max_connections), name="loopwatch-web")


def _url(server: Server) -> str:
    host, port = server.server_address
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else str(host)
    return f"http://{shown}:{port}/"


def serve_in_thread(reader: Reader, host: str = "127.0.0.1", port: int = 0,
                    token: str | None = None, static: Path = STATIC
                    ) -> tuple[str, Callable[[], None]]:
    """Start the page in a daemon thread (for ``loopwatch demo``/``up``); returns its URL
    and a function that stops it. ``port=0`` picks a free port."""
    server = make_server(reader, host, port, token, static)
    server.start()
    return _url(server), server.stop


def serve_forever(reader: Reader, host: str = "127.0.0.1", port: int = 8765,
                  on_ready: Callable[[str], None] | None = None,
                  token: str | None = None) -> None:
    """Serve until interrupted (``loopwatch serve``)."""
    server = make_server(reader, host, port, token)
    if on_ready is not None:
        on_ready(_url(server))
    server.serve_forever()
