"""The OTLP/HTTP trace receiver: ``POST /v1/traces`` in, acknowledged events out.

Answers (OTLP/HTTP semantics, so stock exporters retry what is worth retrying):

- 200 only after the broker acknowledged every message of the batch (the events, the
  capture messages of span content (redacted; docs/capture.md), and the dead letters
  of spans that could not be mapped, which are reported back as
  ``partial_success.rejected_spans`` with the reason);
- checked from the headers, before any of the body is read (and the connection then
  closed): 401 without the configured bearer token, 415 for an unknown content type or
  encoding, 411 without Content-Length, 413 over ``max_body_bytes``, 429 + Retry-After
  when ``max_receiving`` bodies are already arriving, 421 for a foreign ``Host`` when
  no token is configured (DNS rebinding; :mod:`loopwatch.core.httpserver`);
- 408 when the body does not arrive within ``body_timeout_s``; 400 with the reason for
  a body that is not an OTLP trace request, 413 over ``max_body_bytes`` after
  decompression;
- 429 + Retry-After when ``max_inflight`` requests are already being decoded and
  published, and 503 + Retry-After when the broker does not acknowledge within
  ``publish_timeout_s`` or is unreachable.

Memory is bounded by ``(max_receiving + max_inflight) x max_body_bytes`` plus their
events, however slow the broker or the clients; the client keeps the data and retries.
A slow body holds a receive slot, never an in-flight one, and only until its deadline.

Runs on uvicorn + Starlette (:mod:`loopwatch.core.httpserver`: header deadline, a
connection cap slow clients cannot exhaust): one event loop thread reads requests,
``max_inflight`` worker threads decompress, then take the export path
(:mod:`loopwatch.ingest.otlp.export`: decode, map, publish) that the OTLP/gRPC receiver
(:meth:`OtlpReceiver.serve_grpc`) shares, with its in-flight bound and counters
(kafka-python's producer is shared and thread-safe).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import zlib
from concurrent.futures import ThreadPoolExecutor
from threading import BoundedSemaphore

import orjson
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceResponse,
)
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

from loopwatch.core.config import Settings
from loopwatch.core.httpserver import ConnectionLimits, HostCheck, Server, allowed_hosts
from loopwatch.ingest.otlp.export import (
    JSON,
    PROTOBUF,
    ReceiverStats,
    Reject,
    SpanExport,
    partial_success,
)
from loopwatch.ingest.otlp.grpc_server import OtlpGrpcReceiver
from loopwatch.ingest.otlp.mapping import MappedBatch
from loopwatch.ingest.otlp.settings import OtlpSettings, load_otlp_settings
from loopwatch.ingest.sdk import Emitter

log = logging.getLogger(__name__)

TRACES_PATH = "/v1/traces"
# google.rpc.Code for the Status body OTLP/HTTP asks for on errors.
_RPC_CODES = {400: 3, 401: 16, 404: 5, 405: 12, 408: 4, 411: 3, 413: 8, 415: 3, 429: 8,
              503: 14}
ENCODINGS = ("", "identity", "gzip", "deflate")
__all__ = ["TRACES_PATH", "OtlpReceiver", "ReceiverStats", "decompress", "rpc_status"]


def rpc_status(code: int, message: str) -> bytes:
    """A ``google.rpc.Status`` protobuf (code, message), written by hand: two fields."""
    def varint(value: int) -> bytes:
        out = bytearray()
        while True:
            byte = value & 0x7F
            value >>= 7
            out.append(byte | (0x80 if value else 0))
            if not value:
                return bytes(out)

    text = message.encode()
    return b"\x08" + varint(code) + b"\x12" + varint(len(text)) + text


def decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """gzip/deflate with a cap on the output, so a small bomb cannot fill memory."""
    if encoding in ("", "identity"):
        return body
    wbits = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}.get(encoding)
    if wbits is None:
        raise Reject(415, f"unsupported Content-Encoding {encoding!r} (gzip, deflate)")
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise Reject(400, f"malformed {encoding} body: {exc}") from None
    if len(out) > limit:
        raise Reject(413, f"body over {limit} bytes after decompression")
    if not inflater.eof:
        raise Reject(400, f"truncated {encoding} body")
    return out


class OtlpReceiver:
    """The receiver as a service: ``start()`` returns its URL, ``stop()`` ends it.

    ``settings`` supplies the topic, message size, header deadline and allowed hosts;
    ``limits`` the receiver's own knobs (read from ``LOOPWATCH_OTLP_*`` when not given).
    ``token`` enables bearer auth. Binds at construction: a taken port is an OSError.
    :meth:`serve_grpc` adds OTLP/gRPC on the same export path, bound and counters.
    """

    def __init__(self, settings: Settings, bootstrap: str, host: str = "127.0.0.1",
                 port: int = 4318, token: str | None = None, *,
                 limits: OtlpSettings | None = None) -> None:
        self.settings = settings
        self.limits = limits or load_otlp_settings()
        self.token = token
        self.host = host
        self.receiving = 0  # bodies being read; changed on the event loop thread only
        self._server = Server(self._app(host), host, port, ConnectionLimits(
            settings.http_header_timeout_s, self.limits.max_connections,
            self.limits.retry_after_s), name="otlp-receiver")  # a taken port raises here
        self._workers = ThreadPoolExecutor(self.limits.max_inflight,
                                           thread_name_prefix="otlp-worker")
        self.core = SpanExport(settings, bootstrap, self.limits)
        self.grpc: OtlpGrpcReceiver | None = None

    def _app(self, host: str) -> ASGIApp:
        routes = [Route(path, self._export, methods=["POST"])
                  for path in (TRACES_PATH, TRACES_PATH + "/")]
        app = Starlette(routes=routes, exception_handlers={HTTPException: self._http_error})
        if self.token is not None:  # a rebinding page cannot have the token
            return app
        return HostCheck(app, allowed_hosts(host, self.settings.http_allowed_hosts))

    @property
    def url(self) -> str:
        host, port = self._server.server_address
        return f"http://{host!s}:{port}"

    @property
    def grpc_address(self) -> str | None:
        """``host:port`` of the OTLP/gRPC receiver, None when it is not running."""
        return self.grpc.address if self.grpc is not None else None

    @property
    def stats(self) -> ReceiverStats:
        return self.core.stats

    @property
    def emitter(self) -> Emitter:
        return self.core.emitter

    @property
    def _admission(self) -> BoundedSemaphore:
        return self.core.admission

    @property
    def inflight(self) -> int:
        """Requests admitted and not yet answered (over both transports)."""
        return self.core.inflight

    @property
    def server(self) -> Server:
        """The HTTP server (connection states and counters, for tests and status)."""
        return self._server

    def start(self) -> str:
        self._server.start()
        log.info("OTLP/HTTP receiver on %s%s", self.url, TRACES_PATH)
        return self.url

    def serve_grpc(self, port: int) -> str | None:
        """Start OTLP/gRPC on ``port`` (0 = a free one) beside HTTP, sharing its export
        path; returns its address, or None (logged) when the port is taken."""
        try:
            self.grpc = OtlpGrpcReceiver(self.core, self.host, port, self.token)
        except OSError as exc:
            log.warning("OTLP/gRPC receiver not started: %s", exc)
            return None
        return self.grpc.start()

    def stop(self) -> None:
        if self.grpc is not None:
            self.grpc.stop()
        self._server.stop()
        self._workers.shutdown(wait=True, cancel_futures=True)
        self.core.close()

    def count_rejected(self, status: int) -> None:
        self.core.count_rejected(status)

    # -- one request ------------------------------------------------------------------

    async def _export(self, request: Request) -> Response:
        json_wanted = _content_type(request) == JSON
        try:
            body, kind, encoding = await self._receive(request)
            self.core.admit()
            loop = asyncio.get_running_loop()
            answer = await loop.run_in_executor(self._workers, self._work, body, kind,
                                                encoding, json_wanted)
        except Reject as reject:
            self.count_rejected(reject.status)
            return self._error(reject, json_wanted)
        except ClientDisconnect:
            self.count_rejected(499)
            return Response(status_code=400, headers={"Connection": "close"})
        return Response(answer, 200, media_type=JSON if json_wanted else PROTOBUF)

    async def _receive(self, request: Request) -> tuple[bytes, str, str]:
        """Everything checked from the headers first; then the body, within its
        deadline, holding one of ``max_receiving`` slots."""
        headers = request.headers
        if self.token is not None and not hmac.compare_digest(
                headers.get("Authorization", "").encode(), f"Bearer {self.token}".encode()):
            raise Reject(401, "missing or wrong bearer token", close=True)
        kind = _content_type(request)
        if kind not in (PROTOBUF, JSON):
            raise Reject(415, f"unsupported Content-Type {kind!r} ({PROTOBUF} or {JSON})",
                          close=True)
        encoding = headers.get("Content-Encoding", "").strip().lower()
        if encoding not in ENCODINGS:
            raise Reject(415, f"unsupported Content-Encoding {encoding!r} (gzip, deflate)",
                          close=True)
        raw = headers.get("Content-Length", "").strip()
        if not raw.isdigit():
            raise Reject(411, "Content-Length required", close=True)
        length, limit = int(raw), self.limits.max_body_bytes
        if length > limit:
            raise Reject(413, f"body of {length} bytes over the {limit}-byte limit",
                          close=True)
        if self.receiving >= self.limits.max_receiving:
            raise Reject(429, f"busy: {self.limits.max_receiving} bodies being received",
                          close=True, retry_after=self.limits.retry_after_s)
        self.receiving += 1
        try:
            chunks = []
            async with asyncio.timeout(self.limits.body_timeout_s):
                async for chunk in request.stream():
                    chunks.append(chunk)
        except TimeoutError:
            raise Reject(408, f"body not received within {self.limits.body_timeout_s:g}s",
                          close=True) from None
        finally:
            self.receiving -= 1
        body = b"".join(chunks)
        if len(body) < length:
            raise Reject(400, "body shorter than its Content-Length", close=True)
        return body, kind, encoding

    def _work(self, body: bytes, kind: str, encoding: str, json_wanted: bool) -> bytes:
        """On a worker thread, holding an in-flight slot: decompress, then the shared
        export path; returns the 200 body or raises Reject."""
        try:
            body = decompress(body, encoding, self.limits.max_body_bytes)
        except BaseException:
            self.core.admission.release()
            raise
        return self._response(self.core.export(body, kind), json_wanted)

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        """Routing's 404 and 405, as the google.rpc.Status OTLP/HTTP asks for."""
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        self.count_rejected(status)
        reason = (f"no such path {request.url.path!r}; use {TRACES_PATH}" if status == 404
                  else f"POST OTLP trace requests to {TRACES_PATH}")
        json_wanted = request.method != "POST" or _content_type(request) == JSON
        return self._error(Reject(status, reason, close=True), json_wanted)

    @staticmethod
    def _error(reject: Reject, json_wanted: bool) -> Response:
        code = _RPC_CODES.get(reject.status, 2)
        if json_wanted:
            body, kind = orjson.dumps({"code": code, "message": reject.reason}), JSON
        else:
            body, kind = rpc_status(code, reject.reason), PROTOBUF
        headers = {}
        if reject.retry_after is not None:
            headers["Retry-After"] = str(reject.retry_after)
        if reject.status == 401:
            headers["WWW-Authenticate"] = 'Bearer realm="loopwatch"'
        if reject.close:
            headers["Connection"] = "close"
        return Response(body, reject.status, headers, media_type=kind)

    @staticmethod
    def _response(batch: MappedBatch, json_wanted: bool) -> bytes:
        partial = partial_success(batch)
        if partial is None:
            return b"{}" if json_wanted else b""
        if json_wanted:
            return orjson.dumps({"partialSuccess": {
                "rejectedSpans": str(partial.rejected_spans),
                "errorMessage": partial.error_message}})
        return ExportTraceServiceResponse(partial_success=partial).SerializeToString()


def _content_type(request: Request) -> str:
    return request.headers.get("Content-Type", "").split(";")[0].strip().lower()
