"""CLI children forked from one interpreter that has imported the CLI already.

A ``python -m loopwatch.cli`` child spends about 0.8 s of CPU importing the CLI (pydantic,
pydantic-settings, typer, rich) before it reads its arguments, and the CLI tests start
some 150 of them. The server imports ``loopwatch.cli`` and :data:`PRELOADED` once,
freezes what it imported out of the collector's reach, and forks a child per run:
each child is still a process of its own, with its own environment (replaced whole
before the CLI reads any of it: settings are read at the edge, in the command, never at
import), working directory, stdin (``/dev/null``), stdout and stderr (files the caller
reads) and exit status, and it ends as a ``python -m`` run ends (``SystemExit`` out of
the interpreter: atexit handlers, non-daemon threads joined, streams flushed). It runs
``loopwatch.cli.main``, the function ``python -m loopwatch.cli`` runs.

What a fork cannot reproduce is a module that reads the environment at import time;
``tests/test_cli_contract.py::test_forked_children_answer_as_fresh_interpreters_do``
runs cases both ways and compares them.

The server is single-threaded (a fork copies only the forking thread): it reads
requests from fd 0 with ``os.read`` (never through ``sys.stdin``, whose buffer the
children inherit), forks, and reports each child's status when it is reaped.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: what ``python -m loopwatch.cli`` puts in ``sys.argv[0]``
CLI_PATH = str(ROOT / "loopwatch" / "cli.py")


def _child(request: dict[str, Any]) -> None:
    """In the forked child: become the requested run, then end as an interpreter does."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for fd, target in ((devnull, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [CLI_PATH, *request["args"]]
    main_module = sys.modules["__main__"]  # as `-m` leaves it: click names the program so
    main_module.__package__ = "loopwatch"
    main_module.__spec__ = importlib.util.find_spec("loopwatch.cli")
    from loopwatch.cli import main

    main()
    sys.exit(0)


#: what most commands import once they run, beyond ``loopwatch.cli`` (the store's
#: clients, the rules with scipy): 0.25-0.7 s of CPU a child would repeat. None of them
#: starts a thread (chdb, which starts twelve at import, stays out), so a fork is safe.
PRELOADED = ("loopwatch.store.reader", "loopwatch.store.service", "loopwatch.detectors.rules",
             "loopwatch.detectors.playbooks")


def _preload() -> None:
    """Import :data:`PRELOADED`, with OpenBLAS (under scipy) kept to the importing
    thread, and fail if anything started a thread, which a fork would not copy. Then
    ``gc.freeze()``: a child's collections (and its exit) would otherwise walk every
    object the server imported, writing to each page and so copying it; measured on the
    CLI test modules, children's CPU fell by a third (tests/test_cli_contract.py 21 ->
    15 s), and with the preloading above to 9 s."""
    os.environ["OPENBLAS_NUM_THREADS"] = "1"  # each child gets its own environment
    for name in PRELOADED:
        importlib.import_module(name)
    threads = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["1"]
    if len(threads) != 1 or "chdb" in sys.modules:
        raise SystemExit(f"the fork server must stay one thread: {len(threads)} after "
                         f"importing {PRELOADED}")
    gc.freeze()


def serve() -> None:
    """The server's loop: one JSON request per line on fd 0, one status line per child
    on fd 1 (``{"id": ..., "status": ...}``, the status as ``subprocess`` reports it)."""
    import loopwatch.cli  # noqa: F401  (the import every child would repeat)

    _preload()

    pending = b""
    children: dict[int, str] = {}
    open_input = True
    while open_input or children:
        ready, _, _ = select.select([0] if open_input else [], [], [], 0.02)
        if ready:
            chunk = os.read(0, 65536)
            open_input = bool(chunk)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(request)
                children[pid] = request["id"]
                os.write(1, json.dumps({"id": request["id"], "pid": pid}).encode() + b"\n")
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            code = os.waitstatus_to_exitcode(status)
            os.write(1, json.dumps({"id": children.pop(pid), "status": code}).encode() + b"\n")


class ForkServer:
    """The test process's side: :meth:`run` is ``subprocess.run([python, -m,
    loopwatch.cli, *args], capture_output=True, text=True)`` served by a fork."""

    def __init__(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-c", "from tests.forkserver import serve; serve()"],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._lock = threading.Lock()
        self._waiting: dict[str, Future[int]] = {}
        self._pids: dict[str, int] = {}  # children not reaped yet, by request id
        self.last_killed: int | None = None  # the child the last timeout killed
        self._number = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            answer = json.loads(line)
            with self._lock:
                if "pid" in answer:
                    self._pids[answer["id"]] = answer["pid"]
                    continue
                future = self._waiting.pop(answer["id"])
                self._pids.pop(answer["id"], None)
            future.set_result(answer["status"])
        with self._lock:
            for future in self._waiting.values():
                future.set_exception(RuntimeError("the CLI fork server ended"))
            self._waiting.clear()

    def run(self, args: list[str], env: dict[str, str], folder: Path, timeout: float = 300
            ) -> subprocess.CompletedProcess[str]:
        folder.mkdir(parents=True, exist_ok=True)
        future: Future[int] = Future()
        with self._lock:
            self._number += 1
            key = f"{os.getpid()}-{self._number}"
            stdout, stderr = folder / f"cli-{self._number}.out", folder / f"cli-{self._number}.err"
            self._waiting[key] = future
            request = {"id": key, "args": args, "env": env, "cwd": os.getcwd(),
                       "stdout": str(stdout), "stderr": str(stderr)}
            assert self._process.stdin is not None
            self._process.stdin.write(json.dumps(request).encode() + b"\n")
            self._process.stdin.flush()
        try:
            status = future.result(timeout=timeout)
        except TimeoutError:  # as subprocess.run does: kill the child, reap it, raise
            self.last_killed = self._kill(key)
            future.result(timeout=60)
            raise subprocess.TimeoutExpired(["loopwatch", *args], timeout) from None
        return subprocess.CompletedProcess(
            [sys.executable, "-m", "loopwatch.cli", *args], status,
            stdout.read_text(errors="replace"), stderr.read_text(errors="replace"))

    def _kill(self, key: str) -> int | None:
        """SIGKILL the child of request ``key``; its pid line precedes its status line,
        so it is known unless the child has been reaped already."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with self._lock:
                pid = self._pids.get(key)
                if pid is None and key not in self._waiting:
                    return None  # reaped meanwhile
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                return pid
            time.sleep(0.05)
        raise RuntimeError(f"the fork server never named the child of {key}")

    def unreaped(self) -> list[int]:
        """The pids of children the server has forked and not yet reaped."""
        with self._lock:
            return list(self._pids.values())

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
