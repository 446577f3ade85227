"""Fault: the broker unreachable for 30 s, and for longer than a write may wait.

The embedded broker (Tansu) keeps its topics in memory, so it cannot be restarted
without loss; it is paused instead (SIGSTOP, then SIGCONT): connections stay open and
nothing answers, which is what an unreachable broker looks like to a client.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from kafka import KafkaConsumer, TopicPartition

from loopwatch.core.config import Settings, load_settings
from loopwatch.core.embedded.broker import EmbeddedBroker
from loopwatch.core.processes import children
from loopwatch.ingest.sdk import Emitter, RunContext
from loopwatch.upprocess import UpProcess
from tests.conftest import PIPELINE_ENV, scalar, stored_events, wait_for, wait_stored

PAUSE_S = 30.0
RUNS_BEFORE, RUNS_DURING, RUNS_AFTER = 20, 40, 20
EVENTS_PER_RUN = 4  # run.start, step, llm.call, run.end


def emit_runs(emitter: Emitter, agent: str, runs: int) -> None:
    for _ in range(runs):
        with emitter.run(agent=agent, model="gpt-4o") as run:
            run.step()
            run.llm_call(input_tokens=100, output_tokens=10)


def test_broker_paused_for_30s_emitters_spool_and_resend_nothing_lost(
        broker: EmbeddedBroker, pipeline: UpProcess, reader, emitter: Emitter, agent: str,
        tmp_path: Path):
    """Guarantee: while the broker does not answer, emitters never block the agent and
    lose nothing. Two emitters see the outage: one already connected (the ``emitter``
    fixture; its producer holds unacknowledged events and retries them, spooling what
    still fails when its retries run out) and one an agent starts during the outage (it
    cannot bootstrap, so every event goes to the on-disk spool and is resent once the
    broker answers). Duplicates from resends are harmless (``event_id`` deduplicates).
    Afterwards every event is stored exactly once, every run has exact counters, and the
    shared pipeline keeps consuming (runs emitted after the pause are stored too)."""
    assert broker.pid is not None
    emit_runs(emitter, agent, RUNS_BEFORE)
    assert emitter.flush(30)
    wait_stored(reader, agent, RUNS_BEFORE * EVENTS_PER_RUN)

    late = Emitter(broker.bootstrap, spool_dir=tmp_path / "spool-late",
                   max_message_bytes=100_000)
    os.kill(broker.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        emit_runs(emitter, agent, RUNS_DURING)  # returns at once: nothing waits on Kafka
        emit_runs(late, f"{agent}-late", RUNS_DURING)
        wait_for(lambda: late.stats.spooled == RUNS_DURING * EVENTS_PER_RUN, PAUSE_S,
                 what="the emitter started during the outage to spool everything")
        assert late.stats.sent == 0
        time.sleep(max(0.0, PAUSE_S - (time.monotonic() - started)))
    finally:
        os.kill(broker.pid, signal.SIGCONT)

    total = (RUNS_BEFORE + RUNS_DURING) * EVENTS_PER_RUN
    try:
        for running in (emitter, late):
            wait_for(lambda running=running: running.spool.size() == 0
                     and running.outstanding == 0, 120, what="the spool to be resent")
        assert late.stats.resent >= RUNS_DURING * EVENTS_PER_RUN
        assert late.stats.sent >= RUNS_DURING * EVENTS_PER_RUN
    finally:
        late.close(10)
    wait_stored(reader, agent, total, timeout_s=180)
    wait_stored(reader, f"{agent}-late", RUNS_DURING * EVENTS_PER_RUN, timeout_s=180)

    # The shared pipeline still consumes after the pause (other tests rely on it).
    emit_runs(emitter, f"{agent}-after", RUNS_AFTER)
    assert emitter.flush(60)
    wait_stored(reader, f"{agent}-after", RUNS_AFTER * EVENTS_PER_RUN, timeout_s=180)

    assert stored_events(reader, agent) == total
    assert stored_events(reader, f"{agent}-late") == RUNS_DURING * EVENTS_PER_RUN
    assert stored_events(reader, f"{agent}-after") == RUNS_AFTER * EVENTS_PER_RUN
    for name, runs in ((agent, RUNS_BEFORE + RUNS_DURING), (f"{agent}-late", RUNS_DURING),
                       (f"{agent}-after", RUNS_AFTER)):
        wait_for(lambda name=name, runs=runs: scalar(
            reader, "SELECT count() FROM runs FINAL WHERE agent = {a:String} "
                    "AND status = 'closed'", a=name) == runs, 60, what=f"{name} runs closed")
        row = reader.query("SELECT count(), sum(steps), sum(llm_calls), sum(input_tokens), "
                           "countIf(outcome = 'success') FROM runs FINAL "
                           "WHERE agent = {a:String}", {"a": name}).rows[0]
        assert row == [runs, runs, runs, runs * 100, runs]
        calls = scalar(reader, "SELECT count() FROM llm_calls FINAL WHERE agent = {a:String}",
                       a=name)
        assert calls == runs
    assert pipeline.running
    print(f"\nbroker paused {PAUSE_S:.0f}s: connected emitter spooled "
          f"{emitter.stats.spooled}, resent {emitter.stats.resent}; emitter started in the "
          f"outage spooled {late.stats.spooled}, resent {late.stats.resent}")


def retries_shown(log: Path) -> int:
    """The broker retries ``up``'s latest status line shows (0 before the first)."""
    lines = [line for line in log.read_text().splitlines() if "broker retries" in line]
    return int(lines[-1].rsplit(" ", 1)[1]) if lines else 0


