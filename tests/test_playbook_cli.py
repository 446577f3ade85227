"""``loopwatch playbook NAME`` on a terminal: readable text, each query verbatim (to be
copied) and answered under it, and the queries that need a run id said to be skipped,
with the option that runs them (they ran with an empty run id and answered nothing)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from loopwatch.cli import app
from loopwatch.detectors.playbooks import load_playbooks

ENV = {"COLUMNS": "80", "LOOPWATCH_CLICKHOUSE_URL": None, "LOOPWATCH_KAFKA_BOOTSTRAP": None}


def _run(local_store, *args: str):
    settings, _ = local_store
    return CliRunner().invoke(app, ["playbook", *args, "--data-dir", str(settings.data_dir)],
                              env=ENV)


@pytest.mark.parametrize("name", ["agent_stuck_in_loop", "timeout_miscalibration"])
def test_a_playbook_reads_as_text_with_every_query_verbatim(local_store, name):
    book = load_playbooks()[name]
    result = _run(local_store, name)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert not [line for line in lines if line.startswith(("#", "```")) or "**" in line]
    assert lines[0] == f"{book.title} ({book.name})"
    for step in book.sql_steps:
        sql = [f"    {line}" for line in (step.sql or "").strip("\n").splitlines()]
        start = lines.index(sql[0])
        assert lines[start:start + len(sql)] == sql  # not wrapped at 80 columns


def test_the_queries_that_need_a_run_id_are_said_to_be_skipped(local_store):
    book = load_playbooks()["agent_stuck_in_loop"]
    needing = [step for step in book.sql_steps if "run_id" in step.parameters]
    assert len(needing) == 3
    result = _run(local_store, "agent_stuck_in_loop")
    assert result.exit_code == 0, result.output
    skipped = ("skipped: this query needs --run-id RUN_ID (a run_id from the steps above)")
    assert result.stdout.splitlines().count(skipped) == 3
    assert result.stderr.splitlines()[0] == (
        f"skipped 3 of {len(book.sql_steps)} queries: `loopwatch playbook agent_stuck_in_loop "
        "--run-id RUN_ID` runs them")
    given = _run(local_store, "agent_stuck_in_loop", "--run-id", "no-such-run")
    assert given.exit_code == 0, given.output
    assert skipped not in given.stdout and "skipped" not in given.stderr
    assert given.stdout.splitlines().count("no rows") >= 3  # at least the run_id ones
