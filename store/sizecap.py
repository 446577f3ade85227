"""A cap on the embedded store's size (``data_dir_max_bytes``): oldest data dropped first.

TTLs (:mod:`loopwatch.store.retention`) bound data by age; this bounds it by bytes, for
a laptop or a small VM whose disk would otherwise fill. When chdb's directory is over
the cap, :func:`enforce_size_cap` drops whole monthly partitions of the large,
month-partitioned tables (:data:`CAPPED_TABLES`), oldest month first across all of
them, until the bytes dropped cover the excess. The newest month is never dropped (a cap
too small for one month of data is reported, not obeyed). Every drop is logged as a
warning and recorded in ``pipeline_gauges`` (``size_cap_dropped_partitions``,
``size_cap_dropped_bytes``). ``loopwatch up`` runs it every :data:`CHECK_EVERY_S`.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from clickhouse_connect.driver.client import Client

from loopwatch.core.config import Settings

log = logging.getLogger(__name__)

#: The tables that hold the bulk of the bytes, all ``PARTITION BY toYYYYMM(ts)``.
CAPPED_TABLES = ("events", "llm_calls", "tool_calls", "capture_parts")
CHECK_EVERY_S = 300.0


@dataclass
class SizeCapReport:
    cap_bytes: int | None
    size_bytes: int
    dropped: list[tuple[str, str, int, int]] = field(default_factory=list)
    """(table, partition YYYYMM, rows, bytes) per dropped partition, oldest first."""
    still_over: bool = False

    @property
    def dropped_bytes(self) -> int:
        return sum(entry[3] for entry in self.dropped)

    @property
    def dropped_rows(self) -> int:
        return sum(entry[2] for entry in self.dropped)


def directory_bytes(path: Path) -> int:
    """Bytes of every file under ``path`` (what the disk sees)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue  # a part removed by a merge while we looked
    return total


def _partitions(client: Client, database: str) -> list[tuple[str, str, int, int]]:
    """(table, partition, rows, bytes) of the active parts of the capped tables."""
    rows = client.query(
        "SELECT table, partition_id, sum(rows), sum(bytes_on_disk) FROM system.parts "
        "WHERE database = {d:String} AND active AND table IN {t:Array(String)} "
        "GROUP BY table, partition_id ORDER BY partition_id, table",
        parameters={"d": database, "t": list(CAPPED_TABLES)}).result_rows
    return [(str(t), str(p), int(r), int(b)) for t, p, r, b in rows]


def enforce_size_cap(settings: Settings, client: Client,
                     size_bytes: int | None = None) -> SizeCapReport:
    """Drop the oldest monthly partitions while the store is over the cap.

    ``size_bytes`` is the measured size (default: the chdb directory on disk). Dropped
    partitions' files are removed by ClickHouse shortly after, so the excess is covered
    by the dropped partitions' ``bytes_on_disk`` rather than by measuring again.
    """
    cap = settings.data_dir_max_bytes
    size = directory_bytes(settings.chdb_path) if size_bytes is None else size_bytes
    report = SizeCapReport(cap, size)
    if cap is None or size <= cap or not settings.embedded_store:
        return report
    parts = _partitions(client, settings.database)
    months = sorted({partition for _t, partition, _r, _b in parts})
    excess = size - cap
    for month in months[:-1]:  # never the newest month
        if report.dropped_bytes >= excess:
            break
        for table, partition, rows, size_on_disk in parts:
            if partition != month:
                continue
            client.command(f"ALTER TABLE {settings.database}.{table} "
                           f"DROP PARTITION ID '{partition}'")
            report.dropped.append((table, partition, rows, size_on_disk))
    report.still_over = report.dropped_bytes < excess
    if report.dropped:
        log.warning(
            "data dir over its cap (%d > %d bytes): dropped the oldest partitions %s "
            "(%d rows, %d bytes)", size, cap,
            ", ".join(f"{table} {partition}" for table, partition, _r, _b in report.dropped),
            report.dropped_rows, report.dropped_bytes)
        now = datetime.now(UTC)
        client.insert(f"{settings.database}.pipeline_gauges",
                      [[now, "size_cap_dropped_partitions", float(len(report.dropped))],
                       [now, "size_cap_dropped_bytes", float(report.dropped_bytes)]],
                      column_names=["ts", "name", "value"])
    if report.still_over:
        log.warning("data dir still over its cap (%d > %d bytes) with only the newest "
                    "month left in %s; raise data_dir_max_bytes or shorten retention",
                    size - report.dropped_bytes, cap, ", ".join(CAPPED_TABLES))
    return report


def start_size_cap(settings: Settings, client: Client, stop: threading.Event,
                   every_s: float = CHECK_EVERY_S) -> threading.Thread | None:
    """Check the cap now and every ``every_s`` until ``stop`` (no cap: no thread)."""
    if settings.data_dir_max_bytes is None or not settings.embedded_store:
        return None

    def loop() -> None:
        while True:
            try:
                enforce_size_cap(settings, client)
            except Exception as exc:
                log.warning("size cap check failed: %s", exc)
            if stop.wait(every_s):
                return

    thread = threading.Thread(target=loop, name="size-cap", daemon=True)
    thread.start()
    return thread


def storage_report(client: Client, database: str, top: int = 8) -> dict[str, Any]:
    """Compressed bytes of the store's active parts and its biggest columns: what the
    bench reports per event. System tables are out of user SQL's reach (the guard), so
    this is one of the store service's owner-only admin actions."""
    total = client.query(
        "SELECT sum(data_compressed_bytes) FROM system.parts "
        "WHERE database = {database:String} AND active",
        parameters={"database": database}).result_rows[0][0]
    columns = client.query(
        "SELECT table, name, sum(data_compressed_bytes) AS bytes FROM system.columns "
        "WHERE database = {database:String} GROUP BY table, name ORDER BY bytes DESC "
        "LIMIT {top:UInt32}", parameters={"database": database, "top": top}).result_rows
    return {"compressed_bytes": int(total or 0),
            "columns": [[table, name, int(size)] for table, name, size in columns]}
