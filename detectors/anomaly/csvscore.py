"""Score a ``timestamp,value`` CSV online, row by row (behind ``loopwatch detect-csv``)."""

from __future__ import annotations

import csv
import math
from datetime import datetime
from typing import TextIO

from loopwatch.detectors.anomaly.registry import DEFAULT_DETECTOR, DETECTORS

HEADER = ("timestamp", "value")


def _parse_time(text: str, line: int) -> datetime:
    try:
        return datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"line {line}: cannot parse timestamp {text!r} "
            "(expected e.g. 2014-04-01 00:00:00 or ISO-8601)"
        ) from None


def _parse_value(text: str, line: int) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"line {line}: cannot parse value {text!r} as a number") from None
    if not math.isfinite(value):
        raise ValueError(f"line {line}: value {text!r} is not a finite number")
    return value


def score_csv(source: TextIO, sink: TextIO, detector: str | None = None) -> int:
    """Copy ``source`` to ``sink`` with an ``anomaly_score`` column; return the row count.

    Rows keep their order and their ``timestamp`` and ``value`` text. Each score is
    computed online from the rows before it and the row itself (``score_one`` then
    ``learn_one``), so it is what a live detector would have said at that moment. A
    detector still warming up scores 0. ``detector`` names an entry of
    :data:`~loopwatch.detectors.anomaly.registry.DETECTORS` (default: the generic one).

    >>> import io
    >>> out = io.StringIO()
    >>> score_csv(io.StringIO("timestamp,value\\n2024-01-01 00:00:00,1.5\\n"), out)
    1
    >>> out.getvalue().splitlines()
    ['timestamp,value,anomaly_score', '2024-01-01 00:00:00,1.5,0']
    >>> score_csv(io.StringIO("timestamp,value\\n2024-01-01T00:00:00Z,n/a\\n"), out)
    Traceback (most recent call last):
    ...
    ValueError: line 2: cannot parse value 'n/a' as a number
    """
    name = detector or DEFAULT_DETECTOR
    if name not in DETECTORS:
        raise ValueError(f"unknown detector {name!r}; known: {', '.join(sorted(DETECTORS))}")
    model = DETECTORS[name]()
    reader = csv.reader(source)
    writer = csv.writer(sink, lineterminator="\n")
    header = next(reader, None)
    if header is None or tuple(h.strip().lstrip("\ufeff").lower() for h in header) != HEADER:
        raise ValueError(f"line 1: expected the header 'timestamp,value', got {header!r}")
    writer.writerow((*HEADER, "anomaly_score"))
    rows = 0
    for row in reader:
        line = reader.line_num
        if not row or (len(row) == 1 and not row[0].strip()):
            continue
        if len(row) != 2:
            raise ValueError(f"line {line}: expected 2 fields (timestamp,value), got {len(row)}")
        t = _parse_time(row[0], line)
        x = _parse_value(row[1], line)
        score = model.score_one(x, t)
        model.learn_one(x, t)
        writer.writerow((row[0], row[1], format(score, ".6g")))
        rows += 1
    return rows
