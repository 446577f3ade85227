"""Shared fixtures: one real Tansu broker and one real processor (``loopwatch up`` owning
a real chdb store) for the whole session, since every consumer-group join costs 5-25 s.

Tests isolate themselves by agent name (``agent`` fixture), never by fresh services.
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import orjson
import pytest
from _pytest.mark.expression import Expression
from clickhouse_connect.driver.client import Client

from loopwatch.core.config import Settings
from loopwatch.core.embedded.broker import EmbeddedBroker, free_port
from loopwatch.ingest.sdk import Emitter
from loopwatch.processors.rows import EVENTS_IN_TABLE
from loopwatch.store.clickhouse import QueryResult
from loopwatch.store.reader import DirectReader, ServiceReader
from loopwatch.store.service import dumps
from loopwatch.store.sink import RowBatch, encode_rows
from loopwatch.upprocess import UpProcess
from tests.receivers import Receiver
from tests.stores import migrated_store

T = TypeVar("T")

# The usual umask, whatever the machine's: a file loopwatch creates group- or
# world-readable shows as such (tests/test_service_auth.py checks the data dirs).
os.umask(0o022)

#: where the tests' throwaway stores go when the user named no temporary folder: a
#: memory file system if the machine has one with room. The chdb stores of a run are
#: tens of thousands of files that merges and clean-ups delete again; on a disk mounted
#: with ``discard`` (the reference machine's) each delete waits on the device, which
#: cost the fast tier ~8 s of its ~100 (docs/performance.md, "The fast tier").
MEMORY_TEMP_ROOT = Path("/dev/shm")
MEMORY_TEMP_MIN_FREE = 4 << 30


def pytest_configure(config: pytest.Config) -> None:
    """Let the suite's processes cache bytecode, then place its temporary folders."""
    _cache_bytecode()
    _place_temporary_folders(config)


def _cache_bytecode() -> None:
    """Write ``__pycache__`` (ignored by git) even where ``PYTHONDONTWRITEBYTECODE`` is set,
    as on the reference machine: there every process the suite starts (each xdist worker,
    ``up``, receivers, bench and CLI children) compiled the project and pytest rewrote
    the test modules' asserts anew, ~4 s of CPU per worker's collection alone (7.3 ->
    3.1 s). Workers and children inherit the environment; this process writes from now
    on. ``PYTHONPYCACHEPREFIX`` would hide the bytecode pip wrote into site-packages."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False


def _place_temporary_folders(config: pytest.Config) -> None:
    """Point pytest's ``tmp_path`` root (which keeps the last three sessions' folders)
    at :data:`MEMORY_TEMP_ROOT`, and ``TMPDIR`` (what the tests' children and
    ``tempfile`` use) at a folder of this session there, removed when it ends; unless
    the user set either, or the machine has no room there. Workers inherit both."""
    if os.environ.get("PYTEST_DEBUG_TEMPROOT") or os.environ.get("TMPDIR"):
        return
    try:
        usage = shutil.disk_usage(MEMORY_TEMP_ROOT)
        root = MEMORY_TEMP_ROOT / f"loopwatch-tests-{os.getuid()}"
        root.mkdir(exist_ok=True)
        if (usage.free < MEMORY_TEMP_MIN_FREE or root.is_symlink()
                or root.stat().st_uid != os.getuid()):  # another user's folder: not ours
            return
        _remove_abandoned_sessions(root)
        session = Path(tempfile.mkdtemp(prefix=f"session-{os.getpid()}-", dir=root))
        # others may traverse, as they may /tmp: tests/test_service_auth.py checks that
        # the data dir's own modes keep them out, under a parent anyone can pass
        for folder in (root, session):
            os.chmod(folder, 0o755)
    except OSError:
        return
    os.environ["PYTEST_DEBUG_TEMPROOT"] = str(root)
    os.environ["TMPDIR"] = str(session)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    config.add_cleanup(lambda: shutil.rmtree(session, ignore_errors=True))


def _remove_abandoned_sessions(root: Path) -> None:
    """The ``TMPDIR`` folders of sessions whose process is gone (killed before its
    clean-up): they would hold memory until the machine restarts."""
    for folder in root.glob("session-*-*"):
        pid = folder.name.split("-")[1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:  # alive, another user's
            continue


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """The ``-n auto`` of the addopts: the whole suite on two workers (each starts its
    own broker and ``up`` for the stack tier; a third pair would crowd two cores), the
    fast tier on one more worker than cores, since its tests spend a sixth of their
    time waiting on children (CLI runs, bench smokes, receivers): on the reference
    machine 84-85 s against 88-89 s with two. ``PYTEST_XDIST_AUTO_NUM_WORKERS`` wins."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "").isdigit():
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    selection = config.getoption("markexpr") or ""
    fast_tier = bool(selection) and not Expression.compile(selection).evaluate(
        lambda mark: mark == "stack")
    return (os.cpu_count() or 1) + 1 if fast_tier else 2


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection imported out of the garbage collector's reach: every
    later collection would walk those objects again (the test processes import chdb,
    faust, scipy and the whole project), which cost ~5 s of the fast tier's CPU."""
    gc.collect()
    gc.freeze()


