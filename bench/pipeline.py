"""End-to-end throughput of the processors, with a raw-consumer baseline from the same run.

    loopwatch bench [--events N] [--workers K] [--query-events M] [--json]

Against one embedded Tansu broker on loopback (figures are only comparable as ratios
to the baseline measured in the same run; the machine is shared):

* ``emitter_events_per_s``: N generated events (``loopwatch.scenarios.traffic``, a
  three-agent fleet in simulated time, sorted by event time) emitted from this process
  with ``Emitter.emit`` + ``flush``: first emit to last broker ack (generation excluded),
  with the spool on as for the embedded broker: every sender batch written ahead to the
  spool with one fsync before it is sent (to a topic of its own, ``SPOOL_TOPIC``; no
  group confirms it, so the figure is emit + write-ahead + ack).
  ``emitter_baseline_events_per_s``: the same events just before, spool off (a Kafka
  cluster's mode: the broker's ack is enough), and ``emitter_spool_ratio`` on / off.
* ``raw_consume_events_per_s``: aiokafka, no group, all partitions assigned, seek to
  beginning, ``orjson.loads`` of every message and its envelope: first fetched batch to
  the N-th event. Measured twice, before the 1-worker run and after it (once its ``up``
  has stopped; ``raw_consume_bracket``), and the figure is their mean: the machine's
  speed drifts over the minutes of a run, and a baseline taken on one side only moved
  the ratio with that drift.
* ``pipeline_events_per_s``: a real ``loopwatch up`` child (fresh data dir) on the filled
  topic: from the first event consumed to the N-th stored (``count()``, then
  ``uniqExact(event_id)`` in ``events``, polled every 0.25 s; the window opens at the
  last poll at which the child had neither consumed a message (its ``messages``
  counter) nor stored an event), so start-up and the group join are excluded. The
  detectors are held off (``THROUGHPUT_ENV``: their first pass too, which ran at start
  before 2026-12-04): the figure is the processors', and a rule
  pass in the same process (queries, scipy KS tests) holds the GIL for ~1.5 s every 15 s
  on this store; production deployments that scale out run them in ``loopwatch detect``.
  Opening at the first *stored* event instead
  would leave the whole first batch's processing outside the window. ``workers["2"]``: a second
  ``up`` (own consumer group, fresh store, same topic) plus a ``loopwatch worker`` in its
  group; a rebalance while the two join can fall inside the window; its window's CPU
  per event by thread, of ``up`` and of the worker apart, goes to stderr. The processor's
  log is summarised on stderr (timer overruns, a full faust producer buffer: dead
  letters still go through it, the state changelog no longer does).
* ``processor_peak_rss_mb``: VmHWM of the ``up`` child (it also hosts chdb, the store
  service and the detectors).
* ``memory_per_open_run_bytes``: the Python heap an open run keeps in the processor
  (:mod:`loopwatch.bench.open_run_heap`: tracemalloc over two batches of ``run.start`` events
  folded from an empty pipeline by the real pipeline into the real ``TableRunStore``,
  containers included). Beside it, on stderr:
  VmRSS of a ``loopwatch worker`` (the processor alone: own consumer group, writing
  through the store service of an ``up`` child) and of that ``up`` child after each of
  5 batches of K open runs, and the least-squares slope over batches 2-5. RSS moves in
  whole allocator pools (a batch's transients are freed into pools later batches
  reuse), so it brackets the heap figure rather than measuring it.
* ``stored_bytes_per_event``: ``sum(data_compressed_bytes)`` of the active parts of every
  table in the loopwatch database / events stored (bulk rows included on both sides).
* ``query_latency_s``: per investigation query, the median of 3 runs through the store
  service reader, on a store holding M bulk-loaded + N pipeline events.
* ``alert_latency_p50_s`` / ``p95``: with ``LOOPWATCH_DETECT_INTERVAL_S=1``, time from
  sending (acks=all) a run's 21st step to the ``stuck_run`` alert being ``firing`` in
  ``alerts FINAL``, polled every 50 ms; a few samples, one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import orjson
from kafka import KafkaConsumer, KafkaProducer
from kafka import TopicPartition as KafkaTopicPartition
from kafka.consumer.fetcher import ConsumerRecord

from loopwatch.bench.open_run_heap import heap_per_open_run, open_run_starts
from loopwatch.core.config import load_settings
from loopwatch.core.embedded.broker import EmbeddedBroker
from loopwatch.core.processes import terminate
from loopwatch.core.threads import FOLD_THREAD_NAME
from loopwatch.core.topics import LagProbe, ensure_topics
from loopwatch.ingest.events import EventBase, RunStart, Step
from loopwatch.ingest.sdk import Emitter
from loopwatch.investigations import investigations
from loopwatch.scenarios.traffic import Agent, Behaviour, Traffic
from loopwatch.upprocess import UpProcess

Progress = Callable[[str], None]

FLEET: tuple[Agent, ...] = (
    Agent("support-bot", runs_per_minute=20.0, tools=("lookup_ticket", "issue_refund", "search"),
          behaviour=Behaviour(loop_share=0.03, crash_share=0.02, abandon_share=0.02)),
    Agent("research-agent", model="claude-opus-4-1", runs_per_minute=12.0, system_tokens=6000,
          tools=("search", "fetch"), steps=(4, 10),
          behaviour=Behaviour(loop_share=0.05, gave_up_share=0.04, budget_share=0.05)),
    Agent("sql-analyst", model="gpt-4o", runs_per_minute=16.0, tools=("run_sql", "fetch"),
          steps=(3, 7), behaviour=Behaviour(cache_works=False, tool_error_share=0.01)),
)
KEYS = ("events", "pipeline_events_per_s", "raw_consume_events_per_s", "ratio",
        "ratio_at_poll",
        "emitter_events_per_s", "emitter_baseline_events_per_s", "emitter_spool_ratio",
        "alert_latency_p50_s", "alert_latency_p95_s",
        "processor_peak_rss_mb", "memory_per_open_run_bytes", "stored_bytes_per_event",
        "query_latency_s", "workers", "machine", "cpu_budget", "raw_consume_bracket",
        "otlp_spans_per_s", "otlp_accept_spans_per_s", "otlp_at_check_spans_per_s",
        "otlp_lag_s", "otlp_up_cpu_us_per_span", "otlp_stored")
POLL_S = 0.25
#: batches of new open runs for the memory figure (the first pays one-time allocations)
MEMORY_ROUNDS = 5
BASE_ENV = {"LOOPWATCH_OTLP_PORT": "0"}
#: the spool-on emitter run's topic: its events are not processed
SPOOL_TOPIC = "bench.emitter-spool"
#: the throughput runs: no rule or advisor pass inside the window (see the module
#: docstring); without the delay, the first pass ran at start, over the bulk-loaded store,
#: and took ~4 µs/event of the window's CPU (a py-spy profile, docs/performance.md)
THROUGHPUT_ENV = {"LOOPWATCH_DETECT_INTERVAL_S": "3600",
                  "LOOPWATCH_DETECT_START_DELAY_S": "3600"}


def event_spans(count: int, seed: int, end: datetime) -> Iterator[list[EventBase]]:
    """The fleet's events, one simulated span at a time (each in event-time order),
    ending about at ``end``, until at least ``count`` were generated. A span is an hour,
    or, for fewer events than the fleet makes in an hour, the minutes that make about
    ``count``: the smokes and tests that ask for a few thousand events simulated a whole
    hour (~35k events, ~2.4 s of CPU) and kept a tenth of it."""
    per_hour = sum(agent.runs_per_minute for agent in FLEET) * 60 * 12
    span = timedelta(hours=1) if count >= per_hour else \
        timedelta(minutes=max(1, math.ceil(60 * count / per_hour)))
    per_span = per_hour * (span / timedelta(hours=1))
    window = end - span * (max(1, math.ceil(count / per_span)) + 1)
    traffic = Traffic(FLEET, seed)
    generated = 0
    while generated < count:
        events = sorted(traffic.events(window, window + span), key=lambda event: event.ts)
        generated += len(events)
        window += span
        yield events


def generate_events(count: int, seed: int, end: datetime) -> list[EventBase]:
    """``count`` events of the fleet, in event-time order, ending about at ``end``."""
    generated = [event for span in event_spans(count, seed, end) for event in span]
    generated.sort(key=lambda event: event.ts)
    return generated[:count]


def _proc_status(pid: int, field: str) -> int | None:
    """A ``VmRSS``/``VmHWM`` line of /proc/<pid>/status, in bytes."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _stat(path: str) -> tuple[str, float]:
    """(name, CPU seconds user + system) from a /proc ``stat`` file."""
    text = Path(path).read_text()
    name, rest = text[text.index("(") + 1:].rsplit(")", 1)
    fields = rest.split()
    return name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(main thread, whole process) CPU seconds, user + system, that ``pid`` used so far;
    (0, 0) once it is gone."""
    try:
        return _stat(f"/proc/{pid}/task/{pid}/stat")[1], _stat(f"/proc/{pid}/stat")[1]
    except OSError:
        return 0.0, 0.0


def waiting_for_core_s(pid: int, tid: int | None = None) -> float:
    """Seconds thread ``tid`` of ``pid`` (its main thread by default) was ready to run
    but waited for a core (the run queue wait of ``/proc/<pid>/task/<tid>/schedstat``);
    0 once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/task/{pid if tid is None else tid}/schedstat").read_text()
        return int(stat.split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


#: what a thread is, by the name ClickHouse leaves on it: chdb runs a query on the
#: calling thread, and an insert that feeds a materialized view (``events_in``'s) renames
#: it ``Unknown``; in ``loopwatch up`` only the sink thread inserts through that view
RENAMED_BY_CHDB = {"Unknown": "sink thread"}
#: threads ``up`` names itself (:data:`loopwatch.processors.app.FOLD_THREAD_NAME`)
NAMED_BY_UP = {FOLD_THREAD_NAME: "fold thread"}


def thread_kind(tid: int, name: str, pid: int, main_name: str) -> str:
    """What a thread of ``pid`` is, for :func:`threads_note`: ClickHouse names its
    threads (``ThreadPool`` inserts, ``MergeMutate`` merges...) and renames the sink
    thread (:data:`RENAMED_BY_CHDB`); Python's other threads (faust's consumer thread,
    the detectors, the store service...) keep the process's name.

    >>> [thread_kind(tid, name, 7, "python") for tid, name in
    ...  [(7, "python"), (8, "python"), (9, "MergeMutate12"), (10, "Unknown")]]
    ['main thread', 'other Python threads', 'MergeMutate', 'sink thread']
    """
    if tid == pid:
        return "main thread"
    if name == main_name:
        return "other Python threads"
    if name in RENAMED_BY_CHDB:
        return RENAMED_BY_CHDB[name]
    if name in NAMED_BY_UP:
        return NAMED_BY_UP[name]
    return name.rstrip("0123456789") or name


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """Each thread ``pid`` has now: its id -> (its name, CPU seconds so far)."""
    used: dict[int, tuple[str, float]] = {}
    try:
        tids = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return used
    for tid in tids:
        try:
            used[tid] = _stat(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            continue
    return used


def cpu_by_kind(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                pid: int, events: int) -> dict[str, float]:
    """CPU per event (µs) of each kind of thread (:func:`thread_kind`) between two
    :func:`thread_cpu` of ``pid``. Each thread counts what it used in between under the
    name it has at the end (chdb renames threads); threads that ended in between are
    left out.

    >>> cpu_by_kind({7: ("python", 1.0), 9: ("python", 2.0)},
    ...             {7: ("python", 6.0), 9: ("Unknown", 3.0), 11: ("ThreadPool", 4.0)},
    ...             7, 500_000)
    {'main thread': 10.0, 'sink thread': 2.0, 'ThreadPool': 8.0}
    """
    main_name = after.get(pid, before.get(pid, ("", 0.0)))[0]
    per_event = 1e6 / max(events, 1)
    used: dict[str, float] = {}
    for tid, (name, seconds) in after.items():
        kind = thread_kind(tid, name, pid, main_name)
        spent = (seconds - before.get(tid, (name, 0.0))[1]) * per_event
        used[kind] = used.get(kind, 0.0) + spent
    return used


def threads_note(used: dict[str, float]) -> str:
    """:func:`cpu_by_kind`'s figures, most first.

    >>> threads_note({'main thread': 10.0, 'sink thread': 2.0, 'ThreadPool': 8.0})
    'CPU per event by thread: main thread 10.0 µs, ThreadPool 8.0 µs, sink thread 2.0 µs'
    """
    shown = sorted(((us, kind) for kind, us in used.items() if us >= 0.05), reverse=True)
    return "CPU per event by thread: " + ", ".join(f"{kind} {us:.1f} µs" for us, kind in shown)


#: the thread kinds that run the processors' own Python; every other thread of ``up``
#: stores (the sink thread, which encodes rows and calls chdb, and chdb's own threads)
PYTHON_KINDS = frozenset({"main thread", "fold thread", "other Python threads"})


def cpu_budget(used: dict[str, float], broker_us: float, raw_rate: float,
               cores: int) -> dict[str, float]:
    """The ratio target as CPU per event: 1/3 of the raw consumer's rate on ``cores``
    leaves ``budget_us`` for everything; storing (``store_us``) and the broker take
    their share of it first, and ``left_for_processors_us`` is what remains for the
    processors' Python, which spent ``processors_us``.

    >>> budget = cpu_budget({"main thread": 15.0, "other Python threads": 1.0,
    ...     "sink thread": 7.0, "MergeMutate": 5.0, "ThreadPool": 4.0}, 1.0, 300_000, 2)
    >>> [budget[key] for key in ("budget_us", "store_us", "left_for_processors_us",
    ...                          "processors_us")]
    [20.0, 16.0, 3.0, 16.0]
    """
    budget = cores * 1e6 / max(raw_rate / 3, 1e-9)
    store = sum(us for kind, us in used.items() if kind not in PYTHON_KINDS)
    return {"budget_us": budget, "store_us": store, "broker_us": broker_us,
            "left_for_processors_us": budget - store - broker_us,
            "processors_us": sum(us for kind, us in used.items() if kind in PYTHON_KINDS)}


def budget_note(budget: dict[str, float]) -> str:
    """:func:`cpu_budget` in words.

    >>> note = budget_note({'budget_us': 20.0, 'store_us': 16.0, 'broker_us': 1.0,
    ...                     'left_for_processors_us': 3.0, 'processors_us': 16.0})
    >>> note[note.index("which"):]
    "which leaves 3.0 µs for the processors' Python; it spent 16.0 µs"
    """
    return (f"CPU budget at 1/3 of raw: {budget['budget_us']:.1f} µs per event; storing takes "
            f"{budget['store_us']:.1f} µs (sink thread and chdb's threads) and the broker "
            f"{budget['broker_us']:.1f} µs, which leaves "
            f"{budget['left_for_processors_us']:.1f} µs for the processors' Python; "
            f"it spent {budget['processors_us']:.1f} µs")


@dataclass(frozen=True)
class CpuSample:
    """The CPU counters :func:`measure_processing` takes at every poll, so that a
    window's figures cover the window alone: ``loopwatch up`` starts its detectors,
    its store and its consumer before the first event, and counting from its start
    put seconds of start-up CPU into the per-event figures."""

    machine: tuple[int, int]
    up: tuple[float, float]
    threads: dict[int, tuple[str, float]]
    broker: float
    main_waiting: float = 0.0
    fold_waiting: float = 0.0
    #: the threads of a ``loopwatch worker`` beside ``up`` (the 2-worker window's)
    worker_threads: dict[int, tuple[str, float]] = field(default_factory=dict)

    @classmethod
    def take(cls, up_pid: int, broker_pid: int, worker_pid: int = 0) -> CpuSample:
        threads = thread_cpu(up_pid)
        return cls(machine_ticks(), cpu_seconds(up_pid), threads,
                   cpu_seconds(broker_pid)[1] if broker_pid else 0.0,
                   waiting_for_core_s(up_pid), _fold_waiting_s(up_pid, threads),
                   thread_cpu(worker_pid) if worker_pid else {})


def machine() -> dict[str, Any]:
    """What the figures were measured on: they mean little without it.

    >>> sorted(machine())
    ['cores', 'cpu', 'memory_gib', 'python', 'system']
    """
    def first(path: str, key: str) -> str:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError:
            return ""
        return next((line.split(":", 1)[1].strip() for line in lines
                     if line.startswith(key)), "")

    memory_kb = first("/proc/meminfo", "MemTotal").removesuffix(" kB")
    return {"cpu": first("/proc/cpuinfo", "model name") or platform.processor(),
            "cores": os.cpu_count(),
            "memory_gib": round(int(memory_kb) / 2**20, 1) if memory_kb.isdigit() else None,
            "python": platform.python_version(),
            "system": f"{platform.system()} {platform.release()}"}


def machine_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine so far, from ``/proc/stat``."""
    ticks = [int(field) for field in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    return sum(ticks) - idle, sum(ticks)


def busy_cores(before: tuple[int, int], after: tuple[int, int]) -> float:
    """How many of the machine's cores were busy, on average, between two
    :func:`machine_ticks`: near ``os.cpu_count()`` means the window was CPU-bound.

    >>> busy_cores((100, 1000), (250, 1200)) * 2 / (os.cpu_count() or 1)
    1.5
    """
    busy, total = after[0] - before[0], after[1] - before[1]
    return busy / max(total, 1) * (os.cpu_count() or 1)


def _fold_tids(threads: dict[int, tuple[str, float]]) -> list[int]:
    """The fold thread's id among ``threads`` (:func:`thread_cpu`), by its OS name."""
    return [tid for tid, (name, _) in threads.items() if name == FOLD_THREAD_NAME]


def _fold_thread_s(threads: dict[int, tuple[str, float]]) -> float:
    return sum(threads[tid][1] for tid in _fold_tids(threads))


def _fold_waiting_s(up_pid: int, threads: dict[int, tuple[str, float]]) -> float:
    return sum(waiting_for_core_s(up_pid, tid) for tid in _fold_tids(threads))


def cpu_note(opened: CpuSample, closed: CpuSample, events: int, seconds: float) -> str:
    """Where a measured window's CPU went, per event: what bounds the throughput on a
    machine whose two cores the processor, its in-process chdb and the broker share.
    The fold thread comes first: it folds every event, so its share of the window
    running is how close the processor is to its own limit, and its share waiting for
    a core how much of the rest the machine's other work took (the remainder is the
    GIL, or no batch to fold).

    >>> fold = {9: (FOLD_THREAD_NAME, 1.0)}
    >>> note = cpu_note(CpuSample((0, 0), (1.0, 3.0), fold, 0.5, 0.2, 1.0),
    ...                 CpuSample((0, 0), (2.0, 15.0), {9: (FOLD_THREAD_NAME, 9.0)}, 1.0, 0.7,
    ...                           2.5), 500_000, 10.0)
    >>> for part in note.split(", up's")[0].split("), "): print(part)
    CPU per event: fold thread 16.0 µs (running 80% of the window, waiting for a core 15%
    up main thread 2.0 µs (running 10% of the window, waiting for a core 5%)
    """
    main = closed.up[0] - opened.up[0]
    fold = _fold_thread_s(closed.threads) - _fold_thread_s(opened.threads)
    process = closed.up[1] - opened.up[1]
    waiting = closed.main_waiting - opened.main_waiting
    fold_waiting = closed.fold_waiting - opened.fold_waiting
    per_event = 1e6 / max(events, 1)
    window = max(seconds, 1e-9)
    return (f"CPU per event: fold thread {fold * per_event:.1f} µs (running "
            f"{fold / window:.0%} of the window, waiting for a core "
            f"{fold_waiting / window:.0%}), up main thread {main * per_event:.1f} µs "
            f"(running {main / window:.0%} of the window, waiting for a core "
            f"{waiting / window:.0%}), up's other threads "
            f"{(process - main - fold) * per_event:.1f} µs (the sink thread's "
            f"inserts, chdb's threads, faust's consumer thread), broker "
            f"{(closed.broker - opened.broker) * per_event:.1f} µs")


def ceiling_note(cpu_us_per_event: float, raw_rate: float, cores: int) -> str:
    """What the machine's cores allow at a window's CPU per event, against the CPU per
    event that 1/3 of the raw consumer's rate leaves (the ratio target).

    >>> note = ceiling_note(30.0, 430_000, 2)
    >>> note[note.index("2 cores"):note.index(" of raw")]
    '2 cores carry at most 66.7k events/s (0.155'
    >>> note[note.index("1/3"):]
    '1/3 of raw (143.3k events/s) leaves 14.0 µs'
    """
    ceiling = cores * 1e6 / max(cpu_us_per_event, 1e-9)
    needed = raw_rate / 3
    return (f"CPU ceiling: at {cpu_us_per_event:.1f} µs of CPU per event (up and broker), "
            f"{cores} cores carry at most {ceiling / 1e3:.1f}k events/s "
            f"({ceiling / max(raw_rate, 1e-9):.3f} of raw); 1/3 of raw "
            f"({needed / 1e3:.1f}k events/s) leaves {cores * 1e6 / max(needed, 1e-9):.1f} µs")


def _pid(up: UpProcess) -> int:
    assert up.process is not None
    return up.process.pid


# -- producer and raw consumer ------------------------------------------------------------

#: the emitter's spool cap in the bench, in both modes. The SDK counts the events queued
#: for its sender against the cap (256 MB by default, ~800k bench events), and the bench
#: emits its whole run at once: ``--events 2000000`` was refused (``spool full``) before
#: the sender had sent a quarter of it.
EMIT_SPOOL_MAX_BYTES = 1 << 40


def emit_all(bootstrap: str, events: list[EventBase], spool: Path,
             topic: str = "loopwatch.events", write_ahead: bool = False) -> tuple[float, int]:
    """Emit through the SDK from this thread; (events/s, events acknowledged).
    ``write_ahead``: the embedded broker's mode, every batch written to the spool (one
    fsync) before it is sent; a group that never commits, so it all stays there."""
    mode: dict[str, Any] = ({"confirm": "pipeline", "consumer_group": "bench-no-commits"}
                            if write_ahead else {"confirm": "broker"})
    emitter = Emitter(bootstrap, topic, spool_dir=spool,
                      spool_max_bytes=EMIT_SPOOL_MAX_BYTES, **mode)
    try:
        started = time.monotonic()
        for event in events:
            emitter.emit(event)
        if not emitter.flush(timeout_s=600):
            raise RuntimeError("the emitter did not drain in 600 s")
        elapsed = time.monotonic() - started
        if emitter.stats.spooled:
            raise RuntimeError(f"{emitter.stats.spooled} events were spooled, not sent")
        if write_ahead and emitter.stats.logged != emitter.stats.sent:
            raise RuntimeError(f"{emitter.stats.logged} of {emitter.stats.sent} events "
                               "were written ahead")
        return emitter.stats.sent / elapsed, emitter.stats.sent
    finally:
        emitter.close(confirm_timeout_s=0)


async def _raw_consume(bootstrap: str, topic: str, expected: int, timeout_s: float) -> float:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None,
                                enable_auto_commit=False, auto_offset_reset="earliest",
                                max_partition_fetch_bytes=4_194_304)
    await consumer.start()
    try:
        partitions = consumer.partitions_for_topic(topic) or set()
        if not partitions:
            await consumer._client.force_metadata_update()  # the consumer has no public one
            partitions = consumer.partitions_for_topic(topic) or set()
        assigned = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(assigned)
        await consumer.seek_to_beginning(*assigned)
        seen, first = 0, 0.0
        deadline = time.monotonic() + timeout_s
        while seen < expected:
            if time.monotonic() > deadline:
                raise TimeoutError(f"raw consumer read {seen}/{expected} events")
            batches = await consumer.getmany(timeout_ms=1000)
            if batches and not first:
                first = time.monotonic()
            for records in batches.values():
                for record in records:
                    value = orjson.loads(record.value or b"null")
                    if isinstance(value, dict) and "envelope_version" in value:
                        seen += len(value["events"])
                    else:
                        seen += 1
        return seen / (time.monotonic() - first)
    finally:
        await consumer.stop()


def raw_consume(bootstrap: str, topic: str, expected: int, timeout_s: float = 600) -> float:
    return asyncio.run(_raw_consume(bootstrap, topic, expected, timeout_s))


# -- the processors -------------------------------------------------------------------------

def _stored(up: UpProcess, exact: bool) -> int:
    sql = "SELECT uniqExact(event_id) FROM events" if exact else "SELECT count() FROM events"
    return int(up.reader.query(sql).scalar() or 0)


def stored_at(health: dict[str, Any], clock: Callable[[], float] = time.monotonic
              ) -> float | None:
    """When ``up``'s store last accepted events (``events_stored_at`` of its status
    ``health``, a wall time), on ``clock``; None if it does not say."""
    accepted = health.get("events_stored_at")
    if accepted is None:
        return None
    return float(accepted) - (time.time() - clock())


def _last_insert(up: UpProcess) -> float:
    """When ``up``'s store last accepted events, on this process's monotonic clock
    (infinity if it does not say)."""
    accepted = stored_at(up.health())
    return math.inf if accepted is None else accepted


def measure_processing(up: UpProcess, already: int, target: int, progress: Progress,
                       sample: Callable[[], CpuSample], timeout_s: float = 1800
                       ) -> dict[str, Any]:
    """Poll until ``target`` distinct events are stored (``already`` were there before).

    The window opens at the last poll that saw nothing consumed and nothing new stored
    (so start-up and the group join stay out, give or take one poll interval) and
    closes when ``up``'s store last accepted events (``events_stored_at`` of its status:
    its processor's, or an extra worker's through its store service), or when the poll
    that saw the target ended if ``up`` does not say. ``poll_rate`` closes the window
    where the poll that saw the target began, as before: up to a poll period late, or
    early by as much as the poll's queries take when the last insert ends during them
    (the raw consumer's clock stops at its last record). Also returns the longest
    stretch without progress inside it, how many cores the machine had busy in it (near
    all of them: the window was CPU-bound), and the CPU samples (``sample``, taken at
    every poll) at its opening and its close.
    """
    deadline = time.monotonic() + timeout_s
    opened: float | None = None
    before = time.monotonic()
    sample_before = sample_opened = sample()
    last_change, longest_stall, previous = before, 0.0, already
    stored, slowest_poll = already, 0.0
    changes: list[tuple[float, int]] = []
    while True:
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"pipeline stored {stored}/{target} events in {timeout_s:.0f}s")
        stored = _stored(up, exact=False)
        slowest_poll = max(slowest_poll, time.monotonic() - now)
        if stored >= target:
            stored = _stored(up, exact=True)
        seen_at = time.monotonic()
        if opened is None:
            if stored > already or up.health()["counters"]["messages"] > 0:
                opened = last_change = before
                sample_opened = sample_before
            before, sample_before = now, sample()
        if opened is not None and stored != previous:
            longest_stall = max(longest_stall, now - last_change)
            last_change, previous = now, stored
            changes.append((now, stored - already))
            progress(f"stored {stored - already}/{target - already}")
        if stored >= target:
            break
        time.sleep(POLL_S)
    assert opened is not None
    polled = now - opened
    closed_at = min(seen_at, _last_insert(up))
    elapsed = max(closed_at - opened, 1e-9)
    closed = sample()
    return {"rate": (stored - already) / elapsed, "seconds": elapsed,
            "poll_rate": (stored - already) / polled,
            "longest_stall_s": longest_stall, "slowest_poll_s": slowest_poll,
            "busy_cores": busy_cores(sample_opened.machine, closed.machine),
            "middle_rate": middle_rate(changes, target - already),
            "opened": sample_opened, "closed": closed}


