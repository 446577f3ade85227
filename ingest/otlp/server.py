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
  no token is configured (DNS rebinding; :mod:`loopwatch.httpserver`);
- 408 when the body does not arrive within ``body_timeout_s``; 400 with the reason for
  a body that is not an OTLP trace request, 413 over ``max_body_bytes`` after
  decompression;
- 429 + Retry-After when ``max_inflight`` requests are already being decoded and
  published, and 503 + Retry-After when the broker does not acknowledge within
  ``publish_timeout_s`` or is unreachable.

Memory is bounded by ``(max_receiving + max_inflight) x max_body_bytes`` plus their
events, however slow the broker or the clients; the client keeps the data and retries.
A slow body holds a receive slot, never an in-flight one, and only until its deadline.

Runs on uvicorn + Starlette (:mod:`loopwatch.httpserver`: header deadline, a
connection cap slow clients cannot exhaust): one event loop thread reads requests,
``max_inflight`` worker threads decompress, decode, map and publish (kafka-python's
producer is shared and thread-safe).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import orjson
from kafka.errors import KafkaError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceResponse,
)
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

from ingest.otlp.decode import DecodedRequest, PayloadError, decode_json, decode_protobuf
from ingest.otlp.mapping import MappedBatch, map_spans
from ingest.otlp.settings import OtlpSettings, load_otlp_settings
from ingest.redact import Redactor
from ingest.sdk import Emitter
from loopwatch.config import Settings
from loopwatch.httpserver import ConnectionLimits, HostCheck, Server, allowed_hosts

log = logging.getLogger(__name__)

TRACES_PATH = "/v1/traces"
PROTOBUF = "application/x-protobuf"
JSON = "application/json"
# google.rpc.Code for the Status body OTLP/HTTP asks for on errors.
_RPC_CODES = {400: 3, 401: 16, 404: 5, 405: 12, 408: 4, 411: 3, 413: 8, 415: 3, 429: 8,
              503: 14}
ENCODINGS = ("", "identity", "gzip", "deflate")


