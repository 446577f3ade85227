"""``loopwatch status``: where a running ``up``'s parts are and how it is doing; one
line and exit 1 when no ``up`` runs on the data dir."""

from __future__ import annotations

import time

import orjson
import pytest

from tests.conftest import PIPELINE_ENV, wait_for
from tests.test_cli import loopwatch
from tests.test_cli_contract import assert_contract
from tests.test_cli_contract import loopwatch as hostile


def test_status_without_an_up_is_one_line_and_exit_1(tmp_path):
    result = hostile(["status"], tmp_path, LOOPWATCH_CLICKHOUSE_URL="")
    assert_contract(result, 1)
    data_dir = tmp_path / "data"
    assert result.stderr == (f"error: no `loopwatch up` runs on {data_dir}; start one with "
                             f"`loopwatch up --data-dir {data_dir}`\n")
    assert not (data_dir / "chdb").exists()


@pytest.mark.stack  # starts its own `loopwatch up`
def test_status_names_the_running_ups_parts_and_counts(tmp_path):
    """A `loopwatch up` of its own (own embedded broker), with one scripted run."""
    from loopwatch.ingest.sdk import Emitter
    from loopwatch.upprocess import UpProcess

    data_dir = tmp_path / "data"
    up = UpProcess(data_dir, {**PIPELINE_ENV, "LOOPWATCH_KAFKA_BOOTSTRAP": ""})
    up.env = {key: value for key, value in up.env.items() if value != ""}
    up.start(timeout_s=180)
    try:
        assert up.health()["events_stored_at"] is None
        emitted_at = time.time()
        with Emitter(up.info["kafka_bootstrap"], up.info["events_topic"],
                     spool_dir=tmp_path / "spool") as emitter:
            with emitter.run(agent="status-test", model="gpt-4o") as run:
                run.step()
            assert emitter.flush(30)
        wait_for(lambda: up.health()["counters"]["events"] == 3, 120,
                 what="the run's 3 events processed")
        stored_at = wait_for(lambda: up.health()["events_stored_at"], 60,
                             what="the time the store accepted the run's events")
        assert emitted_at < stored_at <= time.time()
        env = {key: value for key, value in up.env.items()}
        as_json = loopwatch("status", "--json", env=env)
        assert as_json.returncode == 0, as_json.stderr
        status = orjson.loads(as_json.stdout)
        assert status["pid"] == up.process.pid
        assert status["data_dir"] == str(data_dir.resolve())
        assert status["store"] == f"chdb://{data_dir.resolve() / 'chdb'}"
        assert status["kafka_bootstrap"] == up.info["kafka_bootstrap"]
        assert status["otlp_url"] == up.info["otlp_url"]
        assert status["embedded_broker"] is True
        assert status["counters"]["events"] == 3
        assert status["dead_letters"] == {"total": 0, "not_replayed": 0}
        assert status["rereads"] == {"holes": 0, "holes_accepted": 0, "stalls": 0}
        assert status["alerts_firing"] == []
        shown = loopwatch("status", env={**env, "COLUMNS": "200"})
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.splitlines()
        assert lines[0] == f"up: running, pid {up.process.pid}, data dir {data_dir.resolve()}"
        assert f"OTLP/HTTP: {up.info['otlp_url']}/v1/traces" in lines
        assert "dead letters: 0 (0 not replayed)" in lines
        (processors,) = [line for line in lines if line.startswith("processors:")]
        assert processors.endswith("; events 3, runs closed 1, store retries 0, "
                                   "broker retries 0, partitions read again 0"), processors
        assert lines[-1] == "alerts firing: 0"
    finally:
        up.stop(timeout_s=120)
