"""The faust-streaming binding of :class:`loopwatch.processors.pipeline.Pipeline`.

One agent consumes the events topic in batches (``take_events``). For each batch:
decode and fold into run state (the ``runs`` table, changelogged), write the rows to
ClickHouse and the changed states to the changelog, publish dead letters, and only
once all of them were accepted let faust ack the batch's messages (each carries an
extra reference until then, so the next batch can fold meanwhile). The fold runs on
a thread of its own, so faust gathers the next batch while one folds. faust commits
acked offsets, so the state changelog is always at least as new as the committed
offsets; redelivered events are recognised by ``event_id`` in the run state and by
ClickHouse's dedup keys.

Changelog records carry an explicit partition (the run's source partition), because
a batch spans partitions.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import faust
import orjson

from loopwatch.core.config import Settings
from loopwatch.core.libc import libc
from loopwatch.core.threads import FOLD_THREAD_NAME, name_os_thread
from loopwatch.ingest.privatefs import private_dir
from loopwatch.processors.capture_app import register_captures
from loopwatch.processors.continuity import PartitionContinuity
from loopwatch.processors.deadletter import DeadLetterRecord
from loopwatch.processors.faust_transport import PromptTransport
from loopwatch.processors.kafka_writes import KafkaWrites, record_limit
from loopwatch.processors.pipeline import Pipeline, RawMessage, RunLookup, Work
from loopwatch.processors.rows import EVENTS_IN_TABLE
from loopwatch.processors.runs import RunState
from loopwatch.store.sink import RetriesStopped, RetryingSink, RowBatch, Sink

log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: a chunk of a taken batch is folded and its raw events (``events_in`` rows) written
#: together: about this many bytes of messages, each counted as its size plus
#: ``CHUNK_MESSAGE_BYTES`` (so single events count too). An insert through the generated
#: views (loopwatch.store.event_views) has a fixed cost of tens of ms: 32 MB (~100k
#: bench events) stored at 12.8 µs of CPU an event against 25.5 at 8 MB, and one worker
#: took 55.6k events/s against 38.7k (`loopwatch bench --events 500000`, 2026-12-02).
CHUNK_BYTES = 32_000_000
CHUNK_MESSAGE_BYTES = 400
#: the table written with every chunk (the raw events); the others (a few rows per run)
#: wait for the batch's last write, or until ``DEFERRED_MAX_ROWS`` of them wait
STREAMED_TABLE = EVENTS_IN_TABLE
DEFERRED_MAX_ROWS = 40_000
#: writes queued for the sink thread at a time (a chunk's rows, or a batch's last
#: write); more waiting writes hold more rows in memory and gained nothing measurable
WRITES_IN_FLIGHT = 2
#: how often :meth:`Processor.caught_up` is brought up to date
CAUGHT_UP_INTERVAL_S = 1.0
#: an idle processor reads a partition again from its next expected offset when the
#: partition's end is past it and none of its messages came for this long
#: (:meth:`loopwatch.processors.continuity.PartitionContinuity.stalled`)
STALLED_PARTITION_S = 5.0


#: the folder under the data dir that holds faust's own (one per app id: empty, since
#: tables live in memory and the changelog)
FAUST_DIR = "faust"


#: the producer's record batches (the state changelog's, ~1 record per run per batch,
#: see :meth:`TableRunStore.send_changes`) take up to 1 MB, and a request waits up to
#: 20 ms to fill, instead of faust's 16 KB and no wait: 500k bench events took ~2 µs
#: less main-thread CPU each (18-19 vs 20-21 µs) when faust still sent the changelog.
CHANGELOG_BATCH_BYTES = 1_000_000
CHANGELOG_LINGER_MS = 20

#: gen-0 threshold of the cyclic GC while processing (CPython's default is 700)
GC_GEN0_THRESHOLD = 50_000
#: how long a thread may hold the GIL while another waits for it (CPython's default is
#: 5 ms): the fold thread holds it nearly all the time, and faust's consumer thread
#: (each read of a fetch response), the event loop and the sink thread (between its
#: inserts) each waited up to that long for every short turn they needed. At 1 ms,
#: `loopwatch bench --events 500000 --workers 1`, two interleaved pairs: 71.8k and 65.1k
#: events/s against 47.8k and 60.3k (87.4k and 77.5k against 55.0k and 66.5k between 10 %
#: and 90 % stored); 0.5 ms was no better than 1 ms in a third pair (43.0k against 46.9k)
GIL_SWITCH_INTERVAL_S = 0.001


def tune_gc() -> None:
    """Make the cyclic garbage collector rare. Folding allocates a few container
    objects per event (models, rows) that reference counting frees, yet every 700 of
    them trigger a collection, and the older generations hold every run state: with
    the defaults the collector took ~45 % of the fold's CPU. Objects alive at start-up
    are frozen out of the collector's view."""
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, max(gen1, 20), max(gen2, 100))


