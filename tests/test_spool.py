"""The emitter's spool (ingest/spool.py) on its own: no broker, real files, real flock.

Batching (one fsync per batch), a line torn by a crash, refusal when full, exclusivity
between live emitters, adoption of what exited emitters left, private modes."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from loopwatch.core.embedded.broker import free_port
from loopwatch.ingest.events import Step
from loopwatch.ingest.sdk import Emitter
from loopwatch.ingest.spool import DiskSpool, SpoolFull, SpoolLocked, open_spool, read_lines


def lines(count: int, start: int = 0) -> list[bytes]:
    return [b'{"run_id":"r%d","n":%d}' % (n % 7, n) for n in range(start, start + count)]


@pytest.fixture()
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """A spy on os.fsync: the real fsync runs, each call is counted."""
    calls: list[int] = []
    real = os.fsync

    def counted(descriptor: int) -> None:
        calls.append(descriptor)
        real(descriptor)

    monkeypatch.setattr(os, "fsync", counted)
    yield calls


def test_one_batch_is_one_write_and_one_fsync(tmp_path: Path, fsyncs: list[int]):
    spool = DiskSpool(tmp_path / "s", 10 << 20)
    for batch in range(3):
        spool.append(lines(1000, batch * 1000))
    assert len(fsyncs) == 3 == spool.fsyncs
    assert spool.records() == lines(3000)
    assert spool.unconfirmed() == 3000
    spool.close()


def test_the_emitter_writes_ahead_in_batches_not_per_event(tmp_path: Path, fsyncs: list[int],
                                                           caplog: pytest.LogCaptureFixture):
    """Embedded-broker mode (every event written ahead), the broker not up yet: 20,000
    events reach the spool in far fewer fsyncs than events (one per sender batch), and
    the outage is told once (a connect per batch held each batch a bootstrap timeout)."""
    emitter = Emitter(f"127.0.0.1:{free_port()}", spool_dir=tmp_path / "spool",
                      confirm="pipeline", consumer_group="g",
                      producer_config={"max_block_ms": 200, "bootstrap_timeout_ms": 200})
    for n in range(20_000):
        emitter.emit(Step(run_id=f"run-{n % 50}", agent="a", step=n))
    assert emitter.flush(60)
    assert emitter.stats.logged == 20_000
    assert emitter.spool.unconfirmed() == 20_000
    assert 1 <= emitter.spool.fsyncs <= 20_000 // 100, emitter.spool.fsyncs
    emitter.close(timeout_s=1, confirm_timeout_s=0)
    assert len(DiskSpool(tmp_path / "spool", 1 << 30).records()) == 20_000
    assert [record.getMessage().split(" (")[0] for record in caplog.records
            if record.name == "loopwatch.ingest.sdk"] == ["broker unavailable"]


class Held:
    """``owner.name`` made to wait, once called (with arguments ``applies`` accepts),
    until the test sets ``release``: a mock of a slow disk, which cannot be made on
    demand here. ``entered`` is set when a call waits."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, owner: object, name: str,
                 applies: Callable[..., bool] = lambda *args: True) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        real = getattr(owner, name)

        def held(*args: Any, **kwargs: Any) -> Any:
            if applies(*args):
                self.entered.set()
                assert self.release.wait(60), f"the test never released {name}"
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, held)


def reserves_meanwhile(spool: DiskSpool) -> bool:
    """Whether a reserve (the lock every emit takes) completes within 30 s."""
    reserving = threading.Thread(target=spool.reserve, args=(100,))
    reserving.start()
    reserving.join(30)
    return not reserving.is_alive()


@pytest.fixture()
def slow_disk(monkeypatch: pytest.MonkeyPatch) -> Iterator[Held]:
    """os.fsync held until the test releases it."""
    fsync = Held(monkeypatch, os, "fsync")
    yield fsync
    fsync.release.set()


def test_an_agent_reserving_room_never_waits_for_the_spools_fsync(
        tmp_path: Path, slow_disk: Held):
    """Every emit reserves room in the spool; the sender's write and fsync of a batch
    must not hold the lock that takes, and a confirmation of the segment's earlier
    records during the write must not find it empty (and close it under the write)."""
    spool = DiskSpool(tmp_path / "s", 10 << 20)
    slow_disk.release.set()
    first = spool.append(lines(3))
    slow_disk.release.clear()
    slow_disk.entered.clear()
    writer = threading.Thread(target=spool.append, args=(lines(4, 3),))
    writer.start()
    assert slow_disk.entered.wait(30)  # the second batch is in its fsync, held
    assert reserves_meanwhile(spool)
    assert spool.confirm(first.seq, first.generation, 3)  # the first batch, confirmed
    assert writer.is_alive()
    slow_disk.release.set()
    writer.join(30)
    assert spool.records() == lines(7)  # the segment was not deleted under the write
    assert (spool.unconfirmed(), spool.used()) == (4, spool.size() + 100)
    spool.close()