#: Fixtures that start a service: a test that needs one (directly or through another
#: fixture) is in the ``stack`` tier; ``pytest -m "not stack"`` runs the fast tier
#: (in-process chdb allowed). A test that starts a service itself says so with
#: ``pytest.mark.stack``.
STACK_FIXTURES = frozenset({"broker", "alertmanager", "pipeline", "browser"})


#: fast-tier modules whose module fixture seeds a store (the dashboards' sample fleet,
#: ~8 s of CPU, which the web view's tests read too; the replay module's captured runs,
#: ~4 s): grouped, so that one worker seeds it once instead of each worker its own
ONE_WORKER_MODULES = {"test_dashboards.py": "dashboards", "test_webview.py": "dashboards",
                      "test_replay.py": "replay"}


def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark the stack tier and split it in two xdist groups (``--dist loadgroup``), each
    run in order on one worker while the fast tier's tests go to either: ``stack``, the
    tests of the session's one broker and ``up`` (one worker starts them once), and
    ``stack_own``, the tests that start brokers and ``up`` of their own; the fast-tier
    tests of :data:`ONE_WORKER_MODULES` get their module's group. Per item as it
    is collected: xdist reads the groups in its ``pytest_collection_modifyitems``, which
    may run before this project's."""
    if STACK_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        item.add_marker(pytest.mark.stack)
        item.add_marker(pytest.mark.xdist_group("stack"))
    elif item.get_closest_marker("stack"):
        item.add_marker(pytest.mark.xdist_group("stack_own"))
    elif item.path.name in ONE_WORKER_MODULES:
        item.add_marker(pytest.mark.xdist_group(ONE_WORKER_MODULES[item.path.name]))


#: fast-tier modules that run long or as one xdist group (their module fixture starts
#: children ahead): handed out first, after the stack groups, so that neither worker is
#: left running one of them at the end while the other idles
STACK_GROUPS_FIRST = {"stack": 0, "stack_own": 1}
LONG_FIRST = frozenset({"test_scenarios.py", "test_cli_contract.py", "test_cli_store.py",
                        "test_cli_numbers.py"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order the work as xdist hands it out (by first appearance): the ``stack`` group,
    the ``stack_own`` group, :data:`LONG_FIRST`, then the rest; a stable sort, so each
    group's tests keep their order."""
    def rank(item: pytest.Item) -> int:
        group = item.get_closest_marker("xdist_group")  # as pytest_itemcollected set it
        name = group.args[0] if group is not None and group.args else None
        if name in STACK_GROUPS_FIRST:
            return STACK_GROUPS_FIRST[name]
        return 2 if item.path.name in LONG_FIRST else 3

    items.sort(key=rank)


PIPELINE_ENV = {
    "LOOPWATCH_ABANDON_TTL_S": "6",
    "LOOPWATCH_IDLE_ADVANCE_S": "2",
    "LOOPWATCH_LATE_ALLOWANCE_S": "1",
    "LOOPWATCH_BATCH_MAX_WAIT_S": "0.2",
    "LOOPWATCH_SESSION_TIMEOUT_S": "6",
    "LOOPWATCH_MAX_MESSAGE_BYTES": "200000",
    "LOOPWATCH_PARTITIONS": "4",
    "LOOPWATCH_OTLP_PORT": "0",
    "LOOPWATCH_OTLP_GRPC_PORT": "0",
    "LOOPWATCH_SWEEP_INTERVAL_S": "1",
    "LOOPWATCH_CAPTURE_DECIDE_INTERVAL_S": "1",
    # store touched runs every 3 runs within a batch (production: 20k), so every
    # pipeline test also runs the mid-batch settle with its exact counts
    "LOOPWATCH_SETTLE_MAX_RUNS": "3",
}


class DiscardSink:
    """A sink that keeps nothing: for tests that read the pipeline's work, not the store."""

    def write_batch(self, batch: RowBatch) -> None:
        return None


def dead_pid() -> int:
    """The pid of a child that has exited and been reaped."""
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def wait_for(probe: Callable[[], T], timeout_s: float = 60.0, interval_s: float = 0.3,
             what: str = "condition") -> T:
    """Poll until ``probe()`` is truthy; return it, or fail with the last value seen."""
    deadline = time.monotonic() + timeout_s
    value = probe()
    while not value:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}: {value!r}")
        time.sleep(interval_s)
        value = probe()
    return value


def wait_while_progressing(observe: Callable[[], T], done: Callable[[T], object],
                           stall_s: float = 30.0, cap_s: float = 300.0,
                           interval_s: float = 0.3, what: str = "condition") -> T:
    """Poll ``observe()`` (e.g. committed offsets and the processor's counters) until
    ``done`` says so; return the last observation. Fails once the observation has not
    changed for ``stall_s``, or after ``cap_s`` in all: a wedge fails as fast as with
    :func:`wait_for`, while a machine too busy to keep up with a fixed deadline still
    passes as long as the work moves."""
    started = moved = time.monotonic()
    seen = observe()
    while not done(seen):
        now = time.monotonic()
        if now - moved > stall_s or now - started > cap_s:
            raise AssertionError(f"no progress for {now - moved:.0f}s ({now - started:.0f}s "
                                 f"in all) waiting for {what}: at {seen!r}")
        time.sleep(interval_s)
        current = observe()
        if current != seen:
            moved = time.monotonic()
        seen = current
    return seen


@pytest.fixture(scope="session")
def local_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Settings, Client]:
    """A real chdb store opened in the test process itself, migrated.

    chdb allows one engine path per process: every in-process test shares this one.
    (The pipeline's store lives in its own child process and is reached over HTTP.)
    Its database is made as ``fresh_store``'s are, from the engine's template
    (``tests/stores.py``), which that engine migrates once either way.
    """
    settings = Settings(data_dir=tmp_path_factory.mktemp("local-store"))
    return settings, migrated_store(settings)


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker(tmp_path_factory.mktemp("broker") / "broker.log") as running:
        yield running


