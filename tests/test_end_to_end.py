"""Scripted fleet -> real broker -> real faust processor -> real chdb: exact figures."""

from __future__ import annotations

import pytest

from loopwatch.ingest.sdk import Emitter
from tests import scripted
from tests.conftest import scalar, wait_for

METRICS_SQL = """
SELECT sum(closed_runs), sum(silent_failures), sum(hard_errors), sum(successes),
       sum(silent_failures) / sum(closed_runs), sum(hard_errors) / sum(closed_runs),
       sum(cost_usd) / sum(successes)
FROM run_metrics_1m WHERE agent = {agent:String}
"""


@pytest.fixture(scope="module")
def fleet(broker, pipeline, reader, tmp_path_factory) -> tuple[str, scripted.Expected]:
    return scripted.emit_and_wait(broker.bootstrap, reader, "scripted-fleet",
                                  tmp_path_factory.mktemp("spool"))


def test_every_run_gets_its_outcome(fleet, reader):
    agent, expected = fleet
    rows = reader.query("SELECT run_id, outcome FROM runs FINAL WHERE agent = {a:String}",
                        {"a": agent}).rows
    found = {run_id: outcome for run_id, outcome in rows}
    assert found == {run_id: outcome for outcome, ids in expected.run_ids.items()
                     for run_id in ids}


def test_silent_failure_ratio_and_exception_rate(fleet, reader):
    agent, _ = fleet
    closed, silent, hard, successes, ratio, exceptions, per_success = reader.query(
        METRICS_SQL, {"agent": agent}).rows[0]
    assert (closed, silent, hard, successes) == (10, 4, 1, 4)
    assert ratio == pytest.approx(0.4)
    assert exceptions == pytest.approx(0.1)
    assert per_success == pytest.approx(sum(scripted.COSTS.values()) / 4)


def test_near_miss_timeout_ratio(fleet, reader):
    agent, _ = fleet
    row = reader.query(
        "SELECT sum(calls), sum(timeouts), sum(timeouts_known_duration), sum(near_misses), "
        "sum(near_misses) / sum(timeouts_known_duration) FROM tool_metrics_1m "
        "WHERE agent = {a:String} AND tool = 'search'", {"a": agent}).rows[0]
    assert row[:4] == [8, 5, 4, 3]
    assert row[4] == pytest.approx(0.75)


def test_cache_hit_rate(fleet, reader):
    agent, _ = fleet
    read, write, uncached, rate = reader.query(
        "SELECT sum(cache_read_input_tokens), sum(cache_creation_input_tokens), "
        "sum(uncached_input_tokens), sum(cache_read_input_tokens) / sum(cache_read_input_tokens"
        " + cache_creation_input_tokens + uncached_input_tokens) FROM cache_metrics_1m "
        "WHERE agent = {a:String}",
        {"a": agent}).rows[0]
    assert (read, write, uncached) == (scripted.CACHE_READ, scripted.CACHE_WRITE,
                                       scripted.UNCACHED)
    assert rate == pytest.approx(84000 / (84000 + 6000 + 55000))


def test_seed_cache_example_costs_0_1737(fleet, reader):
    _, expected = fleet
    cache_run = expected.run_ids["success"][0]
    cost = scalar(reader, "SELECT cost_usd FROM runs FINAL WHERE run_id = {r:String}",
                  r=cache_run)
    assert cost == pytest.approx(0.0225 + 0.0252 + 0.126)


def test_cost_per_outcome(fleet, reader):
    agent, _ = fleet
    rows = reader.query("SELECT outcome, sum(runs), sum(cost_usd), sum(cost_usd) / sum(runs) "
                        "FROM outcomes_1m WHERE agent = {a:String} GROUP BY outcome",
                        {"a": agent}).rows
    found = {outcome: (runs, total, mean) for outcome, runs, total, mean in rows}
    assert set(found) == set(scripted.RUNS)
    for outcome, runs in scripted.RUNS.items():
        assert found[outcome][0] == runs
        assert found[outcome][1] == pytest.approx(scripted.COSTS[outcome])
        assert found[outcome][2] == pytest.approx(scripted.COSTS[outcome] / runs)


def test_late_wrong_label_revises_stored_ratio(fleet, reader, emitter: Emitter):
    agent, expected = fleet
    labelled = expected.run_ids["success"][1]
    closed_minute = scalar(reader, "SELECT toStartOfMinute(closed_ts) FROM runs FINAL "
                                   "WHERE run_id = {r:String}", r=labelled)
    from loopwatch.ingest.events import Label

    emitter.emit(Label(run_id=labelled, agent=agent, verdict="wrong",
                       label_source="post_hoc_check"))
    emitter.flush()
    wait_for(lambda: scalar(reader, "SELECT outcome FROM runs FINAL WHERE run_id = {r:String}",
                            r=labelled) == "wrong", 60, what="the label to land")
    closed, silent, _, successes, ratio, *_ = reader.query(METRICS_SQL, {"agent": agent}).rows[0]
    assert (closed, silent, successes) == (10, 5, 3)
    assert ratio == pytest.approx(0.5)
    still_minute = scalar(reader, "SELECT toStartOfMinute(closed_ts) FROM runs FINAL "
                                  "WHERE run_id = {r:String}", r=labelled)
    assert still_minute == closed_minute  # the revision lands in the minute the run closed
    wrong = reader.query("SELECT sum(runs), sum(cost_usd) FROM outcomes_1m "
                         "WHERE agent = {a:String} AND outcome = 'wrong'", {"a": agent}).rows[0]
    assert wrong[0] == 1
    assert wrong[1] == pytest.approx(scripted.SIMPLE_COST)
