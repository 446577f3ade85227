"""The emitter SDK: what an agent calls.

Usage (``bootstrap`` is what ``loopwatch up`` prints)::

    with Emitter(bootstrap) as emitter:
        with emitter.run(agent="support", task_type="refund", model="gpt-4o") as run:
            run.step()
            run.llm_call(input_tokens=1200, output_tokens=80, cache_read_input_tokens=1000)
            run.tool_call("lookup_order", args={"id": 7}, latency_ms=35)
            run.end("model_done")

Delivery guarantee: at-least-once. Events are validated at the call site (a bad field
raises ``pydantic.ValidationError`` there), queued, and sent by a background thread
with kafka-python, so the agent's loop never waits on the network. Events for one
partition travel together in an envelope (the partition is chosen from ``run_id``, so
a run's events stay ordered). When the broker cannot take them they go to a bounded
on-disk spool and are resent later; ``event_id`` makes a resend harmless.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import orjson
from kafka import KafkaProducer
from kafka.errors import KafkaError
from kafka.partitioner.default import murmur2

from ingest.events import (
    Annotation,
    EventBase,
    Label,
    LlmCall,
    RunEnd,
    RunStart,
    Step,
    ToolCall,
    canonical_args_hash,
)
from ingest.spool import DiskSpool
from ingest.wire import ENVELOPE_VERSION

log = logging.getLogger(__name__)
T = TypeVar("T")

CONTEXT_FIELDS = ("agent", "agent_version", "task_type", "model", "prompt_version",
                  "deployment", "traffic_slice", "worker_id")


def partition_for(run_id: str, partitions: int) -> int:
    """kafka-python's default partitioner (murmur2 of the key), as Java clients do."""
    return (murmur2(run_id.encode()) & 0x7FFFFFFF) % partitions


class ToolTimeout(TimeoutError):
    """The tool call exceeded its timeout (it may still finish in the background)."""


@dataclass
class EmitterStats:
    queued: int = 0
    sent: int = 0
    messages: int = 0
    spooled: int = 0
    resent: int = 0
    send_errors: int = 0


