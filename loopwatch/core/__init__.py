"""The floor every stage stands on: settings, masking, topics, money, the embedded broker,
the HTTP server. It imports nothing of the stages above it (tests/test_layers.py)."""
