"""Rewrite a tree's module and file references from the old layout to the one-namespace one.

Issue #25 put every package under ``loopwatch.*`` (the folders stay: ``loopwatch.ingest``
is ``ingest/``) and moved a few modules (``git mv``). A branch written against the old
layout is merged FIRST, as it is, then the merged tree is rewritten::

    git merge BRANCH          # renames carry its edits to the moved files; a file it added
                              # in a moved folder: git says where (e.g. store/migrations/)
    python scripts/rewrite_imports.py [ROOT] [--dry-run]   # prints every line it changes
    ruff check --fix --select I .                          # re-sort the rewritten imports

(Rewriting the branch before the merge instead makes every rewritten line a change on
both sides: a conflict wherever this branch then wrapped or re-sorted one.)

Deterministic and idempotent: a reference already in the new form never matches again
(every match must not follow ``.``/a word character), so a second run changes nothing.
What it rewrites, in git-tracked text files (``.py .md .toml .sh .yml .yaml .sql .cfg
.ini .txt``, ``Dockerfile``, ``ci/run``):

- ``from X import a, b`` and ``import X`` where X (or X.a) is a moved module; a
  ``from`` import whose names now live in different packages is split, a renamed leaf
  keeps its old name with ``as``;
- dotted references anywhere (strings, patch targets, ``python -m ...``, docs): an old
  top-level package only when it names a module that exists (``bench.fold``, not the
  Kafka topic ``bench.alerts``), an old ``loopwatch.*`` module always;
- ``resources.files("ingest")``-style package strings;
- paths of the files that moved (``loopwatch/reprocess.py`` -> ``processors/jobs/reprocess.py``).

A file holding the marker ``rewrite_imports: skip`` is left alone (this script, its test),
and so is every file under a ``migrations/`` folder (applied once, checksummed).
"""
# rewrite_imports: skip

from __future__ import annotations

import argparse
import io
import re
import subprocess
import sys
import tokenize
from collections.abc import Callable, Iterable
from pathlib import Path

#: the user's top-level folders: each is now ``loopwatch.<name>``
PACKAGES = ("ingest", "processors", "detectors", "dashboards", "bench")

#: modules that moved, old -> new (a key also covers its submodules); longest key wins
MOVES: dict[str, str] = {
    "loopwatch.config": "loopwatch.core.config",
    "loopwatch.masking": "loopwatch.core.masking",
    "loopwatch.topics": "loopwatch.core.topics",
    "loopwatch.money": "loopwatch.core.money",
    "loopwatch.processes": "loopwatch.core.processes",
    "loopwatch.httpserver": "loopwatch.core.httpserver",
    "loopwatch.embedded": "loopwatch.core.embedded",
    "loopwatch.reprocess": "loopwatch.processors.jobs.reprocess",
    "loopwatch.deadletters": "loopwatch.processors.jobs.deadletters",
    "loopwatch.capture.decide": "loopwatch.processors.jobs.capture_decide",
    "loopwatch.replay": "loopwatch.processors.replay",
    "processors.sink": "loopwatch.store.sink",
    **{name: f"loopwatch.{name}" for name in PACKAGES},
}

#: files and folders that moved, old -> new (relative to the repository root)
PATHS: dict[str, str] = {
    "loopwatch/store": "store",
    "loopwatch/config.py": "loopwatch/core/config.py",
    "loopwatch/masking.py": "loopwatch/core/masking.py",
    "loopwatch/topics.py": "loopwatch/core/topics.py",
    "loopwatch/money.py": "loopwatch/core/money.py",
    "loopwatch/processes.py": "loopwatch/core/processes.py",
    "loopwatch/httpserver.py": "loopwatch/core/httpserver.py",
    "loopwatch/embedded": "loopwatch/core/embedded",
    "loopwatch/reprocess.py": "processors/jobs/reprocess.py",
    "loopwatch/deadletters.py": "processors/jobs/deadletters.py",
    "loopwatch/capture/decide.py": "processors/jobs/capture_decide.py",
    "loopwatch/replay": "processors/replay",
    "processors/sink.py": "store/sink.py",
}

