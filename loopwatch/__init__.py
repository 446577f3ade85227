"""loopwatch: streaming observability and anomaly detection for fleets of LLM agents.

The core package holds what ties the parts together: settings, the embedded stack,
the ClickHouse store and the CLI. The parts themselves live beside it: ``ingest``
(the event contract and the emitter SDK) and ``processors`` (faust stream processing).
"""

__version__ = "0.1.0"