def tune_switch_interval() -> None:
    """Let the threads that take short turns between the fold thread's have the GIL
    sooner (:data:`GIL_SWITCH_INTERVAL_S`)."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)


def _glibc_malloc_trim() -> Callable[[], object] | None:
    trim = getattr(libc(), "malloc_trim", None)  # not glibc: nothing to trim
    return None if trim is None else lambda: trim(0)


_malloc_trim = _glibc_malloc_trim()


def release_freed_memory() -> None:
    """Give memory that a batch's transient objects used back to the OS (glibc's
    ``malloc_trim``, ~2 ms; a batch is up to ``batch_max_events`` messages). Without it
    glibc keeps the freed chunks of every batch (state JSON, row dicts, producer
    buffers, the insert body) in its arenas, and the processor's RSS grew by ~2.5 KB
    per open run though live objects took ~0.75 KB."""
    if _malloc_trim is not None:
        _malloc_trim()


def chunks(messages: list[RawMessage]) -> Iterator[list[RawMessage]]:
    """Consecutive runs of messages of about ``CHUNK_BYTES`` (a batch's fold-and-write
    units).

    >>> sizes = [len(c) for c in chunks([RawMessage("t", 0, n, b"x" * 12_000_000)
    ...                                  for n in range(7)])]
    >>> sizes
    [3, 3, 1]
    """
    chunk: list[RawMessage] = []
    size = 0
    for message in messages:
        chunk.append(message)
        size += len(message.value or b"") + CHUNK_MESSAGE_BYTES
        if size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def faust_settings(settings: Settings, bootstrap: str) -> dict[str, Any]:
    """The faust app's settings (also those of the fetch bench,
    :mod:`loopwatch.bench.faust_fetch`, so it measures the processor's own fetch path).

    faust's stream buffer holds at most a batch of messages (faust's default is 4096):
    the event loop is free while a batch folds (:class:`Processor`), and faust's consumer
    fills that buffer meanwhile, on top of the batch folding and the one being gathered.

    faust makes a folder for its tables when an app first starts, even with the memory
    store: ``<app id>-data`` in the *current* directory unless ``datadir`` says where.
    It goes under the data dir (whose ``faust`` folder is made here, private as every
    folder loopwatch makes there: faust makes only the last level), so ``loopwatch up``
    or ``demo`` leaves nothing where it was run."""
    parent = private_dir(settings.data_dir / FAUST_DIR)
    return {
        "datadir": str(parent / "{conf.name}"),
        "broker": ";".join(f"kafka://{host}" for host in bootstrap.split(",")),
        "store": "memory://",
        "web_enabled": False,
        "autodiscover": False,
        "topic_partitions": settings.partitions,
        "topic_replication_factor": 1,
        "table_standby_replicas": 0,
        "consumer_auto_offset_reset": "earliest",
        "broker_session_timeout": settings.session_timeout_s,
        "broker_heartbeat_interval": min(3.0, settings.session_timeout_s / 3),
        "broker_commit_interval": 1.0,
        "producer_request_timeout": settings.producer_request_timeout_s,
        "stream_wait_empty": False,
        "producer_max_request_size": settings.broker_max_message_bytes,
        "producer_max_batch_size": CHANGELOG_BATCH_BYTES,
        "producer_linger_ms": CHANGELOG_LINGER_MS,
        "consumer_max_fetch_size": max(settings.max_message_bytes * 2, 4_194_304),
        "stream_buffer_maxsize": settings.batch_max_events,
    }


def faust_app(name: str, settings: Settings, bootstrap: str, **overrides: Any) -> faust.App:
    """The processors' faust app (also the fetch bench's): :func:`faust_settings` with
    ``overrides``, and a consumer that waits at most ``settings.fetch_max_wait_ms`` for a
    fetch (:mod:`loopwatch.processors.faust_transport`)."""
    app = faust.App(name, **{**faust_settings(settings, bootstrap), **overrides})
    app.transport = PromptTransport(app.conf.broker_consumer, app,
                                    fetch_max_wait_ms=settings.fetch_max_wait_ms)
    return app


def _report_unstored(acked: asyncio.Future[None]) -> None:
    """Log a batch left unacked because its writes stopped retrying (the worker is
    stopping); the agent may no longer be there to await it."""
    if not acked.cancelled() and isinstance(acked.exception(), RetriesStopped):
        log.warning("stopping with a batch not stored (%s); it is read again after a "
                    "restart", acked.exception())


#: run state changes waiting for the changelog: run id -> (its partition, its state's
#: changelog value, or None for a deletion)
StateChanges = dict[bytes, tuple[int, bytes | None]]


class TableRunStore:
    """Run state in a faust table: bytes keys, orjson changelog values, explicit partitions.

    The in-memory table holds :class:`RunState` objects for what this worker wrote and
    orjson bytes for what changelog recovery put there; ``get`` turns bytes into an
    object once. Decoding and re-encoding every state on every access cost more than
    folding the events.

    Changes are not sent one by one through faust's producer buffer, which drains one
    message per event-loop hop and stalls the stream above 100 waiting messages: they
    wait here (the last change per run) until the processor takes them with a write
    and, once the write's rows are stored, :meth:`send_changes` sends them as one
    record batch per partition; the processor awaits that before a batch is acked.
    The records are those ``Table.send_changelog`` would send (raw key and value), so
    faust's recovery reads them unchanged.

    A state larger than ``max_record_bytes`` (a run whose events carry huge dimension
    or tool strings) is not changelogged: the broker would refuse it for good. A
    deletion goes to the changelog in its place, so recovery brings back no older
    state of the run and the processor reads it from the store (``runs.state`` and its
    events) as for a run it forgot; the live state stays in the table. The same
    happens to a state the broker refuses for good (a limit below the setting).
    """

    def __init__(self, table: Any, app: faust.App, topic: str, writes: KafkaWrites,
                 max_record_bytes: int | None = None) -> None:
        self._table = table
        self._app = app
        self._topic = topic
        self._writes = writes
        self._max_record_bytes = max_record_bytes
        self._changes: StateChanges = {}
        #: states not changelogged (too large), a deletion sent instead
        self.too_large = 0

    def active_partitions(self) -> set[int]:
        return {tp.partition for tp in self._app.assignor.assigned_actives()
                if tp.topic == self._topic}

    def get(self, run_id: str) -> RunState | None:
        key = run_id.encode()
        raw = self._table.data.get(key)
        if raw is None or isinstance(raw, RunState):
            return raw
        try:
            state = RunState.from_dict(orjson.loads(raw))
        except Exception as exc:  # cut short, or from an incompatible build
            log.error("the changelogged state of run %r cannot be read (%r); the run is "
                      "taken from the store instead", run_id, exc)
            del self._table.data[key]
            return None
        self._table.data[key] = state
        return state

    def put(self, state: RunState) -> None:
        key = state.run_id.encode()
        self._table.data[key] = state
        value: bytes | None = orjson.dumps(state.to_dict())
        if self._max_record_bytes is not None and value is not None \
                and len(key) + len(value) > self._max_record_bytes:
            self.too_large += 1
            if self.too_large <= 10 or self.too_large % 1000 == 0:
                log.error("the state of run %r is %d bytes, more than a changelog record "
                          "may hold (%d): not changelogged; after a restart the run is "
                          "read from the store (%d such states so far)", state.run_id,
                          len(value), self._max_record_bytes, self.too_large)
            value = None
        self._changes[key] = (state.partition, value)

    def delete(self, state: RunState) -> None:
        key = state.run_id.encode()
        self._table.data.pop(key, None)
        self._changes[key] = (state.partition, None)

    def states(self) -> Iterator[RunState]:
        active = self.active_partitions()
        for key, raw in list(self._table.data.items()):
            state = raw if isinstance(raw, RunState) else self.get(key.decode())
            if state is not None and state.partition in active:
                yield state

    async def send_changes(self, changes: StateChanges) -> None:
        """Send changes from :meth:`take_changes` to the changelog and wait until the
        broker has them (sent again while it does not answer). The caller sends them
        in the order they were taken, so a run's records keep the order they were made
        in."""
        if changes:
            records = [(key, partition, value)
                       for key, (partition, value) in changes.items()]
            await self._writes.deliver(f"{len(changes)} run state changes", records,
                                       self._send, _as_deletion)

    def take_changes(self) -> StateChanges:
        """The changes waiting to be sent, key -> (partition, value or None for a
        deletion); they are no longer waiting."""
        changes, self._changes = self._changes, {}
        return changes

    async def _send(self, records: Sequence[ChangelogRecord]) -> list[BaseException | None]:
        """Send records as one record batch per partition (more when full); each
        record's outcome is its batch's."""
        producer = self._app.producer._ensure_producer()  # type: ignore[attr-defined]
        topic = self._table.changelog_topic.get_topic_name()
        by_partition: dict[int, list[int]] = {}
        for index, (_, partition, _) in enumerate(records):
            by_partition.setdefault(partition, []).append(index)
        delivered: list[tuple[list[int], asyncio.Future[Any]]] = []
        for partition, indexes in by_partition.items():
            batch, members = producer.create_batch(), list[int]()
            for index in indexes:
                key, _, value = records[index]
                while batch.append(key=key, value=value, timestamp=None) is None:  # full
                    delivered.append((members, await producer.send_batch(
                        batch, topic, partition=partition)))
                    batch, members = producer.create_batch(), []  # takes any first record
                members.append(index)
            delivered.append((members, await producer.send_batch(batch, topic,
                                                                 partition=partition)))
        results = await asyncio.gather(*(future for _, future in delivered),
                                       return_exceptions=True)
        outcomes: list[BaseException | None] = [None] * len(records)
        for (members, _), result in zip(delivered, results, strict=True):
            if isinstance(result, BaseException):
                for index in members:
                    outcomes[index] = result
        return outcomes


#: a changelog record: key, partition, value (None: a deletion)
ChangelogRecord = tuple[bytes, int, bytes | None]


def _as_deletion(record: ChangelogRecord, exc: BaseException) -> ChangelogRecord | None:
    """A state the broker refused for good is replaced by a deletion (see
    :class:`TableRunStore`); a refused deletion cannot be made smaller."""
    key, partition, value = record
    if value is None:
        return None
    log.error("the broker refused the state of run %r for good (%r); a deletion is sent "
              "instead: after a restart the run is read from the store", key.decode(), exc)
    return key, partition, None


def _error(result: object) -> BaseException | None:
    return result if isinstance(result, BaseException) else None


def _without_payload(letter: DeadLetterRecord, exc: BaseException
                     ) -> DeadLetterRecord | None:
    """A dead letter the broker refused for good goes again without its payload (its
    ``dead_letters`` row keeps it, cut to the same bound); refused so, it is dropped."""
    smaller = letter.without_payload()
    if smaller is not None:
        log.error("the broker refused dead letter %s (%s) for good (%r); sent again "
                  "without its payload (%d bytes, sha256 %s)", letter.letter_id,
                  letter.source, exc, letter.size, letter.sha256)
    return smaller


class BatchFold:
    """One batch's fold, chunk by chunk, on the fold thread: which rows each chunk's
    write carries (:meth:`Processor._process_batch` says why), and the run state
    changes made up to it, taken where they were made so that no other write can take
    them before the chunk's rows are queued."""

    def __init__(self, pipeline: Pipeline, store: TableRunStore, settle_max_runs: int
                 ) -> None:
        self._pipeline = pipeline
        self._store = store
        self._settle_max_runs = settle_max_runs
        self._touched: dict[str, RunState] = {}
        self._deferred = RowBatch()

    def chunk(self, messages: list[RawMessage], last: bool
              ) -> tuple[Work, StateChanges]:
        """Fold ``messages``; the chunk's write and the state changes that go with it."""
        work = self._pipeline.fold(messages, self._touched)
        if not last:
            self._deferred.extend(work.rows.take_all_but(STREAMED_TABLE))
        if last or len(self._touched) >= self._settle_max_runs \
                or len(self._deferred) >= DEFERRED_MAX_ROWS:
            work.rows.extend(self._pipeline.settle(self._touched).rows)
            work.rows.extend(self._deferred)
            self._touched, self._deferred = {}, RowBatch()
        return work, self._store.take_changes()