SUFFIXES = {".py", ".md", ".toml", ".sh", ".yml", ".yaml", ".sql", ".cfg", ".ini", ".txt"}
NAMES = {"Dockerfile", "run"}
SKIP_MARKER = "rewrite_imports: " + "skip"
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def new_module(old: str) -> str:
    """``old`` under the new layout (unchanged if nothing it lives in moved).

    >>> new_module("ingest.sdk"), new_module("loopwatch.reprocess")
    ('loopwatch.ingest.sdk', 'loopwatch.processors.jobs.reprocess')
    >>> new_module("processors.sink"), new_module("loopwatch.cli"), new_module("loopwatch.ingest")
    ('loopwatch.store.sink', 'loopwatch.cli', 'loopwatch.ingest')
    """
    for key in sorted(MOVES, key=len, reverse=True):
        if old == key or old.startswith(key + "."):
            return MOVES[key] + old[len(key):]
    return old


def known_modules(root: Path) -> set[str]:
    """Every module of the old top-level packages found under ``root`` (plus the moved
    ones), as dotted names: what a dotted reference must name to be rewritten."""
    found = {key for key in MOVES if "." in key}
    for package in PACKAGES:
        folder = root / package
        for path in folder.rglob("*.py") if folder.is_dir() else ():
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if len(parts) > 1:
                found.add(".".join(parts))
    return found


def _names(text: str) -> list[tuple[str, str | None]]:
    names = []
    for item in text.replace("(", " ").replace(")", " ").replace("\\\n", " ").split(","):
        words = item.split("#")[0].split()
        if words:
            names.append((words[0], words[2] if len(words) == 3 and words[1] == "as" else None))
    return names


def _from_import(match: re.Match[str]) -> str:
    indent, module, body = match.group(1), match.group(2), match.group(3)
    if module.startswith("."):
        return match.group(0)
    groups: dict[str, list[str]] = {}
    for name, alias in _names(body):
        full = new_module(f"{module}.{name}")
        parent, leaf = full.rsplit(".", 1)
        if name == "*" or full == f"{new_module(module)}.{name}":
            parent, leaf = new_module(module), name
        as_name = alias or (name if leaf != name else None)
        groups.setdefault(parent, []).append(f"{leaf} as {as_name}" if as_name else leaf)
    if list(groups) == [module]:
        return match.group(0)
    lines = []
    for parent, items in groups.items():
        line = f"{indent}from {parent} import {', '.join(items)}"
        if len(line) > 100 or ("\n" in body and len(groups) == 1):
            inner = "".join(f"{indent}    {item},\n" for item in items)
            line = f"{indent}from {parent} import (\n{inner}{indent})"
        lines.append(line)
    return "\n".join(lines)


def _plain_import(match: re.Match[str]) -> str:
    indent, body = match.group(1), match.group(2)
    parts = []
    for item in body.split(","):
        words = item.split()
        if not words:
            return match.group(0)
        words[0] = new_module(words[0])
        parts.append(" ".join(words))
    return f"{indent}import {', '.join(parts)}"


