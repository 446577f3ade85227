"""Capture and replay of step payloads (docs/capture.md): which runs keep their bodies."""