class Emitter:
    """Sends events to the events topic from a background thread; see the module doc."""

    def __init__(
        self,
        bootstrap: str,
        topic: str = "loopwatch.events",
        spool_dir: Path | None = None,
        *,
        spool_max_bytes: int = 256 * 1024 * 1024,
        max_batch: int = 500,
        linger_s: float = 0.02,
        max_message_bytes: int = 900_000,
        producer_config: dict[str, Any] | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.stats = EmitterStats()
        self.spool = DiskSpool(
            spool_dir or Path.home() / ".local/share/loopwatch/spool" / uuid.uuid4().hex,
            spool_max_bytes,
        )
        self._max_batch = max_batch
        self._linger_s = linger_s
        self._max_message_bytes = max_message_bytes
        self._producer_config = {
            "acks": "all",
            "linger_ms": 5,
            "max_block_ms": 2000,
            "bootstrap_timeout_ms": 2000,
            "retries": 5,
            "request_timeout_ms": 10_000,
            **(producer_config or {}),
        }
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        self._producer: KafkaProducer | None = None
        self._partitions: int | None = None
        self._outstanding = 0
        self._outstanding_lock = threading.Lock()
        self._closed = False
        self._late_calls = ThreadPoolExecutor(max_workers=32, thread_name_prefix="tool")
        self._next_resend = 0.0
        self._thread = threading.Thread(target=self._run, name="loopwatch-emitter", daemon=True)
        self._thread.start()

    # -- public API ---------------------------------------------------------------

    def emit(self, event: EventBase) -> None:
        """Queue one validated event; never blocks on the network."""
        if self._closed:
            raise RuntimeError("emitter is closed")
        self._enqueue([orjson.dumps(event.model_dump(mode="json", exclude_none=True))])

    def emit_raw(self, lines: list[bytes]) -> None:
        """Queue already-encoded events (used by ``dlq replay`` and importers)."""
        self._enqueue(lines)

    def send_and_wait(self, events: Sequence[EventBase | bytes], timeout_s: float = 10.0) -> None:
        """Send now from the caller's thread; return once the broker acknowledged all.

        For callers that must not answer before the data is durable (the OTLP receiver
        answers 200 only after this returns). ``bytes`` are already-encoded JSON objects
        with a ``run_id``. Events are grouped by partition into envelopes as
        :meth:`emit` does. Nothing is spooled: on failure this raises (``KafkaError``,
        or ``KafkaTimeoutError`` after ``timeout_s``) and the caller, who still holds the
        data, decides; resending is harmless as ``event_id`` deduplicates.
        """
        with self.__dict__.setdefault("_connect_lock", threading.Lock()):
            if not self._connect():
                raise KafkaError(f"broker {self.bootstrap} unavailable or topic "
                                 f"{self.topic} has no partitions")
        producer, partitions = self._producer, self._partitions
        assert producer is not None and partitions is not None
        groups: dict[int, list[bytes]] = defaultdict(list)
        keys: dict[int, bytes] = {}
        partition_of: dict[str, int] = {}  # murmur2 is pure Python: once per run
        for event in events:
            if isinstance(event, bytes):
                line, run_id = event, str(orjson.loads(event).get("run_id") or "")
            else:  # pydantic's own JSON: the same bytes as emit() makes, 2x faster
                line = event.__pydantic_serializer__.to_json(event, exclude_none=True)
                run_id = event.run_id
            partition = partition_of.get(run_id)
            if partition is None:
                partition = partition_of[run_id] = partition_for(run_id, partitions)
            groups[partition].append(line)
            keys.setdefault(partition, run_id.encode())
        futures = []
        for partition, group in groups.items():
            for chunk in self._chunks(group):
                value = chunk[0] if len(chunk) == 1 else (
                    b'{"envelope_version":' + str(ENVELOPE_VERSION).encode()
                    + b',"events":[' + b",".join(chunk) + b"]}")
                futures.append((len(chunk), producer.send(
                    self.topic, value=value, key=keys[partition], partition=partition)))
        deadline = time.monotonic() + timeout_s
        for count, future in futures:
            future.get(timeout=max(0.001, deadline - time.monotonic()))
            self.stats.sent += count
            self.stats.messages += 1

    def _enqueue(self, lines: list[bytes]) -> None:
        with self._outstanding_lock:
            self._outstanding += len(lines)
        self.stats.queued += len(lines)
        for line in lines:
            self._queue.put(line)

    @contextmanager
    def run(self, run_id: str | None = None, **fields: Any) -> Iterator[RunContext]:
        """A run: emits ``run.start`` now, and ``run.end`` when the block is left.

        An exception leaving the block ends the run as ``crash`` (and propagates);
        a normal exit without :meth:`RunContext.end` ends it as ``model_done``.
        """
        context = RunContext(self, run_id or uuid.uuid4().hex, fields)
        context.start()
        try:
            yield context
        except BaseException as exc:
            if not context.ended:
                context.end("crash", error_type=type(exc).__name__)
            raise
        if not context.ended:
            context.end("model_done")

    def annotate(self, kind: str, **fields: Any) -> None:
        self.emit(Annotation(kind=kind, **fields))

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything queued has been acknowledged by the broker or spooled."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.outstanding == 0:
                return True
            time.sleep(0.01)
        return False

    @property
    def outstanding(self) -> int:
        """Events queued or in flight: neither acknowledged nor spooled yet."""
        with self._outstanding_lock:
            return self._outstanding

    def resend_spooled(self) -> int:
        """Try to send what the spool holds now; returns how many events were re-queued."""
        lines = self.spool.take()
        self.stats.resent += len(lines)
        self.emit_raw(lines)
        return len(lines)

    def close(self, timeout_s: float = 30.0) -> None:
        if self._closed:
            return
        self._late_calls.shutdown(wait=True, cancel_futures=False)
        self.flush(timeout_s)
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._producer is not None:
            self._producer.close(timeout=5)

    def __enter__(self) -> Emitter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- background thread --------------------------------------------------------

    def _connect(self) -> bool:
        if self._producer is not None and self._partitions:
            return True
        try:
            if self._producer is None:
                self._producer = KafkaProducer(
                    bootstrap_servers=self.bootstrap.split(","), **self._producer_config
                )
            partitions = self._producer.partitions_for(self.topic)
        except KafkaError as exc:
            log.warning("broker unavailable (%s); spooling events", exc)
            return False
        if not partitions:
            return False
        self._partitions = len(partitions)
        return True

    def _run(self) -> None:
        while True:
            first = self._next(timeout=0.5)
            if first is None and self._closed:
                return
            batch = [] if first is None else [first]
            deadline = time.monotonic() + self._linger_s
            while len(batch) < self._max_batch:
                item = self._next(timeout=max(0.0, deadline - time.monotonic()))
                if item is None:
                    break
                batch.append(item)
            if batch:
                self._send(batch)
            self._maybe_resend()

    def _next(self, timeout: float) -> bytes | None:
        try:
            return self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
        except queue.Empty:
            return None

    def _maybe_resend(self) -> None:
        now = time.monotonic()
        if now < self._next_resend or self.spool.size() == 0:
            return
        self._next_resend = now + 2.0
        if self._connect():
            self.resend_spooled()

    def _send(self, lines: list[bytes]) -> None:
        if not self._connect():
            self._to_spool(lines)
            return
        assert self._producer is not None and self._partitions is not None
        groups: dict[int, list[bytes]] = defaultdict(list)
        for line in lines:
            run_id = orjson.loads(line).get("run_id") or ""
            groups[partition_for(run_id, self._partitions)].append(line)
        for partition, group in groups.items():
            for chunk in self._chunks(group):
                self._send_message(partition, chunk)

    def _chunks(self, group: list[bytes]) -> Iterator[list[bytes]]:
        chunk: list[bytes] = []
        size = 0
        for line in group:
            if chunk and size + len(line) > self._max_message_bytes:
                yield chunk
                chunk, size = [], 0
            chunk.append(line)
            size += len(line) + 1
        if chunk:
            yield chunk

    def _send_message(self, partition: int, chunk: list[bytes]) -> None:
        assert self._producer is not None
        if len(chunk) == 1:
            value = chunk[0]
        else:
            value = (b'{"envelope_version":' + str(ENVELOPE_VERSION).encode()
                     + b',"events":[' + b",".join(chunk) + b"]}")
        key = orjson.loads(chunk[0]).get("run_id", "").encode()
        try:
            future = self._producer.send(self.topic, value=value, key=key, partition=partition)
        except KafkaError as exc:
            self.stats.send_errors += 1
            log.warning("send failed (%s); spooling %d events", exc, len(chunk))
            self._to_spool(chunk)
            return

        def delivered(_: Any) -> None:
            self.stats.sent += len(chunk)
            self.stats.messages += 1
            self._settled(len(chunk))

        def failed(exc: BaseException) -> None:
            self.stats.send_errors += 1
            log.warning("delivery failed (%s); spooling %d events", exc, len(chunk))
            self._to_spool(chunk)

        future.add_callback(delivered)
        future.add_errback(failed)

    def _settled(self, events: int) -> None:
        with self._outstanding_lock:
            self._outstanding -= events

    def _to_spool(self, lines: list[bytes]) -> None:
        kept = self.spool.append(lines)
        self._settled(len(lines))
        self.stats.spooled += kept
        if kept < len(lines):
            log.error("spool full: %d events dropped", len(lines) - kept)

    def _run_late(self, fn: Callable[[], T]) -> Future[T]:
        return self._late_calls.submit(fn)


class RunContext:
    """Helpers bound to one run; every event carries the run's common fields."""

    def __init__(self, emitter: Emitter, run_id: str, fields: dict[str, Any]) -> None:
        self.emitter = emitter
        self.run_id = run_id
        self.common = {key: fields.pop(key) for key in CONTEXT_FIELDS if key in fields}
        self.start_fields = fields
        self.ended = False
        self.step_number = 0

    def _emit(self, model: type[EventBase], **fields: Any) -> EventBase:
        event = model(run_id=self.run_id, **{**self.common, **fields})
        self.emitter.emit(event)
        return event

    def start(self) -> None:
        self._emit(RunStart, **self.start_fields)

    def step(self, **fields: Any) -> EventBase:
        fields.setdefault("step", self.step_number)
        self.step_number = int(fields["step"]) + 1
        return self._emit(Step, **fields)

    def llm_call(self, **fields: Any) -> EventBase:
        fields.setdefault("step", max(0, self.step_number - 1))
        return self._emit(LlmCall, **fields)

    def tool_call(self, tool: str, args: Any = None, **fields: Any) -> EventBase:
        if args is not None:
            fields.setdefault("args_hash", canonical_args_hash(tool, args))
        fields.setdefault("step", max(0, self.step_number - 1))
        return self._emit(ToolCall, tool=tool, **fields)

    def label(self, verdict: str, **fields: Any) -> EventBase:
        return self._emit(Label, verdict=verdict, **fields)

    def end(self, terminal_reason: str | None, **fields: Any) -> EventBase:
        self.ended = True
        return self._emit(RunEnd, terminal_reason=terminal_reason, **fields)

    def timed_tool_call(
        self,
        tool: str,
        fn: Callable[..., T],
        args: dict[str, Any],
        timeout_s: float,
        *,
        let_finish: bool = True,
        late_cap_s: float | None = None,
    ) -> T:
        """Call ``fn(**args)`` with a timeout and emit its ``tool.call``.

        On timeout the caller gets :class:`ToolTimeout` at once. With ``let_finish``
        the call keeps running in the background and its event is emitted when it
        ends, carrying the true duration as ``late_completion_ms`` (what the
        near-miss ratio needs); a call still running after ``late_cap_s`` (default
        10 x the timeout) is reported without a true duration.
        """
        started = time.monotonic()
        step = max(0, self.step_number - 1)
        timeout_ms = timeout_s * 1000
        base: dict[str, Any] = {"tool": tool, "args": args, "timeout_ms": timeout_ms,
                                "step": step}
        future = self.emitter._run_late(lambda: fn(**args))
        try:
            result = future.result(timeout=timeout_s)
        except FutureTimeout:
            self._report_timeout(future, base, started, timeout_ms, let_finish,
                                 late_cap_s if late_cap_s is not None else 10 * timeout_s)
            raise ToolTimeout(f"{tool} timed out after {timeout_s:g}s") from None
        except Exception as exc:
            self.tool_call(**base, latency_ms=(time.monotonic() - started) * 1000,
                           error_type=type(exc).__name__)
            raise
        self.tool_call(**base, latency_ms=(time.monotonic() - started) * 1000)
        return result

    def _report_timeout(self, future: Future[Any], base: dict[str, Any], started: float,
                        timeout_ms: float, let_finish: bool, late_cap_s: float) -> None:
        reported = threading.Event()

        def report(late_ms: float | None) -> None:
            if reported.is_set():
                return
            reported.set()
            self.tool_call(**base, latency_ms=timeout_ms, timed_out=True,
                           error_type="timeout", late_completion_ms=late_ms)

        if not let_finish:
            future.cancel()
            report(None)
            return
        future.add_done_callback(lambda _: report((time.monotonic() - started) * 1000))
        timer = threading.Timer(max(0.0, late_cap_s - (time.monotonic() - started)),
                                report, args=(None,))
        timer.daemon = True
        timer.start()
