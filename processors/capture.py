"""The engine-free capture stage: capture messages in, staging rows and dead letters out.

A capture message (docs/capture.md, :class:`loopwatch.ingest.capture.CaptureMessage`) becomes one
``capture_staging`` row per part and one ``capture_staging_blobs`` row per distinct
blob. Nothing is decided here: which runs keep their bodies is decided once the run is
closed (:mod:`loopwatch.processors.jobs.capture_decide`), so this stage stays a pure, idempotent
transformation (rows are keyed by ``(run_id, event_id, part)`` and by ``hash``, so a
redelivered message rewrites the same rows).

A message is checked before anything of it is stored: it must parse, match the
model, reference only blobs it carries, and every blob must hash to its key (a body
that does not match its hash would poison every run sharing it). What fails goes to
the dead letters with the reason, like an event that cannot be read.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
from pydantic import ValidationError

from loopwatch.ingest.capture import CAPTURE_VERSION, CaptureMessage, blob_hash
from loopwatch.ingest.wire import parse_exact
from loopwatch.processors.deadletter import bounded
from loopwatch.processors.pipeline import RawMessage, Work
from loopwatch.store import letters, tables

#: Blobs are written before the parts that reference them (a reader that sees a part
#: finds its blobs), so this table comes first in every batch.
BLOBS_TABLE = tables.CAPTURE_STAGING_BLOBS
PARTS_TABLE = tables.CAPTURE_STAGING


class InvalidCapture(ValueError):
    """The message cannot be staged; the text is the dead letter's reason."""


@dataclass
class CaptureCounters:
    messages: int = 0
    parts: int = 0
    blobs: int = 0
    dead_letters: int = 0


def parse_capture(value: bytes | None) -> CaptureMessage:
    """A checked capture message, or :class:`InvalidCapture` saying what is wrong."""
    if value is None:
        raise InvalidCapture("empty capture message (no value)")
    try:
        body = parse_exact(value)  # a count past 64 bits is refused by its bound, exactly
    except (orjson.JSONDecodeError, RecursionError) as exc:
        raise InvalidCapture(f"malformed JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidCapture("capture message is not a JSON object")
    version = body.get("capture_version")
    if version != CAPTURE_VERSION:
        raise InvalidCapture(f"unsupported capture_version {version!r} "
                             f"(this build reads {CAPTURE_VERSION})")
    try:
        message = CaptureMessage.model_validate(body)
    except ValidationError as exc:
        details = "; ".join(
            f"{'.'.join(str(p) for p in error['loc']) or 'message'}: {error['msg']}"
            for error in exc.errors()[:5])
        raise InvalidCapture(f"capture schema violation: {details}") from None
    try:
        uuid.UUID(message.event_id)
    except ValueError:
        raise InvalidCapture(f"event_id is not a UUID: {message.event_id!r}") from None
    try:
        datetime.fromisoformat(message.ts)
    except ValueError:
        raise InvalidCapture(f"ts is not an ISO-8601 time: {message.ts!r}") from None
    if not message.parts:
        raise InvalidCapture("capture message has no parts")
    for name, part in message.parts.items():
        if not part.hashes:
            raise InvalidCapture(f"part {name} has no blobs")
        if part.encoding != "messages" and len(part.hashes) != 1:
            raise InvalidCapture(f"part {name} ({part.encoding}) has {len(part.hashes)} "
                                 "blobs, expected 1")
        missing = [digest for digest in part.hashes
                   if digest not in message.blobs and digest not in message.sent_before]
        if missing:
            raise InvalidCapture(f"part {name} references missing blob {missing[0][:16]}…")
    for digest, blob in message.blobs.items():
        if blob_hash(blob.encoding, blob.body) != digest:
            raise InvalidCapture(f"blob {digest[:16]}… does not match its content hash")
    return message


def staging_rows(message: CaptureMessage, now: datetime) -> dict[str, list[dict[str, Any]]]:
    """The rows of one checked message, per table (blobs first)."""
    ts = datetime.fromisoformat(message.ts)
    event_id = uuid.UUID(message.event_id)
    blobs = [{"hash": digest, "encoding": blob.encoding, "body": blob.body,
              "bytes": len(blob.body.encode()), "staged_at": now}
             for digest, blob in message.blobs.items()]
    parts = [{"event_id": event_id, "run_id": message.run_id, "agent": message.agent,
              "ts": ts, "event_type": message.event_type, "step": message.step,
              "tool": message.tool or "", "part": name, "encoding": part.encoding,
              "hashes": list(part.hashes), "bytes": part.bytes,
              "truncated": int(part.truncated), "redactions": part.redactions,
              "staged_at": now}
             for name, part in message.parts.items()]
    return {BLOBS_TABLE: blobs, PARTS_TABLE: parts}


class CaptureStage:
    """Turns batches of raw capture messages into :class:`Work` (rows + dead letters)."""

    def __init__(self, letter_limit: int) -> None:
        """``letter_limit``: the bytes of a refused message its dead letter keeps
        (:func:`loopwatch.processors.deadletter.payload_limit`)."""
        self.counters = CaptureCounters()
        self._letter_limit = letter_limit

    def process(self, messages: list[RawMessage], now: datetime) -> Work:
        work = Work()
        work.rows.tables[BLOBS_TABLE] = []  # blobs before the parts that reference them
        seen_blobs: set[str] = set()
        for message in messages:
            self.counters.messages += 1
            try:
                capture = parse_capture(message.value)
            except InvalidCapture as exc:
                self._dead_letter(work, message, str(exc), now)
                continue
            tables = staging_rows(capture, now)
            for row in tables[BLOBS_TABLE]:
                if row["hash"] not in seen_blobs:
                    seen_blobs.add(row["hash"])
                    work.rows.add(BLOBS_TABLE, row)
                    self.counters.blobs += 1
            for row in tables[PARTS_TABLE]:
                work.rows.add(PARTS_TABLE, row)
                self.counters.parts += 1
        return work

    def _dead_letter(self, work: Work, message: RawMessage, reason: str,
                     now: datetime) -> None:
        """As :meth:`loopwatch.processors.pipeline.Pipeline._dead_letter`: the id is derived from
        the message's position, so a redelivery rewrites the same row."""
        source = f"{message.topic}:{message.partition}:{message.offset}:0"
        letter_id = letters.letter_id(source)
        payload = message.value or b""
        run_id = ""
        try:
            body = orjson.loads(payload)
            if isinstance(body, dict):
                run_id = str(body.get("run_id") or "")[:256]
        except orjson.JSONDecodeError:
            pass
        record = bounded(letter_id, source, f"capture: {reason}", run_id, payload,
                         self._letter_limit)
        self.counters.dead_letters += 1
        work.dead.append(record)
        work.rows.add(tables.DEAD_LETTERS, letters.dead_letter_row(
            letter_id, source, record.reason, record.run_id, record.payload, now))
