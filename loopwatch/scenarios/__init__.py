"""Incident scenarios and the detection scorecard (game days for the alerting).

``library.toml`` holds the scenarios as data; ``traffic.py`` generates a fleet's events
in simulated time; ``scorecard.py`` loads clean history, runs a clean baseline and every
scenario through the pipeline core and the detectors on event time, and scores them;
``live.py`` plays one scenario through the whole running stack.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields, replace
from importlib import resources
from typing import Any

from loopwatch.scenarios.traffic import Agent, Behaviour

TARGET_AGENT = "support-bot"
FLEET: tuple[Agent, ...] = (
    Agent(TARGET_AGENT, runs_per_minute=3.0),
    Agent("research-agent", model="claude-opus-4-1", runs_per_minute=1.5,
          tools=("search", "fetch")),
)


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    playbook: str
    expected: tuple[str, ...]
    behaviour: Behaviour
    agent: str = TARGET_AGENT
    #: the advisor finding (detectors/advisors kind) the scenario must show, if any
    advisor: str = ""


def _behaviour(overrides: dict[str, Any]) -> Behaviour:
    known = {f.name for f in fields(Behaviour)}
    unknown = set(overrides) - known
    if unknown:
        raise ValueError(f"unknown behaviour fields {sorted(unknown)}; known: {sorted(known)}")
    values: dict[str, Any] = {key: tuple(value) if isinstance(value, list) else value
                              for key, value in overrides.items()}
    return replace(Behaviour(), **values)


def load_scenarios() -> dict[str, Scenario]:
    """The scenario library, in file order.

    >>> scenarios = load_scenarios()
    >>> len(scenarios), scenarios["rate_limit_storm"].expected
    (16, ('rate_limit_storm',))
    """
    text = resources.files("loopwatch.scenarios").joinpath("library.toml").read_text()
    found: dict[str, Scenario] = {}
    for raw in tomllib.loads(text)["scenarios"]:
        found[raw["name"]] = Scenario(
            name=raw["name"], description=raw["description"], playbook=raw["playbook"],
            expected=tuple(raw["expected"]), behaviour=_behaviour(dict(raw["behaviour"])),
            agent=raw.get("agent", TARGET_AGENT), advisor=raw.get("advisor", ""))
    return found
