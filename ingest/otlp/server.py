"""The OTLP/HTTP trace receiver: ``POST /v1/traces`` in, acknowledged events out.

Answers (OTLP/HTTP semantics, so stock exporters retry what is worth retrying):

- 200 only after the broker acknowledged every message of the batch (the events, the
  capture messages of span content (redacted; docs/capture.md), and the dead letters
  of spans that could not be mapped, which are reported back as
  ``partial_success.rejected_spans`` with the reason);
- 400 with the reason for a body that is not an OTLP trace request, 413 over
  ``max_body_bytes`` (checked before and after decompression), 415 for an unknown
  content type or encoding, 401 without the configured bearer token;
- 429 + Retry-After when ``max_inflight`` requests are already being worked on, and
  503 + Retry-After when the broker does not acknowledge within
  ``publish_timeout_s`` or is unreachable, or ``max_connections`` are open. Work in
  memory is therefore bounded by ``max_inflight x max_body_bytes`` (plus its events),
  however slow the broker; the client keeps the data and retries.

Threads: one per connection (stdlib ``ThreadingHTTPServer``, HTTP/1.1 keep-alive),
admission by a semaphore; kafka-python's producer is shared and thread-safe.
"""

from __future__ import annotations

import hmac
import logging
import threading
import zlib
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from socket import socket
from typing import Any
from urllib.parse import urlsplit

import orjson
from kafka.errors import KafkaError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceResponse,
)

from ingest.otlp.decode import DecodedRequest, PayloadError, decode_json, decode_protobuf
from ingest.otlp.mapping import MappedBatch, map_spans
from ingest.otlp.settings import OtlpSettings, load_otlp_settings
from ingest.redact import Redactor
from ingest.sdk import Emitter
from loopwatch.config import Settings

log = logging.getLogger(__name__)

TRACES_PATH = "/v1/traces"
PROTOBUF = "application/x-protobuf"
JSON = "application/json"
# google.rpc.Code for the Status body OTLP/HTTP asks for on errors.
_RPC_CODES = {400: 3, 401: 16, 404: 5, 405: 12, 411: 3, 413: 8, 415: 3, 429: 8, 503: 14}


