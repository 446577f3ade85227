"""Issue 24 §5, the SDK side: with the embedded broker (memory only), nothing an agent
emitted is lost when the broker is killed, when ClickHouse refuses writes, or when the
agent itself is restarted with a non-empty spool. Real Tansu, real chdb, ``loopwatch
up`` as a child process owning its broker (broker.json in its data dir); the SDK finds
the broker from the data dir and keeps what it sent until the processors' group
committed past it.

Counts are exact: every scripted event stored once (count and uniqExact of event_id),
every run's row and outcome as scripted. Pacing is by acknowledgement, stored progress
and confirmation, never by sleeping.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from loopwatch.core.embedded.broker import EmbeddedBroker
from loopwatch.ingest.announce import BrokerAnnouncement
from loopwatch.ingest.sdk import Emitter
from loopwatch.upprocess import UpProcess
from tests.conftest import PIPELINE_ENV, wait_for
from tests.delivery_agent import EVENTS_PER_RUN, emit_run, outcome, run_id
from tests.test_capture import reassemble, wait_decided
from tests.test_sdk import create_topic

pytestmark = pytest.mark.stack  # starts brokers / `loopwatch up` itself

#: no run is abandoned while the pipeline is down: outcomes come from run.end
ENV = {**PIPELINE_ENV, "LOOPWATCH_ABANDON_TTL_S": "600", "LOOPWATCH_DRAIN_TIMEOUT_S": "10"}
FIGURES: dict[str, str] = {}
PROMPT = [{"role": "user", "content": "Refund order 7, please."}]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    """One ``up`` with its own embedded broker for the module (group joins are dear);
    the store can be made to refuse writes through a marker file."""
    data_dir = tmp_path_factory.mktemp("delivery") / "data"
    process = UpProcess(data_dir, {**ENV, "LOOPWATCH_FAULT_SINK_FILE":
                                   str(data_dir.parent / "store-down")})
    process.start()
    try:
        yield process
    finally:
        process.stop()
        process.discard_broker()
        print("\ndelivery faults: " + "; ".join(f"{k}: {v}" for k, v in FIGURES.items()))


@pytest.fixture()
def own_up(tmp_path: Path) -> Iterator[UpProcess]:
    """An ``up`` of its own, for a test that kills its broker: the module's ``up`` has
    had its broker restarted once already (see the store outage test)."""
    process = UpProcess(tmp_path / "data", ENV)
    process.start()
    try:
        yield process
    finally:
        process.stop()
        process.discard_broker()


def store_down(up: UpProcess) -> Path:
    return up.data_dir.parent / "store-down"


def stored(up: UpProcess, agent: str) -> tuple[int, int]:
    count, unique = up.reader.query(
        "SELECT count(), uniqExact(event_id) FROM events FINAL WHERE agent = {a:String}",
        {"a": agent}).rows[0]
    return int(count), int(unique)


def stream(emitter: Emitter, agent: str, first: int, runs: int, chunk: int = 100) -> None:
    """Emit runs ``first .. first+runs`` in chunks, each acknowledged (or spooled) first."""
    for start in range(first, first + runs, chunk):
        for index in range(start, min(start + chunk, first + runs)):
            emit_run(emitter, agent, index)
        assert emitter.flush(120)


def not_closed(up: UpProcess, agent: str, runs: int) -> list[tuple[object, ...]]:
    """The agent's first runs (of ``0..runs``) that are missing or not closed."""
    found = {row[0]: row for row in up.reader.query(
        "SELECT run_id, status, outcome, steps FROM runs FINAL WHERE agent = {a:String}",
        {"a": agent}).rows}
    rows = (found.get(run_id(agent, n), (run_id(agent, n), "missing")) for n in range(runs))
    wrong = [row for row in rows if row[1] != "closed"]
    return wrong[:5] + ([(f"... {len(wrong)} in all",)] if len(wrong) > 5 else [])


def assert_exact(up: UpProcess, agent: str, runs: int) -> tuple[int, int]:
    """Every event of runs 0..runs stored once, every run closed with its outcome."""
    total = runs * EVENTS_PER_RUN
    wait_for(lambda: stored(up, agent)[0] >= total, 240, what=f"{total} events of {agent}")
    assert stored(up, agent) == (total, total)
    deadline = time.monotonic() + 120
    while wrong := not_closed(up, agent, runs):
        assert time.monotonic() < deadline, \
            f"runs of {agent} not closed after 120 s (run, status, outcome, steps): {wrong}"
        time.sleep(0.3)
    rows = up.reader.query("SELECT run_id, outcome, steps, llm_calls, input_tokens "
                           "FROM runs FINAL WHERE agent = {a:String}", {"a": agent}).rows
    assert {row[0]: row[1] for row in rows} == {run_id(agent, n): outcome(n)
                                                for n in range(runs)}
    assert {tuple(row[2:]) for row in rows} == {(3, 3, 300)}
    return total, len(rows)


