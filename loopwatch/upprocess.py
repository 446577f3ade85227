"""Run ``loopwatch up`` as a child process and wait until its store service answers.

Used by ``loopwatch demo`` and by the tests: the child owns the chdb store, everything
else talks to it through the store service it announces.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from loopwatch.core.config import load_settings
from loopwatch.core.embedded.lifecycle import discard_broker
from loopwatch.core.processes import terminate
from loopwatch.ingest.announce import BrokerAnnouncement, read_announcement
from loopwatch.ingest.privatefs import append_private, private_dir
from loopwatch.store.reader import ServiceReader, running_service


class UpProcess:
    def __init__(self, data_dir: Path, env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.env = {**os.environ, **(env or {}), "LOOPWATCH_DATA_DIR": str(data_dir)}
        self.process: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}

    @property
    def reader(self) -> ServiceReader:
        """Follows the data dir's announcement: an ``up`` that restarted itself (its
        embedded broker was lost) serves the store on a new port."""
        return ServiceReader(self.info["url"], follow=load_settings(data_dir=self.data_dir))

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout_s: float = 90.0) -> UpProcess:
        """Start the child (a no-op while it runs) and wait for its announcement."""
        if self.running:
            return self
        settings = load_settings(data_dir=self.data_dir)
        log_dir = self.data_dir / "logs"
        private_dir(log_dir)
        with append_private(log_dir / "up.log") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "loopwatch.cli", "up"],
                env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"loopwatch up exited with {self.process.returncode}; see {log_dir}/up.log"
                )
            announced = running_service(settings)
            if announced and announced.get("pid") == self.process.pid:
                self.info = announced
                return self
            time.sleep(0.2)
        self.kill()
        raise TimeoutError(f"loopwatch up did not come up in {timeout_s:.0f}s; see {log_dir}")

    def rejoin(self, timeout_s: float = 90.0) -> UpProcess:
        """After the child restarted itself in place (same pid: its embedded broker was
        lost), wait for its new store-service announcement (a new ``started_at``)."""
        settings = load_settings(data_dir=self.data_dir)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.running:
                raise RuntimeError(f"loopwatch up exited; see {self.data_dir}/logs/up.log")
            announced = running_service(settings)
            if (announced and announced.get("pid") == self.process.pid  # type: ignore[union-attr]
                    and announced.get("started_at") != self.info.get("started_at")):
                self.info = announced
                return self
            time.sleep(0.2)
        raise TimeoutError(f"loopwatch up did not announce itself again in {timeout_s:.0f}s")

    def health(self) -> dict[str, Any]:
        return self.reader.health()

    @property
    def broker(self) -> BrokerAnnouncement | None:
        """The embedded broker as recorded in the data dir (it may outlive the child)."""
        return read_announcement(self.data_dir)

    def discard_broker(self) -> None:
        """Stop a broker the child left running (after :meth:`kill`); its memory is lost."""
        discard_broker(self.data_dir)

    def stop(self, timeout_s: float = 90.0) -> int | None:
        """SIGTERM: the child drains what the broker holds, then exits."""
        return None if self.process is None else terminate(self.process, timeout_s)

    def kill(self) -> None:
        """SIGKILL, as a crash would: nothing drains, nothing is committed; an embedded
        broker goes on running, for the next start to adopt."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> UpProcess:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
