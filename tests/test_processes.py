"""Finding child processes (loopwatch/core/processes.py), on real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from loopwatch.core.processes import children, family, terminate


def test_children_started_from_any_thread_are_found_and_gone_once_stopped() -> None:
    started: list[subprocess.Popen[bytes]] = []
    spawn = [sys.executable, "-c", "import time; time.sleep(60)"]
    thread = threading.Thread(target=lambda: started.append(subprocess.Popen(spawn)))
    thread.start()
    thread.join()
    started.append(subprocess.Popen(spawn))
    try:
        assert {p.pid for p in started} <= set(children(os.getpid()))
        assert family(os.getpid())[0] == os.getpid()
        assert {p.pid for p in started} <= set(family(os.getpid()))
    finally:
        for process in started:
            terminate(process, 10)
    assert not {p.pid for p in started} & set(children(os.getpid()))


def test_a_gone_process_has_no_children() -> None:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    assert children(process.pid) == []
    assert family(process.pid) == [process.pid]
