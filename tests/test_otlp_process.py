"""``loopwatch up`` runs its OTLP receivers in a child process (ingest/otlp/process.py):
spans still stored exactly, a taken port still refused clearly, and a killed ``up``
takes its receiver along (no stray process holding the port)."""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from loopwatch.bench.otlp_burst import EVENTS_PER_TRACE, build_burst, burst_worker, stored
from loopwatch.core.config import Settings
from loopwatch.core.embedded.broker import EmbeddedBroker
from loopwatch.core.processes import children
from loopwatch.core.topics import ensure_topics
from loopwatch.ingest.otlp.process import MODULE, ReceiverProcess, _take_over
from loopwatch.ingest.otlp.settings import OtlpSettings
from loopwatch.ingest.spool import LOCK_FILE, DiskSpool
from loopwatch.upprocess import UpProcess
from tests.conftest import PIPELINE_ENV, wait_for


def receiver_children(pid: int) -> list[int]:
    """Children of ``pid`` running the OTLP receiver module."""
    found = []
    for child in children(pid):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if MODULE.encode() in command:
            found.append(int(child))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def post(url: str, body: bytes) -> int:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=60)
    try:
        conn.request("POST", "/v1/traces", body, {"Content-Type": "application/x-protobuf"})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


@pytest.mark.stack
def test_up_receives_otlp_in_a_child_process_and_stores_every_span(
        pipeline: UpProcess) -> None:
    (child,) = receiver_children(pipeline.process.pid)  # type: ignore[union-attr]
    assert child != pipeline.process.pid  # type: ignore[union-attr]
    seed, traces = 9101, 30
    bodies = build_burst(traces, seed=seed, per_request=100)
    assert [post(pipeline.info["otlp_url"], body) for body in bodies] == [200] * 4
    wait_for(lambda: stored(pipeline, burst_worker(seed)) == (EVENTS_PER_TRACE * traces,
                                                              traces), timeout_s=120)
    runs = "run_id IN (SELECT run_id FROM runs WHERE worker_id = {w:String})"
    llm, tools = pipeline.reader.query(
        f"SELECT (SELECT uniqExact(event_id) FROM llm_calls WHERE {runs}), "
        f"(SELECT uniqExact(event_id) FROM tool_calls WHERE {runs})",
        {"w": burst_worker(seed)}).rows[0]
    assert (llm, tools) == (5 * traces, 5 * traces)


@pytest.fixture()
def own_up(broker: EmbeddedBroker, tmp_path: Path) -> Iterator[UpProcess]:
    """An ``up`` on the session broker with a topic and group of its own."""
    topic, group = "otlp-process-test", "otlp-process-test"
    ensure_topics(broker.bootstrap, Settings(data_dir=tmp_path, events_topic=topic))
    up = UpProcess(tmp_path / "data", {**PIPELINE_ENV, "LOOPWATCH_EVENTS_TOPIC": topic,
                                       "LOOPWATCH_CONSUMER_GROUP": group,
                                       "LOOPWATCH_KAFKA_BOOTSTRAP": broker.bootstrap})
    up.start(180)
    try:
        yield up
    finally:
        up.kill()


@pytest.mark.stack
def test_a_killed_up_takes_its_receiver_process_along(own_up: UpProcess) -> None:
    (child,) = receiver_children(own_up.process.pid)  # type: ignore[union-attr]
    port = int(own_up.info["otlp_url"].rsplit(":", 1)[1])
    own_up.kill()  # SIGKILL: nothing of up's own shutdown runs
    wait_for(lambda: not alive(child), timeout_s=60)
    with socket.socket() as probe:  # the port is free again
        probe.bind(("127.0.0.1", port))


def test_a_taken_port_is_refused_in_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=r"(?i)address already in use"):
            ReceiverProcess(Settings(data_dir=tmp_path), "127.0.0.1:1",
                            OtlpSettings(port=port, grpc_port=None))
    assert not [pid for pid in receiver_children(os.getpid()) if alive(pid)]


