"""Send imported events and return only when every one is stored or dead-lettered.

Where they go: a running ``loopwatch up`` on the data dir (its broker and store
service); else, with the embedded store, a ``loopwatch up`` started for the import and
stopped (drained) after it; else the configured Kafka and ClickHouse, whose processors
are assumed to run elsewhere.

Sending is synchronous (``Emitter.send_and_wait``) in batches, so a huge file never
sits in memory and a broker failure is known at once. Then the store is polled by
event id until each event is in ``events`` or its id shows up in a dead letter.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kafka.errors import KafkaError

from loopwatch.core.config import Settings
from loopwatch.ingest.events import EventBase
from loopwatch.ingest.importers.records import Bad, Record
from loopwatch.ingest.sdk import Emitter
from loopwatch.store.reader import Reader, ServiceReader, running_service

SEND_BATCH = 1000
CHECK_CHUNK = 2000
STORED_SQL = ("SELECT toString(event_id) FROM events "
              "WHERE event_id IN {ids:Array(UUID)} GROUP BY event_id")
DEAD_SQL = ("SELECT payload FROM dead_letters "
            "WHERE received_at >= {since:DateTime64(3, 'UTC')}")


class ImportFailed(RuntimeError):
    """The import could not finish (broker down, store never caught up)."""


@dataclass
class Target:
    bootstrap: str
    topic: str
    reader: Reader
    how: str


@dataclass
class Summary:
    records: int = 0
    events: int = 0
    stored: int = 0
    dead_lettered: int = 0
    bad: list[Bad] = field(default_factory=list)


@contextmanager
def open_target(settings: Settings, log: Callable[[str], None]) -> Iterator[Target]:
    """The pipeline to import into; starts (and then drains and stops) one if needed."""
    announced = running_service(settings)
    if announced is not None:
        yield Target(announced["kafka_bootstrap"], announced["events_topic"],
                     ServiceReader(announced["url"]), "the running loopwatch up")
        return
    if settings.embedded_store:
        from loopwatch.upprocess import UpProcess

        log(f"no loopwatch up on {settings.data_dir}; starting one for the import")
        with UpProcess(settings.data_dir) as up:
            yield Target(up.info["kafka_bootstrap"], up.info["events_topic"], up.reader,
                         "a loopwatch up started for the import")
        return
    if settings.kafka_bootstrap is None:
        raise ImportFailed("set LOOPWATCH_KAFKA_BOOTSTRAP (a ClickHouse server is "
                           "configured, so the import needs its Kafka too)")
    from loopwatch.store.reader import open_reader

    yield Target(settings.kafka_bootstrap, settings.events_topic, open_reader(settings),
                 "the configured Kafka and ClickHouse")


class Delivery:
    """Sends records' events in batches; remembers their ids to check them later."""

    def __init__(self, settings: Settings, target: Target, timeout_s: float = 30.0) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.emitter = Emitter(target.bootstrap, target.topic,
                               settings.spool_dir / "import",
                               max_message_bytes=max(1024, settings.max_message_bytes - 4096))
        self.ids: dict[uuid.UUID, None] = {}
        self.started = datetime.now(UTC)
        self._batch: list[EventBase] = []

    def add(self, events: Iterable[EventBase]) -> None:
        for event in events:
            self.ids[event.event_id] = None
            self._batch.append(event)
        if len(self._batch) >= SEND_BATCH:
            self.flush()

    def flush(self) -> None:
        if not self._batch:
            return
        for attempt in range(5):
            try:
                self.emitter.send_and_wait(self._batch, self.timeout_s)
                break
            except KafkaError as exc:
                if attempt == 4:
                    raise ImportFailed(f"the broker did not take the events: {exc}") from exc
                time.sleep(1.0 + attempt)
        self._batch = []

    def close(self) -> None:
        self.emitter.close(timeout_s=5)

    def wait_stored(self, timeout_s: float, progress: Callable[[int], None] | None = None,
                    interval_s: float = 0.5) -> tuple[int, int]:
        """Poll until every sent event is stored or dead-lettered: (stored, dead)."""
        missing = [str(event_id) for event_id in self.ids]
        total = len(missing)
        deadline = time.monotonic() + timeout_s
        dead: set[str] = set()
        last_progress = time.monotonic()
        while True:
            before = len(missing)
            missing = self._still_missing(missing)
            if len(missing) < before:
                last_progress = time.monotonic()
            if missing and time.monotonic() - last_progress > 3 * interval_s + 2:
                dead = self._dead_lettered(missing)
            if progress is not None:
                progress(total - len(missing) + len(dead))
            if len(missing) == len(dead):
                return total - len(missing), len(dead)
            if time.monotonic() > deadline:
                raise ImportFailed(
                    f"{len(missing) - len(dead)} of {total} events not stored after "
                    f"{timeout_s:.0f}s; are the processors running? (loopwatch dlq list)")
            time.sleep(interval_s)

    def _still_missing(self, missing: list[str]) -> list[str]:
        left: list[str] = []
        for start in range(0, len(missing), CHECK_CHUNK):
            chunk = missing[start:start + CHECK_CHUNK]
            rows = self.target.reader.query(STORED_SQL, {"ids": chunk}).rows
            found = {str(row[0]) for row in rows}
            left.extend(event_id for event_id in chunk if event_id not in found)
        return left

    def _dead_lettered(self, missing: list[str]) -> set[str]:
        since = self.started.strftime("%Y-%m-%d %H:%M:%S")
        rows = self.target.reader.query(DEAD_SQL, {"since": since}).rows
        payloads: list[Any] = [row[0] for row in rows]
        return {event_id for event_id in missing
                if any(event_id in str(payload) for payload in payloads)}


def deliver(records: Iterable[tuple[int, Record]], delivery: Delivery,
            on_bad: Callable[[Bad], None],
            on_read: Callable[[int], None] | None = None) -> Summary:
    """Send every good record, report and skip every bad one."""
    summary = Summary()
    for offset, record in records:
        summary.records += 1
        if isinstance(record, Bad):
            summary.bad.append(record)
            on_bad(record)
        else:
            summary.events += len(record.events)
            delivery.add(record.events)
        if on_read is not None:
            on_read(offset)
    delivery.flush()
    return summary
