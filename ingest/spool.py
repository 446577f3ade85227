"""The emitter's on-disk spool: a write-ahead log of segment files in one private folder.

Why a log of segments: for the embedded broker, which keeps everything in memory, an
event is safe only once the pipeline has *committed* past it, so the emitter writes
what it sends here first and deletes a segment only when every record in it has been
confirmed (:meth:`DiskSpool.confirm`). With a replicated Kafka cluster the broker's
acknowledgement is enough, and only what the broker could not take is written here.
Either way a record on disk is sent again until it is confirmed; ``event_id`` makes a
resend harmless downstream.

- One ``write`` and one ``fsync`` per :meth:`DiskSpool.append` (the sender calls it once
  per batch, which it gathers for a bounded time), so the log costs one fsync per
  batch, not per event.
- Bounded: bytes are *reserved* when the agent hands an event over
  (:meth:`DiskSpool.reserve`), so an event is refused at the call, with
  :class:`SpoolFull`, rather than dropped later when it could not be written.
- Private and exclusive: the folder is 0700, files 0600 whatever the umask, and a live
  spool holds an ``flock`` on its ``lock`` file, so two live emitters never share one;
  a folder whose lock nobody holds is an orphan (its emitter exited) and
  :meth:`DiskSpool.adopt` moves its records into a live spool.
- A crash can tear the last line of the last segment; a new segment is started on every
  open, so the fragment stays a line of its own (sent on, and dead-lettered downstream
  with its reason) and never merges with later records.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loopwatch.ingest.privatefs import open_private, private_dir

SEGMENT_PREFIX = "seg-"
SEGMENT_SUFFIX = ".log"
#: the single file the spool used before segments; read (and resent) like a segment
LEGACY_FILE = "spool.jsonl"
LOCK_FILE = "lock"
META_FILE = "meta.json"


class SpoolFull(BufferError):
    """The spool has no room for these events: they were not accepted (nothing queued)."""


class SpoolLocked(RuntimeError):
    """Another live emitter holds this spool folder."""


class SpoolUnsafe(RuntimeError):
    """The spool folder is a symlink or belongs to another user."""


@dataclass(slots=True)
class Segment:
    """One segment file. ``unconfirmed`` counts its records not yet confirmed in the
    current ``generation``; a resend starts a new generation, so confirmations of what
    was sent before (to a broker that has since lost it) no longer count."""

    seq: int
    path: Path
    size: int = 0
    records: int = 0
    unconfirmed: int = 0
    generation: int = 0
    sealed: bool = False
    needs_resend: bool = False


def _lock(directory: Path) -> int | None:
    """The folder's lock, held; None if a live process holds it."""
    descriptor = open_private(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        return None
    os.ftruncate(descriptor, 0)
    os.write(descriptor, str(os.getpid()).encode())
    return descriptor


def _segment_files(directory: Path) -> list[Path]:
    """The segment files of a folder, oldest first; never a symlink (a link planted in
    a spool folder would have its target's content sent to the broker)."""
    found = sorted(directory.glob(f"{SEGMENT_PREFIX}*{SEGMENT_SUFFIX}"))
    legacy = directory / LEGACY_FILE
    candidates = [legacy, *found] if legacy.exists() or legacy.is_symlink() else found
    return [path for path in candidates if not path.is_symlink() and path.is_file()]


def read_lines(path: Path) -> list[bytes]:
    """A segment's records; a torn last line (no newline) is one record of its own.
    Opened with ``O_NOFOLLOW``: a segment swapped for a symlink reads as empty."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, OSError):
        return []
    with os.fdopen(descriptor, "rb") as handle:
        data = handle.read()
    return [line for line in data.split(b"\n") if line]


def owned(directory: Path) -> bool:
    """Whether this user owns ``directory`` (a spool folder made by someone else is
    refused: whoever owns it could plant or read records)."""
    try:
        return directory.lstat().st_uid == os.geteuid() and not directory.is_symlink()
    except OSError:
        return False


class DiskSpool:
    """A write-ahead log in ``directory``, held exclusively while open; see the module doc."""

    def __init__(self, directory: Path, max_bytes: int, *, segment_bytes: int = 16 << 20,
                 topic: str = "", sync: bool = True) -> None:
        if directory.is_symlink() or (directory.exists() and not owned(directory)):
            raise SpoolUnsafe(f"spool {directory} is a symlink or is not yours; refusing it")
        self.directory = private_dir(directory)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.topic = topic
        self.sync = sync
        #: records refused on a resend (over the message size); kept for the stats
        self.dropped = 0
        self.fsyncs = 0
        self._lock = threading.Lock()
        #: held while the active segment's file is written or closed (before ``_lock``)
        self._writing = threading.Lock()
        lock = _lock(self.directory)
        if lock is None:
            raise SpoolLocked(f"spool {self.directory} is held by another live emitter "
                              f"(pid {self._holder()}); give each emitter its own spool_dir")
        self._lock_fd: int | None = lock
        if topic:
            self._write_meta()
        self._segments: dict[int, Segment] = {}
        self._reserved = 0
        self._disk = 0
        self._next_seq = 0
        for path in _segment_files(self.directory):
            self._load(path)
        self._active: Segment | None = None
        self._fd: int | None = None

    # -- accounting -----------------------------------------------------------------

    def size(self) -> int:
        """Bytes of the segments on disk (records not yet confirmed, and the confirmed
        ones that share a segment with them)."""
        with self._lock:
            return self._disk

    def used(self) -> int:
        """Bytes on disk plus bytes reserved for events accepted and not yet settled."""
        with self._lock:
            return self._used()

    def _used(self) -> int:
        return self._disk + self._reserved

    def unconfirmed(self) -> int:
        """Records on disk not yet confirmed."""
        with self._lock:
            return sum(segment.unconfirmed for segment in self._segments.values())

    def reserve(self, nbytes: int, limit: int | None = None) -> None:
        """Hold room for records about to be accepted, or raise :class:`SpoolFull`.
        ``limit`` caps what may be in use after it (captures use at most half)."""
        cap = self.max_bytes if limit is None else min(limit, self.max_bytes)
        with self._lock:
            used = self._used()
            if used + nbytes > cap:
                raise SpoolFull(f"spool full: {used} of {cap} bytes hold events the pipeline "
                                f"has not confirmed yet ({self.directory}); the event was "
                                "not accepted")
            self._reserved += nbytes

    def release(self, nbytes: int) -> None:
        """Give back a reservation that will not be written (its records were settled)."""
        with self._lock:
            self._reserved = max(0, self._reserved - nbytes)

    # -- writing --------------------------------------------------------------------

    def append(self, lines: list[bytes], reserved: int = 0) -> Segment:
        """Write ``lines`` to the active segment with one write and one fsync; returns
        the segment, whose ``unconfirmed`` now counts them. ``reserved`` bytes held by
        :meth:`reserve` become bytes on disk.

        The write and the fsync hold the writer's lock, not the accounting lock that
        :meth:`reserve` takes for every event an agent emits: an agent's thread must
        not wait for the disk (every emit waited behind the fsync of each sender
        batch, a sixth of the emitter's rate). The lines are counted first, so a
        confirmation of the segment's earlier records cannot find it empty and close
        it while they are written; a failed write takes the count back."""
        data = b"".join(line + b"\n" for line in lines)
        with self._writing:
            with self._lock:
                segment = self._active_segment()
                fd = self._fd
                assert fd is not None
                self._count(segment, len(lines), len(data), reserved)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                if self.sync:
                    os.fsync(fd)
                    self.fsyncs += 1
            except BaseException:
                with self._lock:
                    self._count(segment, -len(lines), -len(data), -reserved)
                raise
            with self._lock:
                if segment is self._active and segment.size >= self.segment_bytes:
                    self._seal_active()
            return segment

    def _count(self, segment: Segment, records: int, nbytes: int, reserved: int) -> None:
        """Add written records to ``segment`` and the disk total, moving ``reserved``
        bytes out of the reservations (negative: take a failed write back)."""
        self._reserved = max(0, self._reserved - reserved)
        segment.size += nbytes
        self._disk += nbytes
        segment.records += records
        segment.unconfirmed = max(0, segment.unconfirmed + records)

    def _active_segment(self) -> Segment:
        if self._active is None:
            seq = self._next_seq
            self._next_seq += 1
            path = self.directory / f"{SEGMENT_PREFIX}{seq:012d}{SEGMENT_SUFFIX}"
            self._fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            self._active = self._segments[seq] = Segment(seq, path)
        return self._active

    def _seal_active(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._active is not None:
            self._active.sealed = True
            self._active = None

    # -- confirmation and resends ---------------------------------------------------

    def generation(self, seq: int) -> int | None:
        segment = self._segments.get(seq)
        return None if segment is None else segment.generation

    def confirm(self, seq: int, generation: int, records: int) -> bool:
        """``records`` of segment ``seq`` sent in ``generation`` are confirmed; a segment
        with nothing left unconfirmed is deleted. False when the confirmation is stale.
        Its file is unlinked after the accounting lock is let go: removing a full
        segment (16 MB) waits for the disk, and every emit takes that lock."""
        with self._lock:
            segment = self._segments.get(seq)
            if segment is None or segment.generation != generation:
                return False
            segment.unconfirmed = max(0, segment.unconfirmed - records)
            if segment.unconfirmed != 0 or segment.needs_resend:
                return True
            self._forget(segment)
        segment.path.unlink(missing_ok=True)
        return True

    def _delete(self, segment: Segment) -> None:
        self._forget(segment)
        segment.path.unlink(missing_ok=True)

    def _forget(self, segment: Segment) -> None:
        """Drop ``segment`` from the spool (sealed first if active); its file stays."""
        if segment is self._active:
            self._seal_active()
        del self._segments[segment.seq]
        self._disk -= segment.size

    def mark_resend(self, seq: int, generation: int) -> None:
        """A send of this segment's records (in ``generation``) failed: resend it all."""
        with self._lock:
            segment = self._segments.get(seq)
            if segment is not None and segment.generation == generation:
                segment.needs_resend = True

    def mark_all_resend(self) -> None:
        """The broker lost what it held (a new incarnation): resend every segment."""
        with self._lock:
            for segment in self._segments.values():
                segment.needs_resend = True

    def records(self) -> list[bytes]:
        """Every record on disk, oldest segment first (for inspection and tests)."""
        with self._lock:
            paths = [self._segments[seq].path for seq in sorted(self._segments)]
        return [line for path in paths for line in read_lines(path)]

    def pending_resend(self) -> bool:
        with self._lock:
            return any(segment.needs_resend for segment in self._segments.values())

    def take_resend(self) -> Iterator[tuple[int, int, list[bytes]]]:
        """(seq, generation, records) of each segment to resend, oldest first. Each is
        sealed first (so its records are fixed) and starts a new generation in which
        all its records are unconfirmed again."""
        with self._lock:
            due = sorted(seq for seq, segment in self._segments.items() if segment.needs_resend)
        for seq in due:
            with self._writing, self._lock:
                segment = self._segments.get(seq)
                if segment is None or not segment.needs_resend:
                    continue
                if segment is self._active:
                    self._seal_active()
                segment.needs_resend = False
                segment.generation += 1
                lines = read_lines(segment.path)
                segment.records = segment.unconfirmed = len(lines)
                generation = segment.generation
                if not lines:
                    self._delete(segment)
                    continue
            yield seq, generation, lines

    # -- orphans --------------------------------------------------------------------

    def _load(self, path: Path) -> None:
        lines = read_lines(path)
        if not lines:
            path.unlink(missing_ok=True)
            return
        seq = self._next_seq
        self._next_seq += 1
        size = path.stat().st_size
        self._segments[seq] = Segment(seq, path, size, len(lines), len(lines),
                                      sealed=True, needs_resend=True)
        self._disk += size
        if path.name.startswith(SEGMENT_PREFIX):
            with contextlib.suppress(ValueError):
                self._next_seq = max(self._next_seq, int(path.stem[len(SEGMENT_PREFIX):]) + 1)

    def adopt(self, orphan: Path) -> int:
        """Move the records of an orphaned spool (no live holder) into this one: copied
        with one fsync, then the orphan's files are deleted (a crash in between sends
        them twice, which is harmless). Returns how many records were adopted; 0 if
        the folder is held, belongs to another topic, or its records do not fit."""
        if orphan.resolve() == self.directory.resolve() or not owned(orphan):
            return 0
        try:
            lock = _lock(orphan)
        except OSError:
            return 0
        if lock is None:
            return 0
        adopted = 0
        try:
            if self.topic and spool_topic(orphan) not in ("", self.topic):
                return 0
            for path in _segment_files(orphan):
                lines = read_lines(path)
                if lines:
                    size = sum(len(line) + 1 for line in lines)
                    try:
                        self.reserve(size)
                    except SpoolFull:
                        return adopted
                    segment = self.append(lines, reserved=size)
                    segment.needs_resend = True
                    adopted += len(lines)
                path.unlink(missing_ok=True)
            for name in (META_FILE, LOCK_FILE):
                (orphan / name).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                orphan.rmdir()
        finally:
            os.close(lock)
        return adopted

    # -- life cycle -----------------------------------------------------------------

    def _write_meta(self) -> None:
        descriptor = open_private(self.directory / META_FILE,
                                   os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        with os.fdopen(descriptor, "w") as handle:
            json.dump({"topic": self.topic}, handle)

    def _holder(self) -> str:
        try:
            return (self.directory / LOCK_FILE).read_text().strip() or "?"
        except OSError:
            return "?"

    def close(self, remove_if_empty: bool = False) -> None:
        """Release the folder (what is unconfirmed stays for the next emitter)."""
        with self._writing, self._lock:
            self._seal_active()
            for segment in list(self._segments.values()):
                if segment.records == 0:
                    self._delete(segment)
            empty = not self._segments
            if self._lock_fd is not None:
                if remove_if_empty and empty:
                    for name in (META_FILE, LOCK_FILE):
                        (self.directory / name).unlink(missing_ok=True)
                    with contextlib.suppress(OSError):
                        self.directory.rmdir()
                os.close(self._lock_fd)
                self._lock_fd = None


def spool_topic(directory: Path) -> str:
    """The events topic a spool folder's records were bound for ("" if not recorded)."""
    try:
        return str(json.loads((directory / META_FILE).read_bytes()).get("topic", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def open_spool(root: Path, name: str, max_bytes: int, *, topic: str = "",
               segment_bytes: int = 16 << 20) -> DiskSpool:
    """A spool under ``root``: ``root/name``, or ``name-2``, ``name-3``... if a live
    emitter holds it; then every orphaned folder under ``root`` for the same topic is
    adopted, so what exited emitters left is sent again."""
    private_dir(root)
    for attempt in range(1, 1000):
        folder = root / (name if attempt == 1 else f"{name}-{attempt}")
        try:
            spool = DiskSpool(folder, max_bytes, segment_bytes=segment_bytes, topic=topic)
        except SpoolLocked:
            continue
        for orphan in sorted(root.iterdir()):
            if orphan.is_dir() and (_segment_files(orphan) or (orphan / LOCK_FILE).exists()):
                spool.adopt(orphan)
        return spool
    raise SpoolLocked(f"every spool folder under {root} named {name}* is held")