def test_a_port_a_previous_receiver_still_holds_is_waited_for(tmp_path: Path) -> None:
    """The port is retried while the spool's lock names a live receiver of this module
    (a stand-in here: a child whose argv names it, holding the port for a second); a
    port another program holds is refused at once (the test above)."""
    spool = tmp_path / "spool"
    spool.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import socket, sys, time\n"
         "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
         "print(s.getsockname()[1], flush=True); time.sleep(1)", MODULE],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        port = int(holder.stdout.readline())
        (spool / LOCK_FILE).write_text(str(holder.pid))

        def bind() -> socket.socket:
            listener = socket.socket()
            try:
                listener.bind(("127.0.0.1", port))
            except OSError:
                listener.close()
                raise
            return listener

        with _take_over(bind, 60, spool) as taken:
            assert taken.getsockname()[1] == port
        assert holder.wait(10) == 0  # it let go by itself: nothing was killed
    finally:
        holder.kill()
        holder.wait()


def test_the_receiver_process_ends_when_its_parent_s_pipe_does(tmp_path: Path) -> None:
    """An ``up`` that restarts itself (``execv``) keeps its pid, so neither the parent-pid
    check nor the death signal fires: the end of the config pipe, whose parent end is
    close-on-exec, is what ends the child. Closing it here stands in for the exec."""
    receiver = ReceiverProcess(Settings(data_dir=tmp_path), "127.0.0.1:1",
                               OtlpSettings(port=0, grpc_port=None))
    try:
        pipe = receiver._child.stdin
        assert pipe is not None and not os.get_inheritable(pipe.fileno())
        assert receiver_children(os.getpid()) == [receiver.pid]
        assert post(receiver.url, b"\xff") == 400  # it serves: garbage is refused
        pipe.close()
        wait_for(lambda: receiver._child.poll() is not None, timeout_s=60)
        assert receiver._child.returncode == 0
    finally:
        receiver.stop()


def test_receivers_that_do_not_stop_in_time_do_not_keep_the_child_alive() -> None:
    """A stop stuck in a flush (a stand-in receiver whose stop never returns) ends the
    process after the bound, with exit code 1; one that stops returns normally."""
    code = ("import time; from loopwatch.ingest.otlp.process import _stop_within\n"
            "class Stuck:\n    def stop(self): time.sleep(300)\n"
            "class Quick:\n    def stop(self): pass\n"
            "_stop_within(Quick(), 5); print('quick stopped', flush=True)\n"
            "_stop_within(Stuck(), 0.5); print('not reached')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert (result.returncode, result.stdout) == (1, "quick stopped\n"), result.stderr
    assert "the receivers did not stop within 0 s; exiting" in result.stderr


def test_a_receiver_waits_for_the_spool_of_one_still_stopping(tmp_path: Path) -> None:
    """A crashed ``up``'s receiver goes on flushing for up to ``STOP_WITHIN_S`` while the
    next ``up`` starts its own on the same spool folder. The new one waits for the lock
    (held here by this process for ~1 s) instead of failing: it used to raise
    ``SpoolLocked`` at once, and the restarted ``up`` ran with no OTLP receiver."""
    settings = Settings(data_dir=tmp_path)
    previous = DiskSpool(settings.spool_dir / "otlp-receiver", 1 << 20)
    release = threading.Timer(1.0, previous.close)
    release.start()
    try:
        receiver = ReceiverProcess(settings, "127.0.0.1:1", OtlpSettings(port=0, grpc_port=None))
    finally:
        release.join()
    try:
        assert post(receiver.url, b"\xff") == 400  # it serves: garbage is refused
        holder = (settings.spool_dir / "otlp-receiver" / LOCK_FILE).read_text()
        assert holder == str(receiver.pid)
    finally:
        receiver.stop()
