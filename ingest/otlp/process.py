"""The OTLP receivers of ``loopwatch up`` in a child process of their own.

Why: decoding, mapping and publishing a span costs ~55-60 µs of CPU, almost all of it
Python holding the GIL. Inside ``up`` that GIL is the processors' too: the receiver's
threads and the faust event loop took turns, and the processors stored almost nothing
while a burst was being accepted. A child has its own interpreter, so on two cores
receiving and processing overlap: +14 % persisted spans per second (median, 24 bursts
each way) and ~5-10 % less CPU per span (docs/performance.md, "OTLP ingest").

What does not change: the child runs the same :class:`OtlpReceiver` (same limits,
same answer only after the broker acknowledged every message), from the parent's own
:class:`Settings` and :class:`OtlpSettings` (pickled over its stdin, so a token never
shows in a process listing). It ends when told (SIGTERM: the receiver stops and its
producer flushes) and when its parent is gone: the end of that pipe (the parent's end
is close-on-exec, so an ``up`` that restarts itself with ``execv`` counts as gone),
``PR_SET_PDEATHSIG`` and a check of the parent pid; so a crashed or restarted ``up``
leaves no receiver holding the port.

That receiver may still be stopping (flushing its producer, at most
:data:`STOP_WITHIN_S`) when the next ``up`` starts its own: the new child waits that long
for the old one's spool folder and port, then kills it if it is still there (under load
one was seen alive > 40 s after its ``up``'s SIGKILL). It used to fail at once on the
spool's lock, and an ``up`` restarted right after a crash ran with no OTLP receiver.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import orjson

from loopwatch.core.config import Settings
from loopwatch.core.embedded.broker import process_argv
from loopwatch.core.libc import die_with_parent
from loopwatch.core.processes import parent_of
from loopwatch.ingest.otlp.settings import OtlpSettings
from loopwatch.ingest.spool import LOCK_FILE, SpoolLocked

T = TypeVar("T")

log = logging.getLogger(__name__)
#: the module the child runs (``python -m``): how a receiver is told from other processes
MODULE = "loopwatch.ingest.otlp.process"
#: how long the parent waits for the child's address line (imports take ~1-3 s)
START_TIMEOUT_S = 60.0
#: how long the child's receivers may take to stop before it exits anyway
STOP_WITHIN_S = 15.0
#: how often the child checks that its parent is still there
PARENT_CHECK_S = 0.5
#: how long a new child waits for a previous receiver (orphaned by a crashed ``up``) to
#: let go of the spool folder and the port: it stops within STOP_WITHIN_S of its parent
TAKEOVER_WITHIN_S = STOP_WITHIN_S + 5.0
#: how long it waits for the spool and port once it has killed a receiver that outlived that
AFTER_KILL_WITHIN_S = 5.0


class ReceiverProcess:
    """:class:`OtlpReceiver` in a child: ``url``, ``grpc_address`` and ``stop()`` as the
    in-process receiver has them. A taken port raises :class:`OSError` here, as the
    in-process constructor does."""

    def __init__(self, settings: Settings, bootstrap: str, limits: OtlpSettings) -> None:
        self._child = subprocess.Popen(
            [sys.executable, "-m", MODULE],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None)
        assert self._child.stdin is not None and self._child.stdout is not None
        config = pickle.dumps((settings, bootstrap, limits))
        # the pipe stays open: its end is how the child learns this process is gone
        # (exit, SIGKILL, or the exec of an `up` restarting itself: it is close-on-exec)
        self._child.stdin.write(len(config).to_bytes(8, "big") + config)
        self._child.stdin.flush()
        ready, _, _ = select.select([self._child.stdout], [], [], START_TIMEOUT_S)
        line = self._child.stdout.readline() if ready else b""
        answer: dict[str, Any] = orjson.loads(line) if line.strip() else {}
        if "url" not in answer:
            self.stop()
            raise OSError(answer.get("error") or "the OTLP receiver process did not start")
        self.url: str = answer["url"]
        self.grpc_address: str | None = answer.get("grpc")

    @property
    def pid(self) -> int:
        return self._child.pid

    def stop(self, timeout_s: float = 15.0) -> None:
        with contextlib.suppress(OSError):
            assert self._child.stdin is not None
            self._child.stdin.close()
        if self._child.poll() is None:
            self._child.terminate()
            try:
                self._child.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._child.kill()
                self._child.wait()
        if self._child.stdout is not None:
            self._child.stdout.close()


def main() -> None:
    """The child: read the parent's settings, start the receivers, print their address
    as one JSON line, serve until SIGTERM or the parent is gone."""
    from loopwatch.ingest.otlp.export import receiver_spool  # the child's imports only
    from loopwatch.ingest.otlp.server import OtlpReceiver

    die_with_parent()  # Linux; elsewhere the pid check ends the child
    parent = os.getppid()
    answer = os.fdopen(os.dup(1), "wb")  # the address line; anything printed goes to stderr
    os.dup2(2, 1)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s otlp-receiver %(message)s")
    size = int.from_bytes(sys.stdin.buffer.read(8), "big")
    settings, bootstrap, limits = pickle.loads(sys.stdin.buffer.read(size))
    stop = threading.Event()

    def until_parent_gone() -> None:
        sys.stdin.buffer.read()  # returns at end of file: the parent closed or is gone
        stop.set()

    threading.Thread(target=until_parent_gone, name="parent-watch", daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C: it stops us
    try:
        receiver = _take_over(lambda: OtlpReceiver(settings, bootstrap, limits.host,
                                                   limits.port, limits.token, limits=limits),
                              TAKEOVER_WITHIN_S, receiver_spool(settings))
    except (OSError, SpoolLocked) as exc:
        answer.write(orjson.dumps({"error": str(exc)}) + b"\n")
        answer.close()
        return
    receiver.start()
    if limits.grpc_port is not None:
        receiver.serve_grpc(limits.grpc_port)
    # Spans allocate a few containers each that reference counting frees; the default
    # collector thresholds made the cyclic GC ~1/3 of the mapping's CPU.
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    answer.write(orjson.dumps({"url": receiver.url, "grpc": receiver.grpc_address}) + b"\n")
    answer.close()
    while not stop.wait(PARENT_CHECK_S):
        if os.getppid() != parent:
            break
    _stop_within(receiver, STOP_WITHIN_S)


def _take_over(start: Callable[[], T], within_s: float, spool: Path) -> T:
    """``start()``, tried again while the spool folder is locked or the port taken by the
    receiver that holds it, for up to ``within_s``: a receiver whose ``up`` crashed gives
    both up within that time (a port another program holds is refused at once). One
    that still holds the spool then (seen under load: alive > 40 s after its ``up``'s
    SIGKILL) is an orphan receiver of this module: it is killed, and what it had not sent
    stays in the spool for this one to send."""
    deadline = time.monotonic() + within_s
    killed = False
    while True:
        try:
            return start()
        except (SpoolLocked, OSError) as exc:
            held = isinstance(exc, SpoolLocked) or (
                exc.errno == errno.EADDRINUSE and _receiver_holding(spool) is not None)
            if not held:
                raise
            if time.monotonic() > deadline:
                if killed or not _kill_orphan_holder(spool):
                    raise
                killed, deadline = True, time.monotonic() + AFTER_KILL_WITHIN_S
            time.sleep(0.2)


def _receiver_holding(spool: Path) -> int | None:
    """The pid named in ``spool``'s lock file if that process runs this module (a
    previous receiver of this data folder, maybe still letting go of the port); None
    for a stale lock file or another program, whose taken port is refused at once."""
    try:
        pid = int((spool / LOCK_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    argv = process_argv(pid)
    return pid if argv and MODULE in argv and pid != os.getpid() else None


def _kill_orphan_holder(spool: Path) -> bool:
    """SIGKILL the receiver named in ``spool``'s lock file if it is not this process's
    sibling (its ``up`` is gone); whether one was killed."""
    pid = _receiver_holding(spool)
    if pid is None or parent_of(pid) == os.getppid():
        return False
    log.warning("the previous OTLP receiver (pid %d) still holds %s; killing it", pid, spool)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    return True


def _stop_within(receiver: Any, timeout_s: float) -> None:
    """Stop the receivers, or leave at once if that takes longer than ``timeout_s`` (a
    flush to a broker that is slow or gone): nothing unacknowledged was answered 200, so
    what an exit drops its clients send again, and an orphan must not outlive ``up``."""
    closing = threading.Thread(target=receiver.stop, name="receiver-stop", daemon=True)
    closing.start()
    closing.join(timeout_s)
    if closing.is_alive():
        logging.getLogger(__name__).warning(
            "the receivers did not stop within %.0f s; exiting", timeout_s)
        os._exit(1)


if __name__ == "__main__":
    main()
