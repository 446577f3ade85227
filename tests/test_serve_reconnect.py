"""`loopwatch serve` outlives the `up` it reads from (issue 26 item 4): while `up` is
stopped its health says the store is unreachable and every panel answers a one-line
503; when `up` starts again on the same data dir, serve reads from it again by itself.

Real processes: an `up` of its own (own embedded broker, own data dir, one tiny run)
and `loopwatch serve` as a child process, exactly as a user runs them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loopwatch.core.processes import terminate
from loopwatch.ingest.sdk import Emitter, RunContext
from loopwatch.upprocess import UpProcess
from tests.conftest import PIPELINE_ENV, scalar, wait_for

pytestmark = pytest.mark.stack  # starts brokers / `loopwatch up` itself


def get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture()
def serve(tmp_path: Path) -> Iterator[tuple[UpProcess, str]]:
    up = UpProcess(tmp_path / "data", PIPELINE_ENV).start()
    child = subprocess.Popen(
        [sys.executable, "-m", "loopwatch.cli", "serve", "--port", "0",
         "--data-dir", str(up.data_dir)],
        env={**up.env, "COLUMNS": "200"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, text=True)
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        found = re.search(r"http://\S+/", line)
        assert found, f"serve printed {line!r}"
        yield up, found.group(0)
    finally:
        terminate(child, 30)
        up.stop()


def test_serve_says_the_store_is_unreachable_then_reconnects_after_up_restarts(
        serve: tuple[UpProcess, str], tmp_path: Path):
    up, url = serve
    with Emitter(up.info["kafka_bootstrap"], spool_dir=tmp_path / "spool") as emitter:
        run = RunContext(emitter, "serve-run", {"agent": "serve-bot", "model": "gpt-4o"})
        run.start()
        run.step()
        run.end("model_done")
    wait_for(lambda: scalar(up.reader, "SELECT outcome FROM runs FINAL "
                                       "WHERE run_id = 'serve-run'") == "success", 90,
             what="the run to close")
    assert get(f"{url}api/health") == (200, {"ok": True, "store": "ok"})
    status, drilldown = get(f"{url}api/runs/serve-run")
    summary = drilldown["panels"]["run_summary"]["rows"]
    assert status == 200 and len(summary) == 1

    up.stop()
    status, health = get(f"{url}api/health")
    assert status == 503 and health["ok"] is False
    assert health["store"].startswith("unreachable: the store service at unix:"), health
    for path in ("api/runs/serve-run", "api/panel/cost_per_minute", "api/alerts"):
        status, body = get(f"{url}{path}")
        assert status == 503, (path, body)
        assert body["error"].startswith("store unreachable: the store service at unix:"), body
        assert "\n" not in body["error"] and "Traceback" not in body["error"]

    up.start()
    answered = wait_for(lambda: (reply := get(f"{url}api/runs/serve-run"))[0] != 503 and reply,
                        60, what="serve to read from the restarted up")
    assert answered[0] == 200 and answered[1]["panels"]["run_summary"]["rows"] == summary
    assert get(f"{url}api/health") == (200, {"ok": True, "store": "ok"})
    assert get(f"{url}api/panel/cost_per_minute")[0] == 200
