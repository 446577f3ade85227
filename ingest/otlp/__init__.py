"""OTLP trace receivers (HTTP and gRPC): GenAI, deprecated GenAI and OpenInference spans
to events.

``decode`` turns protobuf or OTLP/JSON bodies into one internal span form, ``mapping``
turns spans into contract events (pure), ``export`` is the one path both transports take
(decode, map, publish with the broker's acknowledgement, partial success), ``server`` the
HTTP receiver and ``grpc_server`` the gRPC one in front of it.
"""
