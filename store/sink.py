"""Where derived rows go. A sink has one job: make a batch durable, or say it could not.

Commit order (the delivery guarantee of the whole pipeline): a batch's rows are written
through :meth:`Sink.write_batch`, its tables in :func:`write_order` (the raw events,
whose views write ``events``, ``llm_calls``, ``tool_calls`` and ``labels``, with the
other rows of events; then revisions; then ``runs``). Only when it returned are the
batch's state changelog records sent, only when the broker accepted them are the
batch's Kafka messages acknowledged, and faust commits acknowledged offsets later. A
crash anywhere before that re-delivers the batch; every table is keyed so that
re-writing a row is harmless (ReplacingMergeTree on ``event_id``, or on ``run_id``
with a version), so re-processing never double counts.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import orjson
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import DatabaseError, OperationalError

from loopwatch.store import tables
from loopwatch.store.letters import dead_letter_row, failure_reason, letter_id
from loopwatch.store.revisions import REVISIONS_TABLE, revise

log = logging.getLogger(__name__)


@dataclass
class RowBatch:
    """Rows per table, ready to insert."""

    tables: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))

    def add(self, table: str, row: dict[str, Any]) -> None:
        self.tables[table].append(row)

    def extend(self, other: RowBatch) -> None:
        for table, rows in other.tables.items():
            self.tables[table].extend(rows)

    def take_all_but(self, table: str) -> RowBatch:
        """Move every other table's rows out into a new batch.

        >>> batch = RowBatch()
        >>> batch.add("events", {"n": 1}); batch.add("runs", {"n": 2})
        >>> rest = batch.take_all_but("events")
        >>> dict(batch.tables), dict(rest.tables)
        ({'events': [{'n': 1}]}, {'runs': [{'n': 2}]})
        """
        rest = RowBatch()
        for name in [name for name in self.tables if name != table]:
            rest.tables[name] = self.tables.pop(name)
        return rest

    def __len__(self) -> int:
        return sum(len(rows) for rows in self.tables.values())


#: the tables a batch writes last, in this order: revisions of stored rows after the
#: rows they revise, and runs (whose state holds what was revised) after both
_LAST = (REVISIONS_TABLE, "runs")


def write_order(batch: RowBatch) -> list[str]:
    """The batch's tables in the order they are written (see :data:`_LAST`).

    >>> batch = RowBatch()
    >>> for table in ("runs", REVISIONS_TABLE, "llm_calls"): batch.add(table, {})
    >>> write_order(batch)
    ['llm_calls', 'agent_revisions', 'runs']
    """
    return sorted(batch.tables, key=lambda table: _LAST.index(table) + 1
                  if table in _LAST else 0)


class Sink(Protocol):
    def write_batch(self, batch: RowBatch) -> None:
        """Return only once every row is accepted; raise if any was not (nothing acked)."""


def _unencodable(value: Any) -> Any:
    raise TypeError(f"cannot store a {type(value).__name__}")


def encode_rows(rows: list[dict[str, Any]]) -> bytes:
    """A table's rows as one JSON array, which ``JSONEachRow`` reads (datetimes as RFC
    3339 and UUIDs natively by orjson; ``best_effort`` time parsing reads the offset)."""
    return orjson.dumps(rows, default=_unencodable)


DEAD_LETTERS_TABLE = tables.DEAD_LETTERS
#: what identifies a row in any table (its dedup key, or where its message was)
_ROW_IDENTITY = ("event_id", "run_id", "id", "version", "kafka_partition", "kafka_offset")


def unstorable_letter(table: str, row: dict[str, Any], exc: Exception) -> dict[str, Any]:
    """A ``dead_letters`` row for a row the insert cannot encode. Its id is derived from
    the row's key, so a redelivered batch rewrites the same letter."""
    key = ":".join([table, *(str(row.get(name, "")) for name in _ROW_IDENTITY)])
    payload = json.dumps(row, default=str, ensure_ascii=False).encode()
    return dead_letter_row(
        letter_id(key), f"sink:{table}", failure_reason(f"unstorable {table} row", exc),
        str(row.get("run_id") or ""), payload, datetime.now(UTC))


