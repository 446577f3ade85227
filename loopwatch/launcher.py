"""The ``loopwatch`` command's entry point: the CLI is part of the server install, so on an
SDK-only install (``pip install loopwatch``) the command says so in one line instead of a
traceback."""

from __future__ import annotations

import sys


def main() -> None:
    """Run :func:`loopwatch.cli.main`, or exit 1 naming the missing server extra."""
    try:
        from loopwatch.cli import main as cli_main
    except ModuleNotFoundError as exc:
        if (exc.name or "loopwatch").split(".")[0] == "loopwatch":
            raise
        sys.stderr.write(f"loopwatch: the command line needs the server install ({exc.name} "
                         "is not installed): pip install 'loopwatch[server]'\n")
        sys.exit(1)
    cli_main()
