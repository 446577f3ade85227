"""Stream processing: assemble runs from step events, label outcomes, write ClickHouse.

``pipeline`` is the engine-free core (a batch of Kafka messages in, rows and state out);
``app`` binds it to faust-streaming. Keeping them apart lets the core be tested on
scripted input and keeps faust out of everything that does not need it.
"""
