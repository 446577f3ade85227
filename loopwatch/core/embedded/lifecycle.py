"""The embedded broker of one data dir: a stable address, adopted after a crash of ``up``.

Tansu keeps topics, committed offsets and the run-state changelog in memory only. So the
broker is a process of its own, recorded in ``<data_dir>/broker.json``
(:mod:`loopwatch.ingest.announce`): an ``up`` killed without its drain leaves it running, and the
next ``up`` adopts it (same pid, port and incarnation) and goes on from what the group
committed. A broker that is gone is started again on the recorded port with a new
incarnation, recorded before the broker listens (it waits at a gate until then), so no
client can reach a new broker under an old incarnation. ``up`` stops the broker only
when the broker holds nothing the processors have not committed.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import IO

from loopwatch.core.config import Settings
from loopwatch.core.embedded.broker import (
    EmbeddedBroker,
    answers,
    free_port,
    is_broker_command,
    owned_by_me,
    pid_alive,
    process_argv,
    stop_pid,
)
from loopwatch.ingest.announce import (
    BrokerAnnouncement,
    broker_file,
    read_announcement,
    write_announcement,
)

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
LOCK_FILE = "up.lock"
#: how long an adopted broker gets to accept a connection before it counts as hung
ANSWER_TIMEOUT_S = 5.0


class BrokerError(RuntimeError):
    """Why ``up`` cannot have its broker, in one line (the CLI exits 1 with it)."""


def usable_record(data_dir: Path) -> BrokerAnnouncement | None:
    """The record if it names a loopback port of ours (``127.0.0.1:1-65535``) and a
    positive pid; a damaged or foreign one counts as none (and is replaced)."""
    record = read_announcement(data_dir)
    if record is None:
        return None
    try:
        usable = (record.bootstrap == f"{HOST}:{record.port}" and 0 < record.port < 65536
                  and record.pid > 0)
    except ValueError:
        usable = False
    if not usable:
        log.warning("ignoring the unusable broker record %s", broker_file(data_dir))
        return None
    return record


def recorded_broker(data_dir: Path) -> BrokerAnnouncement | None:
    """The recorded broker if it still runs (see :func:`is_running`)."""
    record = usable_record(data_dir)
    return record if record is not None and is_running(record) else None


def is_running(record: BrokerAnnouncement) -> bool:
    """Whether the record's process runs, is that Tansu broker (its command line
    listens on the recorded port) and runs as this user; a stopped record never is."""
    if record.stopped_at is not None:
        return False
    argv = process_argv(record.pid)
    return (argv is not None and is_broker_command(argv, HOST, record.port)
            and owned_by_me(record.pid))


def discard_broker(data_dir: Path) -> None:
    """Stop the data dir's recorded broker if it still runs (its memory is lost): for a
    data dir about to be deleted (the demo starts afresh) or a test's cleanup."""
    record = recorded_broker(data_dir)
    if record is not None:
        stop_pid(record.pid)


