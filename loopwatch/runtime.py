"""``loopwatch up``: broker (unless configured), processors and the store service.

Start order: broker, topics, schema, store service, faust worker. Stop order is the
reverse, and a SIGINT/SIGTERM first drains: the worker keeps consuming until the
group's committed offsets reach the end of the events topic (or the setting
``drain_timeout_s`` passes), because the embedded broker forgets everything when it
stops. A signal that arrives while starting is held until the worker runs, then drains
the same way; a second signal stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import faust
import orjson

from loopwatch.core.config import Settings
from loopwatch.core.embedded.lifecycle import DataDirBroker
from loopwatch.core.masking import safe_url
from loopwatch.core.topics import LagProbe, ensure_topics
from loopwatch.detectors.service import start_detectors
from loopwatch.ingest.announce import BrokerAnnouncement, read_announcement
from loopwatch.ingest.otlp.process import ReceiverProcess
from loopwatch.ingest.otlp.server import OtlpReceiver
from loopwatch.ingest.otlp.settings import load_otlp_settings
from loopwatch.ingest.privatefs import PRIVATE_UMASK, private_dir
from loopwatch.ingest.sdk import partition_for
from loopwatch.ingest.spool import SpoolLocked
from loopwatch.processors.app import Processor
from loopwatch.processors.jobs.capture_decide import start_decider
from loopwatch.processors.jobs.deadletters import replay_pending
from loopwatch.processors.jobs.reprocess import reprocess_with
from loopwatch.processors.pipeline import RunLookup
from loopwatch.processors.rows import EVENTS_IN_TABLE
from loopwatch.processors.runs import RunState, pending_label_state, seen_from_ids
from loopwatch.store.clickhouse import connect, migrate
from loopwatch.store.reader import (
    DirectReader,
    PooledReader,
    Reader,
    ServiceReader,
    await_service,
)
from loopwatch.store.remote_sink import INSERT_PATH, ServiceSink, decode_batch
from loopwatch.store.revisions import REVISIONS_TABLE
from loopwatch.store.service import StoreService
from loopwatch.store.sink import ClickHouseSink, FaultInjectingSink, RowBatch, Sink
from loopwatch.store.sizecap import start_size_cap, storage_report

log = logging.getLogger(__name__)


class DrainingWorker(faust.Worker):
    """A faust worker that finishes what the broker holds before it stops.

    It has no terminal spinner: faust's ``on_setup_root_logger`` would otherwise add a
    DEBUG ``SpinnerHandler`` and set the root logger to DEBUG whatever the log level, so
    every produced and fetched message builds a debug ``LogRecord`` (aiokafka,
    faust.topics), ~10 % of the processor's CPU.
    """

    def __init__(self, processor: Processor, bootstrap: str,
                 stop_requested: threading.Event,
                 on_stopping: Callable[[float], None] | None = None, **kwargs: Any) -> None:
        super().__init__(processor.app, **kwargs)
        self._on_stopping = on_stopping
        self.spinner = None  # before execute_from_commandline sets up logging
        self._processor = processor
        self._bootstrap = bootstrap
        self._stop_requested = stop_requested
        self._draining = False
        self._drain_task: asyncio.Future[None] | None = None

    async def on_startup_finished(self) -> None:
        """A signal that came while starting (before faust's handlers) is honoured now."""
        await super().on_startup_finished()
        if self._stop_requested.is_set():
            self._drain_then_stop()

    def _on_sigint(self) -> None:
        self._drain_then_stop()

    def _on_sigterm(self) -> None:
        self._drain_then_stop()

    def _drain_then_stop(self) -> None:
        if self._draining:
            self._stop_now()
            return
        self._draining = True
        if self._on_stopping is not None:
            try:
                self._on_stopping(self._processor.settings.drain_timeout_s)
            except Exception:
                log.exception("could not report the drain")
        self._drain_task = asyncio.ensure_future(self._drain(), loop=self.loop)

    def _stop_now(self) -> None:
        """Stop faust; a write still failing gives up rather than hold the stop."""
        self._processor.stop_retrying()
        super()._on_sigterm()

    async def _drain(self) -> None:
        """Stop once the group's committed offsets reach the end of its topics."""
        settings = self._processor.settings
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + settings.drain_timeout_s
        lag = None
        try:
            probe = await loop.run_in_executor(None, LagProbe, self._bootstrap,
                                               settings.consumer_group, settings.events_topic,
                                               settings.captures_topic)
            try:
                while time.monotonic() < deadline:
                    lag = await loop.run_in_executor(None, probe.lag)
                    if lag == 0:
                        break
                    log.warning("draining: %d messages left", lag)
                    await asyncio.sleep(0.5)
            finally:
                probe.close()
        except Exception:
            log.exception("drain failed; stopping without it")
        if lag == 0:
            log.warning("drained; stopping")
        else:
            log.warning("not drained in %.0f s (%s messages left); stopping: what is not "
                        "committed is read again after a restart", settings.drain_timeout_s,
                        "?" if lag is None else lag)
        self._stop_now()


#: runs one lookup query asks for at most (their ids are a query parameter)
LOOKUP_CHUNK = 1000

#: the event ids a run read back from ``runs`` had folded, oldest first: its ``seen``
#: set (``runs.state`` leaves it out). ``events`` may hold more of the run than the
#: state folded: a batch's events are written chunk by chunk and its runs rows last,
#: so a crash between leaves events stored whose fold is not. Counting those seen made
#: their redelivery a duplicate and left the run open for good (a SIGKILL of ``up``
#: in CI). Messages of a partition fold in order, so an event was folded iff one of its
#: copies came at or before the state's ``folded_offset``: the smallest offset over the
#: copies not yet merged away, not ``FINAL``'s last copy, as an SDK resend of a folded
#: event is a second copy. Offsets count in the broker incarnation the state folded in
#: (``folded_since_ms``; an embedded broker's start again); a copy stored before it
#: (``ingested_at``) counts as folded, as does one of another partition, and every
#: event of a state without the offset (a build before it). Not exact for an event
#: stored unfolded before a broker loss and resent after it, nor once a merge kept only
#: a resent copy.
SEEN_SQL = """
SELECT run_id, groupArray(toString(event_id)) FROM (
    SELECT run_id, event_id, min(ts) AS first_ts FROM events
    WHERE run_id IN {run_ids:Array(String)}
    GROUP BY run_id, event_id
    HAVING min(if(kafka_partition = transform(run_id, {run_ids:Array(String)},
                                              {partitions:Array(UInt32)}, toUInt32(0))
                  AND toUnixTimestamp64Milli(ingested_at)
                      >= transform(run_id, {run_ids:Array(String)}, {since:Array(Int64)},
                                   toInt64(0)),
                  toInt64(kafka_offset), toInt64(-1)))
           <= (transform(run_id, {run_ids:Array(String)}, {offsets:Array(Int64)},
                         toInt64(-1)) AS folded_offset)
        OR folded_offset < 0
    ORDER BY run_id, first_ts, event_id)
GROUP BY run_id
"""


#: labels within the label window whose run has no row: they wait for it (a label that
#: came first), and their state is rebuilt from here when the changelog is gone
PENDING_LABELS_SQL = """
SELECT run_id, groupArray((toString(event_id), toUnixTimestamp64Milli(ts), agent, verdict,
                           label_source)) FROM (
    SELECT * FROM labels FINAL
    WHERE ts >= {since:DateTime64(3)} AND run_id NOT IN (
        SELECT run_id FROM runs WHERE run_id IN (
            SELECT run_id FROM labels WHERE ts >= {since:DateTime64(3)}))
    ORDER BY run_id, ts, event_id)
GROUP BY run_id
"""


def incarnation_start_ms(broker: BrokerAnnouncement) -> int:
    """When an embedded broker incarnation started, in ms: its offsets count from there
    (a new one starts them again), and every ``ingested_at`` of a message it carried is
    later, every one of the incarnations before earlier (one machine, one clock)."""
    return int(broker.started_at * 1000)


def _store_reads(reader: Reader, settings: Settings | None = None
                 ) -> tuple[Callable[[], list[RunState]], RunLookup]:
    """How the processors read run state back from the store (after a broker restart,
    or for runs their table has forgotten or never held: a label's, an OTLP trace's
    children exported before its root). The state comes from ``runs``, the ids already
    folded in from ``events``, so a redelivered event is still known; labels still
    waiting for their run come from ``labels`` (``settings``: their window and the
    partitions; the defaults if None). Runs are looked up many at a time: one query
    for up to :data:`LOOKUP_CHUNK` of them."""
    config = settings or Settings()

    def with_seen(states: list[RunState]) -> list[RunState]:
        by_id = {state.run_id: state for state in states}
        for start in range(0, len(states), LOOKUP_CHUNK):
            chunk = states[start:start + LOOKUP_CHUNK]
            for run_id, event_ids in reader.query(SEEN_SQL, {
                    "run_ids": [state.run_id for state in chunk],
                    "partitions": [state.partition for state in chunk],
                    "offsets": [state.folded_offset for state in chunk],
                    "since": [state.folded_since_ms for state in chunk]}).rows:
                by_id[run_id].seen = seen_from_ids(event_ids)
        return states

    def states(rows: list[list[Any]]) -> list[RunState]:
        """The rows' states; a row without one (written by hand, or by a build before
        ``state``) is skipped with a warning rather than stopping the processor."""
        parsed = []
        for (text,) in rows:
            try:
                parsed.append(RunState.from_dict(orjson.loads(text)))
            except (orjson.JSONDecodeError, TypeError, KeyError, ValueError):
                log.warning("a runs row has no readable state; not resumed: %.80r", text)
        return with_seen(parsed)

    def pending_labels() -> list[RunState]:
        since = datetime.now(UTC) - timedelta(seconds=config.label_window_s)
        fields = ("event_id", "ts", "agent", "verdict", "label_source")
        return [pending_label_state(run_id, partition_for(run_id, config.partitions),
                                    [dict(zip(fields, label, strict=True)) for label in labels])
                for run_id, labels in reader.query(PENDING_LABELS_SQL, {"since": since}).rows]

    def open_runs() -> list[RunState]:
        return states(reader.query("SELECT state FROM runs FINAL WHERE status = 'running'")
                      .rows) + pending_labels()

    def lookup_runs(run_ids: Sequence[str]) -> dict[str, RunState]:
        found: dict[str, RunState] = {}
        for start in range(0, len(run_ids), LOOKUP_CHUNK):
            chunk = list(run_ids[start:start + LOOKUP_CHUNK])
            for state in states(reader.query(
                    "SELECT state FROM runs FINAL WHERE run_id IN {run_ids:Array(String)}",
                    {"run_ids": chunk}).rows):
                found[state.run_id] = state
        return found

    return open_runs, lookup_runs


def _insert_action(connect_client: Callable[[], Any],
                   on_events: Callable[[], None] = lambda: None
                   ) -> Callable[[bytes], dict[str, Any]]:
    """The owner's side of :class:`loopwatch.store.remote_sink.ServiceSink`: one request
    is one batch, each table's part inserted as it came (a JSON array, ``JSONEachRow``);
    ``on_events`` is called once a request's raw events are in.

    No global lock: chdb runs inserts from separate connection handles of one process
    concurrently, so each request thread takes a client of its own from a pool (a
    client's handle serialises its own calls). The answer follows the inserts.
    """
    idle: list[Any] = []
    pool_lock = threading.Lock()

    def insert(body: bytes) -> dict[str, Any]:
        parts = list(decode_batch(body))
        for table, _ in parts:
            if table not in INSERTABLE:
                raise ValueError(f"table {table!r} does not take remote inserts")
        with pool_lock:
            client = idle.pop() if idle else None
        if client is None:
            client = connect_client()
        try:
            sink = ClickHouseSink(client)
            for table, data in parts:
                sink.write_encoded(table, bytes(data))
        finally:
            with pool_lock:
                idle.append(client)
        if any(table == EVENTS_IN_TABLE for table, _ in parts):
            on_events()
        return {"tables": len(parts)}

    return insert


INSERTABLE = frozenset({"events", "events_in", "llm_calls", "tool_calls", "runs", "labels",
                        "annotations", "dead_letters", "capture_staging",
                        "capture_staging_blobs", REVISIONS_TABLE})


def _fault_skip_message() -> tuple[int, int] | None:
    """``LOOPWATCH_FAULT_SKIP_MESSAGE=partition:offset``: the processor's agent does not
    see that message once, as when faust loses its hand-over in a rebalance (tests of
    processors/continuity.py; never set in normal operation)."""
    value = os.environ.get("LOOPWATCH_FAULT_SKIP_MESSAGE")
    if not value:
        return None
    partition, _, offset = value.partition(":")
    return int(partition), int(offset)


def run_worker(settings: Settings, loglevel: str = "warning") -> None:
    """An extra processor process: the same faust app in the same consumer group, writing
    through the store owner (embedded) or straight to the ClickHouse server."""
    os.umask(PRIVATE_UMASK)
    stop_requested = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop_requested.set())
    sink: Sink
    reader: Reader
    if settings.clickhouse_url:
        migrate(settings)
        sink, reader = ClickHouseSink(connect(settings)), DirectReader(connect(settings), settings)
        bootstrap = settings.kafka_bootstrap
    else:
        announced = await_service(settings, settings.broker_wait_s)
        if announced is None:
            raise RuntimeError(f"no `loopwatch up` owns the store in {settings.data_dir}; "
                               "start it first (extra workers write through it)")
        service = ServiceReader(announced["url"], follow=settings)
        sink, reader = ServiceSink(service), service
        bootstrap = settings.kafka_bootstrap or announced["kafka_bootstrap"]
    if not bootstrap:
        raise RuntimeError("set LOOPWATCH_KAFKA_BOOTSTRAP for a worker against a ClickHouse server")
    broker = None if settings.kafka_bootstrap else read_announcement(settings.data_dir)
    incarnation_ms = incarnation_start_ms(broker) if broker is not None \
        and broker.bootstrap == bootstrap else 0
    open_runs, lookup_runs = _store_reads(reader, settings)
    processor = Processor(settings, bootstrap, sink, open_runs=open_runs,
                          lookup_runs=lookup_runs, incarnation_ms=incarnation_ms)
    log_file = settings.data_dir / "logs" / f"worker-{os.getpid()}.log"
    worker = DrainingWorker(processor, bootstrap, stop_requested,
                            loglevel=loglevel, quiet=True, redirect_stdouts=False,
                            logfile=str(log_file))
    with contextlib.suppress(SystemExit):
        worker.execute_from_commandline()
    raise_if_crashed(processor.app, log_file)