class _Reject(Exception):
    """Answer with this status and reason; ``drain`` reads the unread body first."""

    def __init__(self, status: int, reason: str, *, drain: bool = True,
                 retry_after: int | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.drain = drain
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


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], receiver: OtlpReceiver) -> None:
        self.receiver = receiver
        self._open = 0
        self._open_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            full = self._open >= self.receiver.limits.max_connections
            if not full:
                self._open += 1
        if full:
            self.receiver.count_rejected(503)
            retry = self.receiver.limits.retry_after_s
            try:
                sock: socket = request
                sock.sendall(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: "
                             + str(retry).encode()
                             + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._open_lock:
                self._open -= 1


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 60
    server: _Server
    body_read = False

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("otlp %s " + format, self.client_address[0], *args)

    def do_POST(self) -> None:
        receiver = self.server.receiver
        json_wanted = self.headers.get("Content-Type", "").split(";")[0].strip() == JSON
        self.body_read = False
        try:
            status, body = receiver.handle(self, json_wanted)
        except Exception as exc:
            if not isinstance(exc, _Reject):
                log.exception("OTLP request failed")
            reject = exc if isinstance(exc, _Reject) else _Reject(500, "internal error")
            receiver.count_rejected(reject.status)
            if reject.drain:
                self._drain()
            else:
                self.close_connection = True
            self._respond_error(reject, json_wanted)
            return
        self._send(status, body, JSON if json_wanted else PROTOBUF)

    def do_GET(self) -> None:
        self._drain()
        self._respond_error(_Reject(405 if self._path() == TRACES_PATH else 404,
                                    "POST OTLP trace requests to /v1/traces"), True)

    def _path(self) -> str:
        return urlsplit(self.path).path.rstrip("/") or "/"

    def _content_length(self) -> int | None:
        raw = self.headers.get("Content-Length")
        if raw is None or not raw.strip().isdigit():
            return None
        return int(raw)

    def _drain(self) -> None:
        """Read and drop an unread body (it is within the size limit), keeping the
        connection usable for the client's next request."""
        if self.body_read:
            return
        self.body_read = True
        remaining = self._content_length() or 0
        if remaining > self.server.receiver.limits.max_body_bytes:
            self.close_connection = True
            return
        while remaining > 0:
            chunk = self.rfile.read(min(remaining, 65536))
            if not chunk:
                break
            remaining -= len(chunk)

    def read_body(self) -> bytes:
        length = self._content_length()
        if length is None:
            raise _Reject(411, "Content-Length required", drain=False)
        limit = self.server.receiver.limits.max_body_bytes
        if length > limit:
            raise _Reject(413, f"body of {length} bytes over the {limit}-byte limit",
                          drain=False)
        self.body_read = True
        body = self.rfile.read(length)
        if len(body) < length:
            raise _Reject(400, "body shorter than its Content-Length", drain=False)
        return body

    def _respond_error(self, reject: _Reject, json_wanted: bool) -> None:
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
        self._send(reject.status, body, kind, headers)

    def _send(self, status: int, body: bytes, kind: str,
              headers: dict[str, str] | None = None) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            self.close_connection = True


class OtlpReceiver:
    """The receiver as a service: ``start()`` returns its URL, ``stop()`` ends it.

    ``settings`` supplies the topic and message size; ``limits`` the receiver's own
    knobs (read from ``LOOPWATCH_OTLP_*`` when not given). ``token`` enables bearer auth.
    """

    def __init__(self, settings: Settings, bootstrap: str, host: str = "127.0.0.1",
                 port: int = 4318, token: str | None = None, *,
                 limits: OtlpSettings | None = None) -> None:
        self.settings = settings
        self.limits = limits or load_otlp_settings()
        self.token = token
        self.stats = ReceiverStats()
        self._stats_lock = threading.Lock()
        self._admission = threading.BoundedSemaphore(self.limits.max_inflight)
        self._cpu = threading.Lock()
        self.emitter = Emitter(
            bootstrap, settings.events_topic, settings.spool_dir / "otlp-receiver",
            max_message_bytes=max(1024, settings.max_message_bytes - 4096),
            capture=settings.capture, redactor=Redactor.from_settings(settings),
            captures_topic=settings.captures_topic,
            max_part_bytes=settings.capture_max_part_bytes,
        )
        self._server = _Server((host, port), self)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="otlp-receiver")

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def inflight(self) -> int:
        """Requests admitted and not yet answered."""
        return self.limits.max_inflight - self._admission._value  # type: ignore[attr-defined]

    def start(self) -> str:
        self._thread.start()
        log.info("OTLP/HTTP receiver on %s%s", self.url, TRACES_PATH)
        return self.url

    def stop(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for serve_forever to have run
            self._server.shutdown()
        self._server.server_close()
        self.emitter.close(timeout_s=5)

    def count_rejected(self, status: int) -> None:
        with self._stats_lock:
            self.stats.requests += 1
            self.stats.rejected[status] += 1

    # -- one request ------------------------------------------------------------------

    def handle(self, request: _Handler, json_wanted: bool) -> tuple[int, bytes]:
        """Check, decode, map, publish; returns (200, response body) or raises _Reject."""
        if request._path() != TRACES_PATH:
            raise _Reject(404, f"no such path {request._path()!r}; use {TRACES_PATH}")
        if self.token is not None and not hmac.compare_digest(
                request.headers.get("Authorization", "").encode(),
                f"Bearer {self.token}".encode()):
            raise _Reject(401, "missing or wrong bearer token")
        kind = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if kind not in (PROTOBUF, JSON):
            raise _Reject(415, f"unsupported Content-Type {kind!r} ({PROTOBUF} or {JSON})")
        encoding = request.headers.get("Content-Encoding", "").strip().lower()
        if not self._admission.acquire(blocking=False):
            raise _Reject(429, f"busy: {self.limits.max_inflight} requests in flight",
                          retry_after=self.limits.retry_after_s)
        try:
            body = decompress(request.read_body(), encoding, self.limits.max_body_bytes)
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
        return 200, self._response(batch, json_wanted)

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
