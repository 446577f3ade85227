"""Finding child processes (loopwatch/core/processes.py), on real processes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import faust
import pytest

from loopwatch.core.processes import children, family, terminate
from loopwatch.runtime import ProcessorCrashed, raise_if_crashed


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


def test_a_processor_whose_faust_app_crashed_is_a_runtime_error(tmp_path) -> None:
    """faust stops the worker of a crashed app as it does on a clean stop, and
    ``execute_from_commandline`` exits 0 both ways (the bench once waited 300 s on an
    extra worker that had gone with exit 0 and no output). A real faust app, crashed as
    an agent's exception crashes it; a clean one is no error."""
    log_file = tmp_path / "worker-1.log"
    app = faust.App("crash-probe", autodiscover=False)
    raise_if_crashed(app, log_file)  # never crashed: no error

    async def crash() -> None:
        await app.crash(ValueError("an agent raised"))

    asyncio.run(crash())
    with pytest.raises(ProcessorCrashed, match=r"^the processor crashed \(ValueError: an agent "
                       rf"raised\); see {log_file}$"):
        raise_if_crashed(app, log_file)


def test_a_processor_app_leaves_nothing_in_the_working_directory(tmp_path, monkeypatch) -> None:
    """faust makes ``<app id>-data`` in the current directory at an app's first start
    unless told where: a real faust app with the processors' settings makes its folder
    under the data dir, and the directory ``loopwatch up`` was started in stays empty."""
    from loopwatch.core.config import Settings
    from loopwatch.processors.app import FAUST_DIR, faust_settings

    started_in = tmp_path / "cwd"
    started_in.mkdir()
    monkeypatch.chdir(started_in)
    settings = Settings(data_dir=tmp_path / "data")
    app = faust.App("loopwatch-processors", **faust_settings(settings, "127.0.0.1:9"))
    asyncio.run(app.on_first_start())
    assert list(started_in.iterdir()) == []
    assert (settings.data_dir / FAUST_DIR / "loopwatch-processors" / "v1" / "tables").is_dir()
    assert (settings.data_dir / FAUST_DIR).stat().st_mode & 0o777 == 0o700
