"""The command line, as a user runs it: against the running pipeline, and the demo."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
from rich.console import Console

from loopwatch.ingest.events import OUTCOMES


def loopwatch(*args: str, env: dict[str, str] | None = None,
              timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "loopwatch.cli", *args],
                          env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def test_query_goes_through_the_running_service(pipeline):
    result = loopwatch("query", "--json", "SELECT 1 + 1 AS two, 'x' AS letter",
                       env=pipeline.env)
    assert result.returncode == 0, result.stderr
    assert orjson.loads(result.stdout) == [{"two": 2, "letter": "x"}]
    chdb = Path(pipeline.env["LOOPWATCH_DATA_DIR"]).resolve() / "chdb"
    assert result.stderr.startswith(f"store: chdb://{chdb} (through the running up, pid ")


def test_query_is_read_only_and_leaves_the_store_writable(pipeline, reader, emitter, agent):
    refused = loopwatch("query", "DROP TABLE runs", env=pipeline.env)
    assert refused.returncode == 1
    assert "query failed" in refused.stderr and "readonly" in refused.stderr.lower()
    with emitter.run(agent=agent) as run:
        run.step()
    emitter.flush()
    from tests.conftest import wait_stored

    wait_stored(reader, agent, 3)


def test_investigate_runs_a_named_query_and_asks_for_missing_parameters(pipeline):
    listed = loopwatch("investigate", "near_misses_by_tool", "--json", env=pipeline.env)
    assert listed.returncode == 0, listed.stderr
    assert isinstance(orjson.loads(listed.stdout), list)
    missing = loopwatch("investigate", "loop_pattern", env=pipeline.env)
    assert missing.returncode == 2
    assert "loop_pattern needs --param run_id=..." in missing.stderr


def test_invalid_settings_get_a_message_a_person_can_act_on(tmp_path: Path):
    result = loopwatch("query", "SELECT 1", env={"LOOPWATCH_CLICKHOUSE_URL": "ftp://db:21",
                                                 "LOOPWATCH_DATA_DIR": str(tmp_path)})
    assert result.returncode == 2
    assert "LOOPWATCH_CLICKHOUSE_URL must start with http:// or https://" in result.stderr


def test_schema_command_prints_the_checked_in_schema():
    result = loopwatch("schema")
    from loopwatch.ingest.jsonschema import checked_in

    assert result.stdout.encode() == checked_in()


def test_reprocess_through_the_service_is_idempotent(pipeline, reader, emitter, agent):
    """An abandoned run is reprocessed as abandoned, and nothing closed changes.

    The session's pipeline is shared: an open run left by an earlier test may be
    abandoned by the sweep while this test runs. Such a run is counted by the reprocess
    only if it closed before the reprocess read the closed runs, and it is compared by
    nothing: idempotency is about the runs that were closed before."""
    from loopwatch.ingest.sdk import RunContext
    from tests.conftest import scalar, wait_for

    left_open = RunContext(emitter, f"{agent}-left", {"agent": agent, "model": "gpt-4o"})
    left_open.start()
    left_open.step()
    assert emitter.flush(30)
    wait_for(lambda: scalar(reader, "SELECT outcome FROM runs FINAL WHERE run_id = {r:String}",
                            r=left_open.run_id) == "abandoned", 60, what="the run abandoned")
    closed_runs = ("SELECT run_id, outcome, cost_usd, version FROM runs FINAL "
                   "WHERE status = 'closed' ORDER BY run_id")
    before = reader.query(closed_runs).rows
    result = loopwatch("reprocess", "--since", "2000-01-01", env=pipeline.env)
    assert result.returncode == 0, result.stderr
    after = reader.query(closed_runs).rows
    reprocessed = int(re.search(r"of (\d+) runs", result.stderr)[1])  # type: ignore[index]
    assert len(before) <= reprocessed <= len(after)
    kept = {row[0] for row in before}
    after = [row for row in after if row[0] in kept]
    assert [r[:2] for r in after] == [r[:2] for r in before]
    assert [r[2] for r in after] == pytest.approx([r[2] for r in before])
    assert [left_open.run_id, "abandoned"] in [r[:2] for r in after]


def test_reprocess_refuses_a_since_that_is_not_an_iso_time(tmp_path: Path):
    result = loopwatch("reprocess", "--since", "yesterday", "--data-dir", str(tmp_path))
    assert result.returncode == 2
    assert "--since must be an ISO time, e.g. 2026-11-29T10:00 (got 'yesterday')" in (
        result.stdout + result.stderr)


@pytest.mark.stack  # runs `loopwatch demo`: its own broker and `up`
def test_demo_reports_every_outcome_exactly_as_the_fleet_planned_it(tmp_path: Path):
    """Also the piped demo's progress: lines while it simulates and while it drains on
    stderr (not two lines and then silence until the report), the report alone on
    stdout."""
    result = loopwatch("demo", "--duration", "20", "--rate", "6", "--seed", "11", "--json",
                       "--data-dir", str(tmp_path), env={"COLUMNS": "200"}, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    simulating = [line for line in lines if line.startswith("simulating  ")]
    draining = [line for line in lines if line.startswith("draining  ")]
    assert simulating and draining, result.stderr[-3000:]
    assert "events sent" in simulating[0] and "runs closed" in draining[-1]
    report = orjson.loads(result.stdout)
    assert set(report) >= {"events", "runs", "agents", "store"}
    assert report["events"] == report["emitted_events"]
    assert report["store"] == f"chdb://{tmp_path / 'demo' / 'chdb'}"
    seen = set()
    for agent, entry in report["agents"].items():
        planned = {o: n for o, n in report["planned_outcomes"][agent].items() if n}
        assert {o: n for o, n in entry["outcomes"].items() if n} == planned
        assert entry["runs"] == sum(planned.values())
        seen |= set(planned)
        closed = entry["runs"]
        silent = sum(entry["outcomes"][o] for o in ("budget_exhausted", "gave_up", "looped",
                                                    "wrong"))
        assert entry["silent_failure_ratio"] == pytest.approx(silent / closed)
        assert entry["exception_rate"] == pytest.approx(entry["outcomes"]["hard_error"] / closed)
        assert 0 <= entry["cache_hit_rate"] <= 1
    assert seen == set(OUTCOMES) - {"unknown"}
    assert report["runs"] == sum(e["runs"] for e in report["agents"].values())
    assert report["agents"]["sql-analyst"]["cache_hit_rate"] == 0.0  # its prompt never caches
    printed = _printed_at_80_columns(report)
    data_dir = tmp_path / "demo"
    assert f"investigate: loopwatch investigate top_cost_runs --data-dir {data_dir}" in printed
    assert f"dashboards:  loopwatch serve --data-dir {data_dir}" in printed
    assert f"advice:      loopwatch advise --data-dir {data_dir}" in printed
    # the fleet's too-low timeout (web_search, 1.5 s) and cache-missing agent
    # (sql-analyst: a timestamp ahead of the breakpoint) are what the advisors find
    advice = loopwatch("advise", "--json", "--data-dir", str(data_dir))
    assert advice.returncode == 0, advice.stderr[-3000:]
    found = {(f["kind"], f["agent"], f["subject"])
             for f in orjson.loads(advice.stdout)["findings"]}
    assert ("cache", "sql-analyst", "analyst-v7") in found
    assert {agent for kind, agent, subject in found
            if kind == "timeout" and subject == "web_search"} >= {"research-agent"}


def _printed_at_80_columns(report: dict[str, object]) -> list[str]:
    """The demo's human report as an 80-column terminal shows it, line by line."""
    from loopwatch.demo import print_report

    return _shown(lambda console: print_report(report, console))


