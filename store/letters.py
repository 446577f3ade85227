"""Rows of the ``dead_letters`` table: how every stage that refuses input records it (the
processors, the capture stage, the sink for a row no column takes).
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Any

#: how much of an exception's message a dead letter's reason keeps
REASON_CHARS = 300


def letter_id(source: str) -> str:
    """A dead letter's id, derived from where it came from, so a redelivery of the same
    input rewrites the same ``dead_letters`` row."""
    return hashlib.sha256(source.encode()).hexdigest()[:32]


def failure_reason(prefix: str, exc: Exception) -> str:
    """A dead letter's reason for an exception: ``<prefix>: <type>: <message>``, cut.

    >>> failure_reason("processing failed", ZeroDivisionError("planted bug"))
    'processing failed: ZeroDivisionError: planted bug'
    """
    return f"{prefix}: {type(exc).__name__}: {str(exc)[:REASON_CHARS]}"


def dead_letter_row(
    letter_id: str, source: str, reason: str, run_id: str, payload: bytes, now: datetime
) -> dict[str, Any]:
    return {
        "id": letter_id,
        "received_at": now,
        "source": source,
        "reason": reason,
        "run_id": run_id,
        "payload": payload.decode("utf-8", errors="replace"),
        "replayed_at": None,
        "version": 1,
    }
