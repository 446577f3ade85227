"""Issue 24 §2 and §6: the store service is reachable by its owner's user only, and
everything loopwatch keeps in its data dir is private whatever the umask.

Against the real ``loopwatch up`` of the session (its store service, its data dir), a
real chdb store in-process, and a real headless Chromium (Debian's, through Selenium,
as tests/test_webview.py drives it). "Another local user" is a real one: a forked child
of the test that drops to ``nobody`` (uid 65534) with setuid, which needs root (this
machine and CI run the tests as root; elsewhere those tests are skipped and say so).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import socket
import stat
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from loopwatch.core.config import Settings
from loopwatch.core.processes import family
from loopwatch.detectors.outbox import Outbox
from loopwatch.ingest.privatefs import mode
from loopwatch.ingest.spool import DiskSpool
from loopwatch.runtime import _insert_action
from loopwatch.store.clickhouse import connect, run_query
from loopwatch.store.reader import QueryError, ServiceReader, ServiceUnreachable
from loopwatch.store.service import MAX_SOCKET_PATH, SERVICE_HOST, ServiceInUse, StoreService
from tests.browser import chromium
from tests.conftest import dead_pid, wait_for

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0,
                                reason="acting as another user (setuid) needs root")


def forged_batch(run_id: str) -> bytes:
    """The ``/admin/insert-batch`` body of a closed $123,456 run (issue 24's forgery)."""
    rows = orjson.dumps([{"run_id": run_id, "agent": "evil", "status": "closed",
                          "outcome": "success", "cost_usd": 123456.0, "version": 99,
                          "started_ts": "2026-12-01T00:00:00Z",
                          "last_event_ts": "2026-12-01T00:00:00Z"}])
    return f"runs {len(rows)}\n".encode() + rows


def runs_named(query: Callable[[str, dict[str, Any]], Any], run_id: str) -> int:
    return int(query("SELECT count() FROM runs WHERE run_id = {r:String}", {"r": run_id})
               .rows[0][0])


def as_user(uid: int | None, probe: Callable[[], str]) -> str:
    """``probe()`` run in a forked child as ``uid`` (None: as ourselves); its answer, or
    the exception it raised as ``refused <type> <errno>``."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery, only the probe, then _exit
        os.close(read_end)
        try:
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            answer = probe()
        except BaseException as exc:
            answer = f"refused {type(exc).__name__} {getattr(exc, 'errno', '')}"
        os.write(write_end, answer.encode()[:4000])
        os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    with os.fdopen(read_end, "rb") as answer_pipe:
        return answer_pipe.read().decode()


def http_over(address: str, method: str, path: str, body: bytes = b"",
              headers: dict[str, str] | None = None) -> str:
    """A plain HTTP/1.1 request with the standard library only (what another user's
    script would send), to ``unix:<path>`` or ``http://host:port``; the status line."""
    if address.startswith("unix:"):
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.settimeout(10)
        connection.connect(address.removeprefix("unix:"))
    else:
        host, _, port = address.removeprefix("http://").partition(":")
        connection = socket.create_connection((host, int(port)), timeout=10)
    lines = [f"{method} {path} HTTP/1.1", f"Host: {SERVICE_HOST}",
             f"Content-Length: {len(body)}", "Connection: close",
             *(f"{k}: {v}" for k, v in (headers or {}).items())]
    with connection:
        connection.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        return connection.recv(65536).decode(errors="replace").split("\r\n")[0]


@pytest.fixture()
def owned(local_store) -> Iterator[tuple[Settings, StoreService, Path]]:
    """An in-process store service on the session's chdb store, in a data dir whose
    parent anyone may traverse (as a home dir often is): only the data dir's own
    modes keep other users out."""
    _settings, client = local_store
    root = Path(tempfile.mkdtemp(prefix="lw-home-"))
    os.chmod(root, 0o755)
    settings = Settings(data_dir=root / "data")
    service = StoreService(client, lambda: {"probe": 1}, settings.service_file,
                           settings.service_socket, raw_actions={
                               "insert-batch": _insert_action(lambda: connect(settings))})
    service.start({})
    try:
        yield settings, service, root
    finally:
        service.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_the_service_listens_on_a_private_socket_and_announces_it_privately(owned):
    settings, service, _root = owned
    assert service.url == f"unix:{settings.service_socket}"
    assert stat.S_ISSOCK(settings.service_socket.stat().st_mode)
    assert [mode(settings.data_dir), mode(settings.service_socket),
            mode(settings.service_file)] == [0o700, 0o600, 0o600]
    announced = orjson.loads(settings.service_file.read_bytes())
    assert announced["url"] == service.url and announced["pid"] == os.getpid()
    assert ServiceReader(service.url).health() == {"ok": True, "probe": 1}


@needs_root
def test_another_user_can_neither_read_the_announcement_nor_connect(owned, local_store):
    settings, service, root = owned
    run_id = f"FORGED-{uuid.uuid4().hex[:8]}"

    def announcement() -> str:
        return settings.service_file.read_text()

    def forge() -> str:
        return http_over(service.url, "POST", "/admin/insert-batch", forged_batch(run_id),
                         {"Content-Type": "application/octet-stream"})

    # the other user gets as far as the data dir (its parent is open, as a home dir
    # often is): what refuses them below is the data dir's own modes
    assert as_user(NOBODY, lambda: str(os.listdir(root))) == "['data']"
    assert as_user(NOBODY, announcement) == "refused PermissionError 13"
    assert as_user(NOBODY, forge) == "refused PermissionError 13"
    assert as_user(None, lambda: http_over(service.url, "GET", "/health")) == "HTTP/1.1 200 OK"
    assert runs_named(lambda s, p: run_query(local_store[1], s, p), run_id) == 0


@needs_root
def test_another_user_cannot_write_through_the_running_up(pipeline, reader):
    """The forgery of the issue, by another local user against the session's ``up``:
    before, its loopback port took the $123,456 run from anyone."""
    run_id = f"FORGED-{uuid.uuid4().hex[:8]}"
    address = pipeline.info["url"]

    def forge() -> str:
        return http_over(address, "POST", "/admin/insert-batch", forged_batch(run_id),
                         {"Content-Type": "application/octet-stream"})

    assert as_user(NOBODY, forge).startswith("refused ")
    assert runs_named(reader.query, run_id) == 0


@pytest.mark.parametrize(("method", "path", "headers", "status"), [
    ("POST", "/query", {"Host": "attacker.example:8123"}, 421),
    ("POST", "/query", {"Host": "127.0.0.1"}, 421),
    ("POST", "/query", {"Origin": "http://attacker.example"}, 403),
    ("POST", "/query", {"Origin": "null"}, 403),
    ("POST", "/query", {"Sec-Fetch-Site": "cross-site"}, 403),
    ("POST", "/query", {"Content-Type": "text/plain"}, 415),
    ("POST", "/query", {"Content-Type": "application/x-www-form-urlencoded"}, 415),
    ("POST", "/query", {"Content-Type": ""}, 415),
    ("POST", "/admin/insert-batch", {"Content-Type": "text/plain"}, 415),
    ("POST", "/admin/insert-batch", {"Content-Type": "application/json"}, 415),
    ("POST", "/admin/insert-batch", {"Host": "loopwatch-store.attacker.example"}, 421),
    ("POST", "/admin/no-such-action", {}, 404),
    ("GET", "/query", {}, 405),
    ("PUT", "/admin/insert-batch", {}, 405),
    ("GET", "/../../etc/passwd", {}, 404),
])
def test_what_no_loopwatch_client_sends_is_refused_and_writes_nothing(
        owned, local_store, method, path, headers, status):
    _settings, service, _root = owned
    run_id = f"FORGED-{uuid.uuid4().hex[:8]}"
    sent = {"Content-Type": "application/octet-stream" if "insert" in path
            else "application/json", **headers}
    body = forged_batch(run_id) if "insert" in path else orjson.dumps(
        {"sql": f"SELECT 'x' INTO OUTFILE '/tmp/{run_id}'"})
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(service.socket_path)),
                      base_url=f"http://{SERVICE_HOST}") as client:
        answer = client.request(method, path, content=body, headers=sent)
    assert answer.status_code == status
    assert list(answer.json()) == ["error"] and "\n" not in answer.json()["error"]
    assert runs_named(lambda s, p: run_query(local_store[1], s, p), run_id) == 0
    assert not Path(f"/tmp/{run_id}").exists()


