"""The embedded stack: what loopwatch starts itself when no cluster is configured."""