def middle_rate(changes: list[tuple[float, int]], total: int) -> float | None:
    """Events per second between the polls that first saw 10 % and 90 % of ``total``
    stored (``changes``: (time, stored) at each poll that saw more): the rate without
    the window's edges (the poll that opens it, the last chunk's write). A run of a few
    batches still has the wait before its last, partial batch (``batch_max_wait_s``)
    inside that span. None if both fall on one poll.

    >>> middle_rate([(0.0, 5), (1.0, 20), (3.0, 60), (4.0, 95), (5.0, 100)], 100)
    25.0
    >>> middle_rate([(0.0, 100)], 100) is None
    True
    """
    low = next(point for point in changes if point[1] >= total * 0.1)
    high = next(point for point in changes if point[1] >= total * 0.9)
    if high[0] <= low[0]:
        return None
    return (high[1] - low[1]) / (high[0] - low[0])


def window_note(label: str, measured: dict[str, Any], detail: str) -> str:
    """One measured window (:func:`measure_processing`) in words.

    >>> note = window_note("1 worker", {"seconds": 8.7, "busy_cores": 1.53,
    ...                                 "longest_stall_s": 0.6, "slowest_poll_s": 0.1,
    ...                                 "middle_rate": 41_230.0}, "up pid 7")
    >>> note[:87]
    '1 worker: 8.7s window, 41.2k events/s between 10 % and 90 % stored, 1.53 of the machine'
    """
    middle = measured["middle_rate"]
    middle_text = "" if middle is None else \
        f"{middle / 1e3:.1f}k events/s between 10 % and 90 % stored, "
    return (f"{label}: {measured['seconds']:.1f}s window, {middle_text}"
            f"{measured['busy_cores']:.2f} of the machine's {os.cpu_count()} cores busy, "
            f"longest stretch without progress {measured['longest_stall_s']:.1f}s, slowest "
            f"poll {measured['slowest_poll_s']:.1f}s ({detail})")


