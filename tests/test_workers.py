"""Scaling out: an extra `loopwatch worker` shares the partitions, writing through the
store owner; when it dies the owner's worker takes its partitions over."""

from __future__ import annotations

import subprocess
import sys
import time

from loopwatch.ingest.sdk import Emitter
from tests.conftest import scalar, stored_events, wait_for, wait_stored


def emit_runs(emitter: Emitter, agent: str, runs: int, pace_every: int = 50) -> int:
    for index in range(runs):
        with emitter.run(agent=agent, model="gpt-4o") as run:
            run.step()
            run.llm_call(input_tokens=100, output_tokens=10)
        if index % pace_every == pace_every - 1:
            emitter.flush(30)
            time.sleep(0.2)
    emitter.flush(60)
    return runs * 4


def test_an_extra_worker_shares_partitions_and_its_death_loses_nothing(
        pipeline, reader, emitter, agent):
    """Guarantee: with two processes in the group every event is stored exactly once;
    after one is killed (SIGKILL) the other takes its partitions and nothing is lost."""
    extra = subprocess.Popen([sys.executable, "-m", "loopwatch.cli", "worker"],
                             env=pipeline.env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        owner_before = pipeline.health()["counters"]["events"]
        time.sleep(20)  # let the group rebalance onto two members
        total = emit_runs(emitter, agent, 400)
        wait_stored(reader, agent, total, timeout_s=120)
        owner_share = pipeline.health()["counters"]["events"] - owner_before
        assert 0 < owner_share < total, "the extra worker should have taken some partitions"
        extra.kill()
        extra.wait()
        more = emit_runs(emitter, f"{agent}-after", 200)
        wait_stored(reader, f"{agent}-after", more, timeout_s=180)
    finally:
        if extra.poll() is None:
            extra.kill()
    assert stored_events(reader, agent) == total
    assert stored_events(reader, f"{agent}-after") == more
    for name, runs in ((agent, 400), (f"{agent}-after", 200)):
        row = reader.query("SELECT count(), sum(llm_calls), countIf(outcome = 'success') "
                           "FROM runs FINAL WHERE agent = {a:String}", {"a": name}).rows[0]
        assert row == [runs, runs, runs]
    wait_for(lambda: scalar(reader, "SELECT count() FROM llm_calls FINAL WHERE agent = "
                                    "{a:String}", a=agent) == 400, 30)
