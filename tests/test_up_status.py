"""``loopwatch up``'s status line: printed again whenever the pipeline's counters move.

The status callable hands back the processors' *live* counters dict (``vars`` of the
counters object), as ``run_up`` does, mutated in place between polls.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from loopwatch.runtime import _report_status
from tests.conftest import wait_for


def test_the_status_line_is_reported_each_time_the_live_counters_move():
    counters = {"events": 0, "runs_closed": 0}
    live = {"counters": counters, "sink_failures": 0, "kafka_write_retries": 0}
    #: what the pipeline does between polls: None = nothing moved
    script: list[dict[str, Any] | None] = [
        None, {"events": 5}, None, {"events": 570, "runs_closed": 12}, None,
        {"runs_closed": 13}, None]
    polls = 0
    reported: list[tuple[int, int, int]] = []
    stop = threading.Event()

    def status() -> dict[str, Any]:
        nonlocal polls
        step = script[polls] if polls < len(script) else None
        polls += 1
        if step == {"runs_closed": 13}:
            live["sink_failures"] = 2  # a retry alone moves the line too
        if step:
            counters.update(step)
        return live

    def on_status(current: dict[str, Any]) -> None:
        reported.append((current["counters"]["events"], current["counters"]["runs_closed"],
                         current["sink_failures"]))

    _report_status(status, on_status, every_s=0.01, stop=stop)
    try:
        wait_for(lambda: polls > len(script) + 2, 60, what="the reporter to poll past the script")
    finally:
        stop.set()
    assert reported == [(0, 0, 0), (5, 0, 0), (570, 12, 0), (570, 13, 2)]


@pytest.mark.stack
def test_a_stopped_up_says_how_many_events_it_stored(tmp_path):
    """SIGTERM/Ctrl-C drained and exited printing nothing; it says it drains, then ends
    with the count.
    A `loopwatch up` of its own (own embedded broker): it is stopped here."""
    from loopwatch.ingest.sdk import Emitter
    from loopwatch.upprocess import UpProcess
    from tests.conftest import PIPELINE_ENV

    up = UpProcess(tmp_path / "data", {**PIPELINE_ENV, "LOOPWATCH_KAFKA_BOOTSTRAP": "",
                                       "LOOPWATCH_DRAIN_TIMEOUT_S": "30"})
    up.env = {key: value for key, value in up.env.items() if value != ""}
    up.start(timeout_s=180)
    try:
        with Emitter(up.info["kafka_bootstrap"], up.info["events_topic"],
                     spool_dir=tmp_path / "spool") as emitter:
            with emitter.run(agent="stop-test", model="gpt-4o") as run:
                run.step()
                run.llm_call(input_tokens=10, output_tokens=1)
            assert emitter.flush(30)
        wait_for(lambda: up.health()["counters"]["events"] == 4, 120,
                 what="the run's 4 events processed")
        wait_for(lambda: "events 4 " in (tmp_path / "data" / "logs" / "up.log").read_text(),
                 60, what="the status line to report them")
    finally:
        assert up.stop(timeout_s=120) == 0
    log = (tmp_path / "data" / "logs" / "up.log").read_text().splitlines()
    assert log[-1] == "stopped: 4 events stored"
    drains = [line for line in log if line.startswith("draining: ")]
    assert drains == ["draining: storing what the broker holds (at most 30 s; "
                      "Ctrl-C again stops at once)"]
