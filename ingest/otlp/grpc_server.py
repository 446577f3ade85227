"""The OTLP/gRPC trace receiver: ``TraceService/Export`` on 4317, beside OTLP/HTTP.

It is a second front door to :class:`loopwatch.ingest.otlp.export.SpanExport`, the path the HTTP
receiver takes: the request's bytes go to the same protobuf decoder (the method takes
them raw, so a malformed message is INVALID_ARGUMENT with the decoder's reason rather
than grpc's opaque deserialisation error), the same mapping, the same in-flight bound,
and the call returns only after the broker acknowledged every message, with the same
partial success for spans that were dead-lettered.

Answers (OTLP/gRPC semantics; the stock exporter retries the retryable ones):

- UNAUTHENTICATED without ``authorization: Bearer <token>`` when a token is set,
  checked before the method runs;
- RESOURCE_EXHAUSTED over ``max_body_bytes`` (grpc's own check, after decompression),
  over ``max_receiving`` calls open at once (grpc's own, before the message is read),
  and when ``max_inflight`` requests of either transport are being exported (with
  ``google.rpc.retryinfo-bin`` = ``retry_after_s``, as the stock exporter reads);
- INVALID_ARGUMENT for bytes that are not an ExportTraceServiceRequest; UNIMPLEMENTED
  for any other method (grpc's own);
- UNAVAILABLE (with retry info) when the broker does not acknowledge within
  ``publish_timeout_s``, or the caller's deadline if that is sooner.

grpc's synchronous server runs each call on one of ``max_receiving`` threads and
refuses calls beyond that: nothing queues. A connection is asked to go away after
``grpc_max_connection_age_s`` and closed ``body_timeout_s + publish_timeout_s`` later,
which bounds how long a client that never finishes its message holds a slot.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration
from google.rpc.error_details_pb2 import RetryInfo
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from loopwatch.ingest.otlp.export import PROTOBUF, Reject, SpanExport, partial_success

log = logging.getLogger(__name__)

#: ``opentelemetry.proto.collector.trace.v1.TraceService``, from the proto itself
SERVICE = trace_service_pb2.DESCRIPTOR.services_by_name["TraceService"].full_name
EXPORT_METHOD = f"/{SERVICE}/Export"
RETRY_INFO_KEY = "google.rpc.retryinfo-bin"

_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
          413: grpc.StatusCode.RESOURCE_EXHAUSTED, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
          503: grpc.StatusCode.UNAVAILABLE}


class _BearerToken(grpc.ServerInterceptor):  # type: ignore[misc]
    """Every call carries ``authorization: Bearer <token>`` or is refused before its
    method runs (the message itself is never decoded)."""

    def __init__(self, token: str, on_refused: Callable[[], None]) -> None:
        self._expected = f"Bearer {token}".encode()
        self._on_refused = on_refused
        self._refuse = grpc.unary_unary_rpc_method_handler(self._refused)

    def intercept_service(self, continuation: Callable[[Any], Any],
                          details: grpc.HandlerCallDetails) -> Any:
        given = next((value for key, value in details.invocation_metadata or ()
                      if key == "authorization"), "")
        if isinstance(given, bytes) or not hmac.compare_digest(given.encode(),
                                                               self._expected):
            return self._refuse
        return continuation(details)

    def _refused(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self._on_refused()
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        raise AssertionError("unreachable: abort raises")


class OtlpGrpcReceiver:
    """``start()`` returns ``host:port``; ``stop()`` ends it. Binds at construction: a
    taken port is an OSError (port reuse is off, so two receivers never share one)."""

    def __init__(self, core: SpanExport, host: str, port: int,
                 token: str | None = None) -> None:
        self.core = core
        limits = core.limits
        self._pool = ThreadPoolExecutor(limits.max_receiving, thread_name_prefix="otlp-grpc")
        options = [
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", limits.max_body_bytes),
            ("grpc.max_send_message_length", 64 * 1024),
            ("grpc.max_concurrent_streams", limits.max_receiving),
            ("grpc.max_connection_age_ms", int(limits.grpc_max_connection_age_s * 1000)),
            ("grpc.max_connection_age_grace_ms",
             int((limits.body_timeout_s + limits.publish_timeout_s) * 1000)),
        ]
        interceptors = [] if token is None else [
            _BearerToken(token, lambda: core.count_rejected(401))]
        self._server = grpc.server(
            self._pool, handlers=[grpc.method_handlers_generic_handler(SERVICE, {
                "Export": grpc.unary_unary_rpc_method_handler(self._export)})],
            interceptors=interceptors, options=options,
            maximum_concurrent_rpcs=limits.max_receiving)
        self._host = host
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = self._server.add_insecure_port(where)
        except RuntimeError as exc:
            self._pool.shutdown(wait=False)
            raise OSError(f"cannot listen on {where}: {exc}") from None
        if not self.port:  # older grpcio answers 0 instead of raising
            self._pool.shutdown(wait=False)
            raise OSError(f"cannot listen on {where}")

    @property
    def address(self) -> str:
        return f"[{self._host}]:{self.port}" if ":" in self._host else f"{self._host}:{self.port}"

    def start(self) -> str:
        self._server.start()
        log.info("OTLP/gRPC receiver on %s", self.address)
        return self.address

    def stop(self, grace_s: float = 5.0) -> None:
        self._server.stop(grace_s).wait()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _export(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """One call: the shared export path, its Reject turned into a status code."""
        try:
            self.core.admit()
            batch = self.core.export(request, PROTOBUF, timeout_s=context.time_remaining())
        except Reject as reject:
            self.core.count_rejected(reject.status)
            if reject.retry_after is not None:
                info = RetryInfo(retry_delay=Duration(seconds=reject.retry_after))
                context.set_trailing_metadata(((RETRY_INFO_KEY, info.SerializeToString()),))
            context.abort(_CODES.get(reject.status, grpc.StatusCode.INTERNAL), reject.reason)
            raise AssertionError("unreachable: abort raises") from None
        partial = partial_success(batch)
        if partial is None:
            return b""
        return bytes(ExportTraceServiceResponse(partial_success=partial).SerializeToString())
