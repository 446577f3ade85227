"""The processors' writes to Kafka are never retried forever (issue 24 §4): a record
refused for good is reduced (a dead letter without its payload) or, when nothing
smaller is left, dropped and counted, while the rest of the write is delivered; a run
state larger than a record may hold is never sent.

The refusal is real: an aiokafka producer (the client faust uses) whose
``max_request_size`` is below the letter refuses it with ``MessageSizeTooLargeError``,
as the processors' producer refused a 10 MB letter on the session's Tansu broker.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

import orjson
from aiokafka import AIOKafkaProducer
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic

from loopwatch.ingest.sdk import partition_for
from loopwatch.processors.deadletter import DeadLetterRecord, bounded
from loopwatch.processors.kafka_writes import KafkaWrites
from tests.conftest import PIPELINE_ENV, wait_for

PRODUCER_LIMIT = 64 * 1024


def new_topic(bootstrap: str) -> str:
    topic = f"writes-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, 1, 1)])
    admin.close()
    return topic


def deliver(bootstrap: str, topic: str, writes: KafkaWrites,
            letters: list[DeadLetterRecord]) -> None:
    """Deliver ``letters`` as the processors do (``Processor._publish`` sends through
    faust's aiokafka producer), reducing a refused one to no payload."""

    async def run() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap,
                                    max_request_size=PRODUCER_LIMIT)
        await producer.start()

        async def send(pending: Sequence[DeadLetterRecord]) -> list[BaseException | None]:
            outcomes: list[BaseException | None] = []
            for letter in pending:
                try:
                    await producer.send_and_wait(topic, letter.payload,
                                                 key=letter.letter_id.encode(),
                                                 headers=letter.headers())
                    outcomes.append(None)
                except Exception as exc:
                    outcomes.append(exc)
            return outcomes

        try:
            await asyncio.wait_for(writes.deliver(
                f"{len(letters)} dead letters", letters, send,
                lambda letter, exc: letter.without_payload()), 60)
        finally:
            await producer.stop()

    asyncio.run(run())


def letters_on(bootstrap: str, topic: str) -> list[Any]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, consumer_timeout_ms=5000)
    partition = TopicPartition(topic, 0)
    consumer.assign([partition])
    consumer.seek_to_beginning(partition)
    records = list(consumer)
    consumer.close()
    return records


def test_a_letter_the_producer_refuses_is_sent_without_its_payload(broker):
    topic = new_topic(broker.bootstrap)
    small = bounded("small", "t:0:1:0", "malformed JSON", "", b"{oops", 1_000_000)
    large = bounded("large", "t:0:2:0", "oversized message", "", b"y" * 200_000, 100_000)
    writes = KafkaWrites(retry_s=0.1)
    deliver(broker.bootstrap, topic, writes, [small, large])
    records = {record.key: record for record in letters_on(broker.bootstrap, topic)}
    assert sorted(records) == [b"large", b"small"]
    assert records[b"small"].value == b"{oops"
    assert records[b"large"].value == b""
    headers = dict(records[b"large"].headers)
    assert (headers["loopwatch-payload-bytes"], headers["loopwatch-payload-sha256"],
            headers["loopwatch-payload-kept"]) == (b"200000", large.sha256.encode(), b"0")
    assert headers["loopwatch-reason"] == large.reason.encode()
    assert (writes.counters.retries, writes.counters.reduced, writes.counters.dropped) == (
        0, 1, 0)


def test_a_record_refused_even_when_reduced_is_dropped_and_counted(broker):
    """A letter whose headers alone exceed what the producer sends cannot be reduced
    further: it is dropped (its ``dead_letters`` row keeps it), counted, and the write
    ends instead of resending it every second."""
    topic = new_topic(broker.bootstrap)
    huge_source = "t:" + "s" * (PRODUCER_LIMIT * 2)
    letter = bounded("huge", huge_source, "oversized message", "", b"z" * 1000, 100_000)
    writes = KafkaWrites(retry_s=0.1)
    deliver(broker.bootstrap, topic, writes, [letter])
    assert letters_on(broker.bootstrap, topic) == []
    assert (writes.counters.retries, writes.counters.reduced, writes.counters.dropped) == (
        0, 1, 1)


def test_a_run_state_too_large_for_a_record_is_not_changelogged(broker, pipeline, reader,
                                                                 agent):
    """A run whose tool calls carry ~190 KB argument hashes holds more than a record may
    (its last ten actions): the changelog gets a deletion for it instead (recovery then
    reads the run from the store), counted, and its row is exact. On a broker with
    Kafka's default limit that state was refused, and resent, forever."""
    from tests.test_changelog import latest_changelog_values

    before = pipeline.health()["changelog_states_too_large"]
    run_id = f"{agent}-huge-state"
    base = {"run_id": run_id, "agent": agent}
    events = [{"event_type": "run.start", **base},
              *({"event_type": "tool.call", **base, "tool": "grep",
                 "args_hash": f"{n}" + "h" * 190_000} for n in range(8)),
              {"event_type": "run.end", **base, "terminal_reason": "model_done"}]
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap, max_request_size=1_000_000)
    partition = partition_for(run_id, int(PIPELINE_ENV["LOOPWATCH_PARTITIONS"]))
    for event in events:
        producer.send("loopwatch.events", value=orjson.dumps(event), partition=partition)
    producer.flush()
    producer.close()
    wait_for(lambda: reader.query(
        "SELECT status, outcome, tool_calls FROM runs FINAL WHERE run_id = {r:String}",
        {"r": run_id}).rows == [["closed", "success", 8]], 90, what="the run's row")
    wait_for(lambda: pipeline.health()["changelog_states_too_large"] > before, 30,
             what="the state counted as too large")
    changelog = latest_changelog_values(broker.bootstrap)
    assert run_id.encode() in changelog
    assert changelog[run_id.encode()] is None