def test_an_agent_reserving_room_never_waits_for_a_confirmed_segments_removal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A confirmed segment is dropped from the accounting at once and its file removed
    after the lock every emit takes is let go (the unlink is held)."""
    unlink = Held(monkeypatch, Path, "unlink", lambda path: path.name.startswith("seg-"))
    spool = DiskSpool(tmp_path / "s", 10 << 20)
    segment = spool.append(lines(3))
    confirmer = threading.Thread(target=spool.confirm,
                                 args=(segment.seq, segment.generation, 3))
    try:
        confirmer.start()
        assert unlink.entered.wait(30)  # the segment's file is being removed, held
        assert reserves_meanwhile(spool)
        assert (spool.size(), spool.used(), spool.unconfirmed()) == (0, 100, 0)
    finally:
        unlink.release.set()
        confirmer.join(30)
    assert not segment.path.exists()
    assert spool.records() == []
    spool.close()


def test_a_failed_write_takes_its_count_back(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch):
    spool = DiskSpool(tmp_path / "s", 10 << 20)
    spool.append(lines(2))
    before = (spool.unconfirmed(), spool.size(), spool.used())
    spool.reserve(50)

    def full(descriptor: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space"):
        spool.append(lines(3, 2), reserved=50)
    assert (spool.unconfirmed(), spool.size(), spool.used() - 50) == before
    spool.close()


def test_a_line_torn_by_a_crash_stays_a_record_of_its_own(tmp_path: Path):
    """A writer killed mid-line leaves a fragment at the end of its segment: reopened,
    the complete records come back whole, the fragment as one record (sent on and
    dead-lettered downstream), and new records go to a new segment, never after it."""
    folder = tmp_path / "s"
    spool = DiskSpool(folder, 1 << 20)
    spool.append(lines(5))
    spool.close()
    (segment,) = folder.glob("seg-*.log")
    with segment.open("ab") as handle:
        handle.write(b'{"run_id":"torn","n":')
    reopened = DiskSpool(folder, 1 << 20)
    assert reopened.records() == [*lines(5), b'{"run_id":"torn","n":']
    reopened.append(lines(2, 100))
    assert read_lines(segment) == [*lines(5), b'{"run_id":"torn","n":']
    assert len(list(folder.glob("seg-*.log"))) == 2
    resent = [record for _, _, batch in reopened.take_resend() for record in batch]
    assert resent == [*lines(5), b'{"run_id":"torn","n":']  # the new records were sent
    reopened.close()


def test_a_writer_killed_mid_stream_leaves_only_whole_records_but_the_last(tmp_path: Path):
    """SIGKILL a real process appending batches: every record read back is one it wrote,
    in order, and at most the last one is torn."""
    folder = tmp_path / "s"
    script = (
        "import sys; sys.path.insert(0, sys.argv[2])\n"
        "from pathlib import Path\nfrom loopwatch.ingest.spool import DiskSpool\n"
        "spool = DiskSpool(Path(sys.argv[1]), 1 << 40)\n"
        "n = 0\nprint('ready', flush=True)\n"
        "while True:\n"
        "    spool.append([b'{\"n\":%d,\"pad\":\"%s\"}' % (n + i, b'x' * 200) "
        "for i in range(100)])\n"
        "    n += 100\n")
    child = subprocess.Popen([sys.executable, "-c", script, str(folder), os.getcwd()],
                             stdout=subprocess.PIPE)
    assert child.stdout is not None and child.stdout.readline() == b"ready\n"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and sum(
            path.stat().st_size for path in folder.glob("seg-*.log")) < 1 << 20:
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    records = DiskSpool(folder, 1 << 40).records()
    whole = [record for record in records if record.endswith(b'"}')]
    assert len(records) - len(whole) <= 1 and records[:len(whole)] == whole
    assert [int(record[5:record.index(b",")]) for record in whole] == list(range(len(whole)))
    assert len(whole) >= 1000


def test_a_full_spool_refuses_at_the_call_and_counts(tmp_path: Path):
    """Broker unreachable, 4 kB of spool: the events that fit are accepted and kept on
    disk; the next ones raise SpoolFull at emit() and are counted; none is dropped."""
    emitter = Emitter(f"127.0.0.1:{free_port()}", "t", tmp_path / "spool",
                      spool_max_bytes=4096,
                      producer_config={"max_block_ms": 200, "bootstrap_timeout_ms": 200})
    accepted = refused = 0
    for n in range(100):
        try:
            emitter.emit(Step(run_id="full", agent="a", step=n))
            accepted += 1
        except SpoolFull as exc:
            assert "spool full" in str(exc) and "not accepted" in str(exc)
            refused += 1
    assert emitter.flush(30)
    assert (accepted + refused, emitter.stats.refused, emitter.stats.queued) == (
        100, refused, accepted)
    assert 0 < accepted < 100
    assert emitter.spool.unconfirmed() == accepted == emitter.stats.spooled
    assert emitter.spool.size() <= 4096
    emitter.close(timeout_s=1)
    steps = sorted(int(line.split(b'"step":')[1].split(b",")[0].rstrip(b"}"))
                   for line in DiskSpool(tmp_path / "spool", 1 << 20).records())
    assert steps == list(range(accepted))


def test_two_live_spools_never_share_a_folder(tmp_path: Path):
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; sys.path.insert(0, sys.argv[2])\nfrom pathlib import Path\n"
         "from loopwatch.ingest.spool import DiskSpool\nDiskSpool(Path(sys.argv[1]), 1024)\n"
         "print('held', flush=True)\nsys.stdin.read()", str(tmp_path / "emitter"), os.getcwd()],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        with pytest.raises(SpoolLocked, match=f"held by another live emitter .pid {holder.pid}"):
            DiskSpool(tmp_path / "emitter", 1024)
        second = open_spool(tmp_path, "emitter", 1024)
        assert second.directory == tmp_path / "emitter-2"
        with pytest.raises(SpoolLocked):
            DiskSpool(tmp_path / "emitter-2", 1024)  # in this process too
        second.close()
    finally:
        holder.kill()
        holder.wait()
    DiskSpool(tmp_path / "emitter", 1024).close()  # its holder exited: free again


def test_an_emitter_that_starts_adopts_what_exited_emitters_left(tmp_path: Path):
    """Orphans of the same topic (their holder gone) move into the new spool and are
    resent; a live spool and one of another topic are left alone."""
    root = tmp_path / "spool"
    for name, topic, count in (("gone-1", "events", 3), ("gone-2", "events", 2),
                               ("other-topic", "elsewhere", 4)):
        orphan = DiskSpool(root / name, 1 << 20, topic=topic)
        orphan.append(lines(count))
        orphan.close()
    legacy = root / "0123abcd"  # the random folder of an emitter before segments
    legacy.mkdir()
    (legacy / "spool.jsonl").write_bytes(b"\n".join(lines(1, 50)) + b"\n")
    live = DiskSpool(root / "live", 1 << 20, topic="events")
    live.append(lines(6))
    adopter = open_spool(root, "emitter", 1 << 20, topic="events")
    assert sorted(adopter.records()) == sorted([*lines(3), *lines(2), *lines(1, 50)])
    assert sorted(path.name for path in root.iterdir()) == ["emitter", "live", "other-topic"]
    assert len(live.records()) == 6
    assert adopter.pending_resend()
    adopter.close()
    live.close()


def test_confirmed_segments_go_and_a_resend_makes_older_confirmations_stale(tmp_path: Path):
    spool = DiskSpool(tmp_path / "s", 1 << 20, segment_bytes=1)  # one segment a batch
    first, second = spool.append(lines(3)), spool.append(lines(2, 3))
    assert spool.confirm(first.seq, first.generation, 3)
    assert not first.path.exists() and second.path.exists()
    stale = second.generation
    spool.mark_all_resend()
    ((seq, generation, records),) = list(spool.take_resend())
    assert (seq, records) == (second.seq, lines(2, 3)) and generation == stale + 1
    assert not spool.confirm(seq, stale, 2)  # sent to a broker that lost it
    assert second.path.exists() and spool.unconfirmed() == 2
    assert spool.confirm(seq, generation, 2)
    assert not second.path.exists() and spool.size() == 0
    spool.close()


def test_the_spool_is_private_whatever_the_umask(tmp_path: Path):
    previous = os.umask(0o022)
    try:
        data_dir = tmp_path / "fresh" / "data"
        spool = open_spool(data_dir / "spool", "emitter", 1 << 20, topic="events")
        spool.append(lines(1))
    finally:
        os.umask(previous)
    for folder in (data_dir, data_dir / "spool", spool.directory):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    files = list(spool.directory.iterdir())
    assert {path.name.split("-")[0] for path in files} == {"lock", "meta.json", "seg"}
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    spool.close()