class ProcessorCrashed(RuntimeError):
    """The processors' faust app crashed: its worker stopped as on a clean stop."""


def raise_if_crashed(app: faust.App, log_file: Path) -> None:
    """A faust app that crashed (an agent's or a timer's exception) stops its worker as
    a clean stop does, and ``execute_from_commandline`` exits 0 either way: a supervisor
    would not restart it, and the bench waited its whole timeout on a worker that had
    quietly gone. The crash is a runtime error (exit 1) naming its reason."""
    reason = app.crash_reason
    if reason is not None:
        raise ProcessorCrashed(f"the processor crashed ({type(reason).__name__}: {reason}); "
                               f"see {log_file}")


#: what makes ``loopwatch up`` print a status line when it moved: the counters, and the
#: retries, which move alone while an outage holds the processors still
STATUS_MOVES = ("counters", "sink_failures", "kafka_write_retries")


def status_moved(last: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether ``current`` has news for the status line since ``last``.

    >>> still = {"counters": {"events": 5}, "sink_failures": 0, "caught_up": True}
    >>> status_moved(still, {**still, "caught_up": False})
    False
    >>> status_moved(still, {**still, "sink_failures": 1})
    True
    """
    return any(current.get(key) != last.get(key) for key in STATUS_MOVES)


def _report_status(status: Callable[[], dict[str, Any]],
                   on_status: Callable[[dict[str, Any]], None], every_s: float,
                   stop: threading.Event | None = None) -> None:
    """Call ``on_status`` whenever the counters or retries moved, at most every
    ``every_s`` (until ``stop`` is set); a failing call is logged and the next one tried."""
    last: dict[str, Any] = {}
    stopped = stop or threading.Event()

    def loop() -> None:
        while not stopped.wait(every_s):
            try:
                current = status()
                if status_moved(last, current):
                    last.clear()  # a copy: ``current`` holds the live counters dict
                    last.update(copy.deepcopy({key: current.get(key) for key in STATUS_MOVES}))
                    on_status(current)
            except Exception:
                log.exception("could not report the status")

    threading.Thread(target=loop, name="status", daemon=True).start()


def _sample_gauges(settings: Settings, bootstrap: str, writer: Any,
                   status: Callable[[], dict[str, Any]], stop: threading.Event,
                   every_s: float = 15.0) -> None:
    """Write consumer lag and the processors' counters to ``pipeline_gauges``."""

    def loop() -> None:
        probe: LagProbe | None = None
        while not stop.wait(every_s):
            try:
                probe = probe or LagProbe(bootstrap, settings.consumer_group,
                                          settings.events_topic)
                current = status()
                values = {"consumer_lag": float(probe.lag()),
                          "events_processed": float(current["counters"]["events"]),
                          "dead_letters": float(current["counters"]["dead_letters"]),
                          "labels_unmatched": float(current["counters"]["labels_unmatched"]),
                          "store_retries": float(current["sink_failures"]),
                          "kafka_write_retries": float(current["kafka_write_retries"])}
                now = datetime.now(UTC)
                ClickHouseSink(writer).write_batch(RowBatch({"pipeline_gauges": [
                    {"ts": now, "name": name, "value": value} for name, value in values.items()
                ]}))
            except Exception as exc:
                log.warning("could not sample pipeline gauges: %s", exc)

    threading.Thread(target=loop, name="gauges", daemon=True).start()


def _start_otlp(settings: Settings, bootstrap: str,
                port: int | None) -> OtlpReceiver | ReceiverProcess | None:
    """The OTLP/HTTP receiver and, unless disabled, OTLP/gRPC beside it on the same
    export path, in a child process unless ``LOOPWATCH_OTLP_PROCESS=false``; a taken
    port is logged and ``up`` runs without that receiver."""
    limits = load_otlp_settings(port=port)
    try:
        if limits.process:
            return ReceiverProcess(settings, bootstrap, limits)
        receiver = OtlpReceiver(settings, bootstrap, limits.host, limits.port, limits.token,
                                limits=limits)
    except (OSError, SpoolLocked) as exc:
        log.warning("OTLP receiver not started on %s:%d: %s (a taken port: set "
                    "LOOPWATCH_OTLP_PORT or --otlp-port)", limits.host, limits.port, exc)
        return None
    receiver.start()
    if limits.grpc_port is not None:
        receiver.serve_grpc(limits.grpc_port)
    return receiver


def uncommitted(bootstrap: str, settings: Settings) -> int | None:
    """Messages on the events and captures topics the group has not committed; 0 when
    the topics do not exist (nothing was sent), None when the broker cannot tell."""
    try:
        probe = LagProbe(bootstrap, settings.consumer_group, settings.events_topic,
                         settings.captures_topic)
    except Exception:
        return None
    try:
        return probe.lag()
    except RuntimeError:  # a topic without partitions: never created
        return 0
    except Exception:
        return None
    finally:
        probe.close()


class BrokerWatch:
    """Restarts ``up`` in place (``exec``) when its embedded broker dies.

    A new broker is a new incarnation: topics, committed offsets and the run-state
    changelog went with the old one, so everything built on it must start afresh. A
    faust worker cannot be stopped cleanly without its broker (measured: its stop
    waited on a consumer commit that retries forever to find the group coordinator,
    on a producer flush that waits ``producer_request_timeout_s``, and aiokafka's
    ``Fetcher.close`` let a ``CancelledError`` kill the consumer thread, after which
    mode waited for that thread forever), and it must not reach a new broker on the
    same port with its old positions (they would be committed there and skip events).
    Replacing the process image drops all of it at once; the new ``up`` (same pid,
    same arguments) finds the record's broker dead and starts one on the same port
    with a new incarnation, recreates the topics, rebuilds open runs from the store and
    reads the new topics from the start. The store service announces its new address
    in ``service.json`` (clients with ``follow`` move with it).

    If a stop was already requested, ``up`` exits 1 instead: the broker is gone and
    a drain cannot finish.
    """

    def __init__(self, broker: DataDirBroker, stop_requested: threading.Event,
                 every_s: float = 0.5) -> None:
        self.broker = broker
        self.stop_requested = stop_requested
        self.every_s = every_s
        self._stopped = threading.Event()

    def start(self) -> BrokerWatch:
        threading.Thread(target=self._run, name="broker-watch", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(self.every_s):
            if not self.broker.alive():
                self._restart()
                return

    def _restart(self) -> None:
        lost = self.broker.announcement
        if self.stop_requested.is_set():
            log.critical("the embedded broker (pid %d) is gone while stopping; exiting",
                         lost.pid)
            _flush_output()
            os._exit(1)
        log.error("the embedded broker (pid %d, incarnation %s) is gone; restarting "
                  "`loopwatch up` to start a new one on %s", lost.pid, lost.incarnation,
                  lost.bootstrap)
        _flush_output()
        os.execv(sys.executable, sys.orig_argv)


def exit_without_engine_teardown(code: int = 0) -> None:
    """Exit with ``code`` at once, once ``run_up`` has returned (or raised
    :class:`ProcessorCrashed`): offsets are committed, the receivers,
    the store service and the broker are stopped, and every row ClickHouse acknowledged
    is on disk. What is left is the interpreter's teardown, with the detectors' daemon
    threads possibly still inside a chdb query while chdb's own destructors run: under
    load that teardown crashed (a libc++ "vector[] index out of bounds" assertion, then
    SIGSEGV) or hung until the supervisor's SIGKILL, and a clean stop read as a crash."""
    _flush_output()
    os._exit(code)


def _flush_output() -> None:
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _outlive_dead_members(settings: Settings, adopted_at: float,
                          stop_requested: threading.Event) -> None:
    """An adopted broker still counts the killed ``up``'s worker as a group member until
    its session times out. Joining before that makes two rebalances (one with the dead
    member, one without it), and a partition kept across them lost the messages the
    worker had fetched but not folded: their offsets were committed, their events
    never stored (seen: 192 of 16,000 events in 2 of 6 runs). One join after the dead
    member is gone is one rebalance."""
    remaining = adopted_at + settings.session_timeout_s + 1.0 - time.monotonic()
    if remaining > 0:
        log.warning("waiting %.0f s for the previous worker's group session to expire",
                    remaining)
        stop_requested.wait(remaining)


def run_up(settings: Settings, on_ready: Callable[[dict[str, Any]], None] | None = None,
           on_status: Callable[[dict[str, Any]], None] | None = None,
           loglevel: str = "warning", otlp_port: int | None = None,
           on_stopping: Callable[[float], None] | None = None) -> None:
    """Run until SIGINT/SIGTERM. ``on_ready`` gets the announcement (bootstrap, store, url);
    ``on_status`` gets the pipeline's counters every few seconds while they change;
    ``on_stopping`` is told, with the drain's time limit, when the first signal starts
    the drain."""
    os.umask(PRIVATE_UMASK)
    private_dir(settings.data_dir)
    stop_requested = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop_requested.set())
    broker: DataDirBroker | None = None
    watch: BrokerWatch | None = None
    service: StoreService | None = None
    receiver: OtlpReceiver | ReceiverProcess | None = None
    detectors_stop = threading.Event()
    try:
        incarnation_ms = 0
        if settings.kafka_bootstrap:
            bootstrap = settings.kafka_bootstrap
        else:
            broker = DataDirBroker(settings).acquire()
            adopted_at = time.monotonic()
            bootstrap = broker.bootstrap
            incarnation_ms = incarnation_start_ms(broker.announcement)
        ensure_topics(bootstrap, settings)
        writer = migrate(settings)
        receiver = _start_otlp(settings, bootstrap, otlp_port)
        open_runs, lookup_runs = _store_reads(DirectReader(connect(settings), settings),
                                              settings)
        sink: Sink = ClickHouseSink(writer)
        fault_marker = os.environ.get("LOOPWATCH_FAULT_SINK_FILE")
        if fault_marker:
            sink = FaultInjectingSink(sink, Path(fault_marker))
        processor = Processor(settings, bootstrap, sink,
                              open_runs=open_runs, lookup_runs=lookup_runs,
                              skip_once=_fault_skip_message(), incarnation_ms=incarnation_ms)
        store = (safe_url(settings.clickhouse_url) if settings.clickhouse_url
                 else f"chdb://{settings.chdb_path}")  # announced and printed: no password

        detectors = start_detectors(settings, connect(settings), connect(settings),
                                    detectors_stop)

        def status() -> dict[str, Any]:
            outbox = detectors.outbox
            return {"counters": dataclasses.asdict(processor.pipeline.counters),
                    "sink_failures": processor.sink.failures,
                    "events_stored_at": processor.events_stored_at,
                    "rereads": processor.continuity.counts(),
                    **processor.kafka_write_counters(),
                    "caught_up": processor.caught_up(),
                    "alerts_open": len(detectors.book.open),
                    "notifications_pending": outbox.pending if outbox else 0}

        admin_client = connect(settings)
        actions = {
            "dlq-replay": lambda body: {
                "replayed": replay_pending(admin_client, bootstrap, settings)},
            "reprocess": lambda body: reprocess_with(
                admin_client, settings, datetime.fromisoformat(body["since"])),
            "storage": lambda body: storage_report(
                admin_client, settings.database, int(body.get("top", 8))),
        }
        raw_actions = {INSERT_PATH.removeprefix("/admin/"):
                       _insert_action(lambda: connect(settings),
                                      processor.note_events_stored)}
        service = StoreService(PooledReader(settings), status, settings.service_file,
                               settings.service_socket, actions, raw_actions)
        announcement = {"kafka_bootstrap": bootstrap, "store": store,
                        "otlp_url": receiver.url if receiver else None,
                        "otlp_grpc": receiver.grpc_address if receiver else None,
                        "events_topic": settings.events_topic,
                        "embedded_broker": broker is not None}
        url = service.start(announcement)
        if on_ready is not None:
            on_ready({**announcement, "url": url})
        if on_status is not None:
            _report_status(status, on_status, every_s=5.0)
        _sample_gauges(settings, bootstrap, connect(settings), status, detectors_stop)
        start_size_cap(settings, connect(settings), detectors_stop)
        start_decider(settings, connect(settings), detectors_stop)
        log_file = settings.data_dir / "logs" / "worker.log"
        worker = DrainingWorker(processor, bootstrap, stop_requested, on_stopping,
                                loglevel=loglevel, quiet=True, redirect_stdouts=False,
                                logfile=str(log_file))
        if broker is not None:
            if broker.adopted:
                _outlive_dead_members(settings, adopted_at, stop_requested)
            watch = BrokerWatch(broker, stop_requested).start()
        with contextlib.suppress(SystemExit):
            worker.execute_from_commandline()
        raise_if_crashed(processor.app, log_file)
    finally:
        if watch is not None:
            watch.stop()
        detectors_stop.set()
        if receiver is not None:
            receiver.stop()
        if service is not None:
            service.stop()
        if broker is not None:
            broker.release(uncommitted(broker.bootstrap, settings))