def test_malformed_bodies_are_one_line_refusals_that_insert_nothing(owned, local_store):
    _settings, service, _root = owned
    run_id = f"FORGED-{uuid.uuid4().hex[:8]}"
    client = ServiceReader(service.url)
    whole = forged_batch(run_id)
    for path, body, content_type in [
        ("/query", b"{not json", "application/json"),
        ("/query", b"[1, 2]", "application/json"),
        ("/query", b'{"parameters": {}}', "application/json"),
        ("/admin/insert-batch", whole[:-5], "application/octet-stream"),
        ("/admin/insert-batch", b"runs many\n[]", "application/octet-stream"),
        ("/admin/insert-batch", whole.replace(b"runs ", b"system_users ", 1),
         "application/octet-stream"),
    ]:
        with pytest.raises(QueryError) as refused:
            client.send(path, body, content_type)
        assert str(refused.value) and "\n" not in str(refused.value)
    assert runs_named(lambda s, p: run_query(local_store[1], s, p), run_id) == 0
    assert client.query("SELECT 42 AS x").rows == [[42]]  # and it still serves


def test_a_stale_socket_is_replaced_and_a_live_one_is_not_taken_over(owned, local_store):
    settings, service, _root = owned
    second = StoreService(local_store[1], lambda: {}, settings.service_file,
                          settings.service_socket)
    with pytest.raises(ServiceInUse, match="another loopwatch process serves"):
        second.start({})
    assert ServiceReader(service.url).query("SELECT 1 AS one").rows == [[1]]
    service.stop()  # then leave a socket file behind, as a SIGKILL of the owner would
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(settings.service_socket))
    stale.close()
    with pytest.raises(ServiceUnreachable):
        ServiceReader(service.url).health()
    restarted = StoreService(local_store[1], lambda: {}, settings.service_file,
                             settings.service_socket)
    assert restarted.start({}) == service.url
    try:
        assert ServiceReader(service.url).query("SELECT 2 AS two").rows == [[2]]
    finally:
        restarted.stop()


