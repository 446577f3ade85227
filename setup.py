"""The build's one dynamic part: the fold's modules compiled with mypyc
(``loopwatch.processors.native`` lists them and explains the guard), unless
``LOOPWATCH_PURE_PYTHON=1``. Everything else is in ``pyproject.toml``.

mypyc type-checks the modules as it compiles them, in the build's own environment,
which has none of the runtime's packages: their imports are read as ``Any`` (no
``pydantic.mypy`` plugin, no stubs), which changes nothing the compiled code does.
"""

from __future__ import annotations

import json
import os
import runpy
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
native = runpy.run_path(str(ROOT / "processors" / "native.py"))
ext_modules = []
if os.environ.get(native["PURE_ENV"]) != "1":
    from mypyc.build import mypycify

    # by the link loopwatch/processors -> processors: mypy names modules by their path
    sources = [f"loopwatch/processors/{name}.py" for name in native["COMPILED"]]
    ext_modules = mypycify(
        ["--config-file", str(ROOT / "setup_mypyc.ini"), *sources],
        opt_level="3", group_name=native["GROUP"])
    for extension in ext_modules:  # no C compiler: install the sources, which run as they are
        extension.optional = True
    (ROOT / "processors" / native["BUILT"]).write_text(
        json.dumps(native["source_hashes"](ROOT / "processors"), indent=1) + "\n")

setup(ext_modules=ext_modules)