@pytest.fixture(scope="session")
def alert_receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="session")
def alertmanager(alert_receiver: Receiver, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[str]:
    """A real Alertmanager (Debian prometheus-alertmanager) routing to ``alert_receiver``."""
    binary = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    if binary is None:
        pytest.fail("prometheus-alertmanager is not installed (.ci/run installs it)")
    folder = tmp_path_factory.mktemp("alertmanager")
    config = folder / "alertmanager.yml"
    config.write_text(
        "route:\n  receiver: hook\n  group_by: ['alertname', 'agent']\n"
        "  group_wait: 1s\n  group_interval: 1s\n  repeat_interval: 1h\n"
        "receivers:\n  - name: hook\n    webhook_configs:\n"
        f"      - url: {alert_receiver.url}/alertmanager\n        send_resolved: true\n")
    port = free_port()
    with (folder / "alertmanager.log").open("wb") as log:
        process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.path={folder / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _ready(url), 30, what="alertmanager to be ready")
        yield url
    finally:
        process.terminate()
        process.wait(10)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture(scope="session")
def pipeline(broker: EmbeddedBroker, alertmanager: str,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    """The processor and detectors, as a child ``loopwatch up`` on the session broker,
    posting alerts to the session Alertmanager; tests may kill and restart it."""
    store_dir = tmp_path_factory.mktemp("store")
    up = UpProcess(store_dir,
                   {**PIPELINE_ENV, "LOOPWATCH_KAFKA_BOOTSTRAP": broker.bootstrap,
                    "LOOPWATCH_FAULT_SINK_FILE": str(store_dir / "store-down"),
                    "LOOPWATCH_DRAIN_TIMEOUT_S": "10",
                    "LOOPWATCH_ALERTMANAGER_URL": alertmanager,
                    "LOOPWATCH_DETECT_INTERVAL_S": "1",
                    "LOOPWATCH_LINK_BASE_URL": "http://loopwatch.local"})
    up.start()
    yield up
    up.stop()


class LiveReader(ServiceReader):
    """A reader that follows the pipeline across restarts (its service URL changes)."""

    def __init__(self, pipeline: UpProcess) -> None:
        self._pipeline = pipeline
        super().__init__(pipeline.info["url"])

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.url = self._pipeline.info["url"]
        return super().post(path, body)


class ServiceLikeReader:
    """Hands back what a ``ServiceReader`` gets from a running ``loopwatch up``: the
    store service's JSON (times as text without a zone, uuids as text)."""

    def __init__(self, inner: DirectReader) -> None:
        self.inner = inner

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> QueryResult:
        result = self.inner.query(sql, parameters)
        payload = orjson.loads(dumps({"columns": result.columns, "rows": result.rows}))
        return QueryResult(payload["columns"], payload["rows"])


@pytest.fixture(scope="session")
def reader(pipeline: UpProcess) -> ServiceReader:
    return LiveReader(pipeline)


@pytest.fixture()
def emitter(broker: EmbeddedBroker, tmp_path: Path) -> Iterator[Emitter]:
    with Emitter(broker.bootstrap, spool_dir=tmp_path / "spool",
                 max_message_bytes=100_000) as running:
        yield running


@pytest.fixture()
def agent() -> str:
    return f"agent-{uuid.uuid4().hex[:10]}"


def scalar(reader: ServiceReader, sql: str, **parameters: Any) -> Any:
    return reader.query(sql, parameters).scalar()


def stored_events(reader: ServiceReader, agent: str) -> int:
    return int(scalar(reader, "SELECT count() FROM events FINAL WHERE agent = {a:String}",
                      a=agent))


def raw_events(rows: RowBatch) -> list[dict[str, Any]]:
    """Each raw event a batch's rows would store in ``events`` (as the object inside its
    ``events_in`` row, which ClickHouse splits: tests/test_events_in.py checks how)."""
    split = orjson.loads(encode_rows(rows.tables.get(EVENTS_IN_TABLE, [])))
    return [event for row in split for event in row["event_objects"]]


def wait_stored(reader: ServiceReader, agent: str, events: int, timeout_s: float = 90) -> None:
    wait_for(lambda: stored_events(reader, agent) >= events, timeout_s,
             what=f"{events} events of {agent} stored")
