"""Incident playbooks as data: one TOML file per playbook, loaded and checked here.

Playbooks live as TOML rather than code so on-call engineers can read and amend them
without touching Python, the rules engine can route an alert to one by name, and the
investigation SQL in each step is tested against the real schema (so a playbook can
never quietly point at a column that does not exist).

A step answers one investigation question. Where the store can answer it, the step
carries ClickHouse ``sql`` parameterised only with :data:`PARAMETERS`; where it needs a
human or an external system it carries ``action`` text; a partial answer carries both.

>>> books = load_playbooks()
>>> books["agent_stuck_in_loop"].severity, books["upstream_tool_outage"].severity
('warning', 'critical')
>>> loop_step = books["agent_stuck_in_loop"].steps[2]
>>> loop_step.parameters
('run_id',)
>>> render_markdown(books["cost_spike"]).splitlines()[0]
'# Cost spike (`cost_spike`)'
"""

from __future__ import annotations

import functools
import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from typing import Any, Final

from loopwatch.core.metrics import MetricsError, expand

__all__ = [
    "PARAMETERS",
    "SEVERITIES",
    "Playbook",
    "PlaybookError",
    "Step",
    "load_playbooks",
    "parse_playbook",
    "render_markdown",
    "routing",
]

SEVERITIES: Final[tuple[str, ...]] = ("critical", "warning", "info")

#: The only query parameters a step may use, with the one type each must be declared
#: as: callers (the CLI, alert routing) fill these from an alert's context, so a step
#: inventing its own parameter would be unrunnable.
PARAMETERS: Final[dict[str, str]] = {
    "agent": "String",
    "tool": "String",
    "run_id": "String",
    "since": "DateTime64(3, 'UTC')",
    "until": "DateTime64(3, 'UTC')",
}

_PARAMETER = re.compile(r"\{(\w+):([^{}]+)\}")
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_READ_ONLY_START = re.compile(r"^\s*(SELECT|WITH)\b", re.IGNORECASE)

_PLAYBOOK_KEYS: Final[dict[str, bool]] = {  # key -> required
    "name": True,
    "title": True,
    "severity": True,
    "severity_note": False,
    "source": True,
    "summary": True,
    "symptoms": True,
    "steps": True,
    "mitigation": True,
    "prevention": True,
}
_STEP_KEYS: Final[dict[str, bool]] = {"title": True, "why": True, "sql": False, "action": False}


class PlaybookError(ValueError):
    """A playbook file is malformed; the message names the file and the field."""


@dataclass(frozen=True)
class Step:
    """One investigation question, answered by ``sql``, by ``action``, or partly by both."""

    title: str
    why: str
    sql: str | None = None
    action: str | None = None

    @property
    def parameters(self) -> tuple[str, ...]:
        """The query parameters the step's SQL uses, sorted, so a caller knows what to ask.

        >>> Step("t", "w", "SELECT 1 WHERE run_id = {run_id:String} AND "
        ...      "({agent:String} = '' OR agent = {agent:String})").parameters
        ('agent', 'run_id')
        >>> Step("t", "w", action="Call the vendor.").parameters
        ()
        """
        if self.sql is None:
            return ()
        return tuple(sorted({name for name, _ in _PARAMETER.findall(self.sql)}))


@dataclass(frozen=True)
class Playbook:
    """What to do when an alert fires: symptoms, investigation steps, fixes."""

    name: str
    title: str
    severity: str
    source: tuple[str, ...]
    summary: str
    symptoms: tuple[str, ...]
    alerts: tuple[str, ...]
    steps: tuple[Step, ...]
    mitigation: tuple[str, ...]
    prevention: tuple[str, ...]
    severity_note: str | None = None

    @property
    def sql_steps(self) -> tuple[Step, ...]:
        return tuple(step for step in self.steps if step.sql is not None)

    @property
    def parameters(self) -> tuple[str, ...]:
        """Every query parameter any step needs (what ``loopwatch playbook`` must fill)."""
        return tuple(sorted({name for step in self.steps for name in step.parameters}))


