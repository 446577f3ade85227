"""The CLI's error contract, for every command: a user's error is one line on stderr,
a usage error exits 2 and a runtime error 1, and ``--debug`` / ``LOOPWATCH_DEBUG=1``
adds the traceback (loopwatch.cliargs.ErrorContract).

Each command is run as a user runs it (a child ``python -m loopwatch.cli``) against a
store and a broker that refuse connections (closed loopback ports), or with an argument
it cannot take. The command list is read from the CLI itself: a new command fails
``test_every_command_has_a_hostile_case`` until it gets a case here.

Each child costs an interpreter and the CLI's imports (about a second of CPU): when most of
the module is selected, its runs are started together at the module's start, a few at a
time (:class:`Runs`), and each test takes its own run's result: every test still gets a
child of its own, with the same arguments and environment.
"""

from __future__ import annotations

import atexit
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import typer

from loopwatch.cli import app
from loopwatch.core.embedded.broker import free_port
from tests.forkserver import ForkServer

#: one worker runs the module, in order: its fixture starts the children of every case
#: ahead (tests/test_cli_contract.py Runs), which only this process's cases take
pytestmark = pytest.mark.xdist_group("cli_contract")


SECRET = "S3cr3tPw-in-url"
CLOSED = free_port()  # nothing listens: a refused connection


def commands() -> list[str]:
    def walk(command: object, path: tuple[str, ...]) -> Iterator[str]:
        subcommands = getattr(command, "commands", None)
        if subcommands:
            for name, sub in sorted(subcommands.items()):
                yield from walk(sub, (*path, name))
        else:
            yield " ".join(path)

    return list(walk(typer.main.get_command(app), ()))


#: command -> (arguments, the exit code the contract requires). Usage errors (2) are
#: arguments the command cannot take; runtime errors (1) meet the refusing store/broker.
CASES: dict[str, tuple[list[str], int]] = {
    "advise": ([], 1),
    "alerts": ([], 1),
    "bench": (["--events", "many"], 2),
    "dashboards deploy": (["--url", f"http://127.0.0.1:{CLOSED}", "--token", SECRET], 1),
    "dashboards export": (["/proc/no/such/folder"], 1),
    "demo": (["--rate", "fast"], 2),
    "detect": ([], 1),
    "detect-csv": (["--detector", "no_such_detector"], 2),
    "diff": (["run-a", "run-b"], 1),
    "dlq list": ([], 1),
    "dlq replay": ([], 1),
    "economics": (["some-agent"], 1),
    "ingest file": (["/proc/no/such/file.jsonl"], 2),
    "ingest serve": (["--port", "99999999"], 2),
    "ingest transcript": (["/proc/no/such/transcript.jsonl"], 2),
    "investigate": (["top_cost_runs"], 1),
    "playbook": (["agent_stuck_in_loop"], 1),
    "query": (["SELECT 1"], 1),
    "replay": (["some-run"], 1),
    "reprocess": (["--since", "2000-01-01"], 1),
    "scenario list": (["unexpected-argument"], 2),
    "scenario run": (["no_such_scenario"], 2),
    "scenario score": (["--days", "a-week"], 2),
    "schema": (["/proc/no/such/dir/schema.json"], 1),
    "serve": ([], 1),
    "status": ([], 1),
    "up": ([], 1),
    "worker": ([], 1),
}

#: more hostile inputs the issue names
EXTRA_CASES: list[tuple[list[str], int]] = [
    (["investigate", "top_cost_runs", "--param", "foo"], 2),
    (["investigate", "top_cost_runs", "--param", "=value"], 2),
    (["query", "--create", "KILL QUERY WHERE 1"], 1),  # a store to refuse it in
    (["query", "--no-such-option", "SELECT 1"], 2),
    (["no-such-command"], 2),
    (["advise", "--agent", "a" * 300], 2),
]


BOOTSTRAPS = (f"user:{SECRET}@broker", f"user:{SECRET}@broker:9092",
              f"kafka://user:{SECRET}@broker:9092")
GROUPS = {"loopwatch": [], "dlq": ["dlq"], "scenario": ["scenario"]}
INVALID_SETTINGS = {"LOOPWATCH_PARTITIONS": "0", "LOOPWATCH_CLICKHOUSE_URL": "ftp://db:21",
                    "LOOPWATCH_CAPTURE": "maybe"}


def planned() -> Iterator[tuple[list[str], dict[str, str]]]:
    """Every child the tests below run, in their order (what :class:`Runs` starts)."""
    for command in commands():
        yield [*command.split(), *CASES[command][0]], {}
    for arguments, _ in EXTRA_CASES:
        yield arguments, {"LOOPWATCH_CLICKHOUSE_URL": ""}
    yield ["query", "SELECT 1"], {}
    yield ["--debug", "query", "SELECT 1"], {}
    yield ["query", "SELECT 1"], {"LOOPWATCH_DEBUG": "1"}
    for bootstrap in BOOTSTRAPS:
        yield ["query", "SELECT 1"], {"LOOPWATCH_KAFKA_BOOTSTRAP": bootstrap}
    for group in GROUPS.values():
        yield group, {}
    yield ["query", "SELECT 1"], INVALID_SETTINGS


