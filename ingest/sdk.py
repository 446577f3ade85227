"""The emitter SDK: what an agent calls.

Usage: with no address the emitter finds ``loopwatch up``'s embedded broker from the
data dir (``<data_dir>/broker.json``; ``data_dir=`` or ``LOOPWATCH_DATA_DIR``), or give
a Kafka bootstrap (``host:port[,...]``)::

    with Emitter() as emitter:
        with emitter.run(agent="support", task_type="refund", model="gpt-4o") as run:
            run.step()
            run.llm_call(input_tokens=1200, output_tokens=80, cache_read_input_tokens=1000)
            run.tool_call("lookup_order", args={"id": 7}, latency_ms=35)
            run.end("model_done")

Delivery guarantee: at-least-once. Events are validated at the call site (a bad field
raises ``pydantic.ValidationError`` there), queued, and sent by a background thread
with kafka-python, so the agent's loop never waits on the network. Events for one
partition travel together in an envelope (the partition is chosen from ``run_id``, so
a run's events stay ordered): up to ``max_batch`` events of a partition, gathered for
up to ``linger_s``. Every accepted event has room reserved in a bounded on-disk spool
(:mod:`loopwatch.ingest.spool`); when the spool is full, ``emit`` raises :class:`SpoolFull` and
the event is counted in ``stats.refused``, never dropped later. ``event_id`` makes
every resend harmless downstream.

- The embedded broker (``confirm="auto"`` when the address is the data dir's broker,
  or ``confirm="pipeline"``) keeps everything in memory, so its acknowledgement is not
  enough: each batch is written ahead to the spool (one fsync) and kept until the
  processors' consumer group committed past it (:mod:`loopwatch.ingest.confirm`). When the
  broker was restarted (a new incarnation in broker.json, or committed offsets that
  went back) everything not yet confirmed is sent again.
- A Kafka cluster (``acks=all``, replication; ``confirm="broker"``, or ``auto`` with an
  address no broker.json announces): the acknowledgement is enough, and only what the
  broker cannot take is spooled and resent.

``flush()`` waits for the broker's acknowledgement (or the spool, while the broker is
unreachable); ``flush(confirmed=True)`` / ``wait_confirmed()`` for the pipeline's
commit. ``close()`` never raises for the broker and never drops: what is unconfirmed
stays spooled, and the next emitter on that spool resends it; emitters on the default
spool folder (``<data_dir>/spool/<spool_name>``, held with ``flock``) adopt the folders
of emitters that exited.

Capture (docs/capture.md): ``llm_call(prompt=..., response=...)`` and
``tool_call(tool, args=..., output=...)`` also record the bodies. They are redacted,
split into content-addressed parts and serialised in the caller (so the caller may
change its message list right after), and the event keeps only hashes and sizes. The
bodies travel as one capture message per call on their own topic (key ``run_id``, the
same partitioner), sent by the same background thread, unless ``capture="off"``.
Which runs keep them is decided downstream. Strings in an event's extras (and its
free-text fields) are redacted too, since they leave the process as well.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar, cast

import msgspec
import orjson
from kafka import KafkaProducer
from kafka.errors import KafkaError
from kafka.partitioner.default import murmur2
from kafka.producer.future import RecordMetadata

from loopwatch.ingest.announce import BrokerAnnouncement, default_data_dir, read_announcement
from loopwatch.ingest.capture import CaptureMessage, Redact, build_capture_message, part_hash
from loopwatch.ingest.confirm import Confirmations, Tracked
from loopwatch.ingest.events import (
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
from loopwatch.ingest.handoff import Handoff
from loopwatch.ingest.redact import Redactor
from loopwatch.ingest.spool import DiskSpool, SpoolFull, open_spool
from loopwatch.ingest.structs import encode_claim
from loopwatch.ingest.wire import (
    ENVELOPE_OVERHEAD_BYTES,
    envelope_chunks,
    exact_json,
    message_value,
)

#: the Emitter's defaults: events per message (one envelope), and bytes per message
MAX_BATCH = 500
MAX_MESSAGE_BYTES = 900_000

log = logging.getLogger(__name__)
T = TypeVar("T")
#: an encoded event on its way to the sender, with its partition key (its ``run_id``;
#: None for a line that is not JSON, which travels alone: see :func:`partition_key`)
Queued = tuple[str | None, bytes]

CONTEXT_FIELDS = ("agent", "agent_version", "task_type", "model", "prompt_version",
                  "deployment", "traffic_slice", "worker_id")
#: Free-text fields of the contract that can carry what a user typed or a tool said.
FREE_TEXT_FIELDS = ("error_type", "stop_reason", "message", "old_value", "new_value")


@functools.cache
def free_text_fields(kind: type[EventBase]) -> tuple[str, ...]:
    """The :data:`FREE_TEXT_FIELDS` an event type has. Asking a pydantic model for a
    field it lacks raises inside ``__getattr__``: that took 64 % of ``emit``."""
    return tuple(name for name in FREE_TEXT_FIELDS if name in kind.model_fields)
CAPTURE_MODES = ("off", "failures", "all")
#: A spooled capture message is ``@<topic> <message>``: no event line starts with ``@``.
SPOOL_TOPIC_MARK = b"@"
#: a resend round hands kafka-python at most this many bytes (a quarter of its default
#: 32 MiB buffer, which would otherwise block the sender thread once full), and the next
#: round starts only once the last one settled: an outage costs one round per delivery
#: timeout, not the whole spool every 2 s
RESEND_ROUND_BYTES = 8 << 20
#: after a failed connect, batches go straight to the spool for this long before the next
#: attempt: a connect per batch held the sender a bootstrap timeout each (20,000 events
#: took 9 s to spool with a 200 ms timeout), while the queue backed up behind it
RECONNECT_AFTER_S = 1.0


@functools.lru_cache(maxsize=65536)
def partition_for(run_id: str, partitions: int) -> int:
    """kafka-python's default partitioner (murmur2 of the key), as Java clients do;
    cached, since murmur2 is pure Python and a run's events all ask for it."""
    return (murmur2(run_id.encode()) & 0x7FFFFFFF) % partitions


