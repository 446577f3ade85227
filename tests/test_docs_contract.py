"""The documentation states the contract as the code has it: every terminal reason
ingest/events.py accepts is in docs/metrics.md's table, with the outcome processors/runs.py
gives it, and the README links the page saying where an OTLP exporter points."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

from loopwatch.ingest.events import OUTCOMES, TerminalReason
from loopwatch.ingest.otlp.server import TRACES_PATH
from loopwatch.ingest.otlp.settings import OtlpSettings
from loopwatch.processors.runs import _REASON_OUTCOME

ROOT = Path(__file__).resolve().parent.parent


def documented_reasons() -> dict[str, str]:
    readme = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    table = readme.split("<!-- terminal reasons:", 1)[1].split("<!-- end terminal reasons -->")[0]
    rows = re.findall(r"^\| `([a-z_]+)` \| ([a-z_]+) \|", table, re.M)
    return dict(rows)


def test_the_docs_document_every_terminal_reason_and_its_outcome():
    documented = documented_reasons()
    assert list(documented) == list(get_args(TerminalReason))
    assert documented == _REASON_OUTCOME
    assert set(documented.values()) <= set(OUTCOMES)


def test_the_otlp_page_is_linked_and_names_the_endpoint_protocol_and_token_header():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "(docs/otlp.md)" in readme
    page = (ROOT / "docs" / "otlp.md").read_text(encoding="utf-8")
    port = OtlpSettings.model_fields["port"].default
    assert f"http://127.0.0.1:{port}{TRACES_PATH}" in page
    assert "http/protobuf" in page and "Authorization: Bearer <token>" in page
    assert "LOOPWATCH_OTLP_TOKEN" in page and "LOOPWATCH_OTLP_PORT" in page