def query_latencies(up: UpProcess, runs: int = 3) -> dict[str, float]:
    found = up.reader.query(
        "SELECT run_id FROM runs FINAL ORDER BY outcome = 'looped' DESC, tool_calls DESC "
        "LIMIT 1").scalar() or ""
    latencies: dict[str, float] = {}
    for name, investigation in sorted(investigations().items()):
        parameters = {key: value for key, value in {"agent": "", "run_id": str(found)}.items()
                      if key in investigation.parameters}
        samples = []
        for _ in range(runs):
            started = time.monotonic()
            up.reader.query(investigation.sql, parameters)
            samples.append(time.monotonic() - started)
        latencies[name] = statistics.median(samples)
    return latencies


def stored_bytes(up: UpProcess) -> float:
    """Compressed bytes of the store's active parts (the store service's owner-only
    ``storage`` action: system tables are outside user SQL)."""
    return float(up.reader.post("/admin/storage", {"top": 0})["compressed_bytes"])


def stored_bytes_breakdown(up: UpProcess, events: int, top: int = 8) -> str:
    """The biggest columns by compressed bytes per event (what to shrink next)."""
    columns = up.reader.post("/admin/storage", {"top": int(top)})["columns"]
    return ", ".join(f"{table}.{name} {float(size) / max(events, 1):.1f}"
                     for table, name, size in columns)


