"""Bad input never stops the processors: it lands in the dead letters with its reason,
is counted, and what follows it is still processed."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import uuid

import orjson
import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from loopwatch.ingest.events import Step
from loopwatch.ingest.wire import encode_event
from tests.conftest import scalar, wait_for

TOPIC = "loopwatch.events"


def cli(pipeline, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**pipeline.env}
    return subprocess.run([sys.executable, "-m", "loopwatch.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def oversized(marker: str) -> bytes:
    return orjson.dumps({"event_type": "step", "run_id": "r", "agent": "a", "step": 1,
                         "marker": marker, "blob": "x" * 250_000})


@pytest.fixture(scope="module")
def poisoned(broker, pipeline, reader):
    """Five bad messages then a good one, all carrying one marker."""
    marker = uuid.uuid4().hex
    good = Step(run_id=f"good-{marker}", agent=f"dlq-{marker}", step=0)
    bad = [
        b'{"event_type": "step", "marker": "' + marker.encode() + b'", oops',
        orjson.dumps({"event_type": "step", "run_id": "r", "agent": "a", "marker": marker}),
        orjson.dumps({"event_type": "step", "run_id": "r", "agent": "a", "step": 1,
                      "schema_version": "2.0", "marker": marker}),
        oversized(marker),
        orjson.dumps({"envelope_version": 1, "events": [
            {"event_type": "tool.call", "run_id": "r", "agent": "a", "marker": marker}]}),
    ]
    before = pipeline.health()["counters"]["dead_letters"]
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap, max_request_size=2_000_000)
    for value in [*bad, encode_event(good)]:
        producer.send(TOPIC, value=value, partition=0)
    producer.flush()
    producer.close()
    wait_for(lambda: scalar(reader, "SELECT count() FROM events FINAL WHERE run_id = {r:String}",
                            r=good.run_id) == 1, 60, what="the good event after the bad ones")
    wait_for(lambda: dead_letters(reader, marker), 60, what="dead letters")
    return marker, before


def dead_letters(reader, marker: str) -> list[dict]:
    return reader.query("SELECT reason, replayed_at FROM dead_letters FINAL "
                        "WHERE position(payload, {m:String}) > 0 ORDER BY reason",
                        {"m": marker}).records()


def test_each_bad_message_is_a_dead_letter_with_its_reason(poisoned, reader):
    marker, _ = poisoned
    reasons = [row["reason"] for row in dead_letters(reader, marker)]
    assert len(reasons) == 5
    assert reasons[0].startswith("malformed JSON: unexpected character")
    whole = oversized(marker)
    assert reasons[1] == (f"oversized message: {len(whole)} bytes > 200000; payload cut: "
                          f"{len(whole)} bytes, sha256 {hashlib.sha256(whole).hexdigest()}, "
                          "first 200000 bytes kept")
    assert reasons[2] == "schema violation: step.step: Field required"
    assert reasons[3] == "schema violation: tool.call.tool: Field required"
    assert reasons[4] == "unsupported schema_version major 2 (this build reads 1.x)"


def test_dead_letters_are_counted(poisoned, pipeline):
    _, before = poisoned
    assert pipeline.health()["counters"]["dead_letters"] >= before + 5


def test_dead_letters_reach_the_dead_letter_topic_with_reason_headers(poisoned, broker):
    marker, _ = poisoned
    consumer = KafkaConsumer(bootstrap_servers=broker.bootstrap, consumer_timeout_ms=3000)
    partition = TopicPartition("loopwatch.deadletter", 0)
    consumer.assign([partition])
    consumer.seek_to_beginning(partition)
    mine = [m for m in consumer if marker.encode() in (m.value or b"")]
    consumer.close()
    by_letter: dict[bytes, set[tuple[bytes, tuple]]] = {}
    for m in mine:
        by_letter.setdefault(m.key, set()).add((m.value, tuple(sorted(m.headers))))
    # The topic is at least once: a batch read again after a rebalance (other tests
    # join workers to the shared group) sends its letters again, under the same key.
    assert len(by_letter) == 5
    assert all(len(copies) == 1 for copies in by_letter.values())
    assert all(dict(m.headers)["loopwatch-reason"] for m in mine)


def test_dlq_list_shows_reasons(poisoned, pipeline):
    marker, _ = poisoned
    listed = cli(pipeline, "dlq", "list", "--json", "--limit", "1000")
    assert listed.returncode == 0, listed.stderr
    rows = [row for row in orjson.loads(listed.stdout) if marker in row["payload"]
            or row["reason"].startswith("oversized")]
    assert {row["reason"].split(":")[0] for row in rows} >= {"malformed JSON",
                                                            "schema violation"}


def test_dlq_replay_resubmits_and_marks_them(poisoned, pipeline, reader):
    """The four letters whose payloads are whole go back and return (still bad) as new
    letters; the oversized one, whose payload was cut, stays pending and unsent."""
    marker, _ = poisoned
    replayed = cli(pipeline, "dlq", "replay")
    assert replayed.returncode == 0, replayed.stderr
    wait_for(lambda: len(dead_letters(reader, marker)) == 9, 60,
             what="the still-bad payloads to come back as new dead letters")
    rows = dead_letters(reader, marker)
    assert sum(row["replayed_at"] is not None for row in rows) == 4
    assert [row["replayed_at"] for row in rows if "payload cut" in row["reason"]] == [None]
