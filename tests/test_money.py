"""One rounding rule for money (issue 26, item 7): the CLI (loopwatch/core/money.py) and the
web view (dashboards/web/static/money.js, run here by node, the same file the page
loads) give identical strings over a table of values, half-way cases first; and the
CLI's own outputs go through it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from loopwatch.core.money import usd
from loopwatch.demo import _fmt
from loopwatch.processors.replay.cli import step_title
from loopwatch.processors.replay.recording import Step

MONEY_JS = Path(__file__).resolve().parent.parent / "dashboards/web/static/money.js"

#: (value, decimals, the string both must give)
TABLE = [
    (0.02175, 4, "$0.0218"), (0.01635, 4, "$0.0164"), (0.00005, 4, "$0.0001"),
    (0.00015, 4, "$0.0002"), (1.005, 2, "$1.01"), (2.675, 2, "$2.68"),
    (0.125, 2, "$0.13"), (0.5, 0, "$1"), (2.5, 0, "$3"), (0.99995, 4, "$1.0000"),
    (999.995, 2, "$1,000.00"), (123456789.125, 2, "$123,456,789.13"),
    (1234.5, 2, "$1,234.50"), (0.0217, 4, "$0.0217"), (0.021749999, 4, "$0.0217"),
    (1e-7, 4, "$0.0000"), (1.5e-5, 6, "$0.000015"), (3e-9, 8, "$0.00000000"),
    (0, 3, "$0.000"), (-0.02175, 4, "-$0.0218"), (-0.00004, 4, "$0.0000"),
    (1e21, 2, "$1,000,000,000,000,000,000,000.00"), (42, 4, "$42.0000"),
    (0.1 + 0.2, 2, "$0.30"), (16.35 / 1000, 4, "$0.0164"),
]


def _javascript(cases: list[tuple[float, int]]) -> list[str]:
    node = shutil.which("node")
    if node is None:
        pytest.fail("the money test runs the web view's formatter with node "
                    "(apt-get install nodejs)")
    script = ("const {usd} = require(process.argv[1]);"
              "const cases = JSON.parse(process.argv[2]);"
              "console.log(JSON.stringify(cases.map(([v, d]) => usd(v, d))));")
    done = subprocess.run([node, "-e", script, str(MONEY_JS), json.dumps(cases)],
                          capture_output=True, text=True, timeout=60, check=True)
    return list(json.loads(done.stdout))


def test_python_and_the_web_view_format_money_identically():
    cases = [(value, decimals) for value, decimals, _ in TABLE]
    expected = [text for _, _, text in TABLE]
    assert [usd(value, decimals) for value, decimals in cases] == expected
    assert _javascript(cases) == expected


def test_the_cli_outputs_use_the_rule():
    assert _fmt(0.02175) == "$0.0218"  # the demo's per-agent metrics
    step = Step(index=0, step=1, type="llm", cost=0.02175, latency_ms=12)
    assert " · $0.0218 · " in step_title(step)  # replay


def test_not_a_number_is_a_dash_in_both():
    assert [usd(None), usd(float("nan")), usd(float("inf"))] == ["\N{EN DASH}"] * 3
    node = shutil.which("node")
    assert node is not None
    done = subprocess.run([node, "-e", "const {usd} = require(process.argv[1]);"
                           "console.log(JSON.stringify([usd(null), usd(NaN), usd(Infinity), "
                           "usd('0.1')]))", str(MONEY_JS)],
                          capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(done.stdout) == ["\N{EN DASH}"] * 4
