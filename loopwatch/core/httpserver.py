"""loopwatch's HTTP servers (the web view, the OTLP receiver) on one stack: uvicorn
running a Starlette app, with the defences uvicorn does not have built in.

uvicorn bounds a request's headers in size (h11: 16 KiB), closes idle keep-alive
connections (5 s) and can cap connections (``limit_concurrency``), but a cap alone is
what slowloris exhausts: 128 clients trickling header lines held every connection
slot, and uvicorn has no deadline for a request's headers. :class:`GuardedH11Protocol`
adds the two things missing:

- a **header deadline**: a request's headers must be complete within
  ``header_timeout_s`` of the connection opening or of the previous response, or the
  connection is closed (408 when part of a request had arrived);
- a **connection cap that slow clients cannot exhaust**: over ``max_connections`` a
  new connection evicts the connection that has waited longest for headers (idle
  keep-alive ones included); only when every connection is inside a request is the
  new one refused (503 + Retry-After). Requests themselves are bounded by the apps
  (the OTLP receiver's body deadline and receive cap).

:class:`HostCheck` refuses a ``Host`` that is not one of the server's names (DNS
rebinding). :class:`Server` binds at construction (so a taken port is an ``OSError``
there) and runs uvicorn in a thread with its own event loop.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_HOSTS = ("", "0.0.0.0", "::")
ALLOWED_HOSTS_SETTING = "LOOPWATCH_HTTP_ALLOWED_HOSTS"
T = TypeVar("T")


@dataclass(frozen=True)
class ConnectionLimits:
    """What :class:`GuardedH11Protocol` enforces (from the settings of each server)."""

    header_timeout_s: float
    max_connections: int
    retry_after_s: int = 2


@dataclass
class ConnectionStats:
    """Counted on the event loop's thread; read from anywhere (plain ints)."""

    header_timeouts: int = 0
    evicted: int = 0
    refused: int = 0


@dataclass
class _Guard:
    limits: ConnectionLimits
    stats: ConnectionStats = field(default_factory=ConnectionStats)


