"""The embedded broker's lifecycle (issue 24 §5, broker side): a stable address recorded
in the data dir, adoption by the next ``up`` after a crash, a new incarnation on the same
port when the broker itself is lost. Real Tansu, real chdb, ``up`` as a child process.

Counts are exact: every scripted event stored once, every run's row and outcome as
scripted. Pacing is by acknowledgement (``flush``) and stored progress, never sleeps.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loopwatch.core.config import Settings
from loopwatch.core.embedded.broker import answers, free_port, is_broker_command, process_argv
from loopwatch.core.embedded.lifecycle import BrokerError, DataDirBroker
from loopwatch.ingest.announce import BrokerAnnouncement, read_announcement, write_announcement
from loopwatch.ingest.sdk import Emitter, RunContext
from loopwatch.upprocess import UpProcess
from tests.conftest import PIPELINE_ENV, dead_pid, scalar, wait_for

pytestmark = pytest.mark.stack  # starts brokers / `loopwatch up` itself

#: no run is abandoned while ``up`` is down or restarting: outcomes come from run.end
ENV = {**PIPELINE_ENV, "LOOPWATCH_ABANDON_TTL_S": "600"}
#: terminal reason -> outcome, cycled over the runs
SCRIPT = (("model_done", "success"), ("crash", "hard_error"), ("cap", "budget_exhausted"),
          ("cannot_complete", "gave_up"))
EVENTS_PER_RUN = 8  # run.start, 3 x (step, llm.call), run.end


def emit_run(emitter: Emitter, agent: str, index: int) -> tuple[str, str]:
    """One scripted run of 8 events; returns (run_id, the outcome it must get)."""
    reason, outcome = SCRIPT[index % len(SCRIPT)]
    run = RunContext(emitter, f"{agent}-{index:05d}", {"agent": agent, "model": "gpt-4o"})
    run.start()
    for _ in range(3):
        run.step()
        run.llm_call(input_tokens=100, output_tokens=10)
    run.end(reason, **({"error_type": "ToolCrash"} if reason == "crash" else {}),
            **({"cap": "step"} if reason == "cap" else {}))
    return run.run_id, outcome


def stream(emitter: Emitter, agent: str, first: int, runs: int,
           expected: dict[str, str], chunk: int = 100) -> None:
    """Emit runs ``first .. first+runs`` in chunks, each acknowledged before the next."""
    for start in range(first, first + runs, chunk):
        for index in range(start, min(start + chunk, first + runs)):
            run_id, outcome = emit_run(emitter, agent, index)
            expected[run_id] = outcome
        assert emitter.flush(60)


def stored(up: UpProcess, agent: str) -> tuple[int, int]:
    count, unique = up.reader.query(
        "SELECT count(), uniqExact(event_id) FROM events FINAL WHERE agent = {a:String}",
        {"a": agent}).rows[0]
    return int(count), int(unique)


def assert_runs_exact(up: UpProcess, agent: str, expected: dict[str, str]) -> None:
    wait_for(lambda: scalar(up.reader, "SELECT count() FROM runs FINAL WHERE agent = {a:String}"
                                       " AND status = 'closed'", a=agent) == len(expected),
             120, what=f"{len(expected)} runs of {agent} closed")
    rows = up.reader.query("SELECT run_id, outcome, steps, llm_calls FROM runs FINAL "
                           "WHERE agent = {a:String}", {"a": agent}).rows
    assert {run_id: outcome for run_id, outcome, _, _ in rows} == expected
    assert {(steps, calls) for _, _, steps, calls in rows} == {(3, 3)}


def is_tansu(pid: int, port: int) -> bool:
    argv = process_argv(pid)
    return argv is not None and is_broker_command(argv, "127.0.0.1", port)


@pytest.fixture()
def up(tmp_path: Path) -> Iterator[UpProcess]:
    process = UpProcess(tmp_path / "data", ENV)
    try:
        yield process
    finally:
        process.stop()
        process.discard_broker()


def test_sigkill_of_up_mid_stream_adopts_the_broker_and_loses_nothing(
        up: UpProcess, tmp_path: Path):
    """Finding: kill -9 of `up` while an agent streamed 2,000 runs x 8 events, then `up`
    again: 6,936 of 16,000 events stored (the broker died with `up`, the new one listened
    on a new port). Now the broker outlives `up`, the next `up` adopts it (same pid,
    incarnation, port) and the processors go on from the group's committed offsets.
    Once in about six runs faust skipped one message in the rebalance after the restart
    (15,864 of 16,000 stored): processors/continuity.py reads such a hole again."""
    agent = "kill-up"
    expected: dict[str, str] = {}
    up.start()
    before = up.broker
    assert before is not None and before.bootstrap == up.info["kafka_bootstrap"]
    with Emitter(before.bootstrap, spool_dir=tmp_path / "spool") as emitter:
        stream(emitter, agent, 0, 800, expected)
        wait_for(lambda: stored(up, agent)[0] >= 800, 120,
                 what="the processors to store part of the stream")
        stream(emitter, agent, 800, 200, expected)  # in the broker, not all stored yet
        up.kill()
        assert is_tansu(before.pid, before.port)  # the broker outlives `up`
        stream(emitter, agent, 1000, 1000, expected)  # while `up` is down
        up.start()
        after = up.broker
        assert after is not None
        assert (after.pid, after.incarnation, after.bootstrap) == (
            before.pid, before.incarnation, before.bootstrap)
        assert up.info["kafka_bootstrap"] == before.bootstrap
        assert emitter.stats.sent == 2000 * EVENTS_PER_RUN
    wait_for(lambda: stored(up, agent)[0] >= 2000 * EVENTS_PER_RUN, 120,
             what="every event stored")
    assert stored(up, agent) == (16_000, 16_000)
    assert scalar(up.reader, "SELECT count() FROM events WHERE agent = {a:String}",
                  a=agent) >= 16_000  # (redelivered rows collapse under FINAL)
    assert_runs_exact(up, agent, expected)


def test_a_lost_broker_is_restarted_on_its_port_with_a_new_incarnation(
        up: UpProcess, tmp_path: Path):
    """Finding: the broker killed while `up` runs took the processors down with it
    (`up` exited 0 within 20 s, nothing listened any more). Now `up` starts a new broker
    on the same port (new pid, new incarnation), recreates the topics, and a new worker
    processes what is sent after; a run open across the loss is rebuilt from the store,
    and an event of it sent again (an SDK resend) is not counted twice."""
    agent = "lost-broker"
    expected: dict[str, str] = {}
    up.start()
    before = up.broker
    assert before is not None
    with Emitter(before.bootstrap, spool_dir=tmp_path / "spool") as emitter:
        spanning = RunContext(emitter, f"{agent}-spanning", {"agent": agent, "model": "gpt-4o"})
        spanning.start()
        first_step = spanning.step()
        spanning.llm_call(input_tokens=100, output_tokens=10)
        stream(emitter, agent, 0, 4, expected)
    wait_for(lambda: stored(up, agent)[0] == 3 + 4 * EVENTS_PER_RUN, 120,
             what="the events before the loss stored")
    wait_for(lambda: scalar(up.reader, "SELECT status FROM runs FINAL WHERE run_id = "
                                       "{r:String}", r=spanning.run_id) == "running",
             60, what="the open run's row stored")
    os.kill(before.pid, signal.SIGKILL)
    after = wait_for(lambda: (lambda record: record if record and record.incarnation
                              != before.incarnation else None)(up.broker),
                     60, what="a new broker incarnation")
    assert after.bootstrap == before.bootstrap and after.pid != before.pid
    up_pid = up.process.pid if up.process else None
    up.rejoin()  # `up` restarted itself in place: same pid, a new announcement
    assert up.process is not None and up.process.pid == up_pid
    assert is_tansu(after.pid, after.port) and after.stopped_at is None
    with Emitter(after.bootstrap, spool_dir=tmp_path / "spool-after") as emitter:
        spanning.emitter = emitter
        emitter.emit(first_step)  # a resend of an event already stored
        spanning.step()
        spanning.llm_call(input_tokens=100, output_tokens=10)
        spanning.end("model_done")
        stream(emitter, agent, 4, 8, expected)
    expected[spanning.run_id] = "success"
    wait_for(lambda: stored(up, agent)[0] == 3 + 3 + 12 * EVENTS_PER_RUN, 120,
             what="the events sent after the loss stored")
    assert stored(up, agent) == (102, 102)
    wait_for(lambda: scalar(up.reader, "SELECT outcome FROM runs FINAL WHERE run_id = "
                                       "{r:String}", r=spanning.run_id) == "success",
             60, what="the spanning run closed")
    assert up.reader.query("SELECT steps, llm_calls FROM runs FINAL WHERE run_id = {r:String}",
                           {"r": spanning.run_id}).rows == [[2, 2]]
    rows = up.reader.query("SELECT run_id, outcome, steps, llm_calls FROM runs FINAL "
                           "WHERE agent = {a:String} AND run_id != {r:String}",
                           {"a": agent, "r": spanning.run_id}).rows
    assert {run_id: outcome for run_id, outcome, _, _ in rows} == {
        run_id: outcome for run_id, outcome in expected.items() if run_id != spanning.run_id}
    assert {(steps, calls) for _, _, steps, calls in rows} == {(3, 3)}
    assert up.running and up.broker == after


def test_the_port_is_kept_across_clean_restarts_and_a_taken_port_is_one_line(
        up: UpProcess, tmp_path: Path):
    """Finding: every start of `up` listened on a new port, so agents never reconnected.
    Now a pinned port is used, recorded, and reused by a later start without the pin; a
    clean stop stops the broker and marks the record; a port another program holds is
    one line on stderr and exit 1, nothing started."""
    port = free_port()
    up.env["LOOPWATCH_BROKER_PORT"] = str(port)
    with up:
        first = up.broker
        assert first is not None and first.port == port and is_tansu(first.pid, port)
        assert up.info["kafka_bootstrap"] == f"127.0.0.1:{port}"
    stopped = up.broker
    assert stopped is not None and stopped.stopped_at is not None
    assert process_argv(first.pid) is None and not answers("127.0.0.1", port)

    del up.env["LOOPWATCH_BROKER_PORT"]
    with up:
        second = up.broker
        assert second is not None and second.port == port
        assert second.incarnation != first.incarnation and second.stopped_at is None

    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        result = subprocess.run([sys.executable, "-m", "loopwatch.cli", "up"], env=up.env,
                                capture_output=True, timeout=120, check=False)
    assert result.returncode == 1
    assert result.stderr.decode().splitlines() == [
        f"loopwatch up: the embedded broker's port 127.0.0.1:{port} (recorded in "
        f"{up.data_dir / 'broker.json'}) is taken by another program; stop it, or choose "
        "another port with LOOPWATCH_BROKER_PORT"]
    assert up.broker == read_announcement(up.data_dir) and up.broker.stopped_at is not None


# -- acquiring the broker, in this process (no `up`: a real Tansu broker each) ------------

def _record(data_dir: Path, port: int, pid: int, incarnation: str) -> None:
    write_announcement(data_dir, BrokerAnnouncement(
        f"127.0.0.1:{port}", pid, incarnation, "loopwatch.events", "loopwatch-processors", 1.0))


@pytest.mark.parametrize("pid_of", [dead_pid, os.getpid], ids=["dead", "not-a-broker"])
def test_a_stale_record_gets_a_new_incarnation_on_its_port(tmp_path: Path, pid_of):
    """A record whose pid is gone, or is some other process (here: this Python), is not
    adopted: a new broker starts on the recorded port with a new incarnation, recorded
    with its own pid."""
    port = free_port()
    stale_pid = pid_of()
    _record(tmp_path, port, stale_pid, "stale")
    broker = DataDirBroker(Settings(data_dir=tmp_path)).acquire()
    try:
        record = read_announcement(tmp_path)
        assert record == broker.announcement and not broker.adopted
        assert record.port == port and record.incarnation != "stale"
        assert record.pid != stale_pid and is_tansu(record.pid, port)
    finally:
        broker.release(0)
    assert process_argv(record.pid) is None and read_announcement(tmp_path).stopped_at


def test_a_live_recorded_broker_is_adopted_and_kept_while_it_holds_messages(tmp_path: Path):
    """Adoption keeps pid, port and incarnation; a release with uncommitted messages
    leaves the broker running for the next `up`; one with none stops it."""
    first = DataDirBroker(Settings(data_dir=tmp_path)).acquire()
    first.release(5)  # holds 5 uncommitted messages: left running
    assert first.alive()
    adopted = DataDirBroker(Settings(data_dir=tmp_path)).acquire()
    try:
        assert adopted.adopted and adopted.announcement == first.announcement
        with pytest.raises(BrokerError, match="another loopwatch up runs on"):
            DataDirBroker(Settings(data_dir=tmp_path)).acquire()
    finally:
        adopted.release(0)
    assert not first.alive() and read_announcement(tmp_path).stopped_at is not None


def test_a_pinned_port_other_than_the_running_brokers_is_refused(tmp_path: Path):
    running = DataDirBroker(Settings(data_dir=tmp_path)).acquire()
    running.release(1)
    try:
        with pytest.raises(BrokerError, match=f"still runs on port {running.announcement.port}"):
            DataDirBroker(Settings(data_dir=tmp_path, broker_port=free_port())).acquire()
    finally:
        DataDirBroker(Settings(data_dir=tmp_path)).acquire().release(0)
    assert not running.alive()


# -- hostile records: the data dir's broker.json is input too ------------------------------

HOSTILE_RECORDS = {
    "not json": b"\x00\xffnot json{",
    "a list": b"[1, 2, 3]",
    "fields missing": b'{"bootstrap": "127.0.0.1:9"}',
    "pid not a number": b'{"bootstrap": "127.0.0.1:9", "pid": "1; rm -rf /", "incarnation": "x",'
                        b' "events_topic": "t", "consumer_group": "g", "started_at": 0}',
    "pid 0": b'{"bootstrap": "127.0.0.1:9", "pid": 0, "incarnation": "x",'
             b' "events_topic": "t", "consumer_group": "g", "started_at": 0}',
    "pid -1 (every process)": b'{"bootstrap": "127.0.0.1:9", "pid": -1, "incarnation": "x",'
                              b' "events_topic": "t", "consumer_group": "g", "started_at": 0}',
    "pid 1 (init)": b'{"bootstrap": "127.0.0.1:9", "pid": 1, "incarnation": "x",'
                    b' "events_topic": "t", "consumer_group": "g", "started_at": 0}',
    "port out of range": b'{"bootstrap": "127.0.0.1:70000", "pid": 1, "incarnation": "x",'
                         b' "events_topic": "t", "consumer_group": "g", "started_at": 0}',
    "port not a number": b'{"bootstrap": "127.0.0.1:http", "pid": 1, "incarnation": "x",'
                         b' "events_topic": "t", "consumer_group": "g", "started_at": 0}',
    "another host": b'{"bootstrap": "attacker.example:9092", "pid": 1, "incarnation": "x",'
                    b' "events_topic": "t", "consumer_group": "g", "started_at": 0}',
}


@pytest.mark.parametrize("content", HOSTILE_RECORDS.values(), ids=HOSTILE_RECORDS.keys())
def test_a_damaged_or_hostile_record_is_replaced_and_signals_nothing(tmp_path: Path,
                                                                      content: bytes):
    """No process is adopted or signalled on the record's word alone (pid 1, -1, this
    process stay untouched); a broker starts on loopback and its record replaces the bad one."""
    (tmp_path / "broker.json").write_bytes(content)
    broker = DataDirBroker(Settings(data_dir=tmp_path)).acquire()
    try:
        record = read_announcement(tmp_path)
        assert record == broker.announcement and not broker.adopted
        assert record.bootstrap == f"127.0.0.1:{record.port}" and record.incarnation != "x"
        assert is_tansu(record.pid, record.port) and record.pid > 1
        assert oct((tmp_path / "broker.json").stat().st_mode & 0o777) == "0o600"
    finally:
        broker.release(0)
    assert os.getppid() > 0 and process_argv(1) is not None  # nothing signalled


def test_a_record_naming_another_host_is_never_adopted(tmp_path: Path):
    """A live Tansu broker of ours, named in a record under another host: not adopted
    (the record would send the pipeline elsewhere) but replaced by a loopback broker."""
    elsewhere = DataDirBroker(Settings(data_dir=tmp_path / "other")).acquire()
    try:
        live = elsewhere.announcement
        _record(tmp_path / "mine", live.port, live.pid, live.incarnation)
        record = read_announcement(tmp_path / "mine")
        write_announcement(tmp_path / "mine", BrokerAnnouncement(
            f"10.9.8.7:{live.port}", live.pid, live.incarnation, record.events_topic,
            record.consumer_group, record.started_at))
        mine = DataDirBroker(Settings(data_dir=tmp_path / "mine")).acquire()
        try:
            assert not mine.adopted and mine.announcement.pid != live.pid
            assert mine.bootstrap.startswith("127.0.0.1:")
        finally:
            mine.release(0)
        assert is_tansu(live.pid, live.port)  # the other data dir's broker untouched
    finally:
        elsewhere.release(0)
