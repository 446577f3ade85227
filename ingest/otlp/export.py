"""One export path for every OTLP transport: decode, map, publish, answer.

The HTTP receiver (:mod:`loopwatch.ingest.otlp.server`) and the gRPC one
(:mod:`loopwatch.ingest.otlp.grpc_server`) differ only in how a request arrives and how the
answer is written; what a request *does* is here, once: the same decoder and mapping,
the same in-flight bound, the same broker acknowledgement before the answer, the same
partial success for spans that could not be mapped, the same counters.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kafka.errors import KafkaError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
)

from loopwatch.core.config import Settings
from loopwatch.ingest.otlp.decode import DecodedRequest, PayloadError, decode_json, decode_protobuf
from loopwatch.ingest.otlp.mapping import MappedBatch, map_spans
from loopwatch.ingest.otlp.settings import OtlpSettings
from loopwatch.ingest.redact import Redactor
from loopwatch.ingest.sdk import Emitter

log = logging.getLogger(__name__)

PROTOBUF = "application/x-protobuf"
JSON = "application/json"


class Reject(Exception):
    """Refuse the request: ``status`` is the HTTP status (the gRPC receiver maps it to a
    status code); ``close`` when its body was left unread."""

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


def receiver_spool(settings: Settings) -> Path:
    """The spool folder of a process's receivers (one per data dir: ``up`` has one)."""
    return settings.spool_dir / "otlp-receiver"


class SpanExport:
    """The shared half of the receivers: one producer, one in-flight bound, one set of
    counters for every transport of a process, so ``max_inflight`` bounds them all."""

    def __init__(self, settings: Settings, bootstrap: str, limits: OtlpSettings) -> None:
        self.settings = settings
        self.limits = limits
        self.stats = ReceiverStats()
        self._stats_lock = threading.Lock()
        self.admission = threading.BoundedSemaphore(limits.max_inflight)
        self._cpu = threading.Lock()
        self.emitter = Emitter(
            bootstrap, settings.events_topic, receiver_spool(settings),
            max_message_bytes=max(1024, settings.max_message_bytes - 4096),
            capture=settings.capture, redactor=Redactor.from_settings(settings),
            captures_topic=settings.captures_topic,
            max_part_bytes=settings.capture_max_part_bytes,
        )

    @property
    def inflight(self) -> int:
        """Requests admitted and not yet answered, over every transport."""
        return self.limits.max_inflight - self.admission._value  # type: ignore[attr-defined]

    def admit(self) -> None:
        """Take an in-flight slot without waiting (no queue), or refuse with 429."""
        if not self.admission.acquire(blocking=False):
            raise Reject(429, f"busy: {self.limits.max_inflight} requests in flight",
                         retry_after=self.limits.retry_after_s)

    def export(self, body: bytes, kind: str = PROTOBUF,
               timeout_s: float | None = None) -> MappedBatch:
        """Holding a slot from :meth:`admit` (released here): decode, map and publish
        ``body`` (an uncompressed ExportTraceServiceRequest, protobuf or OTLP/JSON);
        returns once the broker acknowledged every message, or raises :class:`Reject`.
        ``timeout_s`` shortens the wait for the ack (a gRPC caller's deadline)."""
        try:
            with self._cpu:  # one request at a time: threads contending for the GIL
                try:         # cost more than they overlap; publishing still overlaps
                    decoded = decode_json(body) if kind == JSON else decode_protobuf(body)
                except PayloadError as exc:
                    raise Reject(400, str(exc)) from None
                batch = map_spans(decoded.spans, decoded.bad,
                                  capture=self.emitter.capture_message, structs=True)
            wait = self.limits.publish_timeout_s
            self._publish(batch, wait if timeout_s is None else max(0.1, min(wait, timeout_s)))
        finally:
            self.admission.release()
        self._count(decoded, batch)
        return batch

    def _publish(self, batch: MappedBatch, timeout_s: float) -> None:
        items: list[Any] = [*batch.events, *(u.to_message() for u in batch.unmapped)]
        if not items:
            return
        try:
            self.emitter.send_and_wait(
                items, timeout_s,
                captures=batch.captures if self.settings.capture != "off" else ())
        except KafkaError as exc:
            log.warning("broker did not acknowledge a span batch: %s", exc)
            raise Reject(503, f"broker did not acknowledge: {type(exc).__name__}",
                         retry_after=self.limits.retry_after_s) from None

    def count_rejected(self, status: int) -> None:
        with self._stats_lock:
            self.stats.requests += 1
            self.stats.rejected[status] += 1

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

    def close(self) -> None:
        self.emitter.close(timeout_s=5)


def partial_success(batch: MappedBatch) -> ExportTracePartialSuccess | None:
    """OTLP's partial success for the spans that were dead-lettered, None for none."""
    if not batch.unmapped:
        return None
    message = "; ".join(sorted({u.reason for u in batch.unmapped}))[:2000]
    return ExportTracePartialSuccess(
        rejected_spans=len(batch.unmapped),
        error_message=f"{len(batch.unmapped)} spans dead-lettered: {message}")