class Processor:
    """Builds the faust app around a pipeline and a sink; owns nothing else.

    Two threads besides the event loop: the fold thread, where everything that reads
    or changes run state runs (a batch's fold, the sweep, adopting runs from the
    store), one job at a time; and the sink thread, which inserts. The event loop
    stays free while a batch folds, so faust's consumer hands over the next batch
    meanwhile: folded on the loop, every batch but the first waited for its messages
    once the fold before it was over (``take_events`` timing out at
    ``batch_max_wait_s`` with 290-390 of 500 messages, a fifth of the bench's window).
    """

    def __init__(
        self,
        settings: Settings,
        bootstrap: str,
        sink: Sink,
        open_runs: Any = None,
        skip_once: tuple[int, int] | None = None,
        lookup_runs: RunLookup | None = None,
        incarnation_ms: int = 0,
    ) -> None:
        """``skip_once`` (partition, offset) hides that message from the agent once, as
        faust's lost hand-over does (:mod:`loopwatch.processors.continuity`): fault injection for
        tests, never set in normal operation. ``incarnation_ms``: when the embedded
        broker started (0 for a cluster; see :class:`Pipeline`)."""
        self.settings = settings
        self.continuity = PartitionContinuity()
        self._skip_once = skip_once
        self._last_acked: asyncio.Future[None] | None = None
        self.sink = RetryingSink(sink, settings.sink_retry_s)
        self._open_runs = open_runs
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sink")
        self._folder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fold",
                                          initializer=name_os_thread,
                                          initargs=(FOLD_THREAD_NAME,))
        self._in_flight: deque[asyncio.Future[None]] = deque()
        self._last_write: asyncio.Future[None] | None = None
        self._adopted_for: frozenset[int] | None = None
        self.positions: dict[int, int] = {}
        #: when the store last accepted a write with events (wall clock), or None
        self.events_stored_at: float | None = None
        self._caught_up = False
        self.kafka_writes = KafkaWrites(settings.sink_retry_s)
        self.app = faust_app(settings.consumer_group, settings, bootstrap)
        self.events_topic = self.app.topic(
            settings.events_topic, key_type=bytes, value_type=bytes,
            key_serializer="raw", value_serializer="raw", partitions=settings.partitions,
        )
        self.deadletter_topic = self.app.topic(
            settings.deadletter_topic, key_type=bytes, value_type=bytes,
            key_serializer="raw", value_serializer="raw", partitions=1,
        )
        self.table = self.app.Table(
            "runs", key_type=bytes, value_type=bytes, partitions=settings.partitions,
        )
        self.store = TableRunStore(self.table, self.app, settings.events_topic,
                                   self.kafka_writes, record_limit(settings))
        self.pipeline = Pipeline(settings, self.store, lookup_runs=lookup_runs,
                                 incarnation_ms=incarnation_ms)

        def reindex_on_assignment(sender: Any, /, *args: Any, signal: Any,
                                  **kwargs: Any) -> None:
            """Recovery may rewrite the table: the sweep's deadline index is rebuilt."""
            self.pipeline.invalidate_index()

        def forget_revoked(sender: Any, /, *args: Any, signal: Any, **kwargs: Any) -> None:
            revoked = args[0] if args else kwargs.get("revoked", ())
            self.continuity.forget(tp.partition for tp in revoked
                                   if tp.topic == settings.events_topic)

        self.app.on_partitions_assigned.connect(reindex_on_assignment)
        self.app.on_partitions_revoked.connect(forget_revoked)
        self.app.agent(self.events_topic, name="assemble-runs")(self._assemble)
        self.app.timer(settings.sweep_interval_s, name="sweep-runs")(self._sweep)
        self.app.timer(CAUGHT_UP_INTERVAL_S, name="caught-up")(self._refresh_caught_up)
        self.capture_stage = register_captures(self)

    async def _assemble(self, stream: Any) -> None:
        """Fold and write taken batches, acking each batch's events only once its
        writes were accepted.

        A batch is folded on the fold thread in chunks of about ``CHUNK_BYTES`` (a
        message may be an envelope of hundreds of events), each chunk's rows written
        while the next folds (up to ``WRITES_IN_FLIGHT`` writes queued). The loop body
        returns once the batch's fold has *started* (and the batch before it is folded
        and its writes queued), so faust gathers the next batch while this one folds:
        faust acks a batch when the body returns, and every message therefore carries
        one extra reference (``incref``) that :meth:`_ack_when_stored` drops after the
        batch's writes, in batch order. Offsets are committed only for acked messages.

        faust also acks a taken batch when the loop body is interrupted (its
        ``finally``), e.g. when the agent is cancelled on stop; the extra reference
        keeps such a batch's offsets uncommitted too, and a cancellation waits for the
        batches folding and their writes, so they are acked with their events and runs
        stored, unless a write fails once the processor stops retrying
        (:meth:`stop_retrying`): then it and every later batch stay unacked. A batch
        taken but not yet folding when the cancellation came stays unacked.
        """
        tune_gc()
        tune_switch_interval()
        acked: asyncio.Future[None] | None = None
        folding: asyncio.Future[list[asyncio.Future[None]]] | None = None
        self._last_acked = None
        try:
            async for events in stream.take_events(
                self.settings.batch_max_events, within=self.settings.batch_max_wait_s
            ):
                for event in events:
                    event.message.incref()
                self.continuity.busy()
                events = await self._without_holes(events)
                if not events:
                    self._idle_unless_acking()
                    continue
                messages = [
                    RawMessage(e.message.topic, e.message.partition, e.message.offset,
                               e.message.value)
                    for e in events
                ]
                if folding is not None:  # one batch folds while the next is gathered
                    await asyncio.shield(folding)
                folding = asyncio.ensure_future(self._process_batch(messages))
                acked = asyncio.ensure_future(
                    self._ack_when_stored(stream, events, folding, acked))
                acked.add_done_callback(_report_unstored)
                acked.add_done_callback(lambda _: self._idle_unless_acking())
                self._last_acked = acked
        except asyncio.CancelledError:
            if acked is not None:
                with contextlib.suppress(RetriesStopped):
                    await acked
            raise
        except RetriesStopped:
            return

    def _all_acked(self) -> bool:
        """Whether every batch taken is stored and acknowledged: the processor waits for
        messages (an earlier batch's ack is not the end of its work)."""
        return self._last_acked is None or self._last_acked.done()

    def _idle_unless_acking(self) -> None:
        """Count the processor idle (for the stall check's quiet time) once the last
        batch it took is stored."""
        if self._all_acked():
            self.continuity.idle()

    async def _without_holes(self, events: list[Any]) -> list[Any]:
        """The taken events up to any hole in their partition's offsets; a partition
        with a hole is read again from it (:mod:`loopwatch.processors.continuity`). Events kept
        back keep their extra reference, so they are never acknowledged: their copies
        read again are."""
        if self._skip_once is not None:
            hidden = self._skip_once
            shown = [e for e in events if (e.message.partition, e.message.offset) != hidden]
            if len(shown) != len(events):
                self._skip_once = None
                events = shown
        by_position = {(e.message.partition, e.message.offset): e for e in events}
        admitted, reread = self.continuity.admit(by_position)
        for partition, offset in reread.items():
            tp = next(e.message.tp for e in events if e.message.partition == partition)
            await self._seek(tp, offset)
        return [by_position[position] for position in admitted]

    async def _ack_when_stored(self, stream: Any, events: list[Any],
                               batch: asyncio.Future[list[asyncio.Future[None]]],
                               previous: asyncio.Future[None] | None) -> None:
        """Drop the extra reference of a batch's messages once its writes (and the
        previous batch's acks) are done. A failed write leaves them unacked: they are
        redelivered after the processor restarts, never committed unstored."""
        for write in await batch:
            await write
        if previous is not None:
            await previous
        for event in events:
            await stream.ack(event)
            message = event.message
            self.positions[message.partition] = max(
                self.positions.get(message.partition, -1), message.offset
            )
        release_freed_memory()

    async def _process_batch(self, messages: list[RawMessage]
                             ) -> list[asyncio.Future[None]]:
        """Fold a batch on the fold thread and queue its writes; returns their futures.

        Each chunk's raw events are written while the next chunk folds; the
        other tables' rows wait for the batch's last write (one insert per table per
        batch: writing five tables per chunk made chdb the bottleneck, at ~10 ms an
        insert). The last chunk, the waiting rows and the touched runs go in one write,
        so a reader who sees a batch's last events sees its runs and calls too. Once
        ``settle_max_runs`` runs or ``DEFERRED_MAX_ROWS`` rows wait, they go with the
        chunk that reached the limit, which bounds a batch's memory as chunks do."""
        await self._in_fold_thread(self._adopt_before_folding)
        fold = BatchFold(self.pipeline, self.store, self.settings.settle_max_runs)
        batch_chunks = list(chunks(messages))
        writes: list[asyncio.Future[None]] = []
        for index, chunk in enumerate(batch_chunks):
            work, changes = await self._in_fold_thread(
                fold.chunk, chunk, index == len(batch_chunks) - 1)
            writes.append(await self._queue_write(work, changes))
        return writes

    async def _in_fold_thread(self, job: Callable[..., _T], *args: Any) -> _T:
        """Run ``job`` on the fold thread (see the class), after the jobs before it."""
        return await asyncio.get_running_loop().run_in_executor(self._folder, job, *args)

    async def _queue_write(self, work: Work, changes: StateChanges
                           ) -> asyncio.Future[None]:
        """Start writing ``work`` once fewer than ``WRITES_IN_FLIGHT`` inserts are
        queued (bounding the rows held in memory), and return the write's future. The
        bound is on inserts, not whole writes: a write's changelog records follow its
        insert (:meth:`_finish_write`), and waiting for them too kept the fold idle."""
        while len(self._in_flight) >= WRITES_IN_FLIGHT:
            await self._in_flight.popleft()
        write, inserted = self._start_write(work, changes)
        self._in_flight.append(inserted)
        return write

    async def _sweep(self) -> None:
        """The timer's pass. An exception in a faust timer crashes the app, which in
        ``loopwatch up`` stops the embedded broker too and loses its memory: whatever
        fails here (e.g. reading open runs from an unreachable ClickHouse server) is
        logged and tried again on the next tick."""
        try:
            if not self._ready():
                return
            await self._write(*await self._in_fold_thread(self._sweep_states))
        except RetriesStopped:
            log.warning("stopping with a sweep not stored; it is redone after a restart")
        except Exception:
            log.exception("the sweep failed; trying again in %.1f s",
                          self.settings.sweep_interval_s)

    def _sweep_states(self) -> tuple[Work, StateChanges]:
        """The sweep's part on the fold thread: adopt, sweep, take the changes made."""
        self._adopt_open_runs()
        return self.pipeline.sweep(), self.store.take_changes()

    async def _refresh_caught_up(self) -> None:
        """The timer behind :meth:`caught_up`, apart from the sweep, whose pass waits
        for the store (in an outage, until it is back)."""
        try:
            self._caught_up = self._compute_caught_up()
            await self._reread_stalled()
        except Exception:  # a timer's exception would crash the app
            log.exception("could not tell whether the processor is caught up")

    async def _reread_stalled(self) -> None:
        """An idle processor (every taken batch acknowledged) whose partition has
        messages past the next expected offset, none of which came for
        ``STALLED_PARTITION_S``, reads it again from there: a hole at a partition's
        end (:mod:`loopwatch.processors.continuity`)."""
        if not self._ready() or not self._all_acked():
            return
        consumer = self.app.consumer
        owned = {tp.partition: tp for tp in self.app.assignor.assigned_actives()
                 if tp.topic == self.settings.events_topic}
        ends = {partition: consumer.highwater(tp) or 0 for partition, tp in owned.items()}
        for partition, offset in self.continuity.stalled(ends, STALLED_PARTITION_S).items():
            await self._seek(owned[partition], offset)

    async def _seek(self, tp: Any, offset: int) -> None:
        """Read ``tp`` again from ``offset``, on the consumer's own thread.

        faust's ``Consumer.seek`` calls aiokafka's ``seek`` from the calling thread (this
        event loop's), and aiokafka's fetcher drops the partition's buffered records
        there while faust's consumer thread may be draining the same buffer: ``up``
        crashed in three of ten bench runs with ``KeyError: TopicPartition(...)`` in
        ``Fetcher.fetched_records`` right after a stalled partition was read again.
        ``seek_wait`` runs the seek on the consumer thread (``call_thread``)."""
        await self.app.consumer.seek_wait({tp: offset})

    def _ready(self) -> bool:
        recovery = self.app.tables.recovery  # type: ignore[attr-defined]
        return bool(recovery.completed.is_set()) and not self.app.rebalancing

    def _adopt_before_folding(self) -> None:
        """Adopt as the sweep does, before a batch folds (a no-op until the assignment
        changes): a run's first event after a restart must find what the store rebuilt
        (labels waiting for it), not start afresh because the sweep's timer had not
        ticked yet. A store that cannot answer is left to the sweep's next pass."""
        try:
            if self._ready():
                self._adopt_open_runs()
        except Exception as exc:
            log.warning("could not rebuild open runs from the store before a batch (%r); "
                        "the sweep tries again", exc)

    def _adopt_open_runs(self) -> None:
        """After an assignment, take over open runs ClickHouse knows and the table lacks.

        The embedded broker keeps data in memory; after a restart the changelog is gone,
        and this is how open runs survive it.
        """
        active = frozenset(self.store.active_partitions())
        if self._open_runs is None or not active or active == self._adopted_for:
            return
        states: Iterable[RunState] = (
            state for state in self._open_runs() if state.partition in active
        )
        adopted = self.pipeline.adopt(states)
        self._adopted_for = active
        if adopted:
            log.info("rebuilt %d open runs from the store", adopted)

    async def _write(self, work: Work,
                     changes: StateChanges | None = None) -> None:
        """Write ``work`` and the run state ``changes`` made with it (the fold thread
        takes them; other stages, e.g. the captures', change no run state)."""
        write, _ = self._start_write(work, changes or {})
        await write

    def _start_write(self, work: Work, changes: StateChanges
                     ) -> tuple[asyncio.Future[None], asyncio.Future[None]]:
        """Hand the rows to the sink thread now, and return the futures of the whole
        write (rows accepted, ``changes`` on the changelog, dead letters published)
        and of its insert (the write's, if it has no rows).

        The rows are submitted before this returns, not when the event loop next runs
        a task: a write wrapped in a task started only once the loop was free again,
        which, when the fold ran on the loop, meant after the next chunk's fold (an
        insert's ~13 µs per event added to the fold's ~16)."""
        rows_accepted = None
        if len(work.rows):
            rows_accepted = asyncio.get_running_loop().run_in_executor(
                self._writer, self._insert, work.rows)
        write = asyncio.ensure_future(self._finish_write(
            work, rows_accepted, changes, self._last_write))
        self._last_write = write
        return write, rows_accepted or write

    def _insert(self, rows: RowBatch) -> None:
        """The sink thread's part of a write; notes when the store last accepted
        events (``events_stored_at`` in the status: ``loopwatch bench`` closes its
        windows there rather than at a poll)."""
        self.sink.write_batch(rows)
        if rows.tables.get(STREAMED_TABLE):
            self.note_events_stored()

    def note_events_stored(self) -> None:
        """The store accepted raw events: this processor's, or those of an extra
        worker inserted through this process's store service."""
        self.events_stored_at = time.time()

    async def _finish_write(self, work: Work, rows_accepted: asyncio.Future[None] | None,
                            changes: StateChanges,
                            previous: asyncio.Future[None] | None) -> None:
        """Rows first; then the run state changes made up to the write, after the
        previous write's; then dead letters.

        The changelog is thus never ahead of ClickHouse. It was, when both were sent
        at once: a run the sweep abandoned during a store outage had its change on
        the changelog and its row unstored when the worker stopped, came back closed,
        and stayed ``running`` in ClickHouse for good. (Event batches were safe: they
        are unacked, so redelivered, and rewrite their runs' rows.)"""
        if rows_accepted is not None:
            await rows_accepted
        if previous is not None:
            await previous
        await self.store.send_changes(changes)
        if work.dead:
            await self.kafka_writes.deliver(f"{len(work.dead)} dead letters", work.dead,
                                            self._publish, _without_payload)

    async def _publish(self, letters: Sequence[DeadLetterRecord]
                       ) -> list[BaseException | None]:
        """Send dead letters and wait until the broker answered for each; returns each
        letter's error, or None. faust's ``send`` returns once a letter is queued (or
        raises, e.g. for a letter larger than the producer sends); the deliveries are
        awaited together, as one await per letter would wait out the producer's
        linger for each."""
        sent: list[BaseException | Awaitable[Any]] = []
        for letter in letters:
            try:
                sent.append(await self.deadletter_topic.send(
                    key=letter.letter_id.encode(), value=letter.payload,
                    headers=letter.headers()))
            except Exception as exc:
                sent.append(exc)
        futures = [item for item in sent if not isinstance(item, BaseException)]
        results = iter(await asyncio.gather(*futures, return_exceptions=True))
        return [item if isinstance(item, BaseException) else _error(next(results))
                for item in sent]

    def stop_retrying(self) -> None:
        """The worker is stopping: writes that fail (store or broker unavailable) give
        up instead of retrying, leaving their batches unacked (read again after a
        restart), so that a stop during an outage ends before the supervisor's kill."""
        self.sink.stop_retrying()
        self.kafka_writes.stop_retrying()

    def kafka_write_counters(self) -> dict[str, int]:
        """The status's view of the processors' writes to Kafka: sends retried, records
        refused for good and sent reduced or dropped, states too large to changelog."""
        counters = self.kafka_writes.counters
        return {"kafka_write_retries": counters.retries,
                "kafka_records_reduced": counters.reduced,
                "kafka_records_dropped": counters.dropped,
                "changelog_states_too_large": self.store.too_large}

    def caught_up(self) -> bool:
        """True when this worker owns partitions and has processed each up to its end.

        Safe from any thread: it reads a flag the event loop refreshes every
        ``CAUGHT_UP_INTERVAL_S`` (touching faust's consumer from another thread would
        create it on the wrong loop).
        """
        return self._caught_up

    def _compute_caught_up(self) -> bool:
        consumer = self.app.consumer
        owned = [tp for tp in self.app.assignor.assigned_actives()
                 if tp.topic == self.settings.events_topic]
        for tp in owned:
            highwater = consumer.highwater(tp)
            if highwater and self.positions.get(tp.partition, -1) < highwater - 1:
                return False
        return bool(owned)
