"""The embedded broker's announcement, ``<data_dir>/broker.json``: how agents find it.

``loopwatch up`` writes it when it starts (or adopts) the embedded Tansu broker; the SDK
reads it to find the broker without being told an address, and to learn when the broker
was restarted. Tansu keeps topics and committed offsets in memory only, so a restart is
a new *incarnation*: whatever an agent sent to an earlier incarnation and the pipeline
had not committed is gone from the broker and must be sent again.

This module is part of the agent-side floor: it imports nothing beyond the standard
library, so an agent that installs only the SDK can read the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from loopwatch.ingest.privatefs import private_dir, write_private

BROKER_FILE = "broker.json"


def default_data_dir() -> Path:
    """Per-user default: ``$XDG_DATA_HOME/loopwatch`` or ``~/.local/share/loopwatch``.

    ``LOOPWATCH_DATA_DIR`` wins, as it does for the server side.
    """
    explicit = os.environ.get("LOOPWATCH_DATA_DIR")
    if explicit:
        return Path(explicit).expanduser().resolve()
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "loopwatch"


@dataclass(frozen=True)
class BrokerAnnouncement:
    """What a running embedded broker is, as ``loopwatch up`` recorded it.

    ``incarnation`` changes each time a broker process is started (never when an
    ``up`` adopts a broker that is still running); ``pid`` is the broker's own process.
    ``stopped_at`` is set when a clean stop of ``up`` stopped the broker (it had nothing
    uncommitted); the record stays, so the next start reuses its port.
    """

    bootstrap: str
    pid: int
    incarnation: str
    events_topic: str
    consumer_group: str
    started_at: float
    stopped_at: float | None = None

    @property
    def port(self) -> int:
        return int(self.bootstrap.rpartition(":")[2])


def broker_file(data_dir: Path) -> Path:
    return data_dir / BROKER_FILE


def read_announcement(data_dir: Path) -> BrokerAnnouncement | None:
    """The recorded broker, or None when there is no (readable, complete) record.

    A record says nothing about whether that broker still runs: callers check.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> read_announcement(folder) is None
    True
    >>> write_announcement(folder, BrokerAnnouncement(
    ...     "127.0.0.1:19092", 42, "i-1", "loopwatch.events", "g", 0.0))
    >>> read_announcement(folder).port, oct(broker_file(folder).stat().st_mode & 0o777)
    (19092, '0o600')
    >>> import shutil; shutil.rmtree(folder)
    """
    try:
        data = json.loads(broker_file(data_dir).read_bytes())
        return BrokerAnnouncement(
            bootstrap=str(data["bootstrap"]),
            pid=int(data["pid"]),
            incarnation=str(data["incarnation"]),
            events_topic=str(data["events_topic"]),
            consumer_group=str(data["consumer_group"]),
            started_at=float(data["started_at"]),
            stopped_at=None if data.get("stopped_at") is None else float(data["stopped_at"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_announcement(data_dir: Path, announcement: BrokerAnnouncement) -> None:
    """Replace the record atomically; the file is private to its owner (0600) in a
    private folder (0700)."""
    private_dir(data_dir)
    write_private(broker_file(data_dir), json.dumps(asdict(announcement)).encode())