Key = tuple[tuple[str, ...], tuple[tuple[str, str], ...], bool]
#: a planned child: its arguments, environment and (optionally) whether its data dir is
#: made (empty) before it starts
Planned = tuple[list[str], dict[str, str]] | tuple[list[str], dict[str, str], bool]


def _key(args: list[str], env: dict[str, str], made: bool) -> Key:
    return tuple(args), tuple(sorted(env.items())), made


class Runs:
    """Children planned by a module, started ahead, each result handed to one test only."""

    def __init__(self, folder: Path, plan: Iterable[Planned]) -> None:
        self._pool = ThreadPoolExecutor(max_workers=2 * (os.cpu_count() or 1))
        self._started: dict[Key, list[tuple[Future[subprocess.CompletedProcess[str]], Path]]]
        self._started = {}
        for number, (args, env, *made) in enumerate(plan):
            run_dir = folder / f"run-{number}"
            (run_dir / "data" if made and made[0] else run_dir).mkdir(parents=True)
            self._started.setdefault(_key(args, env, bool(made and made[0])), []).append(
                (self._pool.submit(_run, args, run_dir, env), run_dir))

    def take(self, args: list[str], env: dict[str, str], made: bool
             ) -> tuple[subprocess.CompletedProcess[str], Path] | None:
        started = self._started.get(_key(args, env, made))
        if not started:
            return None
        future, run_dir = started.pop(0)
        return future.result(), run_dir

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


RUNS: list[Runs] = []  # the running module's, while its tests run (start_together)


def start_together(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                   plan: list[Planned]) -> Iterator[None]:
    """A module fixture's body: start the module's planned children ahead when most of
    its tests are selected (with a few, under ``-k``, each test runs its own)."""
    selected = sum(1 for item in request.session.items if item.module is request.module)
    if selected < len(plan) // 2:
        yield
        return
    runs = Runs(tmp_path_factory.mktemp("cli-runs"), plan)
    RUNS.append(runs)
    try:
        yield
    finally:
        RUNS.remove(runs)
        runs.close()