def test_a_socket_path_too_long_for_unix_binds_a_private_temporary_one(local_store,
                                                                       tmp_path: Path):
    """A Unix socket path holds at most 107 bytes; a deep data dir gets a fresh 0700
    folder under the temporary dir, named in the announcement, and a following reader
    finds it again after the owner restarts (at another such folder)."""
    deep = Settings(data_dir=tmp_path / ("d" * 60) / ("e" * 60))
    assert len(str(deep.service_socket)) > MAX_SOCKET_PATH

    def owner() -> StoreService:
        return StoreService(local_store[1], lambda: {}, deep.service_file,
                            deep.service_socket)

    first = owner()
    address = first.start({})
    follower = ServiceReader(address, follow=deep)
    try:
        assert first.socket_path != deep.service_socket
        assert mode(first.socket_path.parent) == 0o700 and mode(first.socket_path) == 0o600
        assert orjson.loads(deep.service_file.read_bytes())["url"] == address
        assert follower.query("SELECT 1 AS one").rows == [[1]]
    finally:
        first.stop()
    second = owner()
    moved = second.start({})
    try:
        assert moved != address
        assert follower.send("/query", orjson.dumps({"sql": "SELECT 3 AS x"}),
                             "application/json") == b'{"columns":["x"],"rows":[[3]]}'
        assert follower.url == moved
    finally:
        second.stop()


def test_a_following_reader_waits_for_a_live_owner_rebinding_its_socket(local_store,
                                                                        tmp_path: Path):
    """An ``up`` that lost its broker re-executes itself: same pid, its announcement
    left as it was, its socket gone until the new process binds it (the rebalance test
    once failed on that ENOENT). A following reader (an extra worker's, a test's) waits
    for the owner it knows to be alive and is answered once it serves again; an
    announcement naming a dead process is refused at once, as before."""
    settings = Settings(data_dir=tmp_path / "data")
    settings.data_dir.mkdir()

    def owner() -> StoreService:
        return StoreService(local_store[1], lambda: {}, settings.service_file,
                            settings.service_socket)

    first = owner()
    follower = ServiceReader(first.start({}), follow=settings)
    assert follower.query("SELECT 1 AS one").rows == [[1]]
    announcement = settings.service_file.read_bytes()
    first.stop()
    settings.service_file.write_bytes(announcement)  # as os.execv leaves it
    assert not settings.service_socket.exists()
    second = owner()
    rebinding = threading.Timer(1.0, second.start, args=({},))
    rebinding.start()
    try:
        assert follower.query("SELECT 2 AS two").rows == [[2]]
    finally:
        rebinding.join()
        second.stop()
    gone = orjson.loads(announcement) | {"pid": dead_pid()}
    hostile = [orjson.dumps(gone), b"[1, 2]", orjson.dumps(gone | {"pid": "1"}),
               orjson.dumps(gone | {"pid": None}), b"\xff not json"]
    for written in hostile:  # nobody is coming back: refused at once, as before
        settings.service_file.write_bytes(written)
        with pytest.raises(ServiceUnreachable, match="No such file"):
            follower.query("SELECT 3 AS three")


# -- a web page on another origin, in a real browser --------------------------------------


def listening_ports(pid: int) -> list[int]:
    """The TCP ports process ``pid`` and its children listen on (their socket inodes in
    /proc/net/tcp*)."""
    inodes = set()
    for member in family(pid):
        with contextlib.suppress(OSError):
            for descriptor in Path(f"/proc/{member}/fd").iterdir():
                try:
                    target = os.readlink(descriptor)
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