def _shown(draw: Callable[[Console], object], width: int = 80) -> list[str]:
    """What ``draw`` prints on a terminal ``width`` columns wide, line by line."""
    console = Console(width=width, record=True, color_system=None)
    draw(console)
    return [line.rstrip() for line in console.export_text().splitlines()]


def test_the_demo_lists_alerts_with_whole_names_on_80_columns():
    """Rule and playbook names are what a reader types next (``loopwatch playbook``):
    none may be cut, however long the summary."""
    from loopwatch.demo import alerts_list

    lines = _shown(lambda console: console.print(alerts_list([
        {"severity": "warning", "rule": "tool_error_rate_warning", "episodes": 3,
         "firing": 2, "latest": "lookup_ticket failed on 5.1% of 78 calls in the last 15m",
         "playbook": "retry_storm_permanent_error"},
        {"severity": "warning", "rule": "near_miss_high", "episodes": 1, "firing": 0,
         "latest": "60% of web_search's 5 timeouts would have finished within 1.3x the "
                   "timeout", "playbook": "timeout_miscalibration"}])))
    assert lines[1:] == [
        "warning  tool_error_rate_warning  3 episodes, 2 firing now",
        "         lookup_ticket failed on 5.1% of 78 calls in the last 15m",
        "         loopwatch playbook retry_storm_permanent_error",
        "warning  near_miss_high  1 episode, 0 firing now",
        "         60% of web_search's 5 timeouts would have finished within 1.3x the",
        "         timeout",
        "         loopwatch playbook timeout_miscalibration",
    ]


