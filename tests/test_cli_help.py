"""Every command's ``--help`` shows its help text whole: a bracketed note such as
``[env LOOPWATCH_OTLP_PORT, default 4318]`` is text, not markup to be eaten.

The commands are read from the CLI itself, so a new command is covered as it lands.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from loopwatch.cli import app

BRACKETED = re.compile(r"\[[^\]]*\]")


def every_command() -> Iterator[tuple[tuple[str, ...], Any]]:
    def walk(command: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
        yield path, command
        for name, sub in sorted((getattr(command, "commands", None) or {}).items()):
            yield from walk(sub, (*path, name))

    yield from walk(typer.main.get_command(app), ())


COMMANDS = dict(every_command())


def _flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


def test_the_help_texts_have_bracketed_notes_to_check():
    notes = {note for _, command in COMMANDS.items() for note in _notes(command)}
    assert {"[env LOOPWATCH_OTLP_PORT, default 4318]", "[env LOOPWATCH_DATA_DIR]"} <= notes


def _notes(command: Any) -> list[str]:
    texts = [command.help or ""] + [getattr(p, "help", None) or "" for p in command.params]
    return [note for text in texts for note in BRACKETED.findall(_flat(text))]


@pytest.mark.parametrize("path", list(COMMANDS), ids=lambda p: " ".join(p) or "loopwatch")
def test_a_commands_help_keeps_every_bracketed_note(path):
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    shown = _flat(result.output)
    missing = [note for note in _notes(COMMANDS[path]) if note not in shown]
    assert missing == []


#: what a command that reads no store must not pay for at start: the store client
#: (clickhouse-connect, httpx) and every advisor come in with the command that uses them
NOT_AT_START = ("clickhouse_connect", "httpx", "chdb", "scipy", "numpy", "faust",
                "loopwatch.store.reader", "loopwatch.detectors.advisors.run",
                "loopwatch.detectors.advisors.base")


def test_the_cli_starts_without_the_store_client_or_the_advisors():
    """Every ``loopwatch`` command imports the whole CLI (its parts register their
    commands); a heavy import there is paid by ``--help``, every usage error and every
    command that reads no store (the tests start ~80 such children)."""
    import subprocess
    import sys

    probe = ("import sys, loopwatch.cli; print(' '.join(sorted(name for name in sys.modules "
             f"if name.split('.')[0] in {NOT_AT_START!r} or name in {NOT_AT_START!r})))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.split() == []
