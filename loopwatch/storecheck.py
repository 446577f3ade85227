"""Which store a reading command reads, decided before it is opened.

Opening the embedded store migrates it, so a query in a data dir that holds none (a
typo, the default dir while ``up`` runs on another) used to create an empty store and
print a blank result. A reading command asks here first: a ClickHouse server, a live
``loopwatch up`` announcing its store service, or a chdb folder holding the loopwatch
database is a store; anything else is refused, unless the user asked to create one.
"""

from __future__ import annotations

from loopwatch.core.config import Settings
from loopwatch.core.masking import safe_url
from loopwatch.store.reader import Reader, open_reader, running_service


class NoStore(RuntimeError):
    """The data dir holds no loopwatch store: a runtime error (exit 1)."""


def holds_store(settings: Settings) -> bool:
    """Whether ``settings.chdb_path`` holds the loopwatch database (chdb keeps one
    ``metadata/<database>.sql`` per database it has)."""
    return (settings.chdb_path / "metadata" / f"{settings.database}.sql").is_file()


def store_to_read(settings: Settings, create: bool = False) -> str:
    """A one-line description of the store the command will read; :class:`NoStore`
    when there is none and ``create`` is false."""
    if settings.clickhouse_url:
        return f"store: {safe_url(settings.clickhouse_url)} (ClickHouse server)"
    announced = running_service(settings)
    if announced is not None:
        return f"store: chdb://{settings.chdb_path} (through the running up, pid " \
               f"{announced.get('pid', '?')})"
    if holds_store(settings):
        return f"store: chdb://{settings.chdb_path}"
    if create:
        return f"store: chdb://{settings.chdb_path} (created empty)"
    raise NoStore(
        f"no loopwatch store in {settings.data_dir}: `loopwatch up --data-dir "
        f"{settings.data_dir}` creates one; if `up` runs on another "
        "data dir, pass that one (--data-dir or LOOPWATCH_DATA_DIR)")


def open_checked(settings: Settings, create: bool = False) -> tuple[Reader, str]:
    """The reader of the store :func:`store_to_read` found, and its description (for
    the command to print on stderr once it has read, so ``--json`` stays clean)."""
    line = store_to_read(settings, create)
    return open_reader(settings), line