class DataDirBroker:
    """The embedded broker as one ``loopwatch up`` manages it: acquire (adopt or start),
    watch (:meth:`alive`), release. A lost broker is replaced by the next acquire: ``up``
    restarts itself (loopwatch/runtime.py ``BrokerWatch``)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.data_dir = settings.data_dir
        self.log_path = settings.data_dir / "logs" / "broker.log"
        self.adopted = False
        self._announcement: BrokerAnnouncement | None = None
        self._process: EmbeddedBroker | None = None
        self._lock: IO[bytes] | None = None

    @property
    def announcement(self) -> BrokerAnnouncement:
        assert self._announcement is not None, "acquire() first"
        return self._announcement

    @property
    def bootstrap(self) -> str:
        return self.announcement.bootstrap

    def acquire(self) -> DataDirBroker:
        """Adopt the recorded broker if it still runs and answers, else start one on the
        recorded (or pinned, or a free) port. Raises :class:`BrokerError`."""
        self._hold_data_dir()
        pinned = self.settings.broker_port
        record = usable_record(self.data_dir)
        running = record if record is not None and is_running(record) else None
        if running is not None and self._answers_or_stop(running):
            if pinned and pinned != running.port:
                raise BrokerError(
                    f"the embedded broker of {self.data_dir} still runs on port "
                    f"{running.port} (pid {running.pid}), not LOOPWATCH_BROKER_PORT={pinned}; "
                    f"unset it, or stop that broker (kill {running.pid}: what it holds is lost)")
            self._announcement, self.adopted = running, True
            log.warning("adopted the embedded broker still running: pid %d on %s, "
                        "incarnation %s", running.pid, running.bootstrap, running.incarnation)
            return self
        self._start(pinned or (record.port if record else 0))
        return self

    def _hold_data_dir(self) -> None:
        """One ``up`` per data dir manages its broker; the lock goes with the process,
        even on SIGKILL."""
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        descriptor = os.open(self.data_dir / LOCK_FILE,
                             os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        handle = os.fdopen(descriptor, "ab")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise BrokerError(f"another loopwatch up runs on {self.data_dir}") from None
        self._lock = handle

    def _answers_or_stop(self, record: BrokerAnnouncement) -> bool:
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        while time.monotonic() < deadline:
            if answers(HOST, record.port):
                return True
            time.sleep(0.1)
        log.warning("the recorded broker (pid %d) does not answer on %s; stopping it and "
                    "starting a new incarnation", record.pid, record.bootstrap)
        stop_pid(record.pid)
        return False

    def _start(self, port: int) -> None:
        chosen = port or free_port(HOST)
        if answers(HOST, chosen):
            raise BrokerError(self._taken(chosen))
        broker = EmbeddedBroker(self.log_path, HOST, chosen, die_with_parent=False)
        pid = broker.spawn()
        announcement = BrokerAnnouncement(
            bootstrap=broker.bootstrap, pid=pid, incarnation=uuid.uuid4().hex,
            events_topic=self.settings.events_topic,
            consumer_group=self.settings.consumer_group, started_at=time.time())
        try:
            write_announcement(self.data_dir, announcement)
            broker.release()
        except RuntimeError as exc:
            raise BrokerError(self._taken(chosen) if answers(HOST, chosen) else str(exc)
                              ) from None
        except BaseException:
            broker.stop()
            raise
        self._process, self._announcement, self.adopted = broker, announcement, False
        log.warning("started the embedded broker: pid %d on %s, incarnation %s",
                    pid, broker.bootstrap, announcement.incarnation)

    def _taken(self, port: int) -> str:
        return (f"the embedded broker's port {HOST}:{port} (recorded in "
                f"{broker_file(self.data_dir)}) is taken by another program; stop it, or "
                "choose another port with LOOPWATCH_BROKER_PORT")

    def alive(self) -> bool:
        """Whether the broker process still runs (a paused one does)."""
        if self._process is not None:
            return not self._process.exited()
        return pid_alive(self.announcement.pid)

    def release(self, uncommitted: int | None) -> None:
        """At the end of ``up``: stop the broker and mark the record stopped if the broker
        holds nothing uncommitted (``uncommitted == 0``) or is gone; otherwise leave it
        running for the next ``up`` to adopt."""
        try:
            self._stop_unless_holding(uncommitted)
        finally:
            if self._lock is not None:
                self._lock.close()  # the next `up` may take over the data dir
                self._lock = None

    def _stop_unless_holding(self, uncommitted: int | None) -> None:
        if self._announcement is None:
            return
        if uncommitted != 0 and self.alive():
            log.warning("the embedded broker holds %s messages the processors did not "
                        "commit: left running (pid %d on %s) for the next `loopwatch up`; "
                        "`kill %d` discards them", "?" if uncommitted is None else uncommitted,
                        self.announcement.pid, self.bootstrap, self.announcement.pid)
            return
        if self._process is not None:
            self._process.stop()
        elif self.alive():
            stop_pid(self.announcement.pid)
        with contextlib.suppress(OSError):
            write_announcement(self.data_dir, replace(self.announcement, stopped_at=time.time()))
