"""What installing loopwatch puts where (issue #25): only ``loopwatch`` in site-packages;
``pip install loopwatch`` is the SDK alone (no faust, chdb, clickhouse-connect, scipy or
grafana-client), and even in the server install ``import loopwatch`` and ``from loopwatch
import Emitter`` load none of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from loopwatch.core.embedded.broker import EmbeddedBroker
from loopwatch.processors.native import PURE_ENV
from loopwatch.store.reader import ServiceReader
from tests.conftest import stored_events, wait_stored

ROOT = Path(__file__).resolve().parent.parent

#: the server's heavy imports an agent's process must not pay for
SERVER_ONLY = ("faust", "chdb", "clickhouse_connect", "scipy", "grafana_client", "numpy",
               "typer", "rich", "uvicorn", "grpc")
#: what the old layout installed beside loopwatch
OLD_TOP_LEVEL = ("ingest", "processors", "detectors", "dashboards", "bench", "store")

_PROBE = f"""
import importlib.util, json, sys
import loopwatch
from loopwatch import Emitter
print(json.dumps({{"emitter": f"{{Emitter.__module__}}.{{Emitter.__name__}}",
                  "loaded": sorted(m for m in {SERVER_ONLY!r} if m in sys.modules),
                  "installed": sorted(m for m in {SERVER_ONLY!r}
                                      if importlib.util.find_spec(m) is not None),
                  "old": sorted(m for m in {OLD_TOP_LEVEL!r}
                                if importlib.util.find_spec(m) is not None)}}))
"""


def _probe(python: str | Path, cwd: Path) -> dict[str, object]:
    done = subprocess.run([str(python), "-c", _PROBE], cwd=cwd, capture_output=True,
                          text=True, timeout=120, check=True)
    return json.loads(done.stdout)


def test_server_install_imports_the_sdk_alone(tmp_path: Path) -> None:
    """In this (server + test) install, from outside the checkout."""
    probe = _probe(sys.executable, tmp_path)
    assert probe["emitter"] == "loopwatch.ingest.sdk.Emitter"
    assert probe["loaded"] == []
    assert probe["old"] == []
    assert "faust" in probe["installed"]  # the heavy modules are there, just not loaded


#: an agent on the SDK-only install: three runs of 4 events each, emitted and drained
_AGENT = """
import sys
from loopwatch import Emitter
bootstrap, spool, agent = sys.argv[1:4]
with Emitter(bootstrap, spool_dir=spool) as emitter:
    for n in range(3):
        with emitter.run(agent=agent, model="gpt-4o") as run:
            run.step(step=1)
            run.llm_call(input_tokens=10, output_tokens=2)
    assert emitter.flush(timeout_s=60)
    print(emitter.stats.sent)
"""


@pytest.mark.stack  # slow (~40 s: builds a wheel and a fresh venv) and emits to the stack
def test_sdk_only_install(tmp_path: Path, broker: EmbeddedBroker, reader: ServiceReader,
                          agent: str) -> None:
    """``pip install <the wheel>`` into an empty venv, dependencies from the configured
    index: the SDK imports and the heavy stack is absent; an agent there emits runs the
    pipeline stores; the CLI says what to install. The wheel is built without the
    compiled fold (``LOOPWATCH_PURE_PYTHON=1``, ``setup.py``), which the SDK never
    imports: a plain wheel for any platform, and the opt-out build tested."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(ROOT),
                    "-w", str(tmp_path / "dist")], check=True, timeout=600,
                   capture_output=True, env={**os.environ, PURE_ENV: "1"})
    wheel = next((tmp_path / "dist").glob("loopwatch-*-py3-none-any.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert not [name for name in names if name.endswith(".so")]
    tops = {name.split("/")[0] for name in names}
    assert sorted(tops) == ["loopwatch", f"{wheel.name.split('-py3')[0]}.dist-info"]
    # an empty venv, not even pip (ensurepip costs ~10 s): this pip installs into it
    venv.create(tmp_path / "sdk", with_pip=False)
    python = tmp_path / "sdk" / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    str(wheel)], check=True, timeout=900, capture_output=True)
    probe = _probe(python, tmp_path)
    assert probe == {"emitter": "loopwatch.ingest.sdk.Emitter", "loaded": [],
                     "installed": [], "old": []}
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig."
                                "get_paths()['purelib'])"], capture_output=True, text=True,
                               check=True).stdout.strip())
    assert not [name for name in OLD_TOP_LEVEL if (site / name).exists()]
    emitted = subprocess.run([str(python), "-c", _AGENT, broker.bootstrap,
                              str(tmp_path / "spool"), agent], capture_output=True,
                             text=True, timeout=120, check=True)
    assert emitted.stdout.split() == ["12"]
    wait_stored(reader, agent, 12)
    assert stored_events(reader, agent) == 12
    command = subprocess.run([str(tmp_path / "sdk" / "bin" / "loopwatch"), "demo"],
                             capture_output=True, text=True, timeout=60)
    assert command.returncode == 1
    assert command.stderr.splitlines() == [
        "loopwatch: the command line needs the server install (typer is not installed): "
        "pip install 'loopwatch[server]'"]
