"""What every command line of loopwatch shares: the data-dir option, the error console,
reading settings with messages a person can act on, and the error contract.

The contract, for every command: a user's error is one line on stderr; a usage error
(a bad argument or setting) exits 2, a runtime error (a store that does not answer, a
query the store refuses) exits 1; ``loopwatch --debug`` or ``LOOPWATCH_DEBUG=1`` prints
the traceback too. It is kept in one place, :class:`ErrorContract`, the top-level
command group's ``main``, so no command can forget it. Kept apart from
``loopwatch.cli`` so the parts' own commands (``ingest``, ``dashboards``) can use it
without importing the main CLI, which registers them.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from typer.core import TyperGroup

from loopwatch.core.config import Settings, load_settings
from loopwatch.core.masking import mask_secrets

console = Console(stderr=True, soft_wrap=True)
#: every command group's help is plain text: as rich markup, its bracketed notes
#: (``[env LOOPWATCH_DATA_DIR]``, ``[env ..., default 4318]``) were eaten as style tags
HELP_MARKUP = None

DataDir = Annotated[Path | None, typer.Option("--data-dir", help="state directory "
                                              "[env LOOPWATCH_DATA_DIR]")]
JsonFlag = Annotated[bool, typer.Option("--json", help="print JSON instead of tables")]
DEBUG_ENV = "LOOPWATCH_DEBUG"
DebugFlag = Annotated[bool, typer.Option("--debug", envvar=DEBUG_ENV,
                                         help="print the traceback of an error")]
#: click's exception base, vendored by typer or not: what it raises for bad usage
_CLICK_EXCEPTION = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
MAX_MESSAGE = 500
#: libraries that log an error before raising it
QUIET_LOGGERS = ("clickhouse_connect",)
#: modules whose exceptions carry a message for people as they are
OWN_MODULES = frozenset({"builtins", "loopwatch", "ingest", "processors", "detectors",
                         "dashboards", "bench"})


def positive(value: float | None) -> float | None:
    """An option's callback for a duration, rate, window or count: zero or less would
    run an empty or endless command, so it is a usage error before anything starts."""
    if value is not None and value <= 0:
        raise typer.BadParameter(f"must be more than 0 (got {value:g})")
    return value


def port_number(value: int | None) -> int | None:
    """An option's callback for a TCP port (0 = any free one)."""
    if value is not None and not 0 <= value <= 65535:
        raise typer.BadParameter(f"a port is 0 to 65535 (got {value})")
    return value


def one_of(*allowed: int) -> Any:
    """An option's callback that takes only the ``allowed`` numbers."""

    def check(value: int | None) -> int | None:
        if value is not None and value not in allowed:
            raise typer.BadParameter(
                f"must be {' or '.join(map(str, allowed))} (got {value})")
        return value

    return check


#: how many rows of a listing to show, newest first
Limit = Annotated[int, typer.Option(help="newest N", callback=positive)]


class UsageError(Exception):
    """The user's input cannot work: one line, exit 2."""


def settings_from(data_dir: Path | None, **overrides: Any) -> Settings:
    """Settings from the environment plus options; exit 2 naming each invalid setting."""
    try:
        return load_settings(data_dir=data_dir, **overrides)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}"
            for error in exc.errors())
        console.print(f"[red]invalid setting[/red] {' '.join(problems.split())}",
                      markup=True, highlight=False)
        raise typer.Exit(2) from None


def one_line(exc: BaseException) -> str:
    """``exc`` as one line a person can read: its message's lines joined, URLs cut to
    scheme://host:port (no password, path or query), bounded in length; a library's
    own exception type is named (its message alone may not say what failed).

    >>> one_line(RuntimeError("cannot reach http://u:pw@db:8123/x?k=s\\n  (details)"))
    'cannot reach http://db:8123/… (details)'
    >>> one_line(KeyError("run_id"))
    "KeyError: 'run_id'"
    """
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    module = type(exc).__module__.split(".")[0]
    if not text or isinstance(exc, KeyError) or module not in OWN_MODULES:
        text = f"{type(exc).__name__}: {text}".rstrip(": ")
    text = mask_secrets(text)
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE - 1] + "…"


def _debugging(args: Sequence[str]) -> bool:
    return "--debug" in args or os.environ.get(DEBUG_ENV, "").lower() in {"1", "true", "yes"}


def report(exc: BaseException, debug: bool) -> int:
    """Print ``exc`` by the contract and return the exit code."""
    if isinstance(exc, _CLICK_EXCEPTION):
        code = int(getattr(exc, "exit_code", 2))
        if type(exc).__name__ == "NoArgsIsHelpError":  # a bare command group: its help
            sys.stdout.write(exc.format_message().rstrip("\n") + "\n")  # type: ignore[attr-defined]
            return code
        context = getattr(exc, "ctx", None)
        hint = f" (see `{context.command_path} --help`)" if context is not None else ""
        message, exit_code = f"{exc.format_message()}{hint}", code  # type: ignore[attr-defined]
    elif isinstance(exc, UsageError):
        message, exit_code = one_line(exc), 2
    elif isinstance(exc, typer.Abort | KeyboardInterrupt):
        message, exit_code = "aborted", 130
    else:
        message, exit_code = one_line(exc), 1
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    console.print(f"[red]error:[/red] {' '.join(message.split())}", markup=True,
                  highlight=False)
    return exit_code


class ErrorContract(TyperGroup):
    """The top-level group: runs the command, and turns whatever escapes it into the
    contract's one line and exit code (see the module docstring)."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             windows_expand_args: bool = True, **extra: Any) -> Any:
        given = list(sys.argv[1:] if args is None else args)
        if not _debugging(given):
            for name in QUIET_LOGGERS:  # they log what they then raise: reported once, below
                logging.getLogger(name).setLevel(logging.CRITICAL)
        try:
            result = super().main(given, prog_name, complete_var, standalone_mode=False,
                                  windows_expand_args=windows_expand_args, **extra)
            code = result if isinstance(result, int) else 0
        except SystemExit:
            raise
        except BaseException as exc:
            code = report(exc, _debugging(given))
        if not standalone_mode:
            return code
        sys.exit(code)