PAGE = """<!doctype html><html><body><script>
const targets = %(targets)s;
const attempts = [];
for (const base of targets) {
  attempts.push(fetch(base + '/query', {mode: 'no-cors', method: 'POST', body: %(outfile)s}));
  attempts.push(fetch(base + '/admin/insert-batch', {mode: 'no-cors', method: 'POST',
                                                    body: %(forged)s}));
  attempts.push(fetch(base + '/query', {method: 'POST', body: '{"sql": "SELECT 42 AS x"}'})
    .then(r => r.text()).then(t => 'read ' + t));
}
Promise.allSettled(attempts).then(results => {
  document.body.dataset.results = JSON.stringify(results.map(
    r => r.status === 'fulfilled' ? String(r.value) : 'rejected'));
  document.title = 'done';
});
</script></body></html>"""


@pytest.fixture()
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with chromium(tmp_path_factory.mktemp("chromium-profile"), window="800,600") as driver:
        yield driver


def test_a_page_on_another_origin_can_neither_read_nor_write_through_the_store(
        pipeline, reader, browser, tmp_path: Path):
    """The issue's attack in headless Chromium: a page on another origin fires
    ``fetch(..., {mode: 'no-cors', method: 'POST'})`` at every TCP port the running
    ``up`` listens on (where its store service used to be): an ``INTO OUTFILE`` query,
    a forged $123,456 run, and a CORS read. No file appears, no run is stored, and the
    page reads nothing; the store service itself is a Unix socket no page can reach."""
    assert pipeline.process is not None
    ports = listening_ports(pipeline.process.pid)
    assert ports, "up listens on no TCP port: the OTLP receiver should be there"
    run_id = f"FORGED-{uuid.uuid4().hex[:8]}"
    outfile = tmp_path / "written-by-a-web-page.txt"
    page = PAGE % {
        "targets": json.dumps([f"http://127.0.0.1:{port}" for port in ports]),
        "outfile": json.dumps(json.dumps({"sql": f"SELECT 'pwned' INTO OUTFILE '{outfile}'"})),
        "forged": json.dumps(forged_batch(run_id).decode()),
    }

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(page.encode())

        def log_message(self, format: str, *args: Any) -> None:
            return

    origin = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=origin.serve_forever, kwargs={"poll_interval": 0.02},
                     daemon=True).start()
    try:
        browser.get(f"http://127.0.0.1:{origin.server_address[1]}/")
        wait_for(lambda: browser.title == "done", 60, what="the page's requests settled")
        results = json.loads(browser.execute_script("return document.body.dataset.results"))
    finally:
        origin.shutdown()
        origin.server_close()
    assert len(results) == 3 * len(ports)
    assert not [r for r in results if r.startswith("read ") and "42" in r]
    assert not outfile.exists()
    assert runs_named(reader.query, run_id) == 0
    assert pipeline.info["url"] == f"unix:{pipeline.data_dir / 'service.sock'}"


# -- §6: private whatever the umask -------------------------------------------------------


def test_what_loopwatch_keeps_is_private_under_umask_022(tmp_path: Path):
    """Spool, outbox and their folders, created by a process whose umask is the usual
    022 (which made them 0755/0644 before)."""
    old = os.umask(0o022)
    try:
        data = tmp_path / "data"
        spool = DiskSpool(data / "spool" / "agent-1", max_bytes=10_000)
        assert spool.append([b'{"event": 1}']).records == 1
        outbox = Outbox(data / "outbox" / "notifications.jsonl", {"hook": object()})  # type: ignore[dict-item]
        outbox.put([{"alert": "x"}])
    finally:
        os.umask(old)
    assert {str(p.relative_to(tmp_path)): oct(mode(p)) for p in sorted(data.rglob("*"))} | {
        "data": oct(mode(data))} == {
        "data": "0o700", "data/spool": "0o700", "data/spool/agent-1": "0o700",
        "data/spool/agent-1/lock": "0o600",
        "data/spool/agent-1/seg-000000000000.log": "0o600", "data/outbox": "0o700",
        "data/outbox/notifications.jsonl": "0o600"}


def test_the_running_ups_data_dir_and_store_are_private(pipeline):
    """Everything the session's ``up`` made in its data dir, chdb's own files
    included, opens for its owner only. The session runs under umask 022
    (tests/conftest.py sets it), which made all of it 0755/0644 before."""
    data = pipeline.data_dir
    assert [mode(data), mode(data / "chdb"), mode(data / "service.json")] == [
        0o700, 0o700, 0o600]
    assert mode(data / "service.sock") == 0o600
    made = [p for folder in ("chdb", "logs", "spool", "outbox")
            for p in (data / folder).rglob("*") if not p.is_symlink()]  # links are 0777
    assert len(made) > 50  # chdb's tree is there to be checked
    # a part chdb is still writing (tmp_insert_*) can be gone by the time it is looked at
    assert [str(p) for p in made if p.exists() and _mode_or_zero(p) & 0o077] == []


def _mode_or_zero(path: Path) -> int:
    """``mode(path)``, or 0 for a file removed since it was listed."""
    try:
        return mode(path)
    except FileNotFoundError:
        return 0
