"""`loopwatch up` on the embedded broker: stopping loses the broker's memory, so `up`
drains before it exits and rebuilds open runs from ClickHouse when it starts again."""

from __future__ import annotations

from pathlib import Path

import pytest

from loopwatch.ingest.sdk import Emitter, RunContext
from loopwatch.upprocess import UpProcess
from tests.conftest import PIPELINE_ENV, scalar, wait_for

pytestmark = pytest.mark.stack  # starts brokers / `loopwatch up` itself


def test_open_runs_survive_a_restart_of_the_embedded_stack(tmp_path: Path):
    up = UpProcess(tmp_path / "data", PIPELINE_ENV)
    with up:
        with Emitter(up.info["kafka_bootstrap"], spool_dir=tmp_path / "spool") as emitter:
            resumed = RunContext(emitter, "resumed-run", {"agent": "restart", "model": "gpt-4o"})
            resumed.start()
            resumed.step()
            stranded = RunContext(emitter, "stranded-run", {"agent": "restart"})
            stranded.start()
            stranded.step()
        assert emitter.stats.sent == 4
    # stopped: drained before exit, so all four events are stored; the broker is gone
    with up:
        reader = up.reader
        assert scalar(reader, "SELECT count() FROM events FINAL WHERE agent = 'restart'") == 4
        with Emitter(up.info["kafka_bootstrap"], spool_dir=tmp_path / "spool2") as emitter:
            resumed.emitter = emitter
            resumed.step()
            resumed.end("model_done")
        wait_for(lambda: scalar(reader, "SELECT outcome FROM runs FINAL "
                                        "WHERE run_id = 'resumed-run'") == "success", 60,
                 what="the resumed run to close")
        assert reader.query("SELECT steps, model FROM runs FINAL WHERE run_id = 'resumed-run'"
                            ).rows == [[2, "gpt-4o"]]
        wait_for(lambda: scalar(reader, "SELECT outcome FROM runs FINAL "
                                        "WHERE run_id = 'stranded-run'") == "abandoned", 60,
                 what="the stranded run to be abandoned after the restart")
