"""A sink for processes that do not own the embedded store: rows go to the owner.

Delivery guarantee: the same as :class:`processors.sink.ClickHouseSink`. The call
returns only after the owner inserted the rows (its HTTP answer follows the insert), so
a worker that acks its Kafka batch afterwards keeps "offsets after the store".
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

import orjson

from loopwatch.store.clickhouse import clickhouse_time
from loopwatch.store.reader import ServiceReader
from processors.sink import RowBatch


def _json_value(value: Any) -> Any:
    if isinstance(value, datetime):
        return clickhouse_time(value)
    if isinstance(value, uuid.UUID):
        return str(value)
    raise TypeError(f"cannot send {type(value).__name__}")


def encode_rows(rows: list[dict[str, Any]]) -> str:
    """JSONEachRow, with times as ClickHouse parses them."""
    return "\n".join(orjson.dumps(row, default=_json_value).decode() for row in rows)


class ServiceSink:
    def __init__(self, service: ServiceReader) -> None:
        self._service = service

    def write_batch(self, batch: RowBatch) -> None:
        for table, rows in batch.tables.items():
            if rows:
                self._service.post("/admin/insert", {"table": table, "rows": encode_rows(rows)})
