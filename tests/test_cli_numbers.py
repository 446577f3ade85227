"""Numeric options refuse values that cannot work, before anything starts: a usage
error, one line, exit 2 (``demo --duration -5`` ran an empty demo and exited 0).

Run as a user runs them, against a store and a broker that refuse connections (so a
value let through fails at runtime with exit 1, not silently). The numeric options are
read from the CLI itself: a new one fails ``test_every_numeric_option_is_audited``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import typer

from loopwatch.cli import app
from tests.test_cli_contract import assert_contract, loopwatch_in, start_together

#: one worker runs the module, in order: its fixture starts the children of every case
#: ahead (tests/test_cli_contract.py Runs), which only this process's cases take
pytestmark = pytest.mark.xdist_group("cli_numbers")


#: (command, option) -> values it must refuse, and the arguments the command needs
REFUSED: dict[tuple[str, str], tuple[list[str], list[str]]] = {
    ("alerts", "--limit"): (["0", "-3"], []),
    ("bench", "--events"): (["0"], []),
    ("bench", "--workers"): (["0", "3"], []),
    ("bench", "--query-events"): (["-1"], []),
    ("bench", "--otlp-traces"): (["0", "-2"], []),
    ("demo", "--duration"): (["-5", "0"], []),
    ("demo", "--rate"): (["0", "-1"], []),
    ("dlq list", "--limit"): (["-1"], []),
    ("economics", "--days"): (["0"], ["some-agent"]),
    ("ingest file", "--wait-timeout"): (["-1"], ["events.jsonl"]),
    ("ingest serve", "--port"): (["-1"], []),
    ("ingest transcript", "--wait-timeout"): (["0"], ["transcript.jsonl"]),
    ("playbook", "--hours"): (["-1"], ["agent_stuck_in_loop"]),
    ("scenario run", "--speed"): (["0"], ["no_such_scenario"]),
    ("scenario score", "--days"): (["-1"], []),
    ("scenario score", "--baseline-hours"): (["0"], []),
    ("serve", "--port"): (["70000", "-1"], []),
    ("up", "--otlp-port"): (["-1", "65536"], []),
}
#: options where any number is meaningful: a seed, a reward threshold (rewards can be < 0)
ANY_NUMBER = {("demo", "--seed"), ("scenario run", "--seed"), ("scenario score", "--seed"),
              ("ingest transcript", "--reward-threshold")}


def numeric_options() -> Iterator[tuple[str, str]]:
    def walk(command: Any, path: tuple[str, ...]) -> Iterator[tuple[str, str]]:
        for name, sub in sorted((getattr(command, "commands", None) or {}).items()):
            yield from walk(sub, (*path, name))
        for param in getattr(command, "params", []):
            if param.type_descriptor.annotation in (int, float) and param.opts[0] != "--help":
                yield " ".join(path), param.opts[0]

    yield from walk(typer.main.get_command(app), ())


def test_every_numeric_option_is_audited():
    assert sorted(numeric_options()) == sorted(set(REFUSED) | ANY_NUMBER)


CASES = [(command, option, value, needs) for (command, option), (values, needs)
         in REFUSED.items() for value in values]


def arguments(command: str, option: str, value: str, needs: list[str]) -> list[str]:
    return [*command.split(), *needs, f"{option}={value}"]


@pytest.fixture(scope="module", autouse=True)
def _started_together(request: pytest.FixtureRequest,
                      tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Each case's child, started ahead (tests/test_cli_contract.py Runs)."""
    yield from start_together(request, tmp_path_factory,
                              [(arguments(*case), {}) for case in CASES])


@pytest.mark.parametrize(("command", "option", "value", "needs"), CASES,
                         ids=[f"{c} {o} {v}" for c, o, v, _ in CASES])
def test_a_number_that_cannot_work_is_a_usage_error(command, option, value, needs, tmp_path):
    result, folder = loopwatch_in(arguments(command, option, value, needs), tmp_path)
    assert_contract(result, 2)
    assert f"Invalid value for '{option}'" in result.stderr
    assert not (folder / "data").exists()  # refused before anything was created
