"""``loopwatch ingest file``: JSONL whose lines are contract events (or envelopes).

Each line is validated as the processors would (``loopwatch.ingest.wire.decode_one``); a line
that is not valid JSON or not a valid event is a bad record, reported by line number
and skipped. Lines without an ``event_id`` get one derived from the file's digest and
the line, so a re-import is harmless.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from loopwatch.ingest.importers.records import Bad, Good, Record, stable_id
from loopwatch.ingest.wire import ENVELOPE_VERSION, DeadLetter, decode_one


def _items(body: Any) -> list[Any]:
    if isinstance(body, dict) and "events" in body and "event_type" not in body:
        if body.get("envelope_version") != ENVELOPE_VERSION or not isinstance(
                body["events"], list):
            raise ValueError(f"unsupported envelope (envelope_version "
                             f"{body.get('envelope_version')!r})")
        return list(body["events"])
    return [body]


def read_jsonl(path: Path, digest: str) -> Iterator[tuple[int, Record]]:
    """(bytes read so far, record) for every event of every non-blank line."""
    offset = 0
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            offset += len(line)
            if line.strip():
                for record in _records(line, number, digest):
                    yield offset, record


def _records(line: bytes, number: int, digest: str) -> list[Record]:
    """One record per event; an envelope line's events are judged one by one."""
    try:
        items = _items(orjson.loads(line))
    except orjson.JSONDecodeError as exc:
        return [Bad(f"line {number}", f"malformed JSON: {exc}")]
    except ValueError as exc:
        return [Bad(f"line {number}", str(exc))]
    records: list[Record] = []
    for index, item in enumerate(items):
        position = f"line {number}" if len(items) == 1 else f"line {number} event {index + 1}"
        if isinstance(item, dict) and "event_id" not in item:
            item = {**item, "event_id": str(stable_id(digest, number, index))}
        result = decode_one(item)
        if isinstance(result, DeadLetter):
            records.append(Bad(position, result.reason))
        else:
            records.append(Good(position, [result]))
    return records
