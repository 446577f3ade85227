"""The documentation's alert-rule table is the rules' own (``detectors/ruletable.py``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from loopwatch.detectors.rules import load_rules
from loopwatch.detectors.ruletable import BEGIN, END, TableError, main, render, replace

ROOT = Path(__file__).resolve().parent.parent


def _documents() -> list[Path]:
    """Where the table is: the README today, a docs/ page if the README moves it."""
    return [path for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
            if BEGIN in path.read_text(encoding="utf-8")]


def test_the_documented_rule_table_is_generated_from_the_rules():
    documents = _documents()
    assert len(documents) == 1, documents
    text = documents[0].read_text(encoding="utf-8")
    assert replace(text, render(load_rules())) == text, (
        f"{documents[0]} is stale: run `python -m loopwatch.detectors.ruletable --write "
        f"{documents[0].relative_to(ROOT)}`")
    table = text.split(BEGIN)[1].split(END)[0]
    assert [line.split("`")[1] for line in table.splitlines()[3:]] == list(load_rules())


def test_check_fails_on_a_stale_table_and_write_regenerates_it(tmp_path, capsys):
    document = tmp_path / "doc.md"
    stale = render(load_rules()).replace("| warning | `agent_stuck_in_loop` |",
                                         "| critical | `agent_stuck_in_loop` |", 1)
    document.write_text(f"intro\n\n{BEGIN}\n{stale}\n{END}\n\nafter\n", encoding="utf-8")
    assert main(["--check", str(document)]) == 1
    assert "is stale" in capsys.readouterr().err
    assert main(["--write", str(document)]) == 0
    assert main(["--check", str(document)]) == 0
    text = document.read_text(encoding="utf-8")
    assert text.startswith("intro\n\n") and text.endswith(f"{END}\n\nafter\n")
    assert "| `stuck_run` | A run still running" in text


@pytest.mark.parametrize("text", ["no markers at all", f"{BEGIN}\n{BEGIN}\n{END}",
                                  f"{END}\n{BEGIN}", f"{BEGIN} only"])
def test_a_file_without_one_table_is_refused_and_left_alone(tmp_path, capsys, text):
    document = tmp_path / "doc.md"
    document.write_text(text, encoding="utf-8")
    with pytest.raises(TableError):
        replace(text, "table")
    assert main(["--write", str(document)]) == 1
    error = capsys.readouterr().err
    assert error.startswith("error: ") and error.count("\n") == 1
    assert document.read_text(encoding="utf-8") == text


def test_a_missing_or_binary_file_is_one_line_and_usage_errors_exit_2(tmp_path):
    binary = tmp_path / "binary.md"
    binary.write_bytes(b"\xff\xfe\x00")
    for path in (tmp_path / "missing.md", binary):
        done = subprocess.run([sys.executable, "-m", "loopwatch.detectors.ruletable", "--check",
                               str(path)], capture_output=True, text=True, cwd=ROOT)
        assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    done = subprocess.run([sys.executable, "-m", "loopwatch.detectors.ruletable", "--write", "a",
                           "--check", "b"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2


def test_a_pipe_in_a_description_does_not_break_the_table():
    rules = load_rules()
    first = next(iter(rules.values()))
    from dataclasses import replace as with_field

    table = render({first.name: with_field(first, description="a | b.")})
    assert table.splitlines()[2] == (f"| `{first.name}` | a \\| b | {first.severity} | "
                                     f"`{first.playbook}` |")
