"""The fold's compiled build: which modules ``setup.py`` compiles with mypyc, and the
guard that keeps a compiled build from running code older than its sources.

The fold (decode aside) is the processors' hottest Python: compiled, its modules run
~20-40 % faster (docs/performance.md). An editable install (``pip install -e``, the
README's) builds the extensions beside the sources, where Python prefers them to the
``.py`` files: edit ``runs.py`` afterwards and the old code would still run. So the build
records a hash of each compiled source (:data:`BUILT`), and at import
(:func:`prefer_sources_when_stale`, called by this package's ``__init__``) a source that
no longer matches makes the whole group load from source, with a warning: the modules
call each other natively, so one stale module means all of them go. Setting
``LOOPWATCH_PURE_PYTHON=1`` does the same on purpose (at build time it skips the
compilation), for comparing the two or for debugging.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType

#: the modules compiled, in this package (they import each other, not the other way)
COMPILED = ("runs", "rows", "attribution", "pipeline")
#: the group mypyc builds, in this package, and its shared library's module name
GROUP = "loopwatch.processors._fold"
GROUP_LIBRARY = GROUP.rsplit(".", 1)[1] + "__mypyc"
#: what the build writes beside the sources: each compiled module's source hash
BUILT = "native_build.json"
#: set to 1: build without compiling, or run from source with a compiled build
PURE_ENV = "LOOPWATCH_PURE_PYTHON"

log = logging.getLogger(__name__)
HERE = Path(__file__).resolve().parent


def source_hashes(folder: Path) -> dict[str, str]:
    """sha256 of each compiled module's source in ``folder``."""
    return {name: hashlib.sha256((folder / f"{name}.py").read_bytes()).hexdigest()
            for name in COMPILED}


def _extension(folder: Path, name: str) -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = folder / f"{name}{suffix}"
        if path.exists():
            return path
    return None


def why_sources(folder: Path, environ: Mapping[str, str]) -> str | None:
    """Why the compiled modules in ``folder`` must not run (None: they may, or there
    are none).

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     folder = Path(tmp)
    ...     suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    ...     for name in COMPILED:
    ...         _ = (folder / f"{name}.py").write_text(name)
    ...         _ = (folder / f"{name}{suffix}").write_text("")
    ...     incomplete = why_sources(folder, {})
    ...     _ = (folder / f"{GROUP_LIBRARY}{suffix}").write_text("")
    ...     no_record = why_sources(folder, {})
    ...     _ = (folder / BUILT).write_text(json.dumps(source_hashes(folder)))
    ...     fresh, pure = why_sources(folder, {}), why_sources(folder, {PURE_ENV: "1"})
    ...     _ = (folder / "runs.py").write_text("edited")
    ...     stale = why_sources(folder, {})
    >>> incomplete
    'the compiled build lacks _fold__mypyc'
    >>> no_record, fresh, pure
    ('no record of the sources built', None, 'LOOPWATCH_PURE_PYTHON=1')
    >>> stale
    'runs.py changed since the build'
    """
    missing = [name for name in (*COMPILED, GROUP_LIBRARY) if not _extension(folder, name)]
    if set(COMPILED) <= set(missing):
        return None
    if environ.get(PURE_ENV) == "1":
        return f"{PURE_ENV}=1"
    if missing:  # an extension that failed to build (they are optional: setup.py)
        return f"the compiled build lacks {', '.join(missing)}"
    try:
        built = json.loads((folder / BUILT).read_text())
    except (OSError, ValueError):
        return "no record of the sources built"
    now = source_hashes(folder)
    changed = [f"{name}.py" for name in COMPILED if built.get(name) != now[name]]
    return f"{', '.join(changed)} changed since the build" if changed else None


def _source_spec(fullname: str) -> importlib.machinery.ModuleSpec:
    """The spec of compiled module ``fullname`` (``<package>.<name>``) from its ``.py``."""
    spec = importlib.util.spec_from_file_location(
        fullname, HERE / (fullname.rsplit(".", 1)[1] + ".py"))
    assert spec is not None
    return spec


def load_source(fullname: str) -> ModuleType:
    """Compiled module ``fullname`` run once more from its ``.py``, beside the build
    imported and not in ``sys.modules``: what a compiled build does not keep (its
    annotations, its docstrings' examples) read from the source."""
    spec = _source_spec(fullname)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


class _Sources(importlib.abc.MetaPathFinder):
    """Finds the compiled modules' ``.py`` files ahead of their extensions."""

    def __init__(self, package: str) -> None:
        self.names = {f"{package}.{name}" for name in COMPILED}

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        return _source_spec(fullname) if fullname in self.names else None


def prefer_sources_when_stale(package: str) -> str:
    """Make ``package``'s compiled modules load from source when :func:`why_sources`
    says so; which build runs: ``compiled``, ``interpreted`` or ``sources (<why>)``."""
    why = why_sources(HERE, os.environ)
    if why is None:
        return "compiled" if _extension(HERE, COMPILED[0]) else "interpreted"
    if not any(isinstance(finder, _Sources) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Sources(package))
    if os.environ.get(PURE_ENV) != "1":
        log.warning("the fold's compiled modules are not used: %s (rebuild: pip install "
                    "-e .)", why)
    return f"sources ({why})"
