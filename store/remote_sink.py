"""A sink for processes that do not own the embedded store: rows go to the owner.

Delivery guarantee: the same as :class:`loopwatch.store.sink.ClickHouseSink`. The call
returns only after the owner inserted the rows (its HTTP answer follows the inserts), so
a worker that acks its Kafka batch afterwards keeps "offsets after the store".

Wire format (``POST /admin/insert-batch``, one request per batch): for each table a
header line ``<table> <length>\\n`` followed by ``length`` bytes, the table's rows as
one JSON array (``JSONEachRow`` takes an array). orjson writes a whole table in one
call, times as RFC 3339 (ClickHouse's ``best_effort`` parsing reads the offset), and
the owner hands each part to ClickHouse as is: no JSON inside JSON, no re-encoding.
"""

from __future__ import annotations

from collections.abc import Iterator

from loopwatch.store.reader import ServiceReader
from loopwatch.store.sink import RowBatch, encode_rows, write_order

INSERT_PATH = "/admin/insert-batch"


def encode_batch(batch: RowBatch) -> bytes:
    """The request body for a whole batch (see the module docstring)."""
    parts: list[bytes] = []
    for table in write_order(batch):
        rows = batch.tables[table]
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
    """Writes through the owner's store service; follows it to a new address as its
    ``ServiceReader`` does (``follow``)."""

    def __init__(self, service: ServiceReader) -> None:
        self._service = service

    def write_batch(self, batch: RowBatch) -> None:
        body = encode_batch(batch)
        if body:
            self._service.send(INSERT_PATH, body, "application/octet-stream")