#: how ClickHouse reads :func:`encode_rows` output. ``optimize_on_insert`` off: every
#: reader deduplicates with ``FINAL`` anyway (a redelivered batch arrives in another
#: insert), so collapsing each block's duplicate keys at insert bought nothing and cost
#: ClickHouse's insert threads ~1.1 of their ~9.4 µs an event (bench's event mix).
#: ``input_format_parallel_parsing`` off and one insert thread: an insert of ~100k
#: events through the generated views parsed its JSON in 0.58 µs an event single-threaded
#: against 1.97 split across threads (issue #27; ``python -m loopwatch.bench.store_path``
#: measures both), and the processor's other core is the fold's
JSON_INSERT_SETTINGS = {"date_time_input_format": "best_effort", "optimize_on_insert": 0,
                        "input_format_parallel_parsing": 0, "max_insert_threads": 1}


#: ClickHouse errors that refuse a row's values (by name, as the store reports it);
#: any other failure of a single row (memory, disk, a missing table) is the store's
#: and is retried, never dead-lettered
DATA_ERRORS = frozenset({
    "TYPE_MISMATCH", "CANNOT_CONVERT_TYPE", "INCORRECT_DATA", "ARGUMENT_OUT_OF_BOUND",
    "VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE", "CANNOT_INSERT_NULL_IN_ORDINARY_COLUMN",
    "TOO_LARGE_STRING_SIZE", "TOO_LARGE_ARRAY_SIZE", "SIZES_OF_ARRAYS_DONT_MATCH",
    "BAD_ARGUMENTS", "ILLEGAL_TYPE_OF_ARGUMENT", "DECIMAL_OVERFLOW",
    "UNKNOWN_ELEMENT_OF_ENUM", "INCORRECT_NUMBER_OF_COLUMNS", "ILLEGAL_COLUMN",
    "NUMBER_OF_ARGUMENTS_DOESNT_MATCH", "TOO_DEEP_RECURSION"})


def refuses_data(exc: DatabaseError) -> bool:
    """Whether the store refused an insert for the values it holds.

    >>> refuses_data(DatabaseError("x", name="CANNOT_PARSE_UUID")), refuses_data(
    ...     DatabaseError("x", name="MEMORY_LIMIT_EXCEEDED")), refuses_data(DatabaseError("x"))
    (True, False, False)
    """
    name = exc.name or ""
    return name.startswith("CANNOT_PARSE") or name in DATA_ERRORS


def refused_letter(table: str, row: dict[str, Any], exc: Exception) -> dict[str, Any]:
    """A ``dead_letters`` row for a row ClickHouse refused (its reason is the store's
    error); keyed like :func:`unstorable_letter`, so a redelivery rewrites it."""
    key = ":".join([table, *(str(row.get(name, "")) for name in _ROW_IDENTITY)])
    return dead_letter_row(
        letter_id(key), f"sink:{table}", failure_reason(
            f"{table} row refused by the store ({getattr(exc, 'name', None) or 'error'})",
            exc),
        str(row.get("run_id") or ""), encode_rows([row])[1:-1], datetime.now(UTC))


