"""A sink for processes that do not own the embedded store: rows go to the owner.

Delivery guarantee: the same as :class:`processors.sink.ClickHouseSink`. The call
returns only after the owner inserted the rows (its HTTP answer follows the inserts), so
a worker that acks its Kafka batch afterwards keeps "offsets after the store".

Wire format (``POST /admin/insert-batch``, one request per batch): for each table a
header line ``<table> <length>\\n`` followed by ``length`` bytes, the table's rows as
one JSON array (``JSONEachRow`` takes an array). orjson writes a whole table in one
call, times as RFC 3339 (ClickHouse's ``best_effort`` parsing reads the offset), and
the owner hands each part to ClickHouse as is: no JSON inside JSON, no re-encoding.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import orjson

from loopwatch.store.reader import QueryError, ServiceReader
from processors.sink import RowBatch, encode_rows

INSERT_PATH = "/admin/insert-batch"


def encode_batch(batch: RowBatch) -> bytes:
    """The request body for a whole batch (see the module docstring)."""
    parts: list[bytes] = []
    for table, rows in batch.tables.items():
        if rows:
            data = encode_rows(rows)
            parts += [f"{table} {len(data)}\n".encode(), data]
    return b"".join(parts)


def decode_batch(body: bytes) -> Iterator[tuple[str, memoryview]]:
    """(table, rows as a JSON array) for each part of an :func:`encode_batch` body."""
    view = memoryview(body)
    position = 0
    while position < len(body):
        end = body.index(b"\n", position)
        table, _, length = body[position:end].decode().partition(" ")
        start, position = end + 1, end + 1 + int(length)
        if position > len(body):
            raise ValueError("truncated insert batch")
        yield table, view[start:position]


class ServiceSink:
    def __init__(self, service: ServiceReader, timeout_s: float = 60.0) -> None:
        self._url = f"{service.url}{INSERT_PATH}"
        self._timeout_s = timeout_s

    def write_batch(self, batch: RowBatch) -> None:
        body = encode_batch(batch)
        if not body:
            return
        request = urllib.request.Request(
            self._url, data=body, headers={"Content-Type": "application/octet-stream"})
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            raise QueryError(orjson.loads(exc.read()).get("error", str(exc))) from exc
