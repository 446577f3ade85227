"""Every docstring example in the installed ``loopwatch.*`` modules, run as a test.

Not ``pytest --doctest-modules`` over the folders: that imports ``ingest/sdk.py`` a second
time, as a top-level module named after its folder, beside ``loopwatch.ingest.sdk`` (two
copies of every class). Here the modules are the ones ``import loopwatch.*`` loads, found
by walking the package, so a module added to any stage's folder has its examples run
without listing it.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import io
import pkgutil
import sys

import pytest

import loopwatch
from loopwatch.processors import native


def _modules() -> list[str]:
    names = ["loopwatch"]
    for info in pkgutil.walk_packages(loopwatch.__path__, "loopwatch.", onerror=_unimportable):
        names.append(info.name)
    return sorted(names)


def _unimportable(name: str) -> None:
    raise ImportError(f"cannot walk {name}")


def _doctests() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder()
    found = []
    compiled = {f"loopwatch.processors.{name}" for name in native.COMPILED}
    for name in _modules():
        module = importlib.import_module(name)
        if name in compiled:  # the finder keeps what sys.modules says is from the module
            sys.modules[name] = native.load_source(name)
        try:
            found += [test for test in finder.find(sys.modules[name], name) if test.examples]
        finally:
            sys.modules[name] = module
    return sorted(found, key=lambda test: test.name)


#: pytest's own default for doctests (``doctest_optionflags``), which these ran under
OPTIONS = doctest.ELLIPSIS

DOCTESTS = _doctests()


@pytest.mark.parametrize("test", DOCTESTS, ids=[test.name for test in DOCTESTS])
def test_docstring_examples(test: doctest.DocTest) -> None:
    out = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=OPTIONS)
    result = runner.run(test, out=out.write)
    assert result.failed == 0, out.getvalue()


def test_every_stage_has_its_examples_found() -> None:
    """The walk reaches into every stage's folder (a mapping lost in pyproject.toml or a
    missing link would silently drop a stage's examples)."""
    stages = {test.name.split(".")[1] for test in DOCTESTS}
    assert {"ingest", "processors", "store", "detectors", "dashboards", "bench",
            "core"} <= stages
    # the compiled fold's examples are read from its sources
    assert {"loopwatch.processors.runs.remember", "loopwatch.processors.rows.near_miss"} \
        <= {test.name for test in DOCTESTS}