def _string(value: Any, where: str, origin: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise PlaybookError(f"{origin}: {where} must be a non-empty string")
    return value.strip()


def _strings(value: Any, where: str, origin: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise PlaybookError(f"{origin}: {where} must be a non-empty list of strings")
    return tuple(_string(item, f"{where}[{index}]", origin) for index, item in enumerate(value))


def _check_keys(table: dict[str, Any], allowed: dict[str, bool], where: str,
                origin: str) -> None:
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise PlaybookError(f"{origin}: {where} has unknown field(s) {unknown} "
                            f"(allowed: {sorted(allowed)})")
    missing = sorted(key for key, required in allowed.items() if required and key not in table)
    if missing:
        raise PlaybookError(f"{origin}: {where} is missing required field(s) {missing}")


def _check_sql(sql: str, where: str, origin: str) -> str:
    """Reject SQL a caller could not run safely or could not fill in.

    Only a read-only statement is accepted (investigations must never change the store),
    and only the parameters in :data:`PARAMETERS`, declared with their one type.
    """
    sql = sql.strip().rstrip(";").strip()
    if not _READ_ONLY_START.match(sql):
        raise PlaybookError(f"{origin}: {where}.sql must be a read-only SELECT (or WITH)")
    if ";" in sql:
        raise PlaybookError(f"{origin}: {where}.sql must be a single statement")
    for name, declared in _PARAMETER.findall(sql):
        expected = PARAMETERS.get(name)
        if expected is None:
            raise PlaybookError(f"{origin}: {where}.sql uses unknown parameter {{{name}}} "
                                f"(allowed: {sorted(PARAMETERS)})")
        if declared.strip() != expected:
            raise PlaybookError(f"{origin}: {where}.sql declares {{{name}:{declared}}}, "
                                f"expected {{{name}:{expected}}}")
    return sql


def _expand(sql: str, where: str, origin: str) -> str:
    """The step's metric templates rendered from their one definition (loopwatch/metrics)."""
    try:
        return expand(sql)
    except MetricsError as exc:
        raise PlaybookError(f"{origin}: {where}.sql: {exc}") from exc


def _step(table: Any, index: int, origin: str) -> Step:
    where = f"steps[{index}]"
    if not isinstance(table, dict):
        raise PlaybookError(f"{origin}: {where} must be a table ([[steps]])")
    _check_keys(table, _STEP_KEYS, where, origin)
    sql = table.get("sql")
    action = table.get("action")
    if sql is None and action is None:
        raise PlaybookError(f"{origin}: {where} needs `sql` or `action`")
    return Step(
        title=_string(table["title"], f"{where}.title", origin),
        why=_string(table["why"], f"{where}.why", origin),
        sql=None if sql is None else _check_sql(_expand(_string(sql, f"{where}.sql", origin),
                                                        where, origin), where, origin),
        action=None if action is None else _string(action, f"{where}.action", origin),
    )


def _hint_misplaced_keys(data: dict[str, Any], origin: str) -> None:
    """TOML puts every key written after a ``[[steps]]`` header into that step, so a
    ``mitigation`` list at the end of the file silently moves into the last step."""
    steps = data.get("steps")
    if isinstance(steps, list) and steps and isinstance(steps[-1], dict):
        misplaced = sorted(set(steps[-1]) & (set(_PLAYBOOK_KEYS) - set(_STEP_KEYS)))
        if misplaced:
            raise PlaybookError(f"{origin}: {misplaced} ended up inside the last [[steps]] "
                                "table; write top-level keys before the first [[steps]]")


def parse_playbook(text: str, origin: str, expected_name: str | None = None,
                   alerts: tuple[str, ...] = ()) -> Playbook:
    """Parse and validate one playbook; ``origin`` (the file name) prefixes every error.
    ``alerts`` are the rules that route to it: routing is stated once, by the rules
    (``playbook = ...`` in ``detectors/rules.toml``), and :func:`load_playbooks` derives it.

    >>> parse_playbook('name = "x"', "x.toml")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    loopwatch.detectors.playbooks.PlaybookError: x.toml: playbook is missing required field(s) [...]
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PlaybookError(f"{origin}: not valid TOML: {exc}") from exc
    _hint_misplaced_keys(data, origin)
    if "alerts" in data:
        raise PlaybookError(f"{origin}: a playbook does not list its alerts: each rule names "
                            "its playbook (`playbook = ...` in detectors/rules.toml), and the "
                            "playbook's alerts are derived from the rules")
    _check_keys(data, _PLAYBOOK_KEYS, "playbook", origin)
    name = _string(data["name"], "name", origin)
    if not _NAME.match(name):
        raise PlaybookError(f"{origin}: name {name!r} must be snake_case")
    if expected_name is not None and name != expected_name:
        raise PlaybookError(f"{origin}: name {name!r} must match the file name "
                            f"{expected_name!r}")
    severity = _string(data["severity"], "severity", origin)
    if severity not in SEVERITIES:
        raise PlaybookError(f"{origin}: severity {severity!r} is not one of {list(SEVERITIES)}")
    for alert in alerts:
        if not _NAME.match(alert):
            raise PlaybookError(f"{origin}: alert {alert!r} must be a snake_case rule name")
    raw_steps = data["steps"]
    if not isinstance(raw_steps, list) or not raw_steps:
        raise PlaybookError(f"{origin}: steps must be a non-empty array of [[steps]] tables")
    note = data.get("severity_note")
    return Playbook(
        name=name,
        title=_string(data["title"], "title", origin),
        severity=severity,
        severity_note=None if note is None else _string(note, "severity_note", origin),
        source=_strings(data["source"], "source", origin),
        summary=_string(data["summary"], "summary", origin),
        symptoms=_strings(data["symptoms"], "symptoms", origin),
        alerts=alerts,
        steps=tuple(_step(table, index, origin) for index, table in enumerate(raw_steps)),
        mitigation=_strings(data["mitigation"], "mitigation", origin),
        prevention=_strings(data["prevention"], "prevention", origin),
    )


def load_playbooks(rules: Iterable[Any] | None = None) -> dict[str, Playbook]:
    """Every shipped playbook by name, read through ``importlib.resources`` so it works
    from a wheel as well as from a checkout, with the alerts that ``rules`` (the shipped
    rules by default) route to it."""
    folder = resources.files(__name__)
    found: dict[str, Playbook] = {}
    routes = dict(_shipped_routing() if rules is None else routing(rules))
    for entry in sorted(folder.iterdir(), key=lambda item: item.name):
        if not entry.name.endswith(".toml"):
            continue
        stem = entry.name.removesuffix(".toml")
        found[stem] = parse_playbook(entry.read_text(encoding="utf-8"),
                                     f"detectors/playbooks/{entry.name}", expected_name=stem,
                                     alerts=routes.pop(stem, ()))
    if routes:
        raise PlaybookError(f"rules route to playbooks that do not exist: {routes}")
    return found


@functools.cache
def _shipped_routing() -> dict[str, tuple[str, ...]]:
    """The shipped rules' routing, parsed once: the engine loads the playbooks for every
    alert's evidence, and rules.toml does not change under a running process."""
    from loopwatch.detectors.rules import load_rules

    return routing(load_rules().values())


def routing(rules: Iterable[Any]) -> dict[str, tuple[str, ...]]:
    """Playbook -> the rules that name it (``rule.playbook``), in the rules' order."""
    routes: dict[str, list[str]] = {}
    for rule in rules:
        routes.setdefault(rule.playbook, []).append(rule.name)
    return {name: tuple(names) for name, names in routes.items()}


def _bullets(items: tuple[str, ...]) -> list[str]:
    return [f"- {item}" for item in items]


def render_markdown(playbook: Playbook) -> str:
    """The playbook as Markdown, for ``loopwatch playbook NAME`` and for pasting into an
    incident channel: the SQL is shown verbatim so it can be run as is."""
    lines = [f"# {playbook.title} (`{playbook.name}`)", "", f"**Severity:** {playbook.severity}"]
    if playbook.severity_note:
        lines += ["", f"_{playbook.severity_note}_"]
    lines += ["", f"**Alerts:** {', '.join(f'`{alert}`' for alert in playbook.alerts)}", "",
              playbook.summary, "", "## Symptoms", "", *_bullets(playbook.symptoms), "",
              "## Investigation", ""]
    if playbook.parameters:
        lines += ["Parameters: " + ", ".join(
            f"`{{{name}:{PARAMETERS[name]}}}`" for name in playbook.parameters), ""]
    for number, step in enumerate(playbook.steps, start=1):
        lines += [f"### {number}. {step.title}", "", step.why, ""]
        if step.sql is not None:
            lines += ["```sql", step.sql, "```", ""]
        if step.action is not None:
            lines += [f"**Action:** {step.action}", ""]
    lines += ["## Mitigation", "", *_bullets(playbook.mitigation), "",
              "## Prevention", "", *_bullets(playbook.prevention), "",
              "Source: " + "; ".join(playbook.source)]
    return "\n".join(lines) + "\n"
