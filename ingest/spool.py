"""A bounded on-disk spool for events the broker could not take.

Delivery guarantee: an event handed to :meth:`DiskSpool.append` is on disk (one JSON
line each) until :meth:`DiskSpool.take` hands it back for a resend; resending is
harmless because ``event_id`` deduplicates downstream. Over ``max_bytes`` new events
are refused and counted as dropped, rather than filling the disk.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from loopwatch.privatefs import append_private, private_dir


class DiskSpool:
    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.path = directory / "spool.jsonl"
        self._lock = threading.Lock()
        self.dropped = 0
        private_dir(directory)

    def size(self) -> int:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def append(self, lines: list[bytes]) -> int:
        """Write events; returns how many were kept (the rest count as dropped)."""
        with self._lock:
            room = self.max_bytes - self.size()
            kept: list[bytes] = []
            for line in lines:
                if len(line) + 1 > room:
                    break
                kept.append(line)
                room -= len(line) + 1
            if kept:
                with append_private(self.path) as spool:
                    spool.write(b"".join(line + b"\n" for line in kept))
                    spool.flush()
                    os.fsync(spool.fileno())
            self.dropped += len(lines) - len(kept)
            return len(kept)

    def take(self) -> list[bytes]:
        """Remove and return everything spooled (the caller re-appends what still fails)."""
        with self._lock:
            try:
                data = self.path.read_bytes()
            except FileNotFoundError:
                return []
            self.path.unlink()
        return [line for line in data.split(b"\n") if line]
