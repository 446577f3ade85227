"""The capture codec: step payloads as content-addressed parts (docs/capture.md).

One source of truth for how a prompt, response, tool argument or tool output becomes
blobs keyed by their content hash, and how the blobs become the value again. The SDK
and the OTLP receiver encode; the processors store; replay decodes.

>>> message = build_capture_message(
...     event_id="00000000-0000-0000-0000-000000000001", run_id="r1", agent="a",
...     ts="2026-11-30T10:00:00Z", event_type="llm.call", step=0, tool=None,
...     values={"prompt": [{"role": "system", "content": "be brief"},
...                        {"role": "user", "content": "hi"}],
...             "response": "hello"})
>>> message.parts["prompt"].encoding, len(message.parts["prompt"].hashes)
('messages', 2)
>>> assemble_part(message.parts["response"], message.blobs)
'hello'
>>> assemble_part(message.parts["prompt"], message.blobs)[1]
{'role': 'user', 'content': 'hi'}
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Container, Mapping
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

from loopwatch.ingest.events import I64_MAX, U32_MAX

CAPTURE_VERSION = 1
LLM_PARTS: tuple[str, ...] = ("prompt", "response")
TOOL_PARTS: tuple[str, ...] = ("args", "output")
PART_NAMES: tuple[str, ...] = LLM_PARTS + TOOL_PARTS
TRUNCATION_MARK = "…[truncated by loopwatch]"

PartEncoding = Literal["text", "json", "messages"]
BlobEncoding = Literal["text", "json"]
#: A redactor takes a JSON-able value and returns it with secrets replaced, and a count.
Redact = Callable[[Any], tuple[Any, int]]


class Blob(BaseModel):
    model_config = ConfigDict(frozen=True)

    encoding: BlobEncoding
    body: str


class PartRef(BaseModel):
    """One captured value: the ordered hashes of its blobs and how to reassemble them."""

    model_config = ConfigDict(frozen=True)

    encoding: PartEncoding
    hashes: list[str]
    bytes: int = Field(ge=0, le=I64_MAX)
    truncated: bool = False
    redactions: int = Field(0, ge=0, le=U32_MAX)


class CaptureMessage(BaseModel):
    """What travels on the captures topic: one event's parts and the blobs they need."""

    model_config = ConfigDict(frozen=True)

    capture_version: int = CAPTURE_VERSION
    event_id: str = Field(min_length=1, max_length=64)
    run_id: str = Field(min_length=1, max_length=256)
    agent: str = Field(min_length=1, max_length=256)
    ts: str
    event_type: Literal["llm.call", "tool.call"]
    step: int | None = Field(None, ge=0, le=U32_MAX)
    tool: str | None = None
    parts: dict[Literal["prompt", "response", "args", "output"], PartRef]
    blobs: dict[str, Blob]
    #: hashes of blobs this sender already delivered in an earlier message (acked by the
    #: broker), so their bodies are not sent again; the parts may reference them
    sent_before: list[str] = Field(default_factory=list)

    def without(self, delivered: Container[str]) -> CaptureMessage:
        """This message minus the bodies the receiver already has (named in
        ``sent_before`` instead).

        >>> m = build_capture_message(event_id="e", run_id="r", agent="a", ts="t",
        ...     event_type="llm.call", step=0, tool=None, values={"response": "hi"})
        >>> lean = m.without({next(iter(m.blobs))})
        >>> lean.blobs, lean.sent_before == list(m.blobs)
        ({}, True)
        """
        known = [digest for digest in self.blobs if digest in delivered]
        if not known:
            return self
        return self.model_copy(update={
            "blobs": {d: blob for d, blob in self.blobs.items() if d not in delivered},
            "sent_before": [*self.sent_before, *known]})


def blob_hash(encoding: str, body: str) -> str:
    """sha256 over encoding, NUL and body; 64 hex characters.

    >>> blob_hash("text", "hi")[:12]
    '50c3eef8a60a'
    """
    return hashlib.sha256(encoding.encode() + b"\0" + body.encode()).hexdigest()