def _child_pid(parent: int, name: str) -> int:
    """The pid of ``parent``'s child whose command name starts with ``name``."""
    found = children(parent)
    for pid in found:
        if Path(f"/proc/{pid}/comm").read_text().strip().startswith(name):
            return pid
    raise LookupError(f"no child {name!r} of {parent}: {found}")


def _committed_everything(bootstrap: str, settings: Settings) -> bool:
    """Whether the processors' committed offsets reached the end of every partition."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=settings.consumer_group,
                             enable_auto_commit=False)
    try:
        partitions = [TopicPartition(settings.events_topic, p)
                      for p in consumer.partitions_for_topic(settings.events_topic) or ()]
        ends = consumer.end_offsets(partitions)
        return all((consumer.committed(tp) or 0) == ends[tp] for tp in partitions)
    finally:
        consumer.close()


@pytest.mark.stack  # starts its own broker / `loopwatch up`
def test_writes_that_fail_in_a_long_outage_are_sent_again_and_commits_go_on(tmp_path: Path):
    """Guarantee: a processor write to Kafka that gives up (here the state changelog of a
    run the sweep abandons while the broker is paused, past a 2 s producer timeout) is
    sent again once the broker answers; the processor neither stops committing offsets
    (every later batch waited on the failed one's acks) nor exits, which on the embedded
    broker would take the broker's memory with it. `up`'s status line shows the retries
    while the outage lasts. Counts stay exact."""
    env = {**PIPELINE_ENV, "LOOPWATCH_PRODUCER_REQUEST_TIMEOUT_S": "2"}
    up = UpProcess(tmp_path / "data", env)
    with up:
        assert up.process is not None
        broker_pid = _child_pid(up.process.pid, "tansu")
        bootstrap = up.info["kafka_bootstrap"]
        reader = up.reader
        settings = load_settings(data_dir=up.data_dir)
        with Emitter(bootstrap, spool_dir=tmp_path / "spool") as emitter:
            stranded = RunContext(emitter, "stranded-in-outage", {"agent": "outage"})
            stranded.start()
            stranded.step()
            assert emitter.flush(30)
            wait_stored(reader, "outage", 2)
            os.kill(broker_pid, signal.SIGSTOP)
            try:  # abandon TTL 6 s + sweep 1 s + producer timeout 2 s + a status line
                wait_for(lambda: retries_shown(up.data_dir / "logs" / "up.log") >= 1, 120,
                         what="up's status line to show a broker retry")
            finally:
                os.kill(broker_pid, signal.SIGCONT)
            emit_runs(emitter, "outage-after", 3)
            assert emitter.flush(30)
        wait_stored(reader, "outage-after", 3 * EVENTS_PER_RUN, timeout_s=120)
        wait_for(lambda: scalar(reader, "SELECT outcome FROM runs FINAL "
                                        "WHERE run_id = 'stranded-in-outage'") == "abandoned",
                 60, what="the stranded run to be abandoned")
        wait_for(lambda: _committed_everything(bootstrap, settings), 60,
                 what="the processors to commit every partition's offsets")
        assert up.running
        assert reader.query("SELECT agent, count(), sum(steps), sum(llm_calls) "
                            "FROM runs FINAL GROUP BY agent ORDER BY agent").rows == [
            ["outage", 1, 1, 0], ["outage-after", 3, 3, 3]]
        assert up.health()["kafka_write_retries"] >= 1
