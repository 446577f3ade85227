"""A message far larger than any the pipeline accepts (issue 24 §4) wedges nothing.

A 10 MB message on the events topic (the embedded Tansu broker sets no size limit; a
kafka-python producer with ``max_request_size`` raised sends it) used to become a 10 MB
dead-letter record the processors' producer refused and sent again every second for
good: no offset was committed again, ``caught_up`` stayed false and a stop waited out
its whole drain timeout. Here it is followed by 10,000 valid events through the SDK on
a ``loopwatch up`` of its own (embedded broker), and every offset is committed, every
event stored, the dead letter stored with its reason, size, sha256 and a bounded
prefix, and ``up`` stops because it drained.
"""

from __future__ import annotations

import hashlib
import signal
import uuid
from pathlib import Path

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient

from loopwatch.core.config import Settings
from loopwatch.ingest.events import RunEnd, RunStart, Step
from loopwatch.ingest.sdk import Emitter
from loopwatch.processors.deadletter import payload_limit
from loopwatch.upprocess import UpProcess
from tests.conftest import PIPELINE_ENV, scalar, wait_for

pytestmark = pytest.mark.stack  # starts brokers / `loopwatch up` itself

BIG_BYTES = 10 * 1024 * 1024
RUNS = 1000
EVENTS_PER_RUN = 10  # run.start, 8 steps, run.end
DRAIN_TIMEOUT_S = 60


def committed_and_ends(bootstrap: str, settings: Settings) -> dict[int, tuple[int, int]]:
    """partition -> (the group's committed offset or -1, the topic's end)."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap)
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        partitions = [TopicPartition(settings.events_topic, p)
                      for p in sorted(consumer.partitions_for_topic(settings.events_topic))]
        ends = consumer.end_offsets(partitions)
        committed = admin.list_group_offsets(
            {settings.consumer_group: partitions}).get(settings.consumer_group, {})
        return {tp.partition: (committed[tp].offset if tp in committed else -1, ends[tp])
                for tp in partitions}
    finally:
        consumer.close()
        admin.close()


def dead_letter_records(bootstrap: str, settings: Settings) -> list[object]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, consumer_timeout_ms=5000)
    partition = TopicPartition(settings.deadletter_topic, 0)
    consumer.assign([partition])
    consumer.seek_to_beginning(partition)
    records = list(consumer)
    consumer.close()
    return records


def _status(up: UpProcess) -> object:
    """``up``'s status for a failure message, or why it could not be read."""
    try:
        return up.health()
    except Exception as exc:  # the message must still be raised
        return f"unreadable ({exc!r})"


def test_a_10_mb_message_then_10000_events_are_all_committed_and_stored(tmp_path: Path):
    env = {**PIPELINE_ENV, "LOOPWATCH_DRAIN_TIMEOUT_S": str(DRAIN_TIMEOUT_S)}
    up = UpProcess(tmp_path / "data", env).start(180)
    settings = Settings(max_message_bytes=int(PIPELINE_ENV["LOOPWATCH_MAX_MESSAGE_BYTES"]))
    limit = payload_limit(settings)
    try:
        bootstrap = up.info["kafka_bootstrap"]
        agent = f"poison-{uuid.uuid4().hex[:8]}"
        big = (b'{"event_type":"step","run_id":"big","agent":"' + agent.encode()
               + b'","step":1,"blob":"' + b"x" * BIG_BYTES + b'"}')
        producer = KafkaProducer(bootstrap_servers=bootstrap, max_request_size=2 * BIG_BYTES)
        producer.send(settings.events_topic, value=big, partition=0).get(timeout=60)
        producer.close()
        with Emitter(bootstrap, spool_dir=tmp_path / "spool",
                     max_message_bytes=100_000) as emitter:
            for number in range(RUNS):
                run_id = f"{agent}-{number}"
                emitter.emit(RunStart(run_id=run_id, agent=agent))
                for step in range(EVENTS_PER_RUN - 2):
                    emitter.emit(Step(run_id=run_id, agent=agent, step=step))
                emitter.emit(RunEnd(run_id=run_id, agent=agent, terminal_reason="model_done"))
            assert emitter.flush(60)
        assert emitter.stats.sent == RUNS * EVENTS_PER_RUN

        seen: list[dict[int, tuple[int, int]]] = []

        def all_committed() -> dict[int, tuple[int, int]] | None:
            offsets = committed_and_ends(bootstrap, settings)
            seen[:] = [offsets]
            return offsets if all(done == end for done, end in offsets.values()) else None

        try:
            offsets = wait_for(all_committed, 180, 1.0,
                               what="the group's committed offsets at the topic's end")
        except AssertionError as exc:  # say which partitions lag, and what up says
            raise AssertionError(f"{exc}; last (committed, end) by partition: {seen}; "
                                 f"up's status: {_status(up)}") from None
        assert sum(end for _, end in offsets.values()) > 1
        reader = up.reader
        assert scalar(reader, "SELECT count() FROM events FINAL WHERE agent = {a:String}",
                      a=agent) == RUNS * EVENTS_PER_RUN
        assert scalar(reader, "SELECT countIf(outcome = 'success') FROM runs FINAL "
                              "WHERE agent = {a:String}", a=agent) == RUNS
        digest = hashlib.sha256(big).hexdigest()
        letters = reader.query(
            "SELECT source, reason, payload FROM dead_letters FINAL "
            "WHERE position(payload, {a:String}) > 0", {"a": agent}).records()
        assert letters == [{
            "source": f"{settings.events_topic}:0:0:0",
            "reason": f"oversized message: {len(big)} bytes > {settings.max_message_bytes}"
                      f"; payload cut: {len(big)} bytes, sha256 {digest}, "
                      f"first {limit} bytes kept",
            "payload": big[:limit].decode()}]
        (record,) = [r for r in dead_letter_records(bootstrap, settings)
                     if agent.encode() in (r.value or b"")]
        headers = dict(record.headers)
        assert record.value == big[:limit]
        assert (headers["loopwatch-payload-bytes"], headers["loopwatch-payload-sha256"],
                headers["loopwatch-payload-kept"]) == (
            str(len(big)).encode(), digest.encode(), str(limit).encode())
        health = up.health()
        assert health["caught_up"] is True
        assert (health["kafka_records_reduced"], health["kafka_records_dropped"]) == (0, 0)

        up.process.send_signal(signal.SIGTERM)
        exit_code = up.process.wait(DRAIN_TIMEOUT_S + 60)
        assert exit_code == 0
        log = (up.data_dir / "logs" / "worker.log").read_text()
        assert "drained; stopping" in log
        assert "not drained" not in log
    finally:
        up.kill()