class ClickHouseSink:
    """Inserts each table's rows in one statement. At-least-once; idempotent by keys.

    Rows travel as JSON (``JSONEachRow``): orjson writes a table in one call (~0.6 µs a
    row) and ClickHouse parses it in C++ with the GIL released, so on chdb the insert
    runs on another core while the processor folds the next chunk. clickhouse-connect's
    column-oriented insert serialised every value in Python under the GIL (8 µs per
    ``events`` row), which made the write the larger half of the processors' CPU.

    A row ClickHouse refuses (a value the views cannot convert, which validation
    should have refused) must not stall the pipeline behind a batch retried forever:
    an insert refused for its data is split in halves, each inserted again, down to the
    single rows refused, which become dead letters with the store's reason
    (:func:`refused_letter`), ~2 log2(n) inserts per such row. Rows of the halves that
    went in before are harmless to write again (every table dedups by its key). An
    insert that failed for want of the store (a connection, a timeout) is not split:
    it raises, and the batch is retried whole.
    """

    def __init__(self, client: Client,
                 insert_settings: dict[str, Any] | None = None) -> None:
        self._client = client
        #: how ClickHouse reads the inserts (the bench compares others)
        self._insert_settings = JSON_INSERT_SETTINGS if insert_settings is None \
            else insert_settings
        self.unstorable = 0
        self.refused = 0

    def write_batch(self, batch: RowBatch) -> None:
        for table in write_order(batch):
            rows = batch.tables[table]
            if rows:
                rows, data = self._encoded(table, rows)
                self._insert(table, rows, data)

    def _insert(self, table: str, rows: list[dict[str, Any]], data: bytes | None = None
                ) -> None:
        """Insert ``rows`` (``data``: already encoded), bisecting a refusal (see the class)."""
        try:
            self.write_json(table, encode_rows(rows) if data is None else data)
            return
        except OperationalError:
            raise
        except DatabaseError as exc:
            if table in (REVISIONS_TABLE, DEAD_LETTERS_TABLE):
                raise
            refusal = exc
        if len(rows) > 1:
            half = len(rows) // 2
            self._insert(table, rows[:half])
            self._insert(table, rows[half:])
            return
        if not refuses_data(refusal):  # the store's trouble, not the row's: retry it all
            raise refusal
        letter = refused_letter(table, rows[0], refusal)
        self.refused += 1
        log.error("the store refused a %s row (%s); dead-lettered", table, letter["reason"])
        self.write_json(DEAD_LETTERS_TABLE, encode_rows([letter]))

    def _encoded(self, table: str, rows: list[dict[str, Any]]
                 ) -> tuple[list[dict[str, Any]], bytes]:
        """The rows that can be encoded, and their encoding. A row that cannot be (a
        value no column takes, which validation should have refused) becomes a dead
        letter with the error, so that a retry of the batch is not a stall of every
        table. Raises only if the store refuses the letters."""
        try:
            return rows, encode_rows(rows)
        except (TypeError, ValueError):
            pass
        good: list[dict[str, Any]] = []
        letters: list[dict[str, Any]] = []
        for row in rows:
            try:
                encode_rows([row])
            except (TypeError, ValueError) as exc:
                letters.append(unstorable_letter(table, row, exc))
            else:
                good.append(row)
        if letters:
            self.unstorable += len(letters)
            log.error("%d %s rows cannot be stored (%s); dead-lettered", len(letters),
                      table, letters[0]["reason"])
            self.write_json(DEAD_LETTERS_TABLE, encode_rows(letters))
        return good, encode_rows(good)

    def write_encoded(self, table: str, data: bytes) -> None:
        """Insert rows another process encoded with :func:`encode_rows` (the store
        owner's insert endpoint for the extra workers), a refused row found and
        dead-lettered as in :meth:`write_batch`: only then are the rows decoded."""
        try:
            self.write_json(table, data)
        except OperationalError:
            raise
        except DatabaseError:
            if table in (REVISIONS_TABLE, DEAD_LETTERS_TABLE):
                raise
            rows = orjson.loads(data)
            if not rows:
                raise
            self._insert(table, rows)

    def write_json(self, table: str, data: bytes) -> None:
        """Insert rows already encoded by :func:`encode_rows` (revisions: apply them)."""
        if table == REVISIONS_TABLE:
            revise(self._client, orjson.loads(data))
            return
        self._client.raw_insert(table, insert_block=data, fmt="JSONEachRow",
                                settings=self._insert_settings)


class FaultInjectingSink:
    """Refuses writes while a marker file exists: how tests make ClickHouse "unavailable"
    to an in-process chdb store, which cannot be stopped on its own. Enabled only by
    ``LOOPWATCH_FAULT_SINK_FILE``; never in normal operation."""

    def __init__(self, inner: Sink, marker: Path) -> None:
        self._inner = inner
        self._marker = marker

    def write_batch(self, batch: RowBatch) -> None:
        if self._marker.exists():
            raise ConnectionError(f"store unavailable (fault injected by {self._marker})")
        self._inner.write_batch(batch)


class RetriesStopped(Exception):
    """A write that failed while the processor stops: it is not retried, and its batch
    stays unacknowledged, so the next processor reads the batch again."""


class RetryingSink:
    """Blocks until the inner sink accepts the batch: the pipeline's backpressure.

    While the store is down the processor simply stops here, nothing is acked, and
    Kafka keeps the backlog; when the store returns, the same batch is written. Once
    :meth:`stop_retrying` was called a failed write raises :class:`RetriesStopped`
    instead, so that stopping during an outage does not wait for the store.
    """

    def __init__(self, inner: Sink, retry_s: float) -> None:
        self._inner = inner
        self._retry_s = retry_s
        self._stopping = threading.Event()
        self.failures = 0

    def stop_retrying(self) -> None:
        """The processor is stopping: a write waiting to retry gives up now, and so
        does any later write that fails."""
        self._stopping.set()

    def write_batch(self, batch: RowBatch) -> None:
        while True:
            try:
                self._inner.write_batch(batch)
                return
            except Exception as exc:
                self.failures += 1
                log.warning("store rejected a batch of %d rows (%s); retrying", len(batch), exc)
                if self._stopping.wait(self._retry_s):
                    raise RetriesStopped(f"a batch of {len(batch)} rows was not stored "
                                         f"({exc})") from exc
