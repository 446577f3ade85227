"""Faults the pipeline must survive: a processor killed mid-stream, and bad input."""

from __future__ import annotations

import operator
import threading
import time
from collections.abc import Iterator

import pytest
from kafka import KafkaConsumer, TopicPartition

from loopwatch.core.config import Settings
from loopwatch.core.embedded.broker import EmbeddedBroker
from loopwatch.ingest.sdk import Emitter, RunContext
from loopwatch.upprocess import UpProcess
from tests.conftest import scalar, stored_events, wait_for, wait_stored, wait_while_progressing
from tests.test_capture import reassemble, wait_decided

RUNS = 1500
PROMPT = [{"role": "user", "content": "Refund order 7, please."}]
SETTINGS = Settings()


@pytest.fixture(autouse=True)
def pipeline_restored(pipeline: UpProcess) -> Iterator[None]:
    """These tests stop and kill the session's ``up``: whatever one of them ends with, the
    next test (here or in another module) gets it running again, not a dead socket."""
    yield
    pipeline.start()


#: (end offsets, committed offsets) by partition
Offsets = tuple[dict[int, int], dict[int, int]]


def offsets(bootstrap: str) -> Offsets:
    """(end offsets, offsets the processors' group committed) of the events topic."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=SETTINGS.consumer_group,
                             enable_auto_commit=False)
    try:
        topic = SETTINGS.events_topic
        partitions = [TopicPartition(topic, p)
                      for p in sorted(consumer.partitions_for_topic(topic) or ())]
        ends = {tp.partition: offset for tp, offset in consumer.end_offsets(partitions).items()}
        committed = {tp.partition: consumer.committed(tp) or 0 for tp in partitions}
        return ends, committed
    finally:
        consumer.close()


def progress(broker: EmbeddedBroker, pipeline: UpProcess
             ) -> tuple[Offsets, dict[str, int]]:
    """What moves while the processors work: the topic's offsets (end, committed) and
    the processors' counters, in one observation."""
    return offsets(broker.bootstrap), pipeline.health()["counters"]


