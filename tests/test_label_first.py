"""A label for a run the pipeline does not know (issue 24 §6): stored, counted
(``labels_unmatched``), no phantom "running" run; applied once if its run comes later,
also after the embedded stack restarted and its changelog was gone."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from loopwatch.ingest.sdk import Emitter, RunContext
from loopwatch.upprocess import UpProcess
from tests.conftest import PIPELINE_ENV, scalar, wait_for

LABEL_COUNTERS = ("labels_unmatched", "pending_labels_matched", "pending_labels_expired")


def counters(pipeline: UpProcess) -> tuple[int, ...]:
    current = pipeline.health()["counters"]
    return tuple(current[name] for name in LABEL_COUNTERS)


def labels_stored(reader, run_id: str) -> int:
    return int(scalar(reader, "SELECT count() FROM labels FINAL WHERE run_id = {r:String}",
                      r=run_id))


def runs_rows(reader, run_id: str) -> list[list[object]]:
    return reader.query("SELECT status, outcome, label_source, steps FROM runs FINAL "
                        "WHERE run_id = {r:String}", {"r": run_id}).rows


def test_a_label_for_a_run_that_never_comes_makes_no_run(emitter, pipeline, reader, agent):
    before = counters(pipeline)
    run_id = f"{agent}-never"
    RunContext(emitter, run_id, {"agent": agent}).label("wrong", label_source="human")
    assert emitter.flush(30)
    wait_for(lambda: labels_stored(reader, run_id) == 1, 60, what="the label stored")
    wait_for(lambda: counters(pipeline)[0] == before[0] + 1, 30, what="the label counted")
    assert runs_rows(reader, run_id) == []
    assert counters(pipeline) == (before[0] + 1, before[1], before[2])
    wait_for(lambda: scalar(reader, "SELECT count() FROM pipeline_gauges "
                                    "WHERE name = 'labels_unmatched' AND value >= 1"), 60,
             what="the labels_unmatched gauge")


def test_a_label_before_its_run_is_applied_once_when_the_run_comes(emitter, pipeline,
                                                                    reader, agent):
    before = counters(pipeline)
    run_id = f"{agent}-late-run"
    run = RunContext(emitter, run_id, {"agent": agent})
    run.label("wrong", label_source="human")
    assert emitter.flush(30)
    wait_for(lambda: labels_stored(reader, run_id) == 1, 60, what="the label stored")
    assert runs_rows(reader, run_id) == []
    run.start()
    run.step()
    run.end("model_done")
    assert emitter.flush(30)
    wait_for(lambda: runs_rows(reader, run_id) == [["closed", "wrong", "human", 1]], 60,
             what="the run closed with its label")
    assert labels_stored(reader, run_id) == 1
    assert counters(pipeline) == (before[0] + 1, before[1] + 1, before[2])


@pytest.mark.stack  # starts its own broker / `loopwatch up`
def test_a_waiting_label_survives_a_restart_of_the_embedded_stack(tmp_path: Path):
    """The embedded broker forgets the changelog on stop: the waiting label's state is
    rebuilt from the ``labels`` table, and the run that comes after the restart gets it."""
    run_id = f"label-first-{uuid.uuid4().hex[:8]}"
    up = UpProcess(tmp_path / "data", PIPELINE_ENV)
    with up:
        with Emitter(up.info["kafka_bootstrap"], spool_dir=tmp_path / "spool") as emitter:
            run = RunContext(emitter, run_id, {"agent": "label-first"})
            run.label("wrong", label_source="human")
        wait_for(lambda: labels_stored(up.reader, run_id) == 1, 60, what="the label stored")
        assert counters(up) == (1, 0, 0)
    with up:
        reader = up.reader
        assert runs_rows(reader, run_id) == []
        with Emitter(up.info["kafka_bootstrap"], spool_dir=tmp_path / "spool2") as emitter:
            run.emitter = emitter
            run.start()
            run.step()
            run.end("model_done")
        wait_for(lambda: runs_rows(reader, run_id) == [["closed", "wrong", "human", 1]], 90,
                 what="the run closed with the label from before the restart")
        assert labels_stored(reader, run_id) == 1
        assert counters(up) == (0, 1, 0)
