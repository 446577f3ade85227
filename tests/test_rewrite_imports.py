"""scripts/rewrite_imports.py, the rewrite the lead runs on other branches at merge: on a
tiny old-layout tree, exact output, and a second run changes nothing.

rewrite_imports: skip (this file holds old-layout text on purpose)
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "rewrite_imports.py"

_spec = importlib.util.spec_from_file_location("rewrite_imports", SCRIPT)
assert _spec is not None and _spec.loader is not None
rewrite_imports = importlib.util.module_from_spec(_spec)
sys.modules["rewrite_imports"] = rewrite_imports
_spec.loader.exec_module(rewrite_imports)

OLD_PY = '''"""Uses :mod:`ingest.sdk` and ``loopwatch/reprocess.py``."""
import ingest.events
from ingest.sdk import Emitter
from loopwatch import cli, config
from loopwatch.capture import decide
from processors import rows, sink
from loopwatch.reprocess import (
    MemoryRunStore,
)
from . import sibling

TOPIC = "bench.alerts"  # a Kafka topic, not a module
TARGET = "processors.app.Processor"
ARGS = ["-m", "bench.fold"]
PATH = resources.files("detectors")


def f(detectors):
    return detectors.outbox, ingest.events.RunStart
'''

NEW_PY = '''"""Uses :mod:`loopwatch.ingest.sdk` and ``processors/jobs/reprocess.py``."""
import loopwatch.ingest.events
from loopwatch.ingest.sdk import Emitter
from loopwatch import cli
from loopwatch.core import config
from loopwatch.processors.jobs import capture_decide as decide
from loopwatch.processors import rows
from loopwatch.store import sink
from loopwatch.processors.jobs.reprocess import (
    MemoryRunStore,
)
from . import sibling

TOPIC = "bench.alerts"  # a Kafka topic, not a module
TARGET = "loopwatch.processors.app.Processor"
ARGS = ["-m", "loopwatch.bench.fold"]
PATH = resources.files("loopwatch.detectors")


def f(detectors):
    return detectors.outbox, loopwatch.ingest.events.RunStart
'''

OLD_MD = "Run `python -m bench.fold`; see `loopwatch/store/sink.py` and processors/sink.py.\n"
NEW_MD = "Run `python -m loopwatch.bench.fold`; see `store/sink.py` and store/sink.py.\n"


#: applied once and checksummed: never rewritten
MIGRATION = "-- written by loopwatch/reprocess.py\nSELECT 1;\n"


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    for module in ("ingest/sdk.py", "ingest/events.py", "processors/app.py",
                   "processors/rows.py", "processors/sink.py", "detectors/outbox.py",
                   "bench/fold.py", "bench/__init__.py"):
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / module).write_text("")
    (tmp_path / "user.py").write_text(OLD_PY)
    (tmp_path / "notes.md").write_text(OLD_MD)
    (tmp_path / "store" / "migrations").mkdir(parents=True)
    (tmp_path / "store" / "migrations" / "010_x.sql").write_text(MIGRATION)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", "-A"], cwd=tmp_path, check=True)
    return tmp_path


def test_rewrites_imports_strings_and_paths_exactly(tree: Path) -> None:
    printed: list[str] = []
    assert rewrite_imports.rewrite_tree(tree, printed.append) == 2
    assert (tree / "user.py").read_text() == NEW_PY
    assert (tree / "notes.md").read_text() == NEW_MD
    assert (tree / "store" / "migrations" / "010_x.sql").read_text() == MIGRATION
    assert printed[-1] == "2 files changed"
    assert "notes.md:1: " + OLD_MD.strip() + "  ->  " + NEW_MD.strip() in printed


def test_second_run_changes_nothing(tree: Path) -> None:
    rewrite_imports.rewrite_tree(tree, lambda line: None)
    printed: list[str] = []
    assert rewrite_imports.rewrite_tree(tree, printed.append) == 0
    assert printed == ["0 files changed"]


def test_this_branch_is_already_rewritten() -> None:
    """The script was run on this tree: running it again is a no-op."""
    done = subprocess.run([sys.executable, str(SCRIPT), str(ROOT), "--dry-run"],
                          capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == ["0 files changed"], done.stdout