class ToolTimeout(TimeoutError):
    """The tool call exceeded its timeout (it may still finish in the background)."""


@dataclass
class EmitterStats:
    """Counters of one emitter. ``spooled``: records put aside for a resend because a
    send failed or could not start; ``logged``: records written ahead to the spool
    (embedded broker: everything sent); ``confirmed``: records the pipeline's group
    committed past (embedded broker); ``refused``: events refused at the call because
    the spool was full; ``resent``: records sent again from the spool."""

    queued: int = 0
    sent: int = 0
    messages: int = 0
    spooled: int = 0
    resent: int = 0
    send_errors: int = 0
    logged: int = 0
    confirmed: int = 0
    refused: int = 0
    event_bytes: int = 0
    captures: int = 0
    capture_bytes: int = 0
    captures_sent: int = 0
    captures_dropped: int = 0
    capture_errors: int = 0


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One message for a topic other than the events topic (a capture message).

    A capture queued by this emitter keeps its ``message``: the sender leaves out the
    bodies the broker already acknowledged (:class:`DeliveredBlobs`) when it encodes it.
    A spooled one comes back as ``value`` bytes, always whole.
    """

    topic: str
    run_id: str
    value: bytes
    message: CaptureMessage | None = None

    def whole(self) -> bytes:
        """The message with every body, as it is spooled."""
        if self.message is None:
            return self.value
        return self.message.__pydantic_serializer__.to_json(self.message)

    def spool_line(self) -> bytes:
        """``@<topic> <message>``: how the spool keeps it (``value`` is whole when set)."""
        return SPOOL_TOPIC_MARK + self.topic.encode() + b" " + (self.value or self.whole())


class DeliveredBlobs:
    """Blob hashes the broker acknowledged recently, so later captures need not carry
    them again: an agent re-sends its system prompt and whole conversation on every
    call. An entry is forgotten after ``resend_s`` (the body then travels again, which
    refreshes it in the store's staging table long before that table's 7-day TTL), and
    the oldest go first beyond ``max_entries``.

    >>> delivered = DeliveredBlobs(resend_s=60, clock=lambda: 0.0)
    >>> delivered.add(["h1"]); "h1" in delivered, "h2" in delivered
    (True, False)
    """

    def __init__(self, resend_s: float = 3600.0, max_entries: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._resend_s = resend_s
        self._max_entries = max_entries
        self._clock = clock
        self._acked: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, hashes: Iterable[str]) -> None:
        now = self._clock()
        with self._lock:
            for digest in hashes:
                self._acked.pop(digest, None)
                self._acked[digest] = now
            while len(self._acked) > self._max_entries:
                del self._acked[next(iter(self._acked))]

    def clear(self) -> None:
        """Forget every body: the broker that acknowledged them lost them."""
        with self._lock:
            self._acked.clear()

    def __contains__(self, digest: object) -> bool:
        acked = self._acked.get(digest) if isinstance(digest, str) else None
        return acked is not None and self._clock() - acked < self._resend_s


class Emitter:
    """Sends events to the events topic from a background thread; see the module doc."""

    def __init__(
        self,
        bootstrap: str | None = None,
        topic: str = "loopwatch.events",
        spool_dir: Path | None = None,
        *,
        data_dir: Path | None = None,
        confirm: Literal["auto", "pipeline", "broker"] = "auto",
        consumer_group: str | None = None,
        confirm_interval_s: float = 1.0,
        spool_name: str = "emitter",
        spool_max_bytes: int = 256 * 1024 * 1024,
        spool_segment_bytes: int = 1 << 20,
        max_batch: int = MAX_BATCH,
        linger_s: float = 0.02,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        producer_config: dict[str, Any] | None = None,
        capture: str = "failures",
        redactor: Redact | None = None,
        captures_topic: str = "loopwatch.captures",
        max_part_bytes: int = 256 * 1024,
    ) -> None:
        if capture not in CAPTURE_MODES:
            raise ValueError(f"capture must be one of {', '.join(CAPTURE_MODES)}: {capture!r}")
        if confirm not in ("auto", "pipeline", "broker"):
            raise ValueError(f"confirm must be auto, pipeline or broker: {confirm!r}")
        self.data_dir = Path(data_dir).expanduser() if data_dir else default_data_dir()
        announced = read_announcement(self.data_dir)
        #: the embedded broker of ``data_dir``: found (and followed) through broker.json
        self.embedded = bootstrap is None or (
            announced is not None and _same_address(announced.bootstrap, bootstrap))
        self.bootstrap = bootstrap if bootstrap is not None else (
            announced.bootstrap if announced else None)
        self.topic = topic
        self.confirming = confirm == "pipeline" or (
            confirm == "auto" and self.embedded
            and (announced is None or announced.events_topic == topic))
        self._group = consumer_group
        if self.confirming and not self.embedded and consumer_group is None:
            raise ValueError("confirm='pipeline' with a bootstrap that no broker.json "
                             "announces needs consumer_group=")
        self.capture = capture
        self.redactor: Redact = redactor if redactor is not None else Redactor()
        self.captures_topic = captures_topic
        self.max_part_bytes = max_part_bytes
        self.stats = EmitterStats()
        self._own_spool_dir = spool_dir is None
        if spool_dir is None:
            self.spool = open_spool(self.data_dir / "spool", spool_name, spool_max_bytes,
                                    topic=topic, segment_bytes=spool_segment_bytes)
        else:
            self.spool = DiskSpool(Path(spool_dir), spool_max_bytes, topic=topic,
                                   segment_bytes=spool_segment_bytes)
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
            "delivery_timeout_ms": 30_000,
            # kafka-python 3's idempotent producer never recovers from a broker that lost
            # its producer ids (a restarted embedded broker): UnknownProducerIdError, then
            # every InitProducerId fails. Duplicates are harmless here (event_id).
            "enable_idempotence": False,
            **(producer_config or {}),
        }
        self._queue: Handoff[Queued | Outgoing] = Handoff()
        self._producer: KafkaProducer | None = None
        self._partitions: int | None = None
        self._topic_partitions: dict[str, tuple[int | None, float]] = {}
        self._outstanding = 0
        self._outstanding_lock = threading.Lock()
        #: messages whose records are only in memory (not spooled), until settled
        self._in_memory: dict[int, Tracked] = {}
        self._closed = False
        self._late_calls = ThreadPoolExecutor(max_workers=32, thread_name_prefix="tool")
        self._next_resend = 0.0
        self._connect_after = 0.0  # no connect attempt before (time.monotonic())
        self._unavailable = False  # the last attempt failed (logged once per outage)
        #: messages of the last resend round not yet settled (the next waits for them)
        self._resending = 0
        self._resend_all = threading.Event()
        self.delivered_blobs = DeliveredBlobs()
        self.confirmations: Confirmations | None = None
        if self.confirming:
            self.confirmations = Confirmations(
                self.spool, lambda: self.bootstrap, self._consumer_group,
                self._incarnation, self._lost, confirm_interval_s)
            self.confirmations.start()
        self._thread = threading.Thread(target=self._run, name="loopwatch-emitter", daemon=True)
        self._thread.start()

    def _announcement(self) -> BrokerAnnouncement | None:
        return read_announcement(self.data_dir) if self.embedded else None

    def _incarnation(self) -> str | None:
        announced = self._announcement()
        return announced.incarnation if announced else None

    def _consumer_group(self) -> str | None:
        if self._group is None:
            announced = self._announcement()
            return announced.consumer_group if announced else None
        return self._group

    def _lost(self, reason: str) -> None:
        """The broker lost what it held (:mod:`loopwatch.ingest.confirm`): the sender resends."""
        self._resend_all.set()
        self._queue.wake()

    # -- public API ---------------------------------------------------------------

    def emit(self, event: EventBase) -> None:
        """Queue one validated event; never blocks on the network."""
        if self._closed:
            raise RuntimeError("emitter is closed")
        if not event.__pydantic_extra__:
            fields = event.__dict__
            for name in free_text_fields(type(event)):
                if fields[name] is not None:
                    break
            else:  # nothing to redact
                self._enqueue_one(event.run_id, event.__pydantic_serializer__.to_json(
                    event, exclude_none=True))
                return
        data = event.model_dump(mode="json", exclude_none=True)
        self._redact_fields(event, data)
        self._enqueue_one(event.run_id, exact_json(data))

    def _redact_fields(self, event: EventBase, data: dict[str, Any]) -> None:
        """Redact the strings of an event's extras and free-text fields in place."""
        for name in (*(event.model_extra or {}), *FREE_TEXT_FIELDS):
            value = data.get(name)
            if isinstance(value, str | list | dict):
                data[name], _ = self.redactor(value)

    def capture_message(self, event: EventBase, values: dict[str, Any]) -> CaptureMessage:
        """The bodies of ``event`` as a capture message: redacted, split, hashed.

        Serialised here, in the caller, so later changes to the caller's objects do not
        reach what is sent. A message over the emitter's message size is rebuilt with
        smaller parts (each then flagged ``truncated``), so the broker never refuses it.
        """
        limit = self.max_part_bytes
        while True:
            message = build_capture_message(
                event_id=str(event.event_id), run_id=event.run_id, agent=event.agent,
                ts=event.ts.isoformat().replace("+00:00", "Z"),
                event_type=str(getattr(event, "event_type", "")),
                step=getattr(event, "step", None), tool=getattr(event, "tool", None),
                values=values, max_part_bytes=limit, redact=self.redactor)
            if self.capture == "off" or limit <= 1024:
                return message
            size = sum(len(blob.body) for blob in message.blobs.values())
            if size + 4096 <= self._max_message_bytes:
                return message
            limit = max(1024, limit * self._max_message_bytes // (2 * size))

    def send_capture(self, message: CaptureMessage) -> None:
        """Queue a capture message for the captures topic (unless ``capture="off"``)."""
        if self.capture == "off":
            return
        if self._closed:
            raise RuntimeError("emitter is closed")
        item = Outgoing(self.captures_topic, message.run_id,
                        message.__pydantic_serializer__.to_json(message), message)
        try:  # bodies may take half the spool: the other half is kept for events
            self.spool.reserve(len(item.spool_line()) + 1, limit=self.spool.max_bytes // 2)
        except SpoolFull:
            self.stats.captures_dropped += 1
            log.warning("spool half full: capture message of run %s dropped", message.run_id)
            return
        with self._outstanding_lock:
            self._outstanding += 1
        self.stats.captures += 1
        self._queue.put(item)

    def emit_raw(self, lines: list[bytes]) -> None:
        """Queue already-encoded events (used by ``dlq replay`` and importers).

        Each line must be a JSON object with a string ``run_id`` (the partition key);
        anything else is refused here, at the call, rather than in the sender thread.
        """
        items: list[Queued] = []
        for line in lines:
            try:
                run_id = orjson.loads(line).get("run_id", "")
            except (orjson.JSONDecodeError, AttributeError):
                raise ValueError("emit_raw takes JSON objects, one per line") from None
            if not isinstance(run_id, str):
                raise ValueError(f"run_id must be a string, not {type(run_id).__name__}")
            items.append((run_id, line))
        self._enqueue(items)

    def send_and_wait(self, events: Sequence[EventBase | bytes | msgspec.Struct],
                      timeout_s: float = 10.0,
                      captures: Sequence[CaptureMessage] = ()) -> None:
        """Send now from the caller's thread; return once the broker acknowledged all.

        For callers that must not answer before the data is durable (the OTLP receiver
        answers 200 only after this returns). ``bytes`` are already-encoded JSON objects
        with a ``run_id``; structs are the receiver's events
        (:func:`loopwatch.ingest.structs.claim_struct`). Events are grouped by partition
        into envelopes as :meth:`emit` does; ``captures`` go to the captures topic, one
        message each, and are acknowledged before this returns too. Nothing is spooled: on failure
        this raises (``KafkaError``, or ``KafkaTimeoutError`` after ``timeout_s``) and the
        caller, who still holds the data, decides; resending is harmless as ``event_id``
        deduplicates.
        """
        with self.__dict__.setdefault("_connect_lock", threading.Lock()):
            if not self._connect():
                raise KafkaError(f"broker {self.bootstrap} unavailable or topic "
                                 f"{self.topic} has no partitions")
        producer, partitions = self._producer, self._partitions
        assert producer is not None and partitions is not None
        groups: dict[int, list[bytes]] = defaultdict(list)
        keys: dict[int, bytes] = {}
        for event in events:
            if isinstance(event, bytes):
                line, run_id = event, run_id_of(event)
            elif isinstance(event, msgspec.Struct):  # the OTLP receiver's (mapping.py)
                line, run_id = encode_claim(event), event.run_id  # type: ignore[attr-defined]
            else:  # pydantic's own JSON: the same bytes as emit() makes, 2x faster
                line = event.__pydantic_serializer__.to_json(event, exclude_none=True)
                run_id = event.run_id
            partition = partition_for(run_id, partitions)
            groups[partition].append(line)
            keys.setdefault(partition, run_id.encode())
        futures = []
        for partition, group in groups.items():
            for chunk in self._chunks(group):
                futures.append((len(chunk), producer.send(
                    self.topic, value=message_value(chunk), key=keys[partition],
                    partition=partition)))
        if captures:
            capture_partitions = producer.partitions_for(self.captures_topic)
            if not capture_partitions:
                raise KafkaError(f"topic {self.captures_topic} has no partitions")
            for message in captures:
                value = message.__pydantic_serializer__.to_json(message)
                self.stats.capture_bytes += len(value)
                futures.append((0, producer.send(
                    self.captures_topic, value=value, key=message.run_id.encode(),
                    partition=partition_for(message.run_id, len(capture_partitions)))))
        deadline = time.monotonic() + timeout_s
        for count, future in futures:
            future.get(timeout=max(0.001, deadline - time.monotonic()))
            self.stats.sent += count
            self.stats.messages += 1
            self.stats.captures_sent += int(count == 0)

    def _enqueue_one(self, run_id: str, line: bytes) -> None:
        """:meth:`_enqueue` for one event, as :meth:`emit` calls it for every event:
        the same refusal and :meth:`_accept`, without the one-item list and the loops
        and sums over it (with those and the old free-text check, the caller's thread
        spent 14.3-15.9 µs an emit of the bench's events, 13.2 without)."""
        if len(line) > self._max_message_bytes - ENVELOPE_OVERHEAD_BYTES:
            self._enqueue([(run_id, line)])  # which refuses it, in its words
            return
        self._accept(1, len(line) + 1)
        self._queue.put((run_id, line))

    def _enqueue(self, items: list[Queued]) -> None:
        """Refuse an event that could never be sent (over a message) or that the spool
        has no room for (:class:`SpoolFull`, counted in ``stats.refused``), then queue
        all. Room is reserved here, at the call, so that an accepted event can always be
        written to the spool if it has to be: it is refused now rather than lost later."""
        limit = self._max_message_bytes - ENVELOPE_OVERHEAD_BYTES
        for _, line in items:
            if len(line) > limit:
                raise ValueError(f"event of {len(line)} bytes is over the {limit}-byte limit "
                                 "of one message; capture large bodies with prompt=/"
                                 "response=/args=/output= instead")
        self._accept(len(items), sum(len(line) + 1 for _, line in items))
        for item in items:
            self._queue.put(item)

    def _accept(self, events: int, size: int) -> None:
        """Reserve spool room for ``events`` lines of ``size`` bytes (newlines included),
        all or none, and count them queued; :class:`SpoolFull` is counted refused."""
        try:
            self.spool.reserve(size)
        except SpoolFull:
            self.stats.refused += events
            raise
        with self._outstanding_lock:
            self._outstanding += events
        stats = self.stats
        stats.queued += events
        stats.event_bytes += size - events

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

    def flush(self, timeout_s: float = 30.0, *, confirmed: bool = False) -> bool:
        """Wait until everything accepted so far is acknowledged by the broker, or (the
        broker unreachable) in the spool to be resent; False after ``timeout_s``.

        With the embedded broker an acknowledgement is not the end: the broker keeps
        it in memory, and the spool keeps every record until the pipeline committed
        past it, resending it to a restarted broker. ``confirmed=True`` waits for that
        too (:meth:`wait_confirmed`): nothing accepted is left anywhere but in the
        store. With a Kafka cluster (``confirm="broker"``) it waits, besides, until
        nothing waits in the spool for a resend.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.outstanding == 0 and (not confirmed or self.unconfirmed == 0):
                return True
            time.sleep(0.01)
        return False

    def wait_confirmed(self, timeout_s: float = 60.0) -> bool:
        """``flush(confirmed=True)``: every accepted event stored by the pipeline."""
        return self.flush(timeout_s, confirmed=True)

    @property
    def outstanding(self) -> int:
        """Events queued or in flight: neither acknowledged nor spooled yet."""
        with self._outstanding_lock:
            return self._outstanding

    @property
    def unconfirmed(self) -> int:
        """Records accepted and not yet confirmed: in flight, or kept in the spool."""
        return self.outstanding + self.spool.unconfirmed()

    def resend_spooled(self) -> int:
        """Mark everything the spool holds for a resend now; returns the records marked
        (the sender thread sends them: events, and capture messages, which go back to
        the topic they were bound for)."""
        self.spool.mark_all_resend()
        self._next_resend = self._connect_after = 0.0
        self._queue.wake()
        return self.spool.unconfirmed()

    def close(self, timeout_s: float = 30.0, confirm_timeout_s: float = 10.0) -> None:
        """Send what is queued (up to ``timeout_s``), wait up to ``confirm_timeout_s``
        for the pipeline to confirm it (embedded broker), then stop. Never raises for
        the broker and never drops: what is not confirmed stays in the spool, and the
        next emitter on this spool (or, for the default spool folder, any emitter that
        starts under the same data dir) sends it again."""
        if self._closed:
            return
        self._late_calls.shutdown(wait=True, cancel_futures=False)
        self.flush(timeout_s)
        if self.confirming and confirm_timeout_s > 0:
            self.flush(confirm_timeout_s, confirmed=True)
        self._closed = True
        self._queue.wake()
        self._thread.join(timeout_s)
        if self.confirmations is not None:
            self.confirmations.stop()
        self._close_producer()
        leftover = self._queue.take(len(self._queue))
        if leftover:
            self._spool_unsent(leftover)
        with self._outstanding_lock:
            unsettled = list(self._in_memory.values())
            self._in_memory.clear()
        for tracked in unsettled:
            self._spool_tracked(tracked)
        self.spool.close(remove_if_empty=self._own_spool_dir)

    def _close_producer(self) -> None:
        """Close kafka-python's producer without its ``KafkaTimeoutError``: what it
        still holds fails (and is spooled) instead."""
        producer, self._producer = self._producer, None
        if producer is None:
            return
        try:
            producer.close(timeout=5)
        except KafkaError as exc:
            log.warning("the producer did not drain (%s); spooling what it held", exc)
            sender = getattr(producer, "_sender", None)
            if sender is not None and sender.is_alive():
                sender.force_close()
                sender.join(5)

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
        """Whether a producer with the topic's partitions is there (made if not); after a
        failure, False without trying for :data:`RECONNECT_AFTER_S`."""
        if self._producer is not None and self._partitions:
            return True
        if time.monotonic() < self._connect_after:
            return False
        if self.bootstrap is None:  # the embedded broker: found through broker.json
            announced = self._announcement()
            if announced is None:
                return False
            self.bootstrap = announced.bootstrap
        try:
            if self._producer is None:
                self._producer = KafkaProducer(
                    bootstrap_servers=self.bootstrap.split(","), **self._producer_config
                )
            partitions = self._producer.partitions_for(self.topic)
        except KafkaError as exc:
            self._connect_after = time.monotonic() + RECONNECT_AFTER_S
            if not self._unavailable:
                log.warning("broker unavailable (%s); spooling events", exc)
            self._unavailable = True
            return False
        if not partitions:
            return False
        if self._unavailable:
            log.warning("broker reachable again at %s; sending what was spooled",
                        self.bootstrap)
        self._unavailable = False
        self._partitions = len(partitions)
        return True

    def _run(self) -> None:
        while True:
            first = self._queue.get(timeout=0.5)
            if first is None and self._closed:
                return
            batch = [] if first is None else [first]
            deadline = time.monotonic() + self._linger_s
            limit = self._max_batch * (self._partitions or 1)
            while len(batch) < limit:
                waiting = self._queue.take(limit - len(batch))
                if waiting:
                    batch.extend(waiting)
                    continue
                item = self._queue.get(timeout=deadline - time.monotonic())
                if item is None:
                    break
                batch.append(item)
            try:
                self._maybe_resend()
                if batch:
                    self._send(batch)
            except Exception:  # the thread must outlive it: nothing else sends
                log.exception("the emitter's sender failed; spooling the batch")
                self.stats.send_errors += 1
                self._spool_unsent(batch)

    def _spool_unsent(self, batch: list[Queued | Outgoing]) -> None:
        """After an unexpected failure, spool the whole batch for a resend: some of it
        may have been sent, and a resend is harmless (``event_id`` deduplicates)."""
        lines = [item.spool_line() if isinstance(item, Outgoing) else item[1]
                 for item in batch]
        try:
            self._to_spool(lines, sum(len(line) + 1 for line in lines))
        except Exception:
            log.exception("could not spool %d items after a sender failure", len(batch))
        self._settled(len(batch))

    def _maybe_resend(self) -> None:
        """Send again what the spool holds for a resend (every 2 s while it fails), all
        of it once the broker lost what it held."""
        if self._resend_all.is_set():
            self._resend_all.clear()
            self.spool.mark_all_resend()
            self.delivered_blobs.clear()
            self._follow_broker()
            self._next_resend = 0.0
        now = time.monotonic()
        if now < self._next_resend or self._resending or not self.spool.pending_resend():
            return
        self._next_resend = now + 2.0
        if not self._connect():
            return
        handed = 0
        for seq, generation, lines in self.spool.take_resend():
            handed += sum(len(line) for line in lines)
            events, outgoing = self._resendable(lines)
            unsendable = len(lines) - len(events) - len(outgoing)
            if unsendable:
                self.spool.dropped += unsendable
                self.spool.confirm(seq, generation, unsendable)
            self.stats.resent += len(events) + len(outgoing)
            with self._outstanding_lock:
                self._outstanding += len(events) + len(outgoing)
            try:
                self._dispatch(events, outgoing, seq, generation, resend=True)
            except Exception:
                self.spool.mark_resend(seq, generation)  # sent again, whole, next round
                raise
            if handed >= RESEND_ROUND_BYTES:
                break

    def _resendable(self, lines: list[bytes]) -> tuple[list[Queued], list[Outgoing]]:
        """Spool records as events and capture messages to send. A line that is not an
        event (torn by a crash) goes too, for the processors to dead-letter with its
        reason. Left out, logged (and counted in the spool's ``dropped`` by the caller):
        a record larger than a message (``max_message_bytes`` lowered since), which
        could never be sent, and a capture bound for a topic other than this emitter's
        captures topic (a record planted or damaged: it must not pick the topic)."""
        limit = self._max_message_bytes - ENVELOPE_OVERHEAD_BYTES
        events: list[Queued] = []
        outgoing: list[Outgoing] = []
        oversized = foreign = 0
        for line in lines:
            if len(line) > limit:
                oversized += 1
            elif line.startswith(SPOOL_TOPIC_MARK):
                topic, _, value = line[1:].partition(b" ")
                if topic != self.captures_topic.encode():
                    foreign += 1
                    continue
                outgoing.append(Outgoing(self.captures_topic, run_id_of(value), value))
            else:
                events.append((partition_key(line), line))
        if oversized:
            log.error("%d spooled events over the %d-byte message limit dropped",
                      oversized, limit)
        if foreign:
            log.error("%d spooled capture messages for another topic dropped", foreign)
        return events, outgoing

    def _follow_broker(self) -> None:
        """A restarted broker: connect afresh (to where broker.json says it listens),
        since the producer's session state (its producer id) died with the old one."""
        announced = self._announcement()
        self._close_producer()
        self._partitions = None
        self._connect_after = 0.0
        self._topic_partitions.clear()
        if announced is not None:
            self.bootstrap = announced.bootstrap

    def _send(self, batch: list[Queued | Outgoing]) -> None:
        """Write the batch ahead to the spool (embedded broker: one write, one fsync),
        then send it."""
        events = [item for item in batch if not isinstance(item, Outgoing)]
        outgoing = [item for item in batch if isinstance(item, Outgoing)]
        seq: int | None = None
        generation = 0
        if self.confirming:
            lines = [line for _, line in events] + [item.spool_line() for item in outgoing]
            segment = self.spool.append(lines, sum(len(line) + 1 for line in lines))
            seq, generation = segment.seq, segment.generation
            self.stats.logged += len(lines)
        if not self._connect():
            if seq is None:
                self._spool_unsent(batch)
            else:
                self.spool.mark_resend(seq, generation)
                self.stats.spooled += len(batch)
                self._settled(len(batch))
            return
        self._dispatch(events, outgoing, seq, generation)

    def _dispatch(self, events: list[Queued], outgoing: list[Outgoing], seq: int | None,
                  generation: int, resend: bool = False) -> None:
        """Send events (grouped by partition into envelopes) and capture messages; each
        Kafka message is tracked, by its spool segment ``seq`` or in memory (None)."""
        assert self._partitions is not None
        for item in outgoing:
            self._send_outgoing(item, self._tracked(1, seq, generation, [item.spool_line()],
                                                    capture=True, resend=resend))
        groups: dict[int, list[bytes]] = defaultdict(list)
        keys: dict[int, str] = {}
        for key, line in events:
            if key is None:  # not JSON (a spool line torn by a crash): a message alone
                self._send_message(partition_for("", self._partitions), [line], "",
                                   self._tracked(1, seq, generation, [line], resend=resend))
            else:
                partition = partition_for(key, self._partitions)
                groups[partition].append(line)
                keys.setdefault(partition, key)
        for partition, group in groups.items():
            for chunk in self._chunks(group):
                self._send_message(partition, chunk, keys[partition],
                                   self._tracked(len(chunk), seq, generation, chunk,
                                                 resend=resend))

    def _tracked(self, records: int, seq: int | None, generation: int, lines: list[bytes],
                 capture: bool = False, resend: bool = False) -> Tracked:
        if seq is not None:
            return Tracked(records, seq, generation, capture=capture, resend=resend)
        return Tracked(records, lines=lines, reserved=sum(len(line) + 1 for line in lines),
                       capture=capture)

    def _produce(self, tracked: Tracked, topic: str, value: bytes, key: bytes,
                 partition: int) -> None:
        """Send one message; its callbacks settle ``tracked`` (in memory until then)."""
        assert self._producer is not None
        self._remember(tracked)
        try:
            future = self._producer.send(topic, value=value, key=key, partition=partition)
        except KafkaError as exc:
            self._failed(tracked, exc)
            return
        except BaseException:
            self._forget(tracked)
            with self._outstanding_lock:
                self._resending -= int(tracked.resend)
            raise
        future.add_callback(self._delivered, tracked)
        future.add_errback(self._failed, tracked)

    def _chunks(self, group: list[bytes]) -> Iterator[list[bytes]]:
        return envelope_chunks(group, self._max_batch, self._max_message_bytes)

    def _send_message(self, partition: int, chunk: list[bytes], key: str,
                      tracked: Tracked) -> None:
        self._produce(tracked, self.topic, message_value(chunk), key.encode(), partition)

    def _delivered(self, tracked: Tracked, metadata: RecordMetadata) -> None:
        """The broker acknowledged a message (kafka-python's I/O thread)."""
        if tracked.capture:
            self.delivered_blobs.add(tracked.carried)
            self.stats.captures_sent += 1
        else:
            self.stats.sent += tracked.records
            self.stats.messages += 1
        if tracked.segment is None:
            if self._forget(tracked):
                self.spool.release(tracked.reserved)
        elif self.confirmations is not None:
            self.confirmations.acked(metadata.topic, metadata.partition, metadata.offset,
                                     tracked)
        else:
            self.spool.confirm(tracked.segment, tracked.generation, tracked.records)
        self._settled(tracked.records, tracked)

    def _failed(self, tracked: Tracked, exc: BaseException) -> None:
        """A send failed (at once, or after kafka-python's retries): keep it for a resend."""
        self.stats.send_errors += 1
        log.warning("delivery failed (%s); spooling %d records", exc, tracked.records)
        if tracked.segment is None:
            if self._forget(tracked):
                self._spool_tracked(tracked)
        else:
            self.spool.mark_resend(tracked.segment, tracked.generation)
            self.stats.spooled += tracked.records
        self._settled(tracked.records, tracked)

    def _remember(self, tracked: Tracked) -> None:
        """A message is about to be sent: track it until its callbacks settle it."""
        with self._outstanding_lock:
            if tracked.segment is None:
                self._in_memory[id(tracked)] = tracked
            if tracked.resend:
                self._resending += 1

    def _forget(self, tracked: Tracked) -> bool:
        """Stop tracking an in-memory message; False if someone else already settled it."""
        with self._outstanding_lock:
            return self._in_memory.pop(id(tracked), None) is not None

    def _spool_tracked(self, tracked: Tracked) -> None:
        assert tracked.lines is not None
        self._to_spool(tracked.lines, tracked.reserved)

    def _to_spool(self, lines: list[bytes], reserved: int) -> None:
        """Write records for a resend (their room was reserved at the call)."""
        if not lines:
            return
        segment = self.spool.append(lines, reserved)
        segment.needs_resend = True
        self.stats.spooled += len(lines)

    def _partitions_of(self, topic: str) -> int | None:
        """Partitions of another topic, remembered; a missing topic is asked again only
        every 10 s, because asking blocks this thread (and the events) for up to
        ``max_block_ms``."""
        known, checked = self._topic_partitions.get(topic, (None, 0.0))
        if known or time.monotonic() - checked < 10.0:
            return known
        assert self._producer is not None
        try:
            found = self._producer.partitions_for(topic)
        except KafkaError as exc:
            log.warning("topic %s unavailable (%s)", topic, exc)
            found = None
        count = len(found) if found else None
        self._topic_partitions[topic] = (count, time.monotonic())
        return count

    def _send_outgoing(self, item: Outgoing, tracked: Tracked) -> None:
        """Send one capture message, leaving out the bodies the broker already has."""
        assert self._producer is not None
        partitions = self._partitions_of(item.topic)
        if not partitions:
            self._remember(tracked)
            self._failed(tracked, KafkaError(f"topic {item.topic} has no partitions"))
            return
        value = item.value
        if item.message is not None:
            lean = item.message.without(self.delivered_blobs)
            tracked.carried = tuple(lean.blobs)
            value = lean.__pydantic_serializer__.to_json(lean)
        self.stats.capture_bytes += len(value)
        self._produce(tracked, item.topic, value, item.run_id.encode(),
                      partition_for(item.run_id, partitions))

    def _settled(self, events: int, tracked: Tracked | None = None) -> None:
        with self._outstanding_lock:
            self._outstanding -= events
            if tracked is not None and tracked.resend:
                self._resending -= 1

    def _run_late(self, fn: Callable[[], T]) -> Future[T]:
        return self._late_calls.submit(fn)


def _same_address(announced: str, bootstrap: str) -> bool:
    """Whether ``bootstrap`` names the announced broker (``localhost`` is 127.0.0.1).

    >>> _same_address("127.0.0.1:9092", "localhost:9092"), _same_address("a:1", "a:2")
    (True, False)
    """
    def norm(address: str) -> set[str]:
        return {part.strip().replace("localhost:", "127.0.0.1:")
                for part in address.split(",") if part.strip()}
    return bool(norm(bootstrap)) and norm(bootstrap) <= norm(announced)


def partition_key(line: bytes) -> str | None:
    """An encoded event's partition key, its ``run_id``: ``""`` for JSON that is not an
    event object with a string ``run_id`` (the processors dead-letter that event), None
    for a line that is not JSON at all (which would spoil a whole envelope).

    >>> partition_key(b'{"run_id": "r1"}'), partition_key(b'{"run_id": 7}')
    ('r1', '')
    >>> partition_key(b'[1]'), partition_key(b'{"run_id": "to')
    ('', None)
    """
    try:
        run_id = orjson.loads(line).get("run_id", "")
    except orjson.JSONDecodeError:
        return None
    except AttributeError:
        return ""
    return run_id if isinstance(run_id, str) else ""


def run_id_of(line: bytes) -> str:
    return partition_key(line) or ""


class RunContext:
    """Helpers bound to one run; every event carries the run's common fields."""

    def __init__(self, emitter: Emitter, run_id: str, fields: dict[str, Any]) -> None:
        self.emitter = emitter
        self.run_id = run_id
        self.common = {key: fields.pop(key) for key in CONTEXT_FIELDS if key in fields}
        self.start_fields = fields
        self.ended = False
        self.step_number = 0
        self.steps_sent = 0

    def _emit(self, model: type[EventBase], **fields: Any) -> EventBase:
        event = model(run_id=self.run_id, **{**self.common, **fields})
        self.emitter.emit(event)
        return event

    def start(self) -> None:
        self._emit(RunStart, **self.start_fields)

    def step(self, **fields: Any) -> EventBase:
        """A ``step``; without ``step=`` it numbers itself after the previous one. The
        counter moves only once the event validated (``step=inf`` raised OverflowError
        from ``int()`` instead of the model's ValidationError)."""
        fields.setdefault("step", self.step_number)
        event = cast(Step, self._emit(Step, **fields))
        self.step_number = event.step + 1
        self.steps_sent += 1
        return event

    def llm_call(self, prompt: Any = None, response: Any = None, **fields: Any) -> EventBase:
        """An ``llm.call``; ``prompt`` (a string or a list of chat messages) and
        ``response`` are captured (docs/capture.md), the event keeps their hashes/sizes."""
        fields.setdefault("step", max(0, self.step_number - 1))
        if prompt is None and response is None:
            return self._emit(LlmCall, **fields)
        return self._emit_with_bodies(LlmCall, fields, {"prompt": prompt, "response": response})

    def tool_call(self, tool: str, args: Any = None, output: Any = None,
                  **fields: Any) -> EventBase:
        """A ``tool.call``; ``args`` and ``output`` are captured (docs/capture.md)."""
        if args is not None:
            fields.setdefault("args_hash", canonical_args_hash(tool, args))
        fields.setdefault("step", max(0, self.step_number - 1))
        if args is None and output is None:
            return self._emit(ToolCall, tool=tool, **fields)
        return self._emit_with_bodies(ToolCall, {**fields, "tool": tool},
                                      {"args": args, "output": output})

    def _emit_with_bodies(self, model: type[EventBase], fields: dict[str, Any],
                          values: dict[str, Any]) -> EventBase:
        """Validate the event, build its capture message, then queue both.

        The event is validated first (a bad field raises before anything is queued) and
        then given the parts' hashes and sizes, unless the caller set them.
        """
        event = model(run_id=self.run_id, **{**self.common, **fields})
        try:
            message = self.emitter.capture_message(event, values)
        except Exception:  # capture must never break the agent: the event goes alone
            log.exception("could not capture the bodies of %s %s",
                          getattr(event, "event_type", ""), event.event_id)
            self.emitter.stats.capture_errors += 1
            self.emitter.emit(event)
            return event
        update: dict[str, Any] = {}
        if isinstance(event, LlmCall):
            for name in ("prompt", "response"):
                ref = message.parts.get(name)  # type: ignore[call-overload]
                if ref is not None:
                    update[f"{name}_hash"] = part_hash(ref)
                    update[f"{name}_bytes"] = ref.bytes
            system = _system_blob(message)
            if system is not None:
                update["system_prompt_hash"] = system
        else:
            output = message.parts.get("output")  # type: ignore[call-overload]
            if output is not None:
                update["result_size_bytes"] = output.bytes
        update = {name: value for name, value in update.items()
                  if getattr(event, name, None) is None}
        if update:
            event = event.model_copy(update=update)
        self.emitter.emit(event)
        self.emitter.send_capture(message)
        return event

    def label(self, verdict: str, **fields: Any) -> EventBase:
        return self._emit(Label, verdict=verdict, **fields)

    def end(self, terminal_reason: str | None, **fields: Any) -> EventBase:
        """The ``run.end``; unless given, its ``total_steps`` is the number of steps this
        context sent, which the store checks against the steps it got (``steps_lost``).

        A ``run.end`` the contract refuses (a misspelt terminal reason, say) still raises
        here, but the run is not left open until it is abandoned: it ends at once as
        ``crash`` (a hard error) with the refusal's type as its ``error_type``.
        """
        fields.setdefault("total_steps", self.steps_sent)
        try:
            event = self._emit(RunEnd, terminal_reason=terminal_reason, **fields)
        except Exception as exc:
            self.ended = True
            self._emit(RunEnd, terminal_reason="crash", total_steps=self.steps_sent,
                       error_type=f"invalid run.end: {type(exc).__name__}")
            raise
        self.ended = True
        return event

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
        """Call ``fn(**args)`` with a timeout and emit its ``tool.call`` (capturing
        ``args`` and, when it returns in time, its return value as the output).

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
        self.tool_call(**base, output=result, latency_ms=(time.monotonic() - started) * 1000)
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


def _system_blob(message: CaptureMessage) -> str | None:
    """The hash of the prompt's leading system message, if it has one."""
    prompt = message.parts.get("prompt")  # type: ignore[call-overload]
    if prompt is None or prompt.encoding != "messages" or not prompt.hashes:
        return None
    blob = message.blobs.get(prompt.hashes[0])
    if blob is None or blob.encoding != "json" or '"role":"system"' not in blob.body[:64]:
        return None
    return str(prompt.hashes[0])