def new_incarnation(up: UpProcess, before: BrokerAnnouncement,
                    rejoin: bool = True) -> BrokerAnnouncement:
    """Wait for ``up`` to have started a new broker (and, after a loss, to have
    restarted itself in place and announced its store service again)."""
    after = wait_for(lambda: (lambda record: record if record and record.incarnation
                              != before.incarnation and record.stopped_at is None
                              else None)(up.broker), 240, what="a new broker incarnation")
    if rejoin:
        up.rejoin(240)
    return after


def test_an_agent_restarted_with_a_non_empty_spool_resends_it(up: UpProcess, tmp_path: Path):
    """Finding: each Emitter spooled to a new random folder that nothing resent after the
    process exited. An agent emits 300 runs while ``up`` is stopped (the broker went with
    it: nothing uncommitted) and is SIGKILLed; ``up`` starts again (a new incarnation on
    the same port) and a new agent process on the same data dir adopts the dead one's
    spool folder, resends it with its own 100 runs, and every event is stored once."""
    agent = "restarted-agent"
    up.stop()
    assert up.broker is not None and up.broker.stopped_at is not None
    before = up.broker
    first = subprocess.Popen(
        [sys.executable, "-m", "tests.delivery_agent", str(up.data_dir), agent, "0", "300",
         "agent-1", "hang"], stdout=subprocess.PIPE, cwd=Path(__file__).parent.parent)
    try:
        assert first.stdout is not None
        figures = orjson.loads(first.stdout.readline())
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert figures["done"] and figures["logged"] == 300 * EVENTS_PER_RUN
    assert figures["sent"] == 0 and figures["unconfirmed"] == 300 * EVENTS_PER_RUN
    assert Path(figures["spool"]).name == "agent-1"
    up.start()
    assert new_incarnation(up, before, rejoin=False).bootstrap == before.bootstrap
    second = subprocess.run(
        [sys.executable, "-m", "tests.delivery_agent", str(up.data_dir), agent, "300", "100",
         "emitter", "confirm"], capture_output=True, timeout=600, check=False,
        cwd=Path(__file__).parent.parent)
    assert second.returncode == 0, second.stderr.decode()[-2000:]
    resumed = orjson.loads(second.stdout.splitlines()[-1])
    assert resumed["done"] and resumed["unconfirmed"] == 0
    assert resumed["resent"] == 300 * EVENTS_PER_RUN  # the dead agent's spool, adopted
    assert not Path(figures["spool"]).exists()
    events, runs = assert_exact(up, agent, 400)
    FIGURES["agent restarted"] = (f"emitted {events}, spooled by the killed agent "
                                  f"{figures['unconfirmed']}, stored {stored(up, agent)}, "
                                  f"runs exact {runs}")


def test_a_store_outage_then_a_broker_loss_loses_nothing(up: UpProcess, tmp_path: Path):
    """While ClickHouse refuses writes nothing is committed, so nothing is confirmed: the
    spool keeps exactly what was sent during the outage, a run's captured bodies too
    (they travel on loopwatch.captures, which the same group commits). The broker is then SIGKILLed
    (its memory, with every event of the outage, is gone) and restarted by ``up`` with
    a new incarnation; the SDK resends, and once the store is back every event is
    stored exactly once. Before, the events the broker held were lost with it."""
    agent = "outage-agent"
    with Emitter(data_dir=up.data_dir, spool_dir=tmp_path / "spool",
                 max_message_bytes=100_000) as emitter:
        assert emitter.confirming
        stream(emitter, agent, 0, 200)
        assert emitter.wait_confirmed(180)
        assert emitter.spool.size() == 0
        failures_before = up.health()["sink_failures"]
        store_down(up).touch()
        try:
            stream(emitter, agent, 200, 300)
            with emitter.run(agent=f"{agent}-captured", model="gpt-4o") as captured:
                captured.llm_call(prompt=PROMPT, response="No refund.", input_tokens=100)
                captured.end("cannot_complete")
            assert emitter.flush(60) and emitter.stats.captures_sent == 1
            wait_for(lambda: up.health()["sink_failures"] >= failures_before + 3, 120,
                     what="the processors to hit the unavailable store")
            polls = emitter.confirmations.polls if emitter.confirmations else 0
            wait_for(lambda: emitter.confirmations is not None
                     and emitter.confirmations.polls >= polls + 3, 60,
                     what="three confirmation rounds during the outage")
            held = emitter.unconfirmed
            assert held == 300 * EVENTS_PER_RUN + 4  # + 3 events and 1 capture
            assert not emitter.flush(3, confirmed=True)
            before = up.broker
            assert before is not None
            os.kill(before.pid, signal.SIGKILL)
            new_incarnation(up, before)
            stream(emitter, agent, 500, 100)
        finally:
            store_down(up).unlink()
        assert emitter.wait_confirmed(300)
        assert emitter.spool.size() == 0
        losses, resent = emitter.confirmations.losses if emitter.confirmations else 0, \
            emitter.stats.resent
    assert losses >= 1 and resent >= 300 * EVENTS_PER_RUN
    events, runs = assert_exact(up, agent, 600)
    assert wait_decided(up.reader, captured.run_id, parts=2)[:3] == [
        1, "failure:gave_up", "gave_up"]
    assert reassemble(up.reader, captured.run_id) == [("llm.call", "prompt", PROMPT),
                                                       ("llm.call", "response", "No refund.")]
    FIGURES["store outage + broker loss"] = (
        f"emitted {events} (+ a captured run), unconfirmed in the outage {held}, resent "
        f"{resent}, stored {stored(up, agent)}, runs exact {runs}")


