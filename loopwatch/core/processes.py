"""Child processes (the embedded broker, `loopwatch up`, its OTLP receiver, benchmark
workers): finding them and stopping them."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any


def children(pid: int) -> list[int]:
    """The live children of ``pid``, whichever of its threads started them: every
    process whose parent is ``pid`` (``/proc/PID/stat`` names the parent process, not
    its thread); none once ``pid`` is gone. The per-thread listings
    (``/proc/PID/task/TID/children``) missed a child while the thread that had started
    it was exiting and the child moved to another of its threads."""
    return [int(entry.name) for entry in Path("/proc").iterdir()
            if entry.name.isdigit() and parent_of(int(entry.name)) == pid]


def parent_of(pid: int) -> int | None:
    """``pid``'s parent (Linux ``/proc``); None once ``pid`` is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def family(pid: int) -> list[int]:
    """``pid`` and every live process below it."""
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        queue.extend(children(current))
    return found


def terminate(process: subprocess.Popen[Any], timeout_s: float) -> int:
    """SIGTERM, so the child can drain; SIGKILL if it is still there after ``timeout_s``.
    Returns its exit code (at once if it had already exited)."""
    if process.poll() is not None:
        return process.returncode
    process.terminate()
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()
