"""End-to-end confirmation: which sent messages the pipeline's consumer group committed.

The embedded broker keeps everything in memory, so its acknowledgement says only that
the message is in a process that may die. The processors commit a message's offset
only after ClickHouse accepted its rows, so "the group committed past it" is the end
of the emitter's responsibility: then its spool records may go (:meth:`DiskSpool.confirm`).

One thread polls the group's committed offsets (``list_group_offsets``, one small
request) every ``interval_s`` while anything acknowledged waits for confirmation. It
also watches for a broker that lost what it held, and then reports it (``on_lost``)
so the emitter resends every record not yet confirmed:

- the broker's incarnation in ``<data_dir>/broker.json`` changed (``loopwatch up``
  restarted the broker);
- or the group's committed offset of a partition went back (a broker restarted with
  no record to say so, e.g. with ``confirm="pipeline"`` and an explicit bootstrap).
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kafka import TopicPartition
from kafka.admin import KafkaAdminClient

from loopwatch.ingest.spool import DiskSpool

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Tracked:
    """One Kafka message on its way: where its records are kept, to confirm or resend
    them. ``segment`` None: its records are only in memory (``lines``, with ``reserved``
    bytes held in the spool for them) until the broker acknowledges it."""

    records: int
    segment: int | None = None
    generation: int = 0
    lines: list[bytes] | None = None
    reserved: int = 0
    capture: bool = False
    carried: tuple[str, ...] = ()
    resend: bool = False


class Confirmations:
    """Acknowledged messages waiting for the group's commit; see the module doc."""

    def __init__(self, spool: DiskSpool, bootstrap: Callable[[], str | None],
                 group: Callable[[], str | None], incarnation: Callable[[], str | None],
                 on_lost: Callable[[str], None], interval_s: float = 1.0,
                 admin_config: dict[str, Any] | None = None) -> None:
        self.spool = spool
        self.confirmed = 0
        self.polls = 0
        self.losses = 0
        self._bootstrap = bootstrap
        self._group = group
        self._incarnation_of = incarnation
        self._on_lost = on_lost
        self._interval_s = interval_s
        self._admin_config = {"request_timeout_ms": 5000, **(admin_config or {})}
        self._admin: KafkaAdminClient | None = None
        self._admin_for: str | None = None
        self._pending: dict[tuple[str, int], list[tuple[int, Tracked]]] = defaultdict(list)
        self._seen: dict[tuple[str, int], int] = {}
        self._incarnation = incarnation()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loopwatch-confirm",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        self._close_admin()

    def acked(self, topic: str, partition: int, offset: int, tracked: Tracked) -> None:
        """The broker acknowledged ``tracked`` at ``offset`` (called on kafka-python's
        I/O thread)."""
        with self._lock:
            self._pending[(topic, partition)].append((offset, tracked))

    def waiting(self) -> int:
        """Messages acknowledged and not yet confirmed."""
        with self._lock:
            return sum(len(entries) for entries in self._pending.values())

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.poll()
            except Exception:  # the thread must outlive it: nothing else confirms
                log.exception("confirming sent events failed; trying again")
                self._close_admin()

    def poll(self) -> int:
        """One round: watch the incarnation, read the committed offsets, confirm what
        they passed. Returns how many records were confirmed."""
        if self._incarnation_changed():
            return 0
        group = self._group()
        with self._lock:
            partitions = [key for key, entries in self._pending.items() if entries]
        if not partitions or group is None:
            return 0
        admin = self._admin_client()
        if admin is None:
            return 0
        wanted = [TopicPartition(topic, partition) for topic, partition in partitions]
        try:
            offsets = admin.list_group_offsets({group: wanted}).get(group, {})
        except Exception as exc:  # kafka-python raises KafkaError and OSError subclasses
            log.debug("committed offsets unavailable (%s)", exc)
            self._close_admin()
            return 0
        self.polls += 1
        if self._incarnation_changed():
            return 0
        ready: list[tuple[int, Tracked]] = []
        lost = ""
        with self._lock:
            for tp, committed_at in offsets.items():
                key, committed = (tp.topic, tp.partition), int(committed_at.offset)
                seen = self._seen.get(key)
                if seen is not None and committed < seen:
                    lost = f"committed offset of {tp.topic}[{tp.partition}] went back " \
                           f"from {seen} to {committed}"
                    break
                if committed < 0:
                    continue
                self._seen[key] = committed
                kept: list[tuple[int, Tracked]] = []
                for offset, tracked in self._pending.get(key, []):
                    (ready if offset < committed else kept).append((offset, tracked))
                self._pending[key] = kept
        if lost:
            self._lose(lost)
            return 0
        confirmed = 0
        for _, tracked in ready:
            assert tracked.segment is not None
            if self.spool.confirm(tracked.segment, tracked.generation, tracked.records):
                confirmed += tracked.records
        self.confirmed += confirmed
        return confirmed

    def _incarnation_changed(self) -> bool:
        now = self._incarnation_of()
        if now is None or now == self._incarnation:
            return False
        before, self._incarnation = self._incarnation, now
        if before is None:
            return False
        self._lose(f"the broker was restarted (incarnation {before} -> {now})")
        return True

    def _lose(self, reason: str) -> None:
        with self._lock:
            self._pending.clear()
            self._seen.clear()
        self.losses += 1
        log.warning("%s: resending every event the pipeline has not confirmed", reason)
        self._close_admin()
        self._on_lost(reason)

    def _admin_client(self) -> KafkaAdminClient | None:
        bootstrap = self._bootstrap()
        if bootstrap is None:
            return None
        if self._admin is not None and self._admin_for == bootstrap:
            return self._admin
        self._close_admin()
        try:
            self._admin = KafkaAdminClient(bootstrap_servers=bootstrap.split(","),
                                           **self._admin_config)
        except Exception as exc:
            log.debug("admin client unavailable (%s)", exc)
            return None
        self._admin_for = bootstrap
        return self._admin

    def _close_admin(self) -> None:
        admin, self._admin = self._admin, None
        if admin is not None:
            try:
                admin.close()
            except Exception:
                log.debug("closing the admin client failed", exc_info=True)
