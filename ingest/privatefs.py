"""Directories and files only their owner can open, whatever the umask.

loopwatch's data dir holds captured prompts and responses, the outbox of pending
notifications, the SDK's spool of unsent events and the store service's socket: none of
it is for other local users. Everything loopwatch creates there goes through these
helpers, so a directory is 0700 and a file 0600 from the moment it exists (a umask can
only remove permission bits, so creating with these modes is enough; an existing one is
narrowed to them).

>>> import tempfile
>>> root = Path(tempfile.mkdtemp())
>>> old = os.umask(0o022)
>>> folder = private_dir(root / "a" / "b")
>>> write_private(folder / "f.json", b"{}")
>>> with append_private(folder / "log") as handle:
...     _ = handle.write(b"x")
>>> os.umask(old) and None
>>> [oct(mode(p)) for p in (root / "a", folder, folder / "f.json", folder / "log")]
['0o700', '0o700', '0o600', '0o600']
>>> private_dir(folder / "f.json")  # doctest: +ELLIPSIS
Traceback (most recent call last):
NotADirectoryError: [Errno 20] not a directory: '...f.json'
>>> oct(mode(folder / "f.json"))
'0o600'
>>> import shutil; shutil.rmtree(root)
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path
from typing import BinaryIO

DIR_MODE = 0o700
FILE_MODE = 0o600
#: for a process whose every file belongs in the data dir (``up``, ``worker``)
PRIVATE_UMASK = 0o077


def mode(path: Path) -> int:
    """The permission bits of ``path``."""
    return path.stat().st_mode & 0o777


def private_dir(path: Path) -> Path:
    """``path`` as a directory only its owner can enter. Components that did not exist
    are created 0700 too (a parent the user already has keeps its mode)."""
    missing: list[Path] = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            folder.mkdir(mode=DIR_MODE)
        os.chmod(folder, DIR_MODE)
    if not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))
    if mode(path) != DIR_MODE:
        os.chmod(path, DIR_MODE)
    return path


def open_private(path: Path, flags: int) -> int:
    """``os.open`` creating ``path`` 0600 (and an existing file narrowed to 0600)."""
    descriptor = os.open(path, flags | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(descriptor, FILE_MODE)
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def append_private(path: Path) -> BinaryIO:
    """``path`` opened for appending bytes, private (see :func:`open_private`)."""
    return os.fdopen(open_private(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "ab")


def write_private(path: Path, data: bytes, fsync: bool = True) -> None:
    """Replace ``path`` atomically with ``data``; the file is 0600 before it has content
    (``mkstemp`` creates it so), and its folder is private."""
    private_dir(path.parent)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.",
                                             suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            if fsync:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