def bulk_load(data_dir: Path, events: int, seed: int) -> int:
    """Fill the store in a child process (chdb: one process per path) before ``up``."""
    result = subprocess.run(
        [sys.executable, "-m", "loopwatch.bench._bulkload", str(data_dir), str(events), str(seed)],
        env={**os.environ, "LOOPWATCH_DATA_DIR": str(data_dir),
             # ``bench`` is not in the installed packages: run it from this checkout
             "PYTHONPATH": os.pathsep.join(filter(None, [
                 str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]))},
        capture_output=True, check=False, timeout=1800,
    )
    if result.returncode != 0:
        raise RuntimeError(f"bulk load failed: {result.stderr.decode()[-2000:]}")
    return int(orjson.loads(result.stdout.splitlines()[-1])["events"])


def _worker(env: dict[str, str], data_dir: Path) -> subprocess.Popen[bytes]:
    log = (data_dir / "logs" / "bench-worker.out").open("ab")
    return subprocess.Popen([sys.executable, "-m", "loopwatch.cli", "worker"],
                            env={**os.environ, **env, "LOOPWATCH_DATA_DIR": str(data_dir)},
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _still_running(process: subprocess.Popen[bytes], logs: Path) -> None:
    """Raise, naming the last lines of its output and its own log, when ``process`` (a
    ``loopwatch worker`` writing into ``logs``) has exited."""
    code = process.poll()
    if code is not None:
        said = [line for path in (logs / "bench-worker.out", logs / f"worker-{process.pid}.log")
                if path.exists()
                for line in path.read_text(errors="replace").strip().splitlines()[-3:]]
        raise RuntimeError(f"the bench's `loopwatch worker` exited with {code}: "
                           + (" | ".join(said) or "no output"))


# -- open runs and alerts (a separate `up` on its own topic) ---------------------------------

def _wait_counter(up: UpProcess, target: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while up.health()["counters"]["events"] < target:
        if time.monotonic() > deadline:
            raise TimeoutError(f"up processed fewer than {target} events")
        time.sleep(0.1)


def read_topic(bootstrap: str, topic: str) -> list[ConsumerRecord]:
    """Every record of ``topic``, from the beginning to the end offsets it had when read
    (each partition's in offset order)."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap.split(","), enable_auto_commit=False)
    try:
        consumer.topics()  # a new client knows no partitions before its first metadata
        partitions = [KafkaTopicPartition(topic, number)
                      for number in sorted(consumer.partitions_for_topic(topic) or ())]
        consumer.assign(partitions)
        consumer.seek_to_beginning(*partitions)
        ends = consumer.end_offsets(partitions)
        records: list[ConsumerRecord] = []
        while any(consumer.position(tp) < end for tp, end in ends.items()):
            for batch in consumer.poll(timeout_ms=1000).values():
                records.extend(batch)
        return records
    finally:
        consumer.close()


def write_topic(bootstrap: str, topic: str, records: list[ConsumerRecord]) -> None:
    """Send records as :func:`read_topic` returned them, each to its partition."""
    producer = KafkaProducer(bootstrap_servers=bootstrap.split(","), linger_ms=20,
                             batch_size=1_048_576, max_request_size=16_777_216)
    try:
        for record in records:
            producer.send(topic, key=record.key, value=record.value,
                          partition=record.partition)
        producer.flush(120)
    finally:
        producer.close()


async def _group_members(bootstrap: str, group: str) -> tuple[str, int]:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        (response,) = await admin.describe_consumer_groups([group])
        described = response.groups[0]
        return described[2], len(described[5])  # (error, group, state, type, protocol, members)
    finally:
        await admin.close()


@contextlib.contextmanager
def stopped(pids: list[int]) -> Iterator[None]:
    """The processes stopped (SIGSTOP) inside the block, continued after it. Short
    enough a stop (a few seconds, under ``session_timeout_s``) costs no rebalance."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def _timed(action: Callable[[], object]) -> float:
    """Seconds ``action`` took."""
    started = time.monotonic()
    action()
    return time.monotonic() - started


def wait_group_stable(bootstrap: str, group: str, members: int, timeout_s: float = 180) -> None:
    """Until ``group`` is ``Stable`` with ``members`` members. aiokafka's admin, since
    kafka-python 3.0.12 cannot read the broker's DescribeGroups answer (it fails on the
    authorized operations field)."""
    deadline = time.monotonic() + timeout_s
    while asyncio.run(_group_members(bootstrap, group)) != ("Stable", members):
        if time.monotonic() > deadline:
            raise TimeoutError(f"consumer group {group} did not settle with {members} members")
        time.sleep(0.5)


def _wait_lag_zero(bootstrap: str, group: str, topic: str, timeout_s: float = 300,
                   check: Callable[[], None] = lambda: None) -> None:
    """Until ``group`` has committed all of ``topic``. Generous: on a loaded machine a
    group join alone has taken 25 s, and the bench smoke once ran out of 120 s here.
    ``check`` raises when a process the wait depends on is gone, so that a dead worker
    is named at once rather than after the whole timeout."""
    probe = LagProbe(bootstrap, group, topic)
    try:
        deadline = time.monotonic() + timeout_s
        while probe.lag() > 0:
            check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"consumer group {group} still lags on {topic}")
            time.sleep(0.2)
    finally:
        probe.close()


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs``."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread


def open_run_memory(emitter: Emitter, runs: int, rounds: int,
                    processes: dict[str, tuple[int, str]],
                    check: Callable[[], None] = lambda: None) -> dict[str, dict[str, Any]]:
    """VmRSS of each process (name: (pid, its consumer group)) after each of ``rounds``
    batches of ``runs`` new open runs, read once every group has committed the whole
    topic. Per process: ``rounds`` (growth per run of every batch; the first also pays
    one-time allocations) and ``slope`` (bytes per open run, least squares over the
    batches after the first). A batch's transient objects (prefetched messages,
    changelog messages waiting for the producer) leave freed memory the allocator keeps
    and later batches reuse, so a single batch's growth swings by several KB per run;
    the fitted slope averages over them."""
    readings: dict[str, list[int]] = {name: [] for name in processes}
    for round_ in range(rounds + 1):
        if round_:
            starts = open_run_starts(runs)
            for index in range(0, runs, 5000):
                emitter.send_and_wait(starts[index:index + 5000], timeout_s=60)
            for _process_id, group in processes.values():
                _wait_lag_zero(emitter.bootstrap or "", group, emitter.topic, check=check)
        time.sleep(3.0)  # let the batch's rows and changelog writes settle
        for name, (pid, _group) in processes.items():
            rss = _proc_status(pid, "VmRSS")
            if rss is None:
                raise RuntimeError(f"no /proc/{pid}/status for {name}")
            readings[name].append(rss)
    result: dict[str, dict[str, Any]] = {}
    for name, values in readings.items():
        growth = [(after - before) / runs for before, after in itertools.pairwise(values)]
        opened = [float(runs * index) for index in range(1, len(values))]
        result[name] = {"rounds": growth,
                        "slope": _slope(opened, [float(v) for v in values[1:]])}
    return result


def alert_latencies(up: UpProcess, emitter: Emitter, samples: int,
                    timeout_s: float = 30) -> list[float]:
    sql = ("SELECT count() FROM alerts FINAL WHERE rule = 'stuck_run' "
           "AND labels['run_id'] = {run_id:String} AND state = 'firing'")
    latencies = []
    for _ in range(samples):
        run_id = uuid.uuid4().hex
        common: dict[str, Any] = {"run_id": run_id, "agent": "bench-stuck", "task_type": "hold",
                                  "model": "claude-sonnet-4", "prompt_version": "v1",
                                  "deployment": "d1"}
        base = up.health()["counters"]["events"]
        now = datetime.now(UTC)
        first: list[EventBase] = [RunStart(ts=now, step_cap=100, **common)]
        first += [Step(ts=now, step=number, **common) for number in range(20)]
        emitter.send_and_wait(first, timeout_s=30)
        _wait_counter(up, base + len(first))
        time.sleep(1.5)  # the detector has seen the run at 20 steps: not yet stuck
        started = time.monotonic()
        emitter.send_and_wait([Step(ts=datetime.now(UTC), step=20, **common)], timeout_s=30)
        while time.monotonic() - started < timeout_s:
            if up.reader.query(sql, {"run_id": run_id}).scalar():
                latencies.append(time.monotonic() - started)
                break
            time.sleep(0.05)
    return latencies


def log_signals(logs: Path) -> str:
    """What the processor's own log says about stalls: timer overruns, a full changelog
    producer buffer (faust pauses the stream until it drains), and partitions read again
    (a hole, or a partition's end stalled: :mod:`loopwatch.processors.continuity`),
    whose copies count as duplicates. The logs go with a successful run's folder: this
    line is where a run shows them."""
    sweeps: list[float] = []
    commits: list[float] = []
    buffer_full = 0
    reread = 0
    for path in logs.glob("worker*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if "producer buffer full" in line:
                buffer_full += 1
            elif "reading it again from" in line:
                reread += 1
            elif "is overlapping" in line and "runtime=" in line:
                runtime = float(line.rsplit("runtime=", 1)[1].split(")")[0])
                (sweeps if "sweep-runs" in line else commits).append(runtime)
    return (f"log: sweep-runs timer overran {len(sweeps)}x (max {max(sweeps, default=0):.1f}s, "
            f"sum {sum(sweeps):.1f}s), commit timer overran {len(commits)}x (max "
            f"{max(commits, default=0):.1f}s), 'producer buffer full' {buffer_full}x, "
            f"partitions read again {reread}x")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# -- the whole run ------------------------------------------------------------------------------

@contextlib.contextmanager
def logs_kept_on_failure(root: Path, note: Progress) -> Iterator[None]:
    """Copy the run's logs (the broker's and every ``up``'s and worker's, same layout)
    out of ``root`` when the body fails, and name the copy: a bench error names a log
    under ``root``, which is removed as the error propagates.

    >>> root, keep = Path(tempfile.mkdtemp()), []
    >>> (root / "w1" / "logs").mkdir(parents=True)
    >>> _ = (root / "w1" / "logs" / "worker.log").write_text("KeyError")
    >>> with contextlib.suppress(RuntimeError), logs_kept_on_failure(root, keep.append):
    ...     raise RuntimeError("the processor crashed")
    >>> kept = Path(keep[0].rpartition(" ")[2])
    >>> (kept / "w1" / "logs" / "worker.log").read_text()
    'KeyError'
    >>> shutil.rmtree(root); shutil.rmtree(kept)
    """
    try:
        yield
    except BaseException:
        kept = Path(tempfile.mkdtemp(prefix="loopwatch-bench-logs-"))
        for path in [*root.glob("*.log"), *root.glob("*/logs/*")]:
            target = kept / path.relative_to(root)
            target.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):
                shutil.copy2(path, target)
        note(f"the failed run's logs are kept in {kept}")
        raise


def run_bench(events: int, workers: int, query_events: int,
              progress: Progress = lambda _message: None,
              note: Progress | None = None, alert_samples: int = 5,
              otlp_traces: int = 2000) -> dict[str, Any]:
    """Run every measurement; ``progress`` gets status lines, ``note`` the caveats
    (why a figure is null, what a figure includes); ``otlp_traces`` traces per OTLP
    burst (:mod:`loopwatch.bench.otlp_burst`)."""
    from loopwatch.bench import otlp_burst  # it imports this module's helpers

    note = note or progress
    result: dict[str, Any] = dict.fromkeys(KEYS)
    result["query_latency_s"], result["workers"] = {}, {"1": None, "2": None}
    result["machine"] = machine()
    settings = load_settings()
    topic = settings.events_topic
    with tempfile.TemporaryDirectory(prefix="loopwatch-bench-") as tmp, \
            logs_kept_on_failure(Path(tmp), note):
        root = Path(tmp)
        with EmbeddedBroker(root / "broker.log") as broker:
            bootstrap = broker.bootstrap
            ensure_topics(bootstrap, settings)
            env = {**BASE_ENV, "LOOPWATCH_KAFKA_BOOTSTRAP": bootstrap}

            progress(f"generating {events} events")
            generated = generate_events(events, seed=7, end=datetime.now(UTC)
                                        - timedelta(minutes=1))
            progress("emitting through the SDK")
            result["emitter_baseline_events_per_s"], sent = emit_all(
                bootstrap, generated, root / "spool")
            progress("emitting through the SDK, spool on")
            ensure_topics(bootstrap, settings.model_copy(update={"events_topic": SPOOL_TOPIC}))
            result["emitter_events_per_s"], _ = emit_all(
                bootstrap, generated, root / "spool-on", SPOOL_TOPIC, write_ahead=True)
            result["emitter_spool_ratio"] = (result["emitter_events_per_s"]
                                             / result["emitter_baseline_events_per_s"])
            shutil.rmtree(root / "spool-on", ignore_errors=True)
            del generated
            result["events"] = sent
            progress(f"emitter: {result['emitter_events_per_s']:.0f} events/s spool on, "
                     f"{result['emitter_baseline_events_per_s']:.0f} off; raw consumer")
            raw_before = raw_consume(bootstrap, topic, sent)
            progress(f"raw consumer: {raw_before:.0f} events/s")

            # -- one processor, on a store pre-filled for the queries
            data_one = root / "w1"
            baseline = 0
            if query_events > 0:
                progress(f"bulk-loading {query_events} events into the store (child process)")
                baseline = bulk_load(data_one, query_events, seed=11)
            progress("starting loopwatch up (1 worker)")
            with UpProcess(data_one, {**env, **THROUGHPUT_ENV}) as up:
                pid = _pid(up)
                measured = measure_processing(up, baseline, baseline + sent, progress,
                                              partial(CpuSample.take, pid, broker.pid or 0))
                opened, closed = measured["opened"], measured["closed"]
                note(cpu_note(opened, closed, sent, measured["seconds"]))
                by_kind = cpu_by_kind(opened.threads, closed.threads, pid, sent)
                note(threads_note(by_kind))
                note(window_note("1 worker", measured, f"up pid {pid}"))
                note("1 worker " + log_signals(data_one / "logs"))
                result["pipeline_events_per_s"] = measured["rate"]
                result["workers"]["1"] = measured["rate"]
                hwm = _proc_status(pid, "VmHWM")
                result["processor_peak_rss_mb"] = None if hwm is None else hwm / 2**20
                total = _stored(up, exact=False)
                result["stored_bytes_per_event"] = stored_bytes(up) / max(total, 1)
                note("stored bytes per event, biggest columns: "
                     + stored_bytes_breakdown(up, total))
                progress("query latency")
                result["query_latency_s"] = query_latencies(up)
            raw_after = raw_consume(bootstrap, topic, sent)
            result["raw_consume_bracket"] = [raw_before, raw_after]
            raw = result["raw_consume_events_per_s"] = (raw_before + raw_after) / 2
            note(f"raw consumer: {raw_before / 1e3:.1f}k events/s before the 1-worker run, "
                 f"{raw_after / 1e3:.1f}k after it; the baseline is their mean")
            result["ratio"] = result["pipeline_events_per_s"] / raw
            result["ratio_at_poll"] = measured["poll_rate"] / raw
            note(f"1 worker: {measured['poll_rate'] / 1e3:.1f}k events/s with the window "
                 f"closed at the poll that saw every event (ratio "
                 f"{result['ratio_at_poll']:.3f}) instead of at the last insert")
            cores = os.cpu_count() or 1
            per_event = 1e6 / max(sent, 1)
            broker_us = (closed.broker - opened.broker) * per_event
            note(ceiling_note((closed.up[1] - opened.up[1]) * per_event + broker_us, raw,
                              cores))
            result["cpu_budget"] = cpu_budget(by_kind, broker_us, raw, cores)
            note(budget_note(result["cpu_budget"]))

            # -- two processors: a store filled as the first one's (merges with what a store
            # holds cost ClickHouse about twice as much), a group and a topic of their own;
            # the topic gets the messages once both are in the group, so that the window
            # holds no rebalance (the issue leaves group joins out), while both are stopped
            # (SIGSTOP), so that the copy neither starts them early nor takes their CPU
            if workers >= 2:
                if workers > 2:
                    note("only 1 and 2 workers are measured (2 cores)")
                data_two = root / "w2"
                group_two, topic_two = "loopwatch-bench-w2", "bench.w2"
                env_two = {**env, **THROUGHPUT_ENV, "LOOPWATCH_CONSUMER_GROUP": group_two,
                           "LOOPWATCH_EVENTS_TOPIC": topic_two}
                ensure_topics(bootstrap, settings.model_copy(update={"events_topic": topic_two}))
                messages = read_topic(bootstrap, topic)
                baseline_two = 0
                if query_events > 0:
                    progress(f"bulk-loading the same {query_events} events into the second "
                             "store")
                    baseline_two = bulk_load(data_two, query_events, seed=11)
                progress("starting loopwatch up + loopwatch worker (2 workers)")
                with UpProcess(data_two, env_two) as up:
                    extra = _worker(env_two, data_two)
                    try:
                        progress("waiting for both workers to join their group")
                        wait_group_stable(bootstrap, group_two, 2)
                        progress(f"copying the {len(messages)} messages to {topic_two}")
                        with stopped([_pid(up), extra.pid]):
                            copy_s = _timed(partial(write_topic, bootstrap, topic_two, messages))
                        del messages
                        measured = measure_processing(
                            up, baseline_two, baseline_two + sent, progress,
                            partial(CpuSample.take, _pid(up), broker.pid or 0, extra.pid))
                    finally:
                        terminate(extra, 60)
                result["workers"]["2"] = measured["rate"]
                note("2 workers " + log_signals(data_two / "logs"))
                opened, closed = measured["opened"], measured["closed"]
                note("2 workers, up: " + threads_note(
                    cpu_by_kind(opened.threads, closed.threads, _pid(up), sent)))
                note("2 workers, worker: " + threads_note(cpu_by_kind(
                    opened.worker_threads, closed.worker_threads, extra.pid, sent)))
                note(window_note("2 workers", measured,
                                 "both joined their group before any message was in their "
                                 f"topic, and were stopped while it was filled ({copy_s:.1f}s); "
                                 "a store filled as the first one's"))
            else:
                note("workers['2'] is null: run with --workers 2 to measure it")

            # -- open-run memory and alert latency: their own up, topic and group
            progress("open-run memory and alert latency (own up, detect interval 1 s)")
            env_alert = {**env, "LOOPWATCH_EVENTS_TOPIC": "bench.alerts",
                         "LOOPWATCH_CONSUMER_GROUP": "loopwatch-bench-alerts",
                         "LOOPWATCH_DETECT_INTERVAL_S": "1"}
            with UpProcess(root / "alerts", env_alert) as up, \
                    Emitter(bootstrap, topic="bench.alerts", spool_dir=root / "spool2") as emitter:
                open_runs = min(40_000, max(2_000, events // 10))
                memory_group = "loopwatch-bench-memory"
                worker = _worker({**env_alert, "LOOPWATCH_CONSUMER_GROUP": memory_group},
                                 root / "alerts")
                check = partial(_still_running, worker, root / "alerts" / "logs")
                try:
                    _wait_lag_zero(bootstrap, memory_group, "bench.alerts", check=check)
                    growth = open_run_memory(emitter, open_runs, MEMORY_ROUNDS, {
                        "up": (_pid(up), env_alert["LOOPWATCH_CONSUMER_GROUP"]),
                        "worker": (worker.pid, memory_group)}, check)
                finally:
                    terminate(worker, 60)
                result["memory_per_open_run_bytes"] = heap_per_open_run(open_runs)

                def rounds(name: str) -> str:
                    return ", ".join(f"{value:.0f}" for value in growth[name]["rounds"])

                note(f"memory per open run: {result['memory_per_open_run_bytes']:.0f} B of "
                     f"Python heap (tracemalloc, {open_runs} runs). VmRSS of a "
                     f"`loopwatch worker` (the processor "
                     f"alone, own consumer group, writing through the store service) after "
                     f"each of {MEMORY_ROUNDS} batches of {open_runs} run.start without an "
                     f"end: {growth['worker']['slope']:.0f} B per open run (least squares "
                     f"over batches 2-{MEMORY_ROUNDS}); growth per run of each batch "
                     f"{rounds('worker')} B. The `up` child, which also hosts chdb and its "
                     f"share of the rows: {growth['up']['slope']:.0f} B ({rounds('up')} B)")
                latencies = alert_latencies(up, emitter, alert_samples)
            note("memory and alert phase " + log_signals(root / "alerts" / "logs"))
            if latencies:
                result["alert_latency_p50_s"] = statistics.median(latencies)
                result["alert_latency_p95_s"] = _percentile(latencies, 0.95)
                note(f"alert latency: {len(latencies)}/{alert_samples} samples: "
                     + ", ".join(f"{value:.2f}" for value in latencies))
            else:
                note("alert latency is null: no stuck_run alert fired within 30 s")

            # -- OTLP ingest end to end: its own up, topic and group
            result.update(otlp_burst.bench_figures(bootstrap, root / "otlp", env, otlp_traces,
                                                   progress, note))
    return result
