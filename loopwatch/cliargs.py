"""What every command line of loopwatch shares: the data-dir option, the error console,
and reading settings with messages a person can act on. Kept apart from ``loopwatch.cli``
so the parts' own commands (``ingest``, ``dashboards``) can use it without importing the
main CLI, which registers them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console

from loopwatch.config import Settings, load_settings

console = Console(stderr=True, soft_wrap=True)

DataDir = Annotated[Path | None, typer.Option("--data-dir", help="state directory "
                                              "[env LOOPWATCH_DATA_DIR]")]
JsonFlag = Annotated[bool, typer.Option("--json", help="print JSON instead of tables")]


def settings_from(data_dir: Path | None, **overrides: Any) -> Settings:
    """Settings from the environment plus options; exit 2 naming each invalid setting."""
    try:
        return load_settings(data_dir=data_dir, **overrides)
    except ValidationError as exc:
        for error in exc.errors():
            where = ".".join(str(part) for part in error["loc"])
            console.print(f"[red]invalid setting {where}:[/red] {error['msg']}")
        raise typer.Exit(2) from None
