"""The investigation queries (docs/investigations.md), run on the scripted fleet with exact
results."""

from __future__ import annotations

from pathlib import Path

import pytest

from loopwatch.investigations import investigations
from tests import scripted

PAGE = Path(__file__).resolve().parent.parent / "docs" / "investigations.md"


@pytest.fixture(scope="module")
def fleet(broker, pipeline, reader, tmp_path_factory) -> tuple[str, scripted.Expected]:
    return scripted.emit_and_wait(broker.bootstrap, reader, "investigated-fleet",
                                  tmp_path_factory.mktemp("spool"))


def run(reader, name: str, **parameters):
    return reader.query(investigations()[name].sql, parameters).records()


def test_the_page_shows_every_investigation_verbatim():
    text = PAGE.read_text()
    assert len(investigations()) >= 5
    for investigation in investigations().values():
        assert investigation.sql in text, investigation.name


def test_top_cost_runs(fleet, reader):
    agent, expected = fleet
    rows = run(reader, "top_cost_runs", agent=agent)
    assert len(rows) == 10
    assert rows[0]["run_id"] == expected.run_ids["success"][0]
    assert rows[0]["cost_usd"] == pytest.approx(0.1737)
    assert [row["outcome"] for row in rows[1:4]] == [
        "looped", "budget_exhausted", "budget_exhausted"]


def test_loop_pattern_of_one_run(fleet, reader):
    _, expected = fleet
    rows = run(reader, "loop_pattern", run_id=expected.run_ids["looped"][0])
    assert [(r["tool"], r["calls"], r["first_step"], r["last_step"]) for r in rows] == [
        ("grep", 3, 0, 2)]


def test_outcome_mix_by_prompt_version(fleet, reader):
    agent, _ = fleet
    rows = run(reader, "outcome_mix_by_prompt_version", agent=agent)
    assert {(r["prompt_version"], r["outcome"], r["runs"]) for r in rows} == {
        ("p1", outcome, runs) for outcome, runs in scripted.RUNS.items()}
    assert sum(r["share"] for r in rows) == pytest.approx(1.0, abs=0.002)


def test_near_misses_by_tool(fleet, reader):
    agent, _ = fleet
    rows = run(reader, "near_misses_by_tool", agent=agent)
    assert rows == [
        {"tool": "search", "calls": 8, "timeouts": 5, "known_durations": 4, "near_misses": 3,
         "near_miss_ratio": 0.75},
        {"tool": "grep", "calls": 3, "timeouts": 0, "known_durations": 0, "near_misses": 0,
         "near_miss_ratio": None},
    ]


def test_cache_hit_rate_by_deployment(fleet, reader):
    agent, _ = fleet
    rows = run(reader, "cache_hit_rate_by_deployment", agent=agent)
    assert rows == [{"deployment": "d1", "prompt_version": "p1", "calls": 28,
                     "cache_hit_rate": round(84000 / 145000, 3)}]