def _raw_response(status: str, reason: str, retry_after: int | None = None) -> bytes:
    """A complete ``Connection: close`` response, written before h11 has a request."""
    body = reason.encode() + b"\n"
    head = [f"HTTP/1.1 {status}", "content-type: text/plain; charset=utf-8",
            f"content-length: {len(body)}", "connection: close"]
    if retry_after is not None:
        head.append(f"retry-after: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus the header deadline and the evicting connection cap.

    A subclass per server (:func:`guarded_protocol`) carries that server's ``guard``.
    "Awaiting headers" is tracked by identity of uvicorn's request cycle: a new cycle
    object exists only once h11 has parsed a complete request head.
    """

    guard: ClassVar[_Guard]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.awaiting_headers = False
        self.awaiting_since = 0.0
        self._deadline: asyncio.TimerHandle | None = None
        self._armed_cycle: object = None
        self._partial = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_headers()
        self._admit()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.awaiting_headers:
            self._partial = True
        super().data_received(data)
        if self.awaiting_headers and self.cycle is not self._armed_cycle:
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None
                                                 or self.cycle.response_complete):
            self._await_headers()

    def _await_headers(self) -> None:
        self._disarm()
        self.awaiting_headers = True
        self.awaiting_since = self.loop.time()
        self._armed_cycle = self.cycle
        self._partial = False
        self._deadline = self.loop.call_later(self.guard.limits.header_timeout_s,
                                              self._header_timeout)

    def _disarm(self) -> None:
        self.awaiting_headers = False
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _header_timeout(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        self.guard.stats.header_timeouts += 1
        if self._partial:
            self.transport.write(_raw_response(
                "408 Request Timeout",
                f"request headers not complete within {self.guard.limits.header_timeout_s:g}s"))
        self._close()

    def _close(self) -> None:
        self.awaiting_headers = False
        self._disarm()
        self.transport.close()

    def _admit(self) -> None:
        """Over the cap: evict the longest-waiting connection that is between requests,
        or, when every connection is inside a request, refuse this one."""
        live = [c for c in list(self.connections)
                if isinstance(c, GuardedH11Protocol) and not c.transport.is_closing()]
        if len(live) <= self.guard.limits.max_connections:
            return
        waiting = [c for c in live if c is not self and c.awaiting_headers]
        if waiting:
            min(waiting, key=lambda c: c.awaiting_since)._close()
            self.guard.stats.evicted += 1
            return
        self.guard.stats.refused += 1
        self.transport.write(_raw_response(
            "503 Service Unavailable",
            f"{self.guard.limits.max_connections} connections busy with requests",
            self.guard.limits.retry_after_s))
        self._close()


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """A protocol class for one server, with its own limits and counters."""
    return type("Guarded", (GuardedH11Protocol,), {"guard": _Guard(limits)})


def allowed_hosts(bound_host: str, extra: Iterable[str]) -> frozenset[str] | None:
    """The ``Host`` names a server answers to: the loopback names, the address it is
    bound to (unless a wildcard) and ``extra``; ``None`` (any) when ``extra`` has ``*``.

    >>> sorted(allowed_hosts("127.0.0.1", ["LoopWatch.internal"]))
    ['127.0.0.1', '::1', 'localhost', 'loopwatch.internal']
    >>> allowed_hosts("0.0.0.0", ["*"]) is None
    True
    """
    names = {name.strip().lower().strip("[]") for name in extra}
    if "*" in names:
        return None
    names.update(LOOPBACK_NAMES)
    if bound_host not in WILDCARD_HOSTS:
        names.add(bound_host.lower().strip("[]"))
    names.discard("")
    return frozenset(names)


def host_name(header: str) -> str:
    """The name in a ``Host`` header: port dropped, IPv6 brackets dropped, lower case.

    >>> host_name("LOCALHOST:8765"), host_name("[::1]:80"), host_name("a.example")
    ('localhost', '::1', 'a.example')
    """
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    name, colon, port = header.rpartition(":")
    return name if colon and port.isdigit() else header


class HostCheck:
    """ASGI middleware: 421 for a ``Host`` not in ``allowed`` (``None``: any).

    A page on another origin that rebinds its DNS name to 127.0.0.1 reaches a loopback
    server with its own name in ``Host``; refusing unknown names is what stops it.
    """

    def __init__(self, app: ASGIApp, allowed: frozenset[str] | None) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.allowed is None:
            await self.app(scope, receive, send)
            return
        given = next((value.decode("latin-1") for name, value in scope["headers"]
                      if name == b"host"), "")
        name = host_name(given)
        if name in self.allowed:
            await self.app(scope, receive, send)
            return
        body = (f"Host {name[:100]!r} is not a name of this loopwatch server; "
                f"allow it with {ALLOWED_HOSTS_SETTING}\n").encode()
        await send({"type": "http.response.start", "status": 421, "headers": [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class Server:
    """An ASGI app on uvicorn in a daemon thread, bound at construction.

    ``start()`` returns once uvicorn serves; ``stop()`` closes connections and waits up
    to ``grace_s`` for requests in progress, then cancels them.
    """

    def __init__(self, app: ASGIApp, host: str, port: int, limits: ConnectionLimits,
                 name: str, grace_s: int = 3) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server((host, port), family=family, backlog=2048)
        self.protocol = guarded_protocol(limits)
        self.config = uvicorn.Config(
            app, http=self.protocol, ws="none", lifespan="off", loop="asyncio",
            log_config=None, access_log=False, proxy_headers=False, server_header=False,
            timeout_keep_alive=5, timeout_graceful_shutdown=grace_s)
        self._uvicorn = uvicorn.Server(self.config)
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()

    @property
    def server_address(self) -> tuple[str, int]:
        host, port = self._socket.getsockname()[:2]
        return str(host), int(port)

    @property
    def stats(self) -> ConnectionStats:
        return self.protocol.guard.stats

    def _run(self) -> None:
        async def serve() -> None:
            self._loop = asyncio.get_running_loop()
            self._loop.call_soon(self._started.set)
            await self._uvicorn.serve(sockets=[self._socket])

        try:
            asyncio.run(serve())
        finally:
            self._started.set()

    def start(self) -> None:
        self._thread.start()
        self._started.wait(30)
        for _ in range(300):  # uvicorn's startup is a few loop turns away
            if self._uvicorn.started or not self._thread.is_alive():
                return
            time.sleep(0.05)

    def serve_forever(self) -> None:
        """Serve in the calling thread's stead until Ctrl-C (``loopwatch serve``)."""
        self.start()
        try:
            while self._thread.is_alive():
                self._thread.join(0.5)
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()

    def stop(self) -> None:
        self._uvicorn.should_exit = True
        if self._thread.is_alive():
            self._thread.join((self.config.timeout_graceful_shutdown or 0) + 10)
        self.server_close()

    def server_close(self) -> None:
        self._socket.close()

    def call(self, function: Callable[[], T]) -> T:
        """Run ``function`` on the server's event loop thread (its state lives there)."""
        if self._loop is None:
            raise RuntimeError("the server is not running")

        async def run() -> T:
            return function()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(30)

    def connection_states(self) -> Counter[str]:
        """Open connections by state: ``awaiting_headers`` or ``in_request``."""
        def count() -> Counter[str]:
            return Counter(
                "awaiting_headers" if c.awaiting_headers else "in_request"
                for c in self._uvicorn.server_state.connections
                if isinstance(c, GuardedH11Protocol) and not c.transport.is_closing())
        return self.call(count)
