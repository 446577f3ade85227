"""Offline imports: JSONL in the event contract, and recorded agent transcripts.

Readers (``jsonl``, ``transcripts``) turn a file into runs of events or bad records
with their position; ``delivery`` sends them and waits until each one is stored.
"""
