"""Imports flow one way (issue #25): the SDK and event contract at the bottom, then the
floor, ingest's receivers, the store, processors, detectors, dashboards, and the shell
(CLI, ``up``, demo, scenarios, bench) on top. A module imports its own layer or lower.

The check is a function over an import graph read with ``ast`` (every ``import``, lazy
ones too), unit-tested on small graphs, then run on the tree.

rewrite_imports: skip (the small graphs name old-layout modules on purpose)
"""

from __future__ import annotations

import ast
import os
import re
import tomllib
from pathlib import Path

import pytest

from loopwatch.store import tables

ROOT = Path(__file__).resolve().parent.parent

#: lowest first; a module may import only its own layer and those before it
LAYERS = ("contract", "floor", "ingest", "store", "processors", "detectors", "dashboards",
          "shell")

#: module prefix -> layer (the longest prefix wins)
PLACES = {
    "loopwatch": "shell",                   # the roof: cli, runtime, demo, scenarios, ...
    "loopwatch.bench": "shell",
    "loopwatch.core": "floor",              # settings, masking, topics, embedded broker
    "loopwatch.ingest": "contract",         # the event contract and the SDK
    "loopwatch.ingest.otlp": "ingest",      # the receivers
    "loopwatch.ingest.importers": "ingest",
    "loopwatch.store": "store",
    "loopwatch.processors": "processors",
    "loopwatch.detectors": "detectors",
    "loopwatch.dashboards": "dashboards",
}

#: shell pieces that live in a stage's folder beside what they drive: each stage's
#: ``cli`` module (its subcommands), and the import command's delivery, which starts a
#: ``loopwatch up`` when none runs
SHELL_IN_STAGES = ("loopwatch.ingest.importers.delivery",)

#: what installed loopwatch used to put in site-packages: nothing may import them now
OLD_TOP_LEVEL = ("ingest", "processors", "detectors", "dashboards", "bench", "store")


