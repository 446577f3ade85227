"""Processors' jobs run on demand rather than on the stream: reprocess stored events,
replay dead letters, decide which runs' captures to keep."""