def rewriter(root: Path) -> Callable[[str, str], str]:
    """The rewrite of one file's text (its suffix says whether it is Python)."""
    modules = sorted(known_modules(root), key=len, reverse=True)
    dotted = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, modules)) + r")(?![\w])")
    paths = re.compile(r"(?<![\w./])(" + "|".join(
        map(re.escape, sorted(PATHS, key=len, reverse=True))) + r")(?![\w])")
    package_string = re.compile(
        r"""(files\(\s*)(["'])(""" + "|".join(PACKAGES) + r""")\2""")
    from_import = re.compile(
        r"^([ \t]*)from[ \t]+([\w.]+)[ \t]+import[ \t]+(\([^)]*\)|[^\n]*?(?:\\\n[^\n]*?)*)$",
        re.MULTILINE)
    plain_import = re.compile(
        r"^([ \t]*)import[ \t]+((?:" + _IDENT + r"(?:\." + _IDENT + r")*(?:[ \t]+as[ \t]+"
        + _IDENT + r")?[ \t]*,?[ \t]*)+)$", re.MULTILINE)

    def references(text: str) -> str:
        text = dotted.sub(lambda m: new_module(m.group(1)), text)
        return paths.sub(lambda m: PATHS[m.group(1)], text)

    def rewrite(text: str, suffix: str) -> str:
        if suffix not in (".py", ".md"):
            return references(text)
        bound = {m.group(2).split()[0].split(".")[0] for m in plain_import.finditer(text)}
        text = from_import.sub(_from_import, text)
        text = plain_import.sub(_plain_import, text)
        text = package_string.sub(
            lambda m: f"{m.group(1)}{m.group(2)}{new_module(m.group(3))}{m.group(2)}", text)
        if suffix == ".md":
            return references(text)
        in_code = [name for name in modules if name.split(".")[0] in bound]
        code = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, in_code)) + r")(?![\w])")
        return _in_strings(text, references,
                           lambda t: code.sub(lambda m: new_module(m.group(1)), t)
                           if in_code else t)

    return rewrite


def _in_strings(text: str, sub: Callable[[str], str], code_sub: Callable[[str], str]) -> str:
    """``sub`` applied to the strings and comments of Python source, ``code_sub`` to the
    rest: in code a local name may spell a module (``detectors.outbox`` is an attribute
    of a variable there), so code is rewritten only for packages the file imports
    plainly (``import ingest.sdk`` then ``ingest.sdk.Emitter``)."""
    kinds = {tokenize.STRING, tokenize.COMMENT, getattr(tokenize, "FSTRING_MIDDLE", -1)}
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    try:
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(text).readline)
                  if t.type in kinds]
    except (tokenize.TokenError, SyntaxError):
        return sub(text)
    out, last = [], 0
    for token in tokens:
        begin = starts[token.start[0] - 1] + token.start[1]
        end = starts[token.end[0] - 1] + token.end[1]
        out += [code_sub(text[last:begin]), sub(text[begin:end])]
        last = end
    out.append(code_sub(text[last:]))
    return "".join(out)


def tracked_files(root: Path) -> Iterable[Path]:
    """The git-tracked text files the rewrite reads, in a stable order."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for name in sorted(filter(None, listed)):
        path = root / name
        if "migrations" in path.parts:
            continue  # applied once and checksummed: an edited comment is a new migration
        if (path.suffix in SUFFIXES or path.name in NAMES) and path.is_file():
            yield path


def rewrite_tree(root: Path, out: Callable[[str], None] = print, write: bool = True) -> int:
    """Rewrite every tracked file under ``root`` in place (only report, if not ``write``);
    return how many files changed."""
    rewrite = rewriter(root)
    changed = 0
    for path in tracked_files(root):
        text = path.read_text(encoding="utf-8")
        if SKIP_MARKER in text:
            continue
        new = rewrite(text, path.suffix)
        if new == text:
            continue
        changed += 1
        if write:
            path.write_text(new, encoding="utf-8")
        old_lines, new_lines = text.splitlines(), new.splitlines()
        if len(old_lines) == len(new_lines):
            for number, (a, b) in enumerate(zip(old_lines, new_lines, strict=True), 1):
                if a != b:
                    out(f"{path.relative_to(root)}:{number}: {a.strip()}  ->  {b.strip()}")
        else:
            out(f"{path.relative_to(root)}: {len(old_lines)} -> {len(new_lines)} lines")
    out(f"{changed} files changed")
    return changed


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rewrite_imports.py", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("root", nargs="?", default=".", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="print, change nothing")
    args = parser.parse_args(argv[1:])
    rewrite_tree(args.root.resolve(), write=not args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