def test_the_broker_killed_mid_stream_loses_nothing(own_up: UpProcess, tmp_path: Path):
    """Finding: the embedded broker keeps everything in memory, and the SDK forgot an
    event once the broker acknowledged it. SIGKILL the broker while an agent streams
    2,000 runs x 8 events; ``up`` restarts it on the same port with a new incarnation,
    the SDK sees the new incarnation and resends every event not yet confirmed: every
    event stored once, every run exact."""
    agent = "broker-killed"
    up = own_up
    before = up.broker
    assert before is not None
    with Emitter(data_dir=up.data_dir, spool_dir=tmp_path / "spool",
                 max_message_bytes=100_000) as emitter:
        stream(emitter, agent, 0, 800)
        wait_for(lambda: stored(up, agent)[0] >= 400 * EVENTS_PER_RUN, 180,
                 what="the processors to store part of the stream")
        stream(emitter, agent, 800, 200)  # acknowledged, in the broker, not all stored
        unconfirmed_at_kill = emitter.unconfirmed
        os.kill(before.pid, signal.SIGKILL)
        stream(emitter, agent, 1000, 500)  # while the broker is gone and restarting
        after = new_incarnation(up, before)
        assert after.bootstrap == before.bootstrap
        stream(emitter, agent, 1500, 500)
        assert emitter.wait_confirmed(300)
        resent = emitter.stats.resent
    assert unconfirmed_at_kill > 0, "the kill must land while events await confirmation"
    assert resent >= unconfirmed_at_kill
    events, runs = assert_exact(up, agent, 2000)
    FIGURES["broker SIGKILLed"] = (f"emitted {events}, unconfirmed at the kill "
                                   f"{unconfirmed_at_kill}, resent {resent}, stored "
                                   f"{stored(up, agent)}, runs exact {runs}")


def test_up_killed_mid_stream_loses_nothing_and_the_spool_waits_for_it(
        up: UpProcess, tmp_path: Path):
    """SIGKILL ``up`` while an agent streams (the broker outlives it and the next ``up``
    adopts it: tests/test_broker_lifecycle.py). While no processor runs nothing is
    committed, so the spool keeps at least everything emitted meanwhile; after the
    restart every event is stored once and the spool empties."""
    agent = "up-killed"
    with Emitter(data_dir=up.data_dir, spool_dir=tmp_path / "spool",
                 max_message_bytes=100_000) as emitter:
        stream(emitter, agent, 0, 600)
        wait_for(lambda: stored(up, agent)[0] >= 200 * EVENTS_PER_RUN, 180,
                 what="the processors to store part of the stream")
        up.kill()
        stream(emitter, agent, 600, 400)  # while no `up` runs
        polls = emitter.confirmations.polls if emitter.confirmations else 0
        wait_for(lambda: emitter.confirmations is not None
                 and emitter.confirmations.polls >= polls + 2, 60,
                 what="two confirmation rounds while up is down")
        waiting = emitter.unconfirmed
        assert waiting >= 400 * EVENTS_PER_RUN
        up.start()
        stream(emitter, agent, 1000, 200)
        assert emitter.wait_confirmed(300)
        assert emitter.spool.size() == 0
    events, runs = assert_exact(up, agent, 1200)
    FIGURES["up SIGKILLed"] = (f"emitted {events}, unconfirmed while up was down {waiting}, "
                               f"stored {stored(up, agent)}, runs exact {runs}")


def test_close_with_a_hung_broker_neither_raises_nor_drops(tmp_path: Path):
    """Finding: ``Emitter.close()`` raised KafkaTimeoutError and dropped what was in
    flight. A broker that stops answering (SIGSTOP) while events are in flight: close
    returns, and every event is in the spool; a new emitter on it sends them all once
    the broker answers."""
    with EmbeddedBroker(tmp_path / "broker.log") as broker:
        assert broker.pid is not None
        create_topic(broker.bootstrap, "hung")
        emitter = Emitter(broker.bootstrap, "hung", tmp_path / "spool")
        emit_run(emitter, "hung", 0)
        assert emitter.flush(30) and emitter.stats.sent == EVENTS_PER_RUN
        os.kill(broker.pid, signal.SIGSTOP)
        try:
            for index in range(1, 51):
                emit_run(emitter, "hung", index)
            emitter.close(timeout_s=2)  # raised KafkaTimeoutError here
            assert emitter.spool.unconfirmed() == 50 * EVENTS_PER_RUN
        finally:
            os.kill(broker.pid, signal.SIGCONT)
        again = Emitter(broker.bootstrap, "hung", tmp_path / "spool")
        assert again.wait_confirmed(120)
        assert again.stats.resent == 50 * EVENTS_PER_RUN
        again.close()
        assert again.spool.size() == 0
