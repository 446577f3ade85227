"""Trace economics: the seed's worked example as the test vector, then an agent's numbers
from a scripted store (real in-process chdb), also as the web view serves them."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from loopwatch.core.config import Settings
from loopwatch.dashboards.web.api import BadRequest, WebApi
from loopwatch.ingest.capture import build_capture_message
from loopwatch.processors.replay.economics import (
    GIB,
    Rates,
    agent_economics,
    capture_cost_per_run,
    reproduction_tax,
    worth_capturing,
)
from loopwatch.store.reader import DirectReader
from tests.captured import insert_rows, parts_rows


def cents(value: float) -> float:
    return round(value, 2)


def test_the_seeds_worked_example():
    """p = 2 %, $0.05 and 40 s a run, an engineer at $120/h (seed 000)."""
    tax = reproduction_tax(p=0.02, run_cost_usd=0.05, run_seconds=40,
                           engineer_usd_per_hour=120)
    assert tax.expected_runs == 50
    assert cents(tax.token_cost) == 2.50
    assert cents(tax.engineer_cost) == 66.67
    assert cents(tax.total) == 69.17
    assert tax.wall_seconds == 2000  # ~33 minutes of re-running
    # "even if tracing costs a full cent per run ... the avoided tax is ~$70"
    assert worth_capturing(0.01, 0.02, tax.total)
    assert not worth_capturing(1.39, 0.02, tax.total)  # p x tax = $1.38 per run
    assert cents(0.02 * tax.total) == 1.38


def test_capture_cost_and_bad_input():
    assert capture_cost_per_run(GIB, 0.10, 30) == 0.1
    assert capture_cost_per_run(GIB / 2, 0.10, 60) == 0.1
    assert capture_cost_per_run(0, 0.10, 30) == 0
    for p in (0, -0.1, 1.5):
        with pytest.raises(ValueError, match="p must be in"):
            reproduction_tax(p, 0.05, 40, 120)
    assert Rates.from_settings(Settings(engineer_usd_per_hour=90, storage_usd_per_gb_month=0.02,
                                        capture_retention_days=14)) == Rates(90, 0.02, 14)


NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def run_row(run_id: str, agent: str, outcome: str, cost: float, seconds: float,
            started: datetime, status: str = "closed") -> dict[str, Any]:
    return {"run_id": run_id, "agent": agent, "status": status,
            "outcome": outcome if status == "closed" else "", "started_ts": started,
            "last_event_ts": started + timedelta(seconds=seconds),
            "closed_ts": started + timedelta(seconds=seconds) if status == "closed" else None,
            "cost_usd": cost, "version": 1}


@pytest.fixture(scope="module")
def scripted(local_store):
    """Agent X over the last 7 days: 8 successes ($0.04, 30 s), one hard_error and one
    gave_up ($0.09, 80 s): average $0.05 and 40 s a run, p = 10 % per failure mode.
    Not counted: a run still open, a run 8 days old, another agent's run. The two
    failures are kept with their payloads; one success is captured but discarded."""
    _, client = local_store
    agent = f"econ-{uuid.uuid4().hex[:10]}"
    runs = [run_row(f"{agent}-ok-{i}", agent, "success", 0.04, 30, NOW - timedelta(hours=i + 1))
            for i in range(8)]
    failures = [run_row(f"{agent}-crash", agent, "hard_error", 0.09, 80,
                        NOW - timedelta(hours=3)),
                run_row(f"{agent}-gaveup", agent, "gave_up", 0.09, 80, NOW - timedelta(hours=5))]
    runs += failures
    runs.append(run_row(f"{agent}-open", agent, "", 1.0, 500, NOW - timedelta(minutes=5),
                        status="running"))
    runs.append(run_row(f"{agent}-old", agent, "hard_error", 5.0, 900, NOW - timedelta(days=8)))
    runs.append(run_row(f"other-{agent}", f"other-{agent}", "hard_error", 9.0, 9,
                        NOW - timedelta(hours=1)))
    insert_rows(client, "runs", runs)
    kept_bytes = 0
    for number, run in enumerate([*failures, runs[0]]):
        message = build_capture_message(
            event_id=str(uuid.uuid4()), run_id=run["run_id"], agent=agent,
            ts=run["started_ts"].isoformat(), event_type="tool.call", step=0, tool="search",
            values={"args": {"q": f"query {number}"}, "output": ["result " * 50] * (number + 1)})
        parts, blobs = parts_rows(message, NOW, "kept_at")
        keep = run in failures
        if keep:
            insert_rows(client, "capture_parts", parts)
            insert_rows(client, "capture_blobs", blobs)
        total = sum(part["bytes"] for part in parts)
        kept_bytes += total if keep else 0
        insert_rows(client, "capture_decisions", [{
            "run_id": run["run_id"], "agent": agent, "outcome": run["outcome"],
            "keep": int(keep), "reason": "failure:" + run["outcome"] if keep
            else "success_not_sampled", "parts": len(parts), "bytes": total,
            "decided_at": NOW}])
    return DirectReader(client), agent, kept_bytes


def stored_totals(reader: DirectReader) -> tuple[int, int]:
    """What the store holds in kept payloads: compressed bytes (system.parts) and the
    logical bytes of every kept run (capture_decisions)."""
    compressed = reader.query(
        "SELECT sum(data_compressed_bytes) FROM system.parts WHERE database = currentDatabase()"
        " AND active AND table IN ('capture_parts', 'capture_blobs')").scalar()
    logical = reader.query(
        "SELECT sumIf(bytes, keep = 1) FROM capture_decisions FINAL").scalar()
    return int(compressed), int(logical)


def test_an_agents_numbers_from_the_store(scripted):
    reader, agent, kept_bytes = scripted
    rates = Rates(engineer_usd_per_hour=120, storage_usd_per_gb_month=0.10,
                  capture_retention_days=30)
    numbers = agent_economics(reader, agent, rates, timedelta(days=7), NOW)
    assert numbers.runs == 10 and numbers.kept_runs == 2 and numbers.kept_bytes == kept_bytes
    assert cents(numbers.avg_run_cost_usd) == 0.05 and numbers.avg_run_seconds == 40
    assert [(m.outcome, m.runs) for m in numbers.failure_modes] == [("gave_up", 1),
                                                                     ("hard_error", 1)]
    for mode in numbers.failure_modes:
        assert mode.tax.p == 0.1 and cents(mode.tax.expected_runs) == 10
        assert cents(mode.tax.token_cost) == 0.50
        assert cents(mode.tax.engineer_cost) == 13.33  # 10 runs x 40 s at $120/h
        assert cents(mode.tax.total) == 13.83
        assert mode.worth_it  # a few compressed KB cost far less than $1.38 a run
    compressed, logical = stored_totals(reader)
    assert compressed > 0 and logical >= kept_bytes
    stored = compressed * kept_bytes / logical  # apportioned by logical bytes
    assert numbers.stored_bytes == stored and numbers.stored_bytes_per_run == stored / 10
    assert numbers.capture_cost_per_run_usd == stored / 10 / GIB * 0.10 * 30 / 30
    # the same numbers as the web view serves them to the run drill-down
    api = WebApi(reader, clock=lambda: NOW, rates=rates)
    served = api.economics({"agent": [agent]})
    assert served == numbers.to_json()
    assert [m["outcome"] for m in served["failure_modes"]] == ["gave_up", "hard_error"]
    assert cents(served["failure_modes"][0]["avoided_per_run_usd"]) == 1.38
    for bad in ({}, {"agent": [agent], "days": ["x"]}, {"agent": [agent], "days": ["0"]}):
        with pytest.raises(BadRequest):
            api.economics(bad)


def test_an_agent_without_runs_has_nothing_to_reproduce(scripted):
    reader, _, _ = scripted
    numbers = agent_economics(reader, "no-such-agent", Rates(), timedelta(days=7), NOW)
    assert (numbers.runs, numbers.failure_modes, numbers.stored_bytes) == (0, (), 0.0)
    assert numbers.capture_cost_per_run_usd == 0.0
