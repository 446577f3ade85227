"""Holes in an events partition (issue 24 §5): a rebalance in the middle of a full
stream buffer must leave each partition read without a hole. Real Tansu (the data dir's
own embedded broker), real chdb behind ``loopwatch up``, extra ``loopwatch worker``
processes joining and leaving.

Finding: after `up` was killed and restarted, one envelope of 2,000 runs was never
stored (partition 2 offset 12 missing, 0..20 of every other partition stored): faust
marks a message read when a rebalance cuts short its hand-over to the stream, and the
worker kept the partition. The rebalance cannot be timed from a test, so the second test
hides one message from the agent once, as faust does (``LOOPWATCH_FAULT_SKIP_MESSAGE``:
fault injection), and the processors must find the hole and read the partition again.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kafka import KafkaConsumer, TopicPartition

from loopwatch.core.config import Settings
from loopwatch.ingest.sdk import Emitter
from loopwatch.upprocess import UpProcess
from tests.conftest import scalar, wait_for
from tests.test_broker_lifecycle import ENV, EVENTS_PER_RUN, assert_runs_exact, stored, stream

pytestmark = pytest.mark.stack  # starts its own broker, `loopwatch up` and workers

AGENT = "churn"
ENV_TOPIC = Settings.model_fields["events_topic"].default
RUNS = 12_000


@pytest.fixture()
def up(tmp_path: Path) -> Iterator[UpProcess]:
    process = UpProcess(tmp_path / "data", ENV)
    try:
        yield process
    finally:
        process.stop()
        process.discard_broker()


def start_worker(up: UpProcess) -> subprocess.Popen[bytes]:
    log = (up.data_dir / "logs" / "churn-worker.log").open("ab")
    return subprocess.Popen([sys.executable, "-m", "loopwatch.cli", "worker"], env=up.env,
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def holes(up: UpProcess) -> list[tuple[int, int, int]]:
    """(partition, first offset, last offset) of each partition's stored offsets whose
    count is not last - first + 1: a message of the partition was skipped."""
    rows = up.reader.query(
        "SELECT kafka_partition, min(kafka_offset), max(kafka_offset), uniqExact(kafka_offset)"
        " FROM events WHERE agent = {a:String} GROUP BY kafka_partition ORDER BY 1",
        {"a": AGENT}).rows
    return [(int(p), int(lo), int(hi)) for p, lo, hi, n in rows if int(n) != int(hi) - int(lo) + 1]


def test_workers_joining_and_leaving_mid_backlog_leave_no_hole(up: UpProcess, tmp_path: Path):
    """A backlog of runs x 8 events, sent while `up` is down (the broker outlives it),
    drains through rebalances (a worker joins and leaves cleanly, another joins and is
    killed); every event is stored once, every partition's offsets are contiguous, every
    run exact."""
    expected: dict[str, str] = {}
    up.start()
    bootstrap = up.info["kafka_bootstrap"]
    up.kill()
    with Emitter(bootstrap, spool_dir=tmp_path / "spool", max_message_bytes=100_000) as emitter:
        stream(emitter, AGENT, 0, RUNS, expected, chunk=1000)
    total = RUNS * EVENTS_PER_RUN
    up.start()
    for leave in (signal.SIGTERM, signal.SIGKILL, signal.SIGTERM):
        already = stored(up, AGENT)[0]
        worker = start_worker(up)
        wait_for(lambda already=already: stored(up, AGENT)[0] > already + total // 10
                 or stored(up, AGENT)[0] >= total, 180, what="the backlog draining")
        worker.send_signal(leave)
        worker.wait(120)
    wait_for(lambda: stored(up, AGENT)[0] >= total, 300, what="every event stored")
    assert scalar(up.reader, "SELECT count() FROM dead_letters") == 0
    assert holes(up) == []
    assert stored(up, AGENT) == (total, total)
    assert_runs_exact(up, AGENT, expected)


def test_a_message_the_consumer_skipped_is_read_again_and_stored(tmp_path: Path):
    """Partition 1's offset 3 is hidden from the agent once: the next offset shows the
    hole, the partition is read again from 3, and every event and run is stored exactly
    (before: that envelope's 8 x 25 / 4 events were never stored, and the group's
    committed offset stayed at 3 for good)."""
    up = UpProcess(tmp_path / "data", {**ENV, "LOOPWATCH_FAULT_SKIP_MESSAGE": "1:3"})
    expected: dict[str, str] = {}
    try:
        up.start()
        with Emitter(up.info["kafka_bootstrap"], spool_dir=tmp_path / "spool") as emitter:
            stream(emitter, "hole", 0, 400, expected, chunk=25)
        total = 400 * EVENTS_PER_RUN
        wait_for(lambda: stored(up, "hole")[0] >= total, 120, what="every event stored")
        assert stored(up, "hole") == (total, total)
        assert scalar(up.reader, "SELECT uniqExact(kafka_offset) FROM events WHERE agent = "
                      "'hole' AND kafka_partition = 1 AND kafka_offset <= 3") == 4
        assert_runs_exact(up, "hole", expected)
        log = (up.data_dir / "logs" / "worker.log").read_text()
        assert "events partition 1 delivered offset 4 after 2: reading it again from 3" in log
    finally:
        up.stop()
        up.discard_broker()


def test_a_partitions_last_message_skipped_is_read_again_once_it_stalls(tmp_path: Path):
    """A hole at a partition's end has no later message to show it (the SIGKILL test saw
    that too: a partition's last envelope never handed over, the group's lag stuck at 1).
    Partition 1's last message is hidden once from an `up` that adopts the broker holding
    the whole stream: once idle, the processor reads the partition again from there."""
    up = UpProcess(tmp_path / "data", ENV)
    expected: dict[str, str] = {}
    try:
        up.start()
        bootstrap = up.info["kafka_bootstrap"]
        up.kill()
        with Emitter(bootstrap, spool_dir=tmp_path / "spool") as emitter:
            stream(emitter, "tail", 0, 200, expected, chunk=25)
        consumer = KafkaConsumer(bootstrap_servers=bootstrap)
        try:
            last = consumer.end_offsets([TopicPartition(ENV_TOPIC, 1)])[
                TopicPartition(ENV_TOPIC, 1)] - 1
        finally:
            consumer.close()
        up.env["LOOPWATCH_FAULT_SKIP_MESSAGE"] = f"1:{last}"
        up.start()
        total = 200 * EVENTS_PER_RUN
        wait_for(lambda: stored(up, "tail")[0] >= total, 120, what="every event stored")
        assert stored(up, "tail") == (total, total)
        assert_runs_exact(up, "tail", expected)
        log = (up.data_dir / "logs" / "worker.log").read_text()
        assert f"reading it again from {last}" in log
    finally:
        up.stop()
        up.discard_broker()