def test_processor_killed_mid_stream_loses_nothing_and_counts_nothing_twice(
        broker, pipeline: UpProcess, reader, emitter: Emitter, agent: str):
    """Guarantee: offsets are committed only after ClickHouse accepted the rows, and
    re-processing after a crash (SIGKILL: no drain, no final commit) must not double
    count: raw events, per-run counters and outcomes all come out exact."""
    total = RUNS * 6
    killed_at: list[int] = []

    def kill_when_a_tenth_is_stored() -> None:
        stored = wait_for(lambda: stored_events(reader, agent) >= total // 10 and
                          stored_events(reader, agent), 120, interval_s=0.05,
                          what="the processor to be mid-stream")
        pipeline.kill()
        killed_at.append(stored)

    killer = threading.Thread(target=kill_when_a_tenth_is_stored)
    killer.start()
    outcomes = ("model_done", "cannot_complete", "crash")
    for index in range(RUNS):
        with emitter.run(agent=agent, task_type="bulk", model="gpt-4o") as run:
            for _ in range(2):
                run.step()
                run.llm_call(input_tokens=1000, output_tokens=10)
            run.end(outcomes[index % 3])
        if index % 75 == 74:  # a stream, not one burst: the kill must land inside it
            assert emitter.flush(30)
            time.sleep(0.25)
    assert emitter.flush(60)
    killer.join()
    assert killed_at[0] < total, "the kill must land mid-stream for this test to mean it"
    pipeline.start()
    # the killed up's OTLP receiver outlives it while it stops; the new one waits for it
    assert pipeline.info["otlp_url"], "the restarted up must have its OTLP receiver"
    wait_stored(reader, agent, total, timeout_s=240)
    wait_for(lambda: scalar(reader, "SELECT count() FROM runs FINAL WHERE agent = {a:String} "
                                    "AND status = 'closed'", a=agent) == RUNS, 120,
             what="every run closed")
    assert stored_events(reader, agent) == total
    row = reader.query(
        "SELECT count(), sum(llm_calls), sum(steps), sum(input_tokens), "
        "countIf(outcome = 'success'), countIf(outcome = 'gave_up'), "
        "countIf(outcome = 'hard_error') FROM runs FINAL WHERE agent = {a:String}",
        {"a": agent}).rows[0]
    assert row == [RUNS, RUNS * 2, RUNS * 2, RUNS * 2000, RUNS // 3, RUNS // 3, RUNS // 3]
    calls = scalar(reader, "SELECT count() FROM llm_calls FINAL WHERE agent = {a:String}",
                   a=agent)
    assert calls == RUNS * 2



def test_store_unavailable_processors_wait_and_lose_nothing(
        broker: EmbeddedBroker, pipeline: UpProcess, reader, emitter: Emitter, agent: str):
    """Guarantee: while ClickHouse refuses writes the processors stop there (nothing is
    acked, so no offset moves past the refused batch) and, once it is back, every event is
    stored exactly once. The in-process chdb store cannot be stopped on its own, so the
    fault is injected at the sink (a marker file the sink checks; see FaultInjectingSink).

    Stopped during the outage (SIGTERM), the processor drains for its
    ``drain_timeout_s`` (10 s here), then gives up its retries and exits by itself;
    it used to retry until the supervisor's SIGKILL. What it had not stored is read
    again by the next processor, the captured bodies of a run too.

    A run left open before the outage passes its abandonment TTL (6 s) during it. The
    sweep used to abandon it then: the state change reached the changelog while the
    row did not reach ClickHouse, so the restarted processor recovered the run closed
    and its row said ``running`` for good. The change now waits for the row, so the
    run is abandoned, and stored so, after the restart."""
    marker = pipeline.data_dir / "store-down"
    stranded = RunContext(emitter, f"stranded-{agent}", {"agent": agent, "model": "gpt-4o"})
    stranded.start()
    stranded.step()
    assert emitter.flush(30)
    wait_stored(reader, agent, 2, timeout_s=60)
    wait_while_progressing(lambda: progress(broker, pipeline),
                           lambda seen: operator.eq(*seen[0]),
                           what="the open run's offsets to be committed")
    before_outage, _ = offsets(broker.bootstrap)
    marker.touch()
    try:
        failures_before = pipeline.health()["sink_failures"]
        for _ in range(50):
            with emitter.run(agent=agent, model="gpt-4o") as run:
                run.step()
                run.llm_call(input_tokens=100, output_tokens=10)
        with emitter.run(agent=agent, model="gpt-4o") as captured:
            captured.llm_call(prompt=PROMPT, response="No refund.", input_tokens=100)
            captured.end("cannot_complete")
        assert emitter.flush(30)
        assert emitter.stats.captures_sent == 1
        wait_for(lambda: pipeline.health()["sink_failures"] >= failures_before + 3, 60,
                 what="the processors to hit the unavailable store")
        time.sleep(2)  # two commit intervals: a wrongly acked batch would be committed now
        ends, committed = offsets(broker.bootstrap)
        assert ends != before_outage, "the events must have reached the broker"
        assert all(committed[p] <= before_outage[p] for p in committed), (
            f"offsets committed past unstored events: {committed} > {before_outage}")
        assert stored_events(reader, agent) == 2
        assert pipeline.stop(timeout_s=80) == 0, "stopped by SIGKILL: its retries held it"
        assert "not drained in 10 s" in (pipeline.data_dir / "logs" / "worker.log").read_text()
        _, committed = offsets(broker.bootstrap)
        assert all(committed[p] <= before_outage[p] for p in committed), (
            f"a stop committed unstored events: {committed} > {before_outage}")
    finally:
        marker.unlink()
    pipeline.start()
    wait_stored(reader, agent, 205, timeout_s=120)
    assert stored_events(reader, agent) == 205
    wait_while_progressing(lambda: progress(broker, pipeline),
                           lambda seen: all(committed >= ends[p]
                                            for p, committed in seen[0][1].items()),
                           what="the stored events' offsets to be committed")

    def run_rows() -> list[object]:
        """Run rows are written once per batch, after its events: wait for them too."""
        return reader.query("SELECT count(), sum(llm_calls), countIf(outcome = 'success') "
                            "FROM runs FINAL WHERE agent = {a:String}", {"a": agent}).rows[0]

    wait_for(lambda: run_rows() == [52, 51, 50], 60, what="every run's row")
    assert run_rows() == [52, 51, 50]
    wait_for(lambda: scalar(reader, "SELECT outcome FROM runs FINAL WHERE run_id = {r:String}",
                            r=stranded.run_id) == "abandoned", 60,
             what="the run abandoned during the outage to be stored so")
    assert wait_decided(reader, captured.run_id, parts=2)[:3] == [1, "failure:gave_up", "gave_up"]
    assert reassemble(reader, captured.run_id) == [("llm.call", "prompt", PROMPT),
                                                    ("llm.call", "response", "No refund.")]
