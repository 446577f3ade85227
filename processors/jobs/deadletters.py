"""Dead letters: list them, and re-submit them after a fix (``loopwatch dlq``).

Replaying sends each payload back to the topic it came from (the events topic, or the
captures topic for a refused capture message) and records ``replayed_at`` on
its row (a new version of it) once the broker took it. A letter whose payload was cut
(a message larger than any letter keeps) is left alone: its payload is not the message.
If the payload is still bad it returns as a new dead letter with a new source, so
nothing is lost either way. Replaying writes, so in the
embedded default it runs inside the process that owns the store.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

import orjson
from clickhouse_connect.driver.client import Client
from kafka import KafkaProducer
from kafka.errors import KafkaError

from loopwatch.core.config import Settings
from loopwatch.ingest.sdk import partition_for
from loopwatch.processors.deadletter import CUT_MARK
from loopwatch.store import tables
from loopwatch.store.clickhouse import QueryResult, connect, run_query
from loopwatch.store.reader import Reader, ServiceReader, running_service

log = logging.getLogger(__name__)

LIST_SQL = """
SELECT id, received_at, reason, source, run_id, substring(payload, 1, 160) AS payload,
       replayed_at
FROM dead_letters FINAL ORDER BY received_at DESC, id LIMIT {limit:UInt32}
"""
#: a letter whose payload was cut (processors/deadletter.py) is not replayed: its payload
#: is no longer the message
PENDING_SQL = """
SELECT id, received_at, source, reason, run_id, payload, version
FROM dead_letters FINAL
WHERE replayed_at IS NULL AND position(reason, {cut_mark:String}) = 0
ORDER BY received_at, id
"""


def list_dead_letters(reader: Reader, limit: int) -> QueryResult:
    return reader.query(LIST_SQL, {"limit": limit})


def _partition(payload: str, partitions: int) -> int:
    try:
        run_id = orjson.loads(payload).get("run_id", "")
    except (orjson.JSONDecodeError, AttributeError):
        return 0
    return partition_for(str(run_id), partitions) if run_id else 0


def source_topic(source: str, settings: Settings) -> str:
    """Where a dead letter goes back to: captures came from the captures topic.

    >>> source_topic("loopwatch.captures:3:17:0", Settings())
    'loopwatch.captures'
    >>> source_topic("loopwatch.events:0:5:2", Settings())
    'loopwatch.events'
    """
    topic = source.split(":", 1)[0]
    return settings.captures_topic if topic == settings.captures_topic else settings.events_topic


def replay_pending(client: Client, bootstrap: str, settings: Settings) -> int:
    """Send every not-yet-replayed dead letter back to its topic; mark those the broker
    took replayed (the others stay pending, logged, for the next replay). Returns how
    many were replayed."""
    letters = run_query(client, PENDING_SQL, {"cut_mark": CUT_MARK}).records()
    if not letters:
        return 0
    producer = KafkaProducer(bootstrap_servers=bootstrap.split(","), acks="all",
                             max_request_size=settings.broker_max_message_bytes)
    sent = []
    try:
        for letter in letters:
            topic = source_topic(letter["source"], settings)
            partitions = len(producer.partitions_for(topic) or {0})
            try:
                sent.append((letter, producer.send(
                    topic, value=letter["payload"].encode(),
                    partition=_partition(letter["payload"], partitions))))
            except KafkaError as exc:
                log.error("dead letter %s was not replayed: %r", letter["id"], exc)
        producer.flush(timeout=30)
    finally:
        producer.close(timeout=5)
    pending = []
    for letter, future in sent:
        if future.succeeded():
            pending.append(letter)
        else:
            log.error("dead letter %s was not replayed: %r", letter["id"], future.exception)
    if not pending:
        return 0
    now = datetime.now(UTC)
    columns = ["id", "received_at", "source", "reason", "run_id", "payload", "replayed_at",
               "version"]
    client.insert(tables.DEAD_LETTERS, [
        [row["id"], row["received_at"], row["source"], row["reason"], row["run_id"],
         row["payload"], now, row["version"] + 1]
        for row in pending
    ], column_names=columns)
    return len(pending)


def replay_dead_letters(settings: Settings) -> int:
    announced = running_service(settings)
    if announced is not None:
        result: dict[str, Any] = ServiceReader(announced["url"]).post("/admin/dlq-replay", {})
        return int(result["replayed"])
    if settings.kafka_bootstrap is None:
        raise RuntimeError("dlq replay needs a broker: start `loopwatch up` on this data dir, "
                           "or set LOOPWATCH_KAFKA_BOOTSTRAP")
    return replay_pending(connect(settings), settings.kafka_bootstrap, settings)
