"""Advisors: from "what went wrong" to "change this setting, save this much".

Each advisor (one module each) reads stored events over a window of event time and
yields :class:`~loopwatch.detectors.advisors.base.Finding` s; :func:`~loopwatch.detectors.
advisors.run.advise` runs them all and sorts the findings by saving. docs/advisors.md has
the formulas, thresholds and test vectors.

Nothing is imported here: the CLI registers ``loopwatch advise`` from ``advisors.cli`` at
every start, and importing every advisor (and the store client under them) for that
cost each command ~0.25 s (tests/test_cli_help.py checks the package stays unloaded).
"""
