"""A durable outbox: notifications wait on disk until their receiver accepts them.

Delivery guarantee: at-least-once per notifier. An entry is written (fsync'd) before any
attempt and removed only after a 2xx; failures back off exponentially (capped), and a
restart picks up where the last process stopped. Receivers dedup by fingerprint.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from loopwatch.core.masking import mask_secrets
from loopwatch.detectors.notify import DeliveryError, Notifier
from loopwatch.ingest.privatefs import write_private

log = logging.getLogger(__name__)


@dataclass
class Entry:
    id: str
    notifier: str
    notifications: list[dict[str, Any]]
    attempts: int = 0
    next_attempt: float = 0.0
    last_error: str = ""


class Outbox:
    def __init__(self, path: Path, notifiers: Mapping[str, Notifier],
                 max_backoff_s: float = 60.0, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.notifiers = dict(notifiers)
        self.max_backoff_s = max_backoff_s
        self.clock = clock
        self.delivered = 0
        self.failures = 0
        self._lock = threading.Lock()
        self._entries: list[Entry] = self._load()

    def _load(self) -> list[Entry]:
        try:
            return [Entry(**orjson.loads(line)) for line in self.path.read_bytes().splitlines()
                    if line.strip()]
        except FileNotFoundError:
            return []

    def _save(self) -> None:
        """Write the entries to disk; if that fails (a full disk), they stay in memory
        and are delivered all the same, only not across a restart."""
        try:
            self._write_entries()
        except OSError:
            log.exception("could not save the outbox to %s; %d notification batches are "
                          "kept in memory only", self.path, len(self._entries))

    def _write_entries(self) -> None:
        write_private(self.path, b"".join(orjson.dumps(asdict(e), default=str) + b"\n"
                                          for e in self._entries))

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._entries)

    def put(self, notifications: list[dict[str, Any]]) -> None:
        """Queue a batch for every notifier (durably, before any attempt)."""
        if not notifications or not self.notifiers:
            return
        with self._lock:
            for name in self.notifiers:
                self._entries.append(Entry(uuid.uuid4().hex, name, notifications))
            self._save()

    def flush(self) -> int:
        """Attempt every due entry once; returns how many were delivered."""
        with self._lock:
            due = [e for e in self._entries if e.next_attempt <= self.clock()]
        delivered = 0
        for entry in due:
            notifier = self.notifiers.get(entry.notifier)
            if notifier is None:
                continue
            try:
                notifier.deliver(entry.notifications)
            except DeliveryError as exc:
                self.failures += 1
                entry.attempts += 1
                entry.last_error = mask_secrets(str(exc))[:500]
                entry.next_attempt = self.clock() + min(self.max_backoff_s,
                                                        0.5 * 2 ** entry.attempts)
                log.warning("notifier %s: %s (attempt %d)", entry.notifier,
                            mask_secrets(str(exc)), entry.attempts)
                with self._lock:
                    self._save()
                continue
            delivered += 1
            with self._lock:
                self._entries = [e for e in self._entries if e.id != entry.id]
                self._save()
        self.delivered += delivered
        return delivered