def part_hash(ref: PartRef) -> str:
    """One hash for a whole part (what an event's ``prompt_hash``/``response_hash`` says):
    the blob's hash for a one-blob part, else :func:`blob_hash` over the encoding and
    the blob hashes joined by newlines, so equal parts hash equal however they arrive.

    >>> ref, _ = encode_part("hi", max_bytes=1024)
    >>> part_hash(ref) == blob_hash("text", "hi")
    True
    """
    if len(ref.hashes) == 1 and ref.encoding != "messages":
        return ref.hashes[0]
    return blob_hash(ref.encoding, "\n".join(ref.hashes))


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(item, dict) for item in value)


def _truncate(body: str, limit: int) -> tuple[str, bool]:
    raw = body.encode()
    if len(raw) <= limit:
        return body, False
    return raw[:limit].decode(errors="ignore") + TRUNCATION_MARK, True


def encode_part(value: Any, max_bytes: int, redact: Redact | None = None
                ) -> tuple[PartRef, dict[str, Blob]]:
    """Redact, then split ``value`` into blobs; bodies over ``max_bytes`` are truncated.

    A truncated ``json`` body is kept as text (it no longer parses).

    >>> ref, blobs = encode_part({"q": "x" * 50}, max_bytes=20)
    >>> ref.truncated, ref.encoding, blobs[ref.hashes[0]].encoding
    (True, 'json', 'text')
    """
    redactions = 0
    if redact is not None:
        value, redactions = redact(value)
    items: list[tuple[BlobEncoding, str]]
    encoding: PartEncoding
    if isinstance(value, str):
        encoding, items = "text", [("text", value)]
    elif _is_messages(value):
        encoding = "messages"
        items = [("json", orjson.dumps(item, option=orjson.OPT_NON_STR_KEYS,
                                       default=str).decode())
                 for item in value]
    else:
        encoding = "json"
        items = [("json", orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS,
                                       default=str).decode())]
    blobs: dict[str, Blob] = {}
    hashes: list[str] = []
    total = 0
    truncated_any = False
    for blob_encoding, body in items:
        body, truncated = _truncate(body, max_bytes)
        if truncated:
            blob_encoding, truncated_any = "text", True
        digest = blob_hash(blob_encoding, body)
        blobs[digest] = Blob(encoding=blob_encoding, body=body)
        hashes.append(digest)
        total += len(body.encode())
    ref = PartRef(encoding=encoding, hashes=hashes, bytes=total, truncated=truncated_any,
                  redactions=redactions)
    return ref, blobs


def build_capture_message(
    *, event_id: str, run_id: str, agent: str, ts: str, event_type: str,
    step: int | None, tool: str | None, values: Mapping[str, Any],
    max_part_bytes: int = 256 * 1024, redact: Redact | None = None,
) -> CaptureMessage:
    """Encode every given part (``None`` values are skipped) into one message."""
    parts: dict[str, PartRef] = {}
    blobs: dict[str, Blob] = {}
    for name, value in values.items():
        if value is None:
            continue
        if name not in PART_NAMES:
            raise ValueError(f"unknown capture part {name!r} (one of {', '.join(PART_NAMES)})")
        parts[name], part_blobs = encode_part(value, max_part_bytes, redact)
        blobs.update(part_blobs)
    return CaptureMessage.model_validate({
        "event_id": event_id, "run_id": run_id, "agent": agent, "ts": ts,
        "event_type": event_type, "step": step, "tool": tool, "parts": parts,
        "blobs": blobs,
    })


def _decode_blob(blob: Blob) -> Any:
    return orjson.loads(blob.body) if blob.encoding == "json" else blob.body


def assemble_part(ref: PartRef, blobs: Mapping[str, Blob]) -> Any:
    """The captured value again (strings byte for byte); a missing blob raises KeyError."""
    if ref.encoding == "messages":
        return [_decode_blob(blobs[digest]) for digest in ref.hashes]
    return _decode_blob(blobs[ref.hashes[0]])