def layer(module: str) -> str:
    """The layer a module belongs to.

    >>> layer("loopwatch.ingest.sdk"), layer("loopwatch.ingest.otlp.server")
    ('contract', 'ingest')
    >>> layer("loopwatch.processors.replay.cli"), layer("loopwatch"), layer("loopwatch.demo")
    ('shell', 'contract', 'shell')
    """
    if module == "loopwatch":
        return "contract"  # its __init__ re-exports the SDK's Emitter, nothing else
    if module.rsplit(".", 1)[-1] == "cli" or module in SHELL_IN_STAGES:
        return "shell"
    prefix = max((p for p in PLACES if module == p or module.startswith(p + ".")), key=len)
    return PLACES[prefix]


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that goes up a layer or names an old top-level package."""
    found = []
    for module, imports in sorted(graph.items()):
        for target in sorted(imports):
            top = target.split(".")[0]
            if top in OLD_TOP_LEVEL:
                found.append(f"{module} imports {target}: old top-level package")
            elif top == "loopwatch" and LAYERS.index(layer(target)) > LAYERS.index(
                    layer(module)):
                found.append(f"{module} ({layer(module)}) imports {target} ({layer(target)})")
    return found


def modules(root: Path) -> dict[str, Path]:
    """Every module of the installed package, found through the folders' links."""
    found = {}
    for folder, dirs, files in os.walk(root / "loopwatch", followlinks=True):
        dirs[:] = sorted(d for d in dirs if (Path(folder) / d / "__init__.py").exists())
        package = Path(folder).relative_to(root).parts
        for name in files:
            if name.endswith(".py"):
                parts = package if name == "__init__.py" else (*package, name[:-3])
                found[".".join(parts)] = Path(folder) / name
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the project modules it imports (absolute and relative imports, at any
    depth in the file: a lazy import is a dependency too)."""
    known = modules(root)
    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in known else base)
        graph[module] = {t for t in targets
                         if t.split(".")[0] in ("loopwatch", *OLD_TOP_LEVEL)} - {module}
    return graph


@pytest.mark.parametrize(("graph", "expected"), [
    ({"loopwatch.processors.app": {"loopwatch.store.sink", "loopwatch.core.config",
                                   "loopwatch.ingest.wire"}}, []),
    ({"loopwatch.store.sink": {"loopwatch.processors.rows"}},
     ["loopwatch.store.sink (store) imports loopwatch.processors.rows (processors)"]),
    ({"loopwatch.core.config": {"loopwatch.runtime"}},
     ["loopwatch.core.config (floor) imports loopwatch.runtime (shell)"]),
    ({"loopwatch.ingest.sdk": {"loopwatch.core.config"}},
     ["loopwatch.ingest.sdk (contract) imports loopwatch.core.config (floor)"]),
    ({"loopwatch.detectors.engine": {"loopwatch.dashboards.panels"}},
     ["loopwatch.detectors.engine (detectors) imports loopwatch.dashboards.panels "
      "(dashboards)"]),
    ({"loopwatch.dashboards.cli": {"loopwatch.runtime"}}, []),
    ({"loopwatch.processors.pipeline": {"ingest.events"}},
     ["loopwatch.processors.pipeline imports ingest.events: old top-level package"]),
])
def test_checker_on_small_graphs(graph: dict[str, set[str]], expected: list[str]) -> None:
    assert violations(graph) == expected


def test_checker_reads_a_wrong_import_from_a_file(tmp_path: Path) -> None:
    """The graph reader sees a lazy, relative import going up (store -> processors)."""
    for name in ("loopwatch/__init__.py", "loopwatch/store/__init__.py",
                 "loopwatch/processors/__init__.py", "loopwatch/processors/rows.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    (tmp_path / "loopwatch/store/sink.py").write_text(
        "def f():\n    from ..processors import rows\n    return rows\n")
    graph = import_graph(tmp_path)
    assert graph["loopwatch.store.sink"] == {"loopwatch.processors.rows"}
    assert violations(graph) == [
        "loopwatch.store.sink (store) imports loopwatch.processors.rows (processors)"]


def test_the_tree_imports_one_way() -> None:
    graph = import_graph(ROOT)
    assert len(graph) > 120  # every stage's folder was read through its link
    assert violations(graph) == []


def test_every_package_is_installed() -> None:
    """pyproject.toml lists the packages (setuptools maps each stage's folder): a new
    sub-package left out of the list would be missing from the wheel."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {m for m, path in modules(ROOT).items() if path.name == "__init__.py"}
    assert sorted(config["packages"]) == sorted(packages)
    for package, folder in config["package-dir"].items():
        assert (ROOT / "loopwatch" / package.split(".", 1)[1]).resolve() == (
            ROOT / folder).resolve(), f"loopwatch/{folder} must link to {folder}/"


def _table_literals(path: Path) -> list[str]:
    """Table names written as string literals where rows are added or inserted."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("add", "insert", "pop") and node.args
                and isinstance(node.args[0], ast.Constant) and node.args[0].value in
                tables.TABLES):
            found.append(f"{path.name}:{node.lineno}: {node.args[0].value!r}")
        if (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
                and isinstance(node.value, ast.Attribute) and node.value.attr == "tables"):
            found.append(f"{path.name}:{node.lineno}: {node.slice.value!r}")
    return found


def test_writers_name_tables_through_the_store() -> None:
    """Rows are added and inserted under ``loopwatch.store.tables`` names, never a string
    of their own (``"runs"`` in pipeline.py, ``"dead_letters"`` in reprocess.py)."""
    found = [hit for module, path in sorted(modules(ROOT).items())
             if not module.startswith("loopwatch.store.") for hit in _table_literals(path)]
    assert found == []


def test_the_store_tables_are_the_migrations_tables() -> None:
    created = set(re.findall(r"CREATE TABLE IF NOT EXISTS (\w+)", "".join(
        path.read_text() for path in (ROOT / "store" / "migrations").glob("*.sql"))))
    created = {name for name in created if not re.search(r"_v\d{3}$", name)}  # a rebuild's copy
    assert sorted(tables.TABLES) == sorted(created)


def test_no_module_seeks_faust_consumers_from_the_event_loop() -> None:
    """faust's ``Consumer.seek`` runs aiokafka's seek on the calling thread while faust's
    consumer thread drains the same fetch buffer: ``up`` crashed with ``KeyError:
    TopicPartition(...)`` in ``Fetcher.fetched_records`` after reading a stalled
    partition again (processors/app.py ``Processor._seek``). Seeks go through
    ``seek_wait``, which runs them on the consumer's thread."""
    found = [f"{module}:{number}" for module, path in sorted(modules(ROOT).items())
             for number, line in enumerate(path.read_text().splitlines(), start=1)
             if re.search(r"\bconsumer\.seek\(", line)]
    assert found == []