def test_a_result_wider_than_the_terminal_stays_a_table_with_cut_cells():
    """At 80 columns the table keeps its shape: the longest cells are cut with an
    ellipsis, the run id (what a reader copies next) last, and the caption says where
    the whole values are. At 200 the same result is shown whole."""
    from loopwatch.render import fitted

    columns = ["run_id", "agent", "outcome", "summary", "cost_usd"]
    rows = [["58765393e407ae63b787af21a7c8b91b", "research-agent", "budget_exhausted",
             "spent its whole budget of 14 steps on web_search without an answer", 1.1948],
            ["edf92beef31c", "sql-analyst", None, "ok", 0.0801]]

    def shown(width: int) -> list[str]:
        return _shown(lambda console: console.print(fitted(console, columns, rows,
                                                           title="top")), width)

    narrow = shown(80)
    assert max(len(line) for line in narrow) <= 80
    (first_row,) = [line for line in narrow if "58765393" in line]
    cells = [cell.strip() for cell in first_row.split("│")[1:-1]]
    assert cells == ["58765393e407ae63b787af21a7c8b91b", "researc…", "budget_…", "spent i…",
                     "1.1948"]
    assert narrow[-1].strip() == "cut to fit 80 columns: --json prints every value whole"
    wide = shown(200)
    (first_row,) = [line for line in wide if "58765393" in line]
    assert [c.strip() for c in first_row.split("│")[1:-1]] == [str(v) for v in rows[0]]
    assert not any("cut to fit" in line for line in wide)


def test_an_empty_result_says_no_rows():
    from loopwatch.render import fitted

    assert _shown(lambda console: console.print(fitted(console, ["a", "b"], [],
                                                       title="dead letters"))) == [
        "dead letters", "no rows"]
    assert _shown(lambda console: console.print(fitted(console, ["a"], []))) == ["no rows"]


def test_query_and_investigate_say_no_rows_for_an_empty_result(local_store):
    from typer.testing import CliRunner

    from loopwatch.cli import app

    settings, _ = local_store
    runner = CliRunner()
    env = {"COLUMNS": "80", "LOOPWATCH_CLICKHOUSE_URL": None, "LOOPWATCH_KAFKA_BOOTSTRAP": None}
    empty = runner.invoke(app, ["query", "SELECT 1 AS x WHERE 0", "--data-dir",
                                str(settings.data_dir)], env=env)
    assert empty.exit_code == 0, empty.output
    assert empty.stdout == "no rows\n"
    none = runner.invoke(app, ["investigate", "loop_pattern", "--param", "run_id=no-such-run",
                               "--data-dir", str(settings.data_dir)], env=env)
    assert none.exit_code == 0, none.output
    assert none.stdout.endswith("the same arguments, and where.\nno rows\n")
    as_json = runner.invoke(app, ["query", "--json", "SELECT 1 AS x WHERE 0", "--data-dir",
                                  str(settings.data_dir)], env=env)
    assert as_json.stdout == "[]\n"
