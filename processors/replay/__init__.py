"""Replay: a stored run read back as its recorded trajectory (docs/capture.md).

Reproducing a failed agent run by re-running it costs 1/p runs of tokens and engineer
time and may never succeed (the model samples again, the world has moved). A recording
makes it a read:

- :mod:`loopwatch.processors.replay.recording` loads a run's steps with their captured bodies;
- :mod:`loopwatch.processors.replay.diff` finds where two recordings part ways;
- :mod:`loopwatch.processors.replay.redrive` feeds recorded responses back to agent code (replay
  mode) or records a live session to diff against a stored one (record mode);
- :mod:`loopwatch.processors.replay.economics` prices reproduction by re-running against capture.
"""

from loopwatch.processors.replay.diff import Divergence, diff_recordings
from loopwatch.processors.replay.recording import (
    CaptureStatus,
    Recording,
    RunNotFound,
    Step,
    load_recording,
)
from loopwatch.processors.replay.redrive import (
    RecordSession,
    ReplayDivergence,
    ReplayExhausted,
    ReplaySession,
)

__all__ = [
    "CaptureStatus",
    "Divergence",
    "RecordSession",
    "Recording",
    "ReplayDivergence",
    "ReplayExhausted",
    "ReplaySession",
    "RunNotFound",
    "Step",
    "diff_recordings",
    "load_recording",
]