class _Reject(Exception):
    """Answer with this status and reason; ``close`` when the body was left unread."""

    def __init__(self, status: int, reason: str, *, close: bool = False,
                 retry_after: int | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.close = close
        self.retry_after = retry_after


@dataclass
class ReceiverStats:
    requests: int = 0
    accepted: int = 0
    spans: int = 0
    events: int = 0
    dead_letters: int = 0
    ignored_spans: int = 0
    rejected: Counter[int] = field(default_factory=Counter)
    conventions: Counter[str] = field(default_factory=Counter)


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
        raise _Reject(415, f"unsupported Content-Encoding {encoding!r} (gzip, deflate)")
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise _Reject(400, f"malformed {encoding} body: {exc}") from None
    if len(out) > limit:
        raise _Reject(413, f"body over {limit} bytes after decompression")
    if not inflater.eof:
        raise _Reject(400, f"truncated {encoding} body")
    return out


class OtlpReceiver:
    """The receiver as a service: ``start()`` returns its URL, ``stop()`` ends it.

    ``settings`` supplies the topic, message size, header deadline and allowed hosts;
    ``limits`` the receiver's own knobs (read from ``LOOPWATCH_OTLP_*`` when not given).
    ``token`` enables bearer auth. Binds at construction: a taken port is an OSError.
    """

    def __init__(self, settings: Settings, bootstrap: str, host: str = "127.0.0.1",
                 port: int = 4318, token: str | None = None, *,
                 limits: OtlpSettings | None = None) -> None:
        self.settings = settings
        self.limits = limits or load_otlp_settings()
        self.token = token
        self.stats = ReceiverStats()
        self.receiving = 0  # bodies being read; changed on the event loop thread only
        self._stats_lock = threading.Lock()
        self._admission = threading.BoundedSemaphore(self.limits.max_inflight)
        self._cpu = threading.Lock()
        self._server = Server(self._app(host), host, port, ConnectionLimits(
            settings.http_header_timeout_s, self.limits.max_connections,
            self.limits.retry_after_s), name="otlp-receiver")  # a taken port raises here
        self._workers = ThreadPoolExecutor(self.limits.max_inflight,
                                           thread_name_prefix="otlp-worker")
        self.emitter = Emitter(
            bootstrap, settings.events_topic, settings.spool_dir / "otlp-receiver",
            max_message_bytes=max(1024, settings.max_message_bytes - 4096),
            capture=settings.capture, redactor=Redactor.from_settings(settings),
            captures_topic=settings.captures_topic,
            max_part_bytes=settings.capture_max_part_bytes,
        )

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
    def inflight(self) -> int:
        """Requests admitted and not yet answered."""
        return self.limits.max_inflight - self._admission._value  # type: ignore[attr-defined]

    @property
    def server(self) -> Server:
        """The HTTP server (connection states and counters, for tests and status)."""
        return self._server

    def start(self) -> str:
        self._server.start()
        log.info("OTLP/HTTP receiver on %s%s", self.url, TRACES_PATH)
        return self.url

    def stop(self) -> None:
        self._server.stop()
        self._workers.shutdown(wait=True, cancel_futures=True)
        self.emitter.close(timeout_s=5)

    def count_rejected(self, status: int) -> None:
        with self._stats_lock:
            self.stats.requests += 1
            self.stats.rejected[status] += 1

    # -- one request ------------------------------------------------------------------

    async def _export(self, request: Request) -> Response:
        json_wanted = _content_type(request) == JSON
        try:
            body, kind, encoding = await self._receive(request)
            if not self._admission.acquire(blocking=False):
                raise _Reject(429, f"busy: {self.limits.max_inflight} requests in flight",
                              retry_after=self.limits.retry_after_s)
            loop = asyncio.get_running_loop()
            answer = await loop.run_in_executor(self._workers, self._work, body, kind,
                                                encoding, json_wanted)
        except _Reject as reject:
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
            raise _Reject(401, "missing or wrong bearer token", close=True)
        kind = _content_type(request)
        if kind not in (PROTOBUF, JSON):
            raise _Reject(415, f"unsupported Content-Type {kind!r} ({PROTOBUF} or {JSON})",
                          close=True)
        encoding = headers.get("Content-Encoding", "").strip().lower()
        if encoding not in ENCODINGS:
            raise _Reject(415, f"unsupported Content-Encoding {encoding!r} (gzip, deflate)",
                          close=True)
        raw = headers.get("Content-Length", "").strip()
        if not raw.isdigit():
            raise _Reject(411, "Content-Length required", close=True)
        length, limit = int(raw), self.limits.max_body_bytes
        if length > limit:
            raise _Reject(413, f"body of {length} bytes over the {limit}-byte limit",
                          close=True)
        if self.receiving >= self.limits.max_receiving:
            raise _Reject(429, f"busy: {self.limits.max_receiving} bodies being received",
                          close=True, retry_after=self.limits.retry_after_s)
        self.receiving += 1
        try:
            chunks = []
            async with asyncio.timeout(self.limits.body_timeout_s):
                async for chunk in request.stream():
                    chunks.append(chunk)
        except TimeoutError:
            raise _Reject(408, f"body not received within {self.limits.body_timeout_s:g}s",
                          close=True) from None
        finally:
            self.receiving -= 1
        body = b"".join(chunks)
        if len(body) < length:
            raise _Reject(400, "body shorter than its Content-Length", close=True)
        return body, kind, encoding

    def _work(self, body: bytes, kind: str, encoding: str, json_wanted: bool) -> bytes:
        """On a worker thread, holding an in-flight slot: decompress, decode, map,
        publish; returns the 200 body or raises _Reject."""
        try:
            body = decompress(body, encoding, self.limits.max_body_bytes)
            with self._cpu:  # one request at a time: threads contending for the GIL
                try:         # cost more than they overlap; publishing still overlaps
                    decoded = decode_json(body) if kind == JSON else decode_protobuf(body)
                except PayloadError as exc:
                    raise _Reject(400, str(exc)) from None
                batch = map_spans(decoded.spans, decoded.bad,
                                  capture=self.emitter.capture_message)
            self._publish(batch)
        finally:
            self._admission.release()
        self._count(decoded, batch)
        return self._response(batch, json_wanted)

    def _publish(self, batch: MappedBatch) -> None:
        items: list[Any] = [*batch.events, *(u.to_message() for u in batch.unmapped)]
        if not items:
            return
        try:
            self.emitter.send_and_wait(
                items, self.limits.publish_timeout_s,
                captures=batch.captures if self.settings.capture != "off" else ())
        except KafkaError as exc:
            log.warning("broker did not acknowledge a span batch: %s", exc)
            raise _Reject(503, f"broker did not acknowledge: {type(exc).__name__}",
                          retry_after=self.limits.retry_after_s) from None

    def _count(self, decoded: DecodedRequest, batch: MappedBatch) -> None:
        with self._stats_lock:
            stats = self.stats
            stats.requests += 1
            stats.accepted += 1
            stats.spans += len(decoded.spans) + len(decoded.bad)
            stats.events += len(batch.events)
            stats.dead_letters += len(batch.unmapped)
            stats.ignored_spans += batch.ignored
            stats.conventions.update(batch.conventions)
        if batch.unmapped:
            log.warning("%d spans not mapped (dead-lettered), first: %s",
                        len(batch.unmapped), batch.unmapped[0].reason)
        log.debug("span batch conventions %s", dict(batch.conventions))

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        """Routing's 404 and 405, as the google.rpc.Status OTLP/HTTP asks for."""
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        self.count_rejected(status)
        reason = (f"no such path {request.url.path!r}; use {TRACES_PATH}" if status == 404
                  else f"POST OTLP trace requests to {TRACES_PATH}")
        json_wanted = request.method != "POST" or _content_type(request) == JSON
        return self._error(_Reject(status, reason, close=True), json_wanted)

    @staticmethod
    def _error(reject: _Reject, json_wanted: bool) -> Response:
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
        if not batch.unmapped:
            return b"{}" if json_wanted else b""
        message = "; ".join(sorted({u.reason for u in batch.unmapped}))[:2000]
        message = f"{len(batch.unmapped)} spans dead-lettered: {message}"
        if json_wanted:
            return orjson.dumps({"partialSuccess": {
                "rejectedSpans": str(len(batch.unmapped)), "errorMessage": message}})
        return ExportTraceServiceResponse(partial_success=ExportTracePartialSuccess(
            rejected_spans=len(batch.unmapped), error_message=message)).SerializeToString()


def _content_type(request: Request) -> str:
    return request.headers.get("Content-Type", "").split(";")[0].strip().lower()
