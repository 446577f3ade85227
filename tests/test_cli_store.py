"""Reading commands say which store they read, and refuse a data dir holding none
(``loopwatch query`` in a missing or empty data dir created an empty store and printed
a blank line with exit 0). loopwatch.storecheck decides, before the store is opened."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from loopwatch.cli import app
from tests.test_cli_contract import assert_contract, loopwatch, loopwatch_in, start_together

#: one worker runs the module, in order: its fixture starts the children of every case
#: ahead (tests/test_cli_contract.py Runs), which only this process's cases take
pytestmark = pytest.mark.xdist_group("cli_store")


REFUSING = [["query", "SELECT 1"], ["alerts"], ["dlq", "list"],
            ["investigate", "top_cost_runs"], ["replay", "some-run"],
            ["playbook", "agent_stuck_in_loop"]]


NO_STORE_ENV = {"LOOPWATCH_CLICKHOUSE_URL": "", "LOOPWATCH_KAFKA_BOOTSTRAP": ""}
WHERE = ["missing", "empty"]


@pytest.fixture(scope="module", autouse=True)
def _started_together(request: pytest.FixtureRequest,
                      tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The refusal cases' children, started ahead (tests/test_cli_contract.py Runs)."""
    yield from start_together(request, tmp_path_factory, [
        (command, NO_STORE_ENV, where == "empty") for where in WHERE for command in REFUSING])


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("command", REFUSING, ids=" ".join)
def test_a_data_dir_without_a_store_is_refused_and_left_alone(command, where, tmp_path):
    if where == "empty":
        (tmp_path / "data").mkdir()
    result, folder = loopwatch_in(command, tmp_path, where == "empty", **NO_STORE_ENV)
    data_dir = folder / "data"
    assert_contract(result, 1)
    assert result.stderr == (
        f"error: no loopwatch store in {data_dir}: `loopwatch up --data-dir {data_dir}` "
        "creates one; if `up` runs on another data dir, pass that one (--data-dir or "
        "LOOPWATCH_DATA_DIR)\n")
    assert result.stdout == ""
    assert not (data_dir / "chdb").exists()


def test_query_creates_an_empty_store_only_when_asked(tmp_path):
    created = loopwatch(["query", "--json", "--create", "SELECT count() AS n FROM runs"],
                        tmp_path, LOOPWATCH_CLICKHOUSE_URL="", LOOPWATCH_KAFKA_BOOTSTRAP="")
    assert created.returncode == 0, created.stderr
    assert orjson.loads(created.stdout) == [{"n": 0}]
    chdb = tmp_path / "data" / "chdb"
    assert created.stderr == f"store: chdb://{chdb} (created empty)\n"
    again = loopwatch(["query", "--json", "SELECT count() AS n FROM runs"], tmp_path,
                      LOOPWATCH_CLICKHOUSE_URL="", LOOPWATCH_KAFKA_BOOTSTRAP="")
    assert again.returncode == 0, again.stderr
    assert again.stderr == f"store: chdb://{chdb}\n"


def test_the_store_read_is_named_on_stderr_and_json_stays_clean(local_store):
    settings, _ = local_store
    result = CliRunner().invoke(app, ["query", "--json", "SELECT 2 AS two", "--data-dir",
                                      str(settings.data_dir)],
                                env={"LOOPWATCH_CLICKHOUSE_URL": None,
                                     "LOOPWATCH_KAFKA_BOOTSTRAP": None})
    assert result.exit_code == 0, result.output
    assert orjson.loads(result.stdout) == [{"two": 2}]
    assert result.stderr == f"store: chdb://{Path(settings.data_dir) / 'chdb'}\n"


def test_listings_of_a_fresh_store_say_no_rows(tmp_path):
    """``dlq list`` and ``alerts`` printed nothing at all for an empty result."""
    env = {"LOOPWATCH_CLICKHOUSE_URL": "", "LOOPWATCH_KAFKA_BOOTSTRAP": ""}
    created = loopwatch(["query", "--create", "SELECT 1"], tmp_path, **env)
    assert created.returncode == 0, created.stderr
    for command, title in ((["dlq", "list"], "dead letters"), (["alerts"], "alerts")):
        result = loopwatch(command, tmp_path, **env)
        assert result.returncode == 0, result.stderr
        assert result.stdout == f"{title}\nno rows\n"
