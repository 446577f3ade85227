"""loopwatch: streaming observability and anomaly detection for fleets of LLM agents.

An agent needs only ``from loopwatch import Emitter`` (``pip install loopwatch``: the SDK
and the event contract). The stages live in the repository's own folders, installed as
``loopwatch.ingest`` (contract, SDK, receivers), ``loopwatch.processors``,
``loopwatch.store`` (ClickHouse), ``loopwatch.detectors`` and ``loopwatch.dashboards``, on
the floor ``loopwatch.core`` (settings, topics, the embedded broker); the rest of this
package is the shell that runs them (CLI, ``up``, demo, scenarios). ``import loopwatch``
imports nothing else: the SDK is loaded on first use of ``loopwatch.Emitter``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Emitter"]

if TYPE_CHECKING:
    from loopwatch.ingest.sdk import Emitter


def __getattr__(name: str) -> Any:
    """The SDK on first use, so ``import loopwatch`` (and the server's own imports of
    ``loopwatch.*``) do not pay for pydantic and kafka-python."""
    if name == "Emitter":
        from loopwatch.ingest.sdk import Emitter

        return Emitter
    raise AttributeError(f"module 'loopwatch' has no attribute {name!r}")
