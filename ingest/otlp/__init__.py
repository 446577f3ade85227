"""OTLP/HTTP trace receiver: GenAI, deprecated GenAI and OpenInference spans to events.

``decode`` turns protobuf or OTLP/JSON bodies into one internal span form, ``mapping``
turns spans into contract events (pure), ``server`` is the HTTP receiver that publishes
them with the broker's acknowledgement before answering 200.
"""
