"""The Grafana dashboards' schema and their link to the web view (issue 26, item 17):
the current classic schema version without keys Grafana dropped, and ``loopwatch_web``
set where the dashboards are provisioned (``--web-url``, else LOOPWATCH_LINK_BASE_URL),
not fixed at 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from loopwatch.cli import app
from loopwatch.dashboards.panels import TIERS
from loopwatch.dashboards.provisioning import exported_files


def _web_variable(model: dict) -> dict:
    return next(v for v in model["templating"]["list"] if v["name"] == "loopwatch_web")


def test_every_dashboard_follows_the_current_schema():
    for relative, text in exported_files().items():
        if not relative.endswith(".json"):
            continue
        model = json.loads(text)
        assert model["schemaVersion"] == 42, relative
        assert "style" not in model, relative
        assert "time_options" not in model["timepicker"], relative
        assert isinstance(model["refresh"], str), relative
    committed = Path(__file__).resolve().parent.parent / "deploy/grafana/dashboards"
    assert {json.loads(path.read_text())["schemaVersion"] for path in
            committed.glob("*.json")} == {42}


def _export(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple:
    folder = tmp_path / "out"
    result = CliRunner().invoke(app, ["dashboards", "export", str(folder), *args],
                                env={"LOOPWATCH_LINK_BASE_URL": "", **(env or {})})
    models = {path.stem: json.loads(path.read_text())
              for path in sorted((folder / "dashboards").glob("*.json"))}
    return result, models


def test_the_web_view_url_is_a_provisioning_setting(tmp_path):
    result, models = _export(tmp_path / "a", "--web-url", "https://loopwatch.example.com/")
    assert result.exit_code == 0, result.output
    assert set(models) == {tier.id for tier in TIERS}
    for model in models.values():
        variable = _web_variable(model)
        assert (variable["query"], variable["current"]["value"], variable["hide"]) == (
            "https://loopwatch.example.com", "https://loopwatch.example.com", 2)
    result, models = _export(tmp_path / "b",
                             env={"LOOPWATCH_LINK_BASE_URL": "http://lw.internal:9000"})
    assert result.exit_code == 0, result.output
    assert {_web_variable(m)["query"] for m in models.values()} == {"http://lw.internal:9000"}
    result, models = _export(tmp_path / "c")
    assert {_web_variable(m)["query"] for m in models.values()} == {"http://127.0.0.1:8765"}


def test_a_bad_web_view_url_is_refused_and_nothing_is_written(tmp_path):
    for bad in ("javascript:alert(1)", "ftp://host", "http://", 'http://x/"><script>',
                "https://host/?q=1"):
        result, models = _export(tmp_path / "bad", "--web-url", bad)
        assert result.exit_code == 2, (bad, result.output)
        assert models == {} and not (tmp_path / "bad" / "out").exists()
        assert len(result.output.strip().splitlines()) == 1, result.output
        assert "invalid --web-url" in result.output
