"""Stream processing: assemble runs from step events, label outcomes, write ClickHouse.

``pipeline`` is the engine-free core (a batch of Kafka messages in, rows and state out);
``app`` binds it to faust-streaming. Keeping them apart lets the core be tested on
scripted input and keeps faust out of everything that does not need it.
"""

from loopwatch.processors.native import prefer_sources_when_stale

#: which build of the fold runs (``loopwatch.processors.native``): compiled, interpreted,
#: or its sources because the compiled one is stale or ``LOOPWATCH_PURE_PYTHON=1``
FOLD_BUILD = prefer_sources_when_stale(__name__)
