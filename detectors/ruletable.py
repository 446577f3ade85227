"""The documentation's alert-rule table, generated from ``detectors/rules.toml``.

The table lives between two markers in a Markdown file (docs/detectors.md); it is never
edited by hand: ``python -m loopwatch.detectors.ruletable --write docs/detectors.md``
regenerates it and
``--check docs/detectors.md`` exits 1 when it is stale (``tests/test_ruletable.py`` does the same).

>>> from loopwatch.detectors.rules import load_rules
>>> render(load_rules()).splitlines()[2].split(" | ")[::2]
['| `stuck_run`', 'warning']
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from loopwatch.detectors.rules import Rule, load_rules

#: names the file, not the module: the file stays where it is when the import path moves
BEGIN: Final = ("<!-- rules table: generated from detectors/rules.toml by "
                "detectors/ruletable.py (--write docs/detectors.md); do not edit -->")
END: Final = "<!-- end of the rules table -->"
HEADER: Final = "| rule | fires when | severity | playbook |\n|---|---|---|---|"


class TableError(ValueError):
    """The Markdown file has no (or more than one) generated table."""


def _cell(text: str) -> str:
    return " ".join(text.split()).rstrip(".").replace("|", "\\|")


def render(rules: Mapping[str, Rule]) -> str:
    """The table: one row per rule, in the rules file's order."""
    rows = [f"| `{rule.name}` | {_cell(rule.description)} | {rule.severity} | "
            f"`{rule.playbook}` |" for rule in rules.values()]
    return "\n".join([HEADER, *rows])


def replace(text: str, table: str) -> str:
    """``text`` with the block between the markers replaced by ``table``."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise TableError("the file needs exactly one rules table between the markers "
                         f"{BEGIN!r} and {END!r}")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loopwatch.detectors.ruletable",
                                     description="The alert-rule table, from rules.toml.")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="FILE", type=Path, help="regenerate FILE's table")
    group.add_argument("--check", metavar="FILE", type=Path,
                       help="exit 1 if FILE's table is not the rules' table")
    args = parser.parse_args(argv)
    table = render(load_rules())
    path = args.write or args.check
    if path is None:
        sys.stdout.write(table + "\n")
        return 0
    try:
        text = path.read_text(encoding="utf-8")
        updated = replace(text, table)
    except (OSError, UnicodeDecodeError, TableError) as exc:
        sys.stderr.write(f"error: {path}: {exc}\n")
        return 1
    if args.check:
        if updated != text:
            sys.stderr.write(f"{path}: the rules table is stale: run "
                             f"`python -m loopwatch.detectors.ruletable --write {path}`\n")
            return 1
        return 0
    if updated != text:
        path.write_text(updated, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
