"""Stopping child processes (the embedded broker, `loopwatch up`, benchmark workers)."""

from __future__ import annotations

import subprocess
from typing import Any


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
