"""The event contract as JSON Schema, for emitters written in other languages.

The checked-in copy (``ingest/schema/events.schema.json``) is generated from the models
by ``loopwatch schema``; a test keeps the two identical.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import orjson

from loopwatch.ingest.events import EVENT_ADAPTER, SCHEMA_VERSION
from loopwatch.ingest.wire import ENVELOPE_VERSION


def contract_schema() -> dict[str, Any]:
    event = EVENT_ADAPTER.json_schema(mode="validation")
    definitions = event.pop("$defs", {})
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://loopwatch.dev/schema/events.schema.json",
        "title": "loopwatch Kafka message",
        "description": (
            f"One event, or an envelope of events for one partition. Event schema "
            f"{SCHEMA_VERSION}; envelope version {ENVELOPE_VERSION}. Unknown fields are "
            "kept; a newer minor schema_version is accepted."
        ),
        "oneOf": [
            {"$ref": "#/$defs/Event"},
            {
                "type": "object",
                "required": ["envelope_version", "events"],
                "properties": {
                    "envelope_version": {"const": ENVELOPE_VERSION},
                    "events": {"type": "array", "items": {"$ref": "#/$defs/Event"}},
                },
            },
        ],
        "$defs": {**definitions, "Event": event},
    }


def render() -> bytes:
    options = orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS
    return orjson.dumps(contract_schema(), option=options) + b"\n"


def checked_in() -> bytes:
    return resources.files("loopwatch.ingest").joinpath("schema/events.schema.json").read_bytes()