@pytest.fixture(scope="module", autouse=True)
def _started_together(request: pytest.FixtureRequest,
                      tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    yield from start_together(request, tmp_path_factory, list(planned()))


def loopwatch(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m loopwatch.cli ARGS`` in a child, as a user runs it (the run started
    for it ahead, if there is one)."""
    return loopwatch_in(args, tmp_path, **env)[0]


def loopwatch_in(args: list[str], tmp_path: Path, made: bool = False, **env: str
                 ) -> tuple[subprocess.CompletedProcess[str], Path]:
    """:func:`loopwatch`, and the folder whose ``data`` was the child's data dir (made
    empty before the child started, when ``made``: the caller made it in ``tmp_path``)."""
    ahead = RUNS[0].take(args, env, made) if RUNS else None
    return ahead if ahead is not None else (_run(args, tmp_path, env), tmp_path)


def _run(args: list[str], tmp_path: Path, env: dict[str, str], fresh: bool = False
         ) -> subprocess.CompletedProcess[str]:
    """The child of one case: forked from the CLI fork server, or (``fresh``) a new
    ``python -m loopwatch.cli`` interpreter, as a user starts it."""
    environment = {key: value for key, value in os.environ.items()
                   if not key.startswith("LOOPWATCH_")}
    environment.update({
        "LOOPWATCH_DATA_DIR": str(tmp_path / "data"),
        "LOOPWATCH_CLICKHOUSE_URL": f"http://reader:{SECRET}@127.0.0.1:{CLOSED}/loopwatch",
        "LOOPWATCH_KAFKA_BOOTSTRAP": f"127.0.0.1:{CLOSED}",
        "LOOPWATCH_OTLP_PORT": "0",
        "LOOPWATCH_BROKER_WAIT_S": "1",  # `up` gives up on the refusing broker after 1 s, not 30
        "COLUMNS": "100",
        **env})
    environment = {key: value for key, value in environment.items() if value}  # "" = unset
    if not fresh:
        return _forks().run(args, environment, tmp_path / "cli-output")
    return subprocess.run([sys.executable, "-m", "loopwatch.cli", *args], env=environment,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


_FORKS: list[ForkServer] = []
_FORKS_LOCK = threading.Lock()


def _forks() -> ForkServer:
    """This test process's CLI fork server (tests/forkserver.py), started on first use."""
    with _FORKS_LOCK:
        if not _FORKS:
            _FORKS.append(ForkServer())
            atexit.register(_FORKS[0].close)
        return _FORKS[0]


def assert_contract(result: subprocess.CompletedProcess[str], code: int) -> None:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == code, result.stderr[-3000:]
    assert len(lines) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and SECRET not in result.stderr + result.stdout


#: cases run both ways by the fidelity test: a usage error, a refused store, a traceback
#: asked for by flag and by environment, settings the CLI refuses, a bad bootstrap
FIDELITY: list[tuple[list[str], dict[str, str]]] = [
    (["bench", "--events", "many"], {}), (["query", "SELECT 1"], {}),
    (["--debug", "query", "SELECT 1"], {}), (["query", "SELECT 1"], {"LOOPWATCH_DEBUG": "1"}),
    (["query", "SELECT 1"], INVALID_SETTINGS),
    (["alerts"], {"LOOPWATCH_KAFKA_BOOTSTRAP": BOOTSTRAPS[0]}), (["dlq"], {}),
    (["playbook", "agent_stuck_in_loop"], {}),  # imports what the fork server preloads
]


def test_a_forked_child_that_outlasts_its_timeout_is_killed(tmp_path: Path) -> None:
    """As ``subprocess.run(timeout=...)``: the caller gets ``TimeoutExpired`` and the
    child (here a web view that would serve forever) is killed, not left running."""
    forks = _forks()
    env = {**os.environ, "LOOPWATCH_DATA_DIR": str(tmp_path / "data")}
    with pytest.raises(subprocess.TimeoutExpired):
        forks.run(["serve", "--port", "0"], env, tmp_path / "out", timeout=2)
    killed = forks.last_killed
    assert killed is not None and killed not in forks.unreaped()  # killed, then reaped


def test_forked_children_answer_as_fresh_interpreters_do(tmp_path):
    """The fork server's children (tests/forkserver.py) are the CLI's real runs only if
    nothing the CLI imports reads the environment early: each case above, forked and as
    a new interpreter, gives the same exit status, stdout and stderr (query ids and
    object addresses aside; of a traceback, its last line: the frames above the CLI's
    are runpy's in one and the fork server's in the other)."""
    def answer(number: int, way: str) -> tuple[int, str, str]:
        args, env = FIDELITY[number]
        result = _run(args, tmp_path / f"{way}-{number}", env, fresh=way == "fresh")
        stderr = _VARYING.sub("~", result.stderr.replace(f"{way}-{number}", "~"))
        if "Traceback" in stderr:
            stderr = "Traceback ... " + stderr.strip().splitlines()[-1]
        return result.returncode, result.stdout, stderr

    with ThreadPoolExecutor(max_workers=4) as pool:
        answers = {(number, way): pool.submit(answer, number, way)
                   for number in range(len(FIDELITY)) for way in ("forked", "fresh")}
    for number, (args, _) in enumerate(FIDELITY):
        assert answers[number, "forked"].result() == answers[number, "fresh"].result(), args


#: what differs between two runs of one case: uuids (query ids) and object addresses
_VARYING = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|0x[0-9a-f]+")


def test_every_command_has_a_hostile_case():
    assert sorted(CASES) == commands()


@pytest.mark.parametrize("command", commands())
def test_every_command_fails_in_one_line_with_the_contracts_exit_code(command, tmp_path):
    arguments, code = CASES[command]
    assert_contract(loopwatch([*command.split(), *arguments], tmp_path), code)


@pytest.mark.parametrize(("arguments", "code"), EXTRA_CASES,
                         ids=[" ".join(a) for a, _ in EXTRA_CASES])
def test_hostile_arguments_are_one_line(arguments, code, tmp_path):
    result = loopwatch(arguments, tmp_path, LOOPWATCH_CLICKHOUSE_URL="")
    assert_contract(result, code)


def test_a_refused_store_connection_is_one_line_that_names_it(tmp_path):
    result = loopwatch(["query", "SELECT 1"], tmp_path)
    assert_contract(result, 1)
    assert result.stderr.startswith("error: OperationalError: ")
    assert "Connection refused" in result.stderr
    assert f"http://127.0.0.1:{CLOSED}" in result.stderr


@pytest.mark.parametrize("how", [["--debug"], []], ids=["--debug", "LOOPWATCH_DEBUG=1"])
def test_debug_prints_the_traceback_too(how, tmp_path):
    env = {} if how else {"LOOPWATCH_DEBUG": "1"}
    result = loopwatch([*how, "query", "SELECT 1"], tmp_path, **env)
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert result.stderr.rstrip().splitlines()[-1].startswith("error: OperationalError: ")


def test_a_bootstrap_with_credentials_is_refused_without_echoing_them(tmp_path):
    for bootstrap in BOOTSTRAPS:
        result = loopwatch(["query", "SELECT 1"], tmp_path,
                           LOOPWATCH_KAFKA_BOOTSTRAP=bootstrap)
        assert_contract(result, 2)
        assert "LOOPWATCH_KAFKA_BOOTSTRAP must be host:port[,host:port]" in result.stderr


@pytest.mark.parametrize("group", list(GROUPS.values()), ids=list(GROUPS))
def test_a_bare_command_group_prints_its_help_and_nothing_on_stderr(group, tmp_path):
    result = loopwatch(group, tmp_path)
    assert result.returncode == 2 and result.stderr == ""
    assert "Usage:" in result.stdout and "Commands" in result.stdout


def test_several_invalid_settings_are_still_one_line(tmp_path):
    result = loopwatch(["query", "SELECT 1"], tmp_path, **INVALID_SETTINGS)
    assert_contract(result, 2)
    assert result.stderr.startswith("invalid setting ")
    assert [name in result.stderr for name in ("partitions", "clickhouse_url", "capture")] == [
        True, True, True]
