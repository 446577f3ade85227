"""What readers yield: events to send, or a bad record to report and skip."""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from pathlib import Path

from loopwatch.ingest.events import EventBase

IMPORT_NAMESPACE = uuid.UUID("2b7d0c4e-8f61-4c39-a1d5-5e0f3c9b7a21")


@dataclass(frozen=True, slots=True)
class Good:
    """Events read from one record (one JSONL line, or one transcript run)."""

    position: str
    events: list[EventBase]


@dataclass(frozen=True, slots=True)
class Bad:
    """A record that was skipped: where it is in the file, and why."""

    position: str
    reason: str


Record = Good | Bad


def file_digest(path: Path) -> str:
    """sha256 of the file's bytes: the same file gives the same ids wherever it lies."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def stable_id(*parts: object) -> uuid.UUID:
    """A deterministic event id, so importing a file twice stores each event once."""
    return uuid.uuid5(IMPORT_NAMESPACE, ":".join(str(part) for part in parts))
