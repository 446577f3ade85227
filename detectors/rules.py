"""Alert rules as data (``rules.toml``) and their evaluation over query results.

A rule's SQL computes, per label set, a ``value`` (and maybe ``samples``, ``baseline``,
``history_s``, ``k``); :func:`evaluate` turns those rows into findings: firing candidates,
rows below the sample floor, and rows waiting for enough history. Thresholds, windows
and for-durations can be overridden per agent / task_type / tool.

>>> rule = load_rules()["tool_error_rate"]
>>> rows = [{"agent": "a", "tool": "search", "value": 0.8, "samples": 12},
...         {"agent": "a", "tool": "fetch", "value": 0.8, "samples": 2}]
>>> [(f.labels["tool"], f.state) for f in evaluate(rule, rows)]
[('search', 'active'), ('fetch', 'too_few_samples')]
"""

from __future__ import annotations

import operator
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from importlib import resources
from typing import Any, Literal

from loopwatch.core.metrics import MetricsError, expand
from loopwatch.detectors.anomaly.registry import DEFAULT_DETECTOR, DETECTORS

Severity = Literal["critical", "warning", "info"]
FindingState = Literal["active", "inactive", "too_few_samples", "waiting_for_history"]
SEVERITIES: tuple[str, ...] = ("critical", "warning", "info")
#: the query parameter holding the traffic slices left out (the engine's policy), by name
#: and as rule SQL spells it
EXCLUDED_SLICES = "excluded_slices"
EXCLUDED_SLICES_PARAMETER = f"{{{EXCLUDED_SLICES}:Array(String)}}"
OPS: dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le,
}
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)$")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> timedelta:
    """``"90s"``, ``"15m"``, ``"1h"``, ``"7d"``.

    >>> parse_duration("15m").total_seconds(), parse_duration("7d").days
    (900.0, 7)
    """
    match = _DURATION.match(text.strip())
    if not match:
        raise ValueError(f"not a duration: {text!r} (use e.g. 30s, 15m, 1h, 7d)")
    return timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])


@dataclass(frozen=True)
class Override:
    """Different settings where the labels match, e.g. one agent or one tool."""

    match: dict[str, str]
    settings: dict[str, Any]

    def applies(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(key) == value for key, value in self.match.items())


@dataclass(frozen=True)
class Rule:
    name: str
    description: str
    severity: Severity
    playbook: str
    labels: tuple[str, ...]
    sql: str
    summary: str
    op: str = ">"
    threshold: float | None = None
    factor: float | None = None
    kind: Literal["threshold", "proportion", "anomaly"] = "threshold"
    alpha: float = 0.001
    detector: str = DEFAULT_DETECTOR
    """An anomaly rule's detector (a registry name); unless named, the registry's default."""
    score_threshold: float = 0.5
    recent_points: int = 3
    min_samples: int = 1
    window: timedelta = timedelta(0)
    baseline: timedelta = timedelta(0)
    min_history: timedelta = timedelta(0)
    for_: timedelta = timedelta(0)
    clock: Literal["event", "wall"] = "event"
    budget: str | None = None
    severity_from_tool_criticality: bool = False
    #: the pipeline's own health reads all traffic; every other rule leaves test traffic
    #: out (:data:`EXCLUDED_SLICES_PARAMETER` in its SQL)
    all_traffic: bool = False
    overrides: tuple[Override, ...] = ()

    def for_labels(self, labels: Mapping[str, str]) -> Rule:
        """This rule with the overrides whose match fits ``labels`` applied, in order."""
        rule = self
        for override in self.overrides:
            if override.applies(labels):
                rule = replace(rule, **_fields(override.settings))
        return rule


@dataclass(frozen=True)
class Finding:
    """One label set of one rule at one evaluation."""

    rule: Rule
    labels: dict[str, str]
    value: float
    state: FindingState
    samples: float = 0.0
    baseline: float | None = None
    detail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.state == "active"

    def summary(self) -> str:
        whole = float(self.samples).is_integer()
        samples: float | int = int(self.samples) if whole else self.samples
        context: dict[str, Any] = {**self.labels, **self.extra, "value": self.value,
                                   "samples": samples,
                                   "baseline": self.baseline or 0.0,
                                   "ratio": self.value / self.baseline if self.baseline else 0.0,
                                   "window": _human(self.rule.window)}
        try:
            return self.rule.summary.format(**context)
        except (KeyError, ValueError, IndexError):
            return f"{self.rule.name}: value {self.value:g}"


def _human(delta: timedelta) -> str:
    seconds = int(delta.total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


_DURATION_FIELDS = {"window": "window", "baseline": "baseline", "min_history": "min_history",
                    "for": "for_"}


def _fields(raw: Mapping[str, Any]) -> dict[str, Any]:
    converted: dict[str, Any] = {}
    for key, value in raw.items():
        if key in _DURATION_FIELDS:
            converted[_DURATION_FIELDS[key]] = parse_duration(str(value))
        else:
            converted[key] = value
    return converted


def _rule(raw: dict[str, Any]) -> Rule:
    raw = dict(raw)
    name = raw.get("name", "?")
    overrides = tuple(
        Override(dict(item.pop("match")), item)
        for item in (dict(o) for o in raw.pop("overrides", []))
    )
    raw["labels"] = tuple(raw.get("labels", ()))
    if "sql" in raw:
        try:
            raw["sql"] = expand(raw["sql"])
        except MetricsError as exc:
            raise ValueError(f"rule {name}: {exc}") from exc
    rule = Rule(overrides=overrides, **_fields(raw))
    if rule.severity not in SEVERITIES:
        raise ValueError(f"rule {name}: severity must be one of {SEVERITIES}")
    if rule.op not in OPS:
        raise ValueError(f"rule {name}: op must be one of {sorted(OPS)}")
    if rule.kind == "anomaly":
        if rule.detector not in DETECTORS:
            raise ValueError(f"rule {name}: unknown detector {rule.detector!r}")
    elif rule.kind == "threshold" and (rule.threshold is None) == (rule.factor is None):
        raise ValueError(f"rule {name}: give exactly one of threshold or factor")
    if not rule.all_traffic and EXCLUDED_SLICES_PARAMETER not in rule.sql:
        raise ValueError(f"rule {name}: leave test traffic out with 'traffic_slice NOT IN "
                         f"{EXCLUDED_SLICES_PARAMETER}', or set all_traffic = true")
    return rule


def load_rules(text: str | None = None) -> dict[str, Rule]:
    """The shipped rules, or the rules in ``text`` (TOML)."""
    if text is None:
        text = resources.files("loopwatch.detectors").joinpath("rules.toml").read_text()
    rules = [_rule(raw) for raw in tomllib.loads(text)["rules"]]
    return {rule.name: rule for rule in rules}


def with_overrides(rules: Mapping[str, Rule], extra: Iterable[dict[str, Any]]) -> dict[str, Rule]:
    """Add overrides from configuration: ``{"rule": name, "match": {...}, ...settings}``."""
    result = dict(rules)
    for item in extra:
        item = dict(item)
        name = item.pop("rule")
        if name not in result:
            raise ValueError(f"override for unknown rule {name!r}")
        override = Override(dict(item.pop("match", {})), item)
        result[name] = replace(result[name], overrides=(*result[name].overrides, override))
    return result


@dataclass
class SeriesState:
    """An anomaly rule's detector for one label set, kept between evaluations so each
    point is scored and learned exactly once (online), not replayed every pass."""

    detector: Any
    last_t: Any = None
    points: int = 0
    scores: list[float] = field(default_factory=list)


def evaluate(rule: Rule, rows: Iterable[Mapping[str, Any]],
             budgets: Mapping[str, float] | None = None,
             series: dict[tuple[str, ...], SeriesState] | None = None) -> list[Finding]:
    """Apply the rule's condition to its query rows (per-label overrides included).

    ``series`` carries anomaly detectors across evaluations (the engine keeps one per
    rule); without it every evaluation replays the rows from scratch."""
    if rule.kind == "anomaly":
        return _evaluate_series(rule, rows, {} if series is None else series)
    findings = []
    for row in rows:
        labels = {name: str(row.get(name, "")) for name in rule.labels}
        effective = rule.for_labels(labels)
        findings.append(_evaluate_row(effective, labels, row, budgets or {}))
    return findings


def _evaluate_row(rule: Rule, labels: dict[str, str], row: Mapping[str, Any],
                  budgets: Mapping[str, float]) -> Finding:
    value = float(row.get("value") or 0.0)
    samples = float(row.get("samples") or 0.0)
    baseline = None if row.get("baseline") is None else float(row["baseline"])
    history = row.get("history_s")
    if rule.budget is not None:
        budget = budgets.get(labels.get("agent", ""))
        if not budget:
            return Finding(rule, labels, value, "inactive", samples, detail="no budget set")
        value = value / budget
    if samples < rule.min_samples:
        return Finding(rule, labels, value, "too_few_samples", samples, baseline,
                       f"{samples:g} samples < {rule.min_samples}")
    if rule.min_history and (history is None or float(history) < rule.min_history.total_seconds()):
        have = timedelta(seconds=max(0.0, float(history or 0)))
        return Finding(rule, labels, value, "waiting_for_history", samples, baseline,
                       f"baseline needs {_human(rule.min_history)} of history, has {_human(have)}")
    if rule.kind == "proportion":
        k = int(row.get("k") or 0)
        p = min(max(baseline or 0.0, 1e-6), 1 - 1e-6)
        from scipy.stats import binom  # here: ~0.4 s of import most rule loaders never use

        p_value = float(binom.sf(k - 1, int(samples), p))
        state: FindingState = "active" if p_value < rule.alpha and value > p else "inactive"
        return Finding(rule, labels, value, state, samples, baseline,
                       f"binomial p = {p_value:.2g}", {"p_value": p_value})
    limit = rule.threshold if rule.factor is None else rule.factor * (baseline or 0.0)
    assert limit is not None
    if rule.factor is not None and not baseline:
        return Finding(rule, labels, value, "inactive", samples, baseline, "no baseline")
    outcome: FindingState = "active" if OPS[rule.op](value, limit) else "inactive"
    return Finding(rule, labels, value, outcome, samples, baseline, f"{rule.op} {limit:g}",
                   {"limit": limit})


def _evaluate_series(rule: Rule, rows: Iterable[Mapping[str, Any]],
                     states: dict[tuple[str, ...], SeriesState]) -> list[Finding]:
    """An online detector over each label set's series (rows ``t``, ``value`` in time
    order): every new point is scored on what came before it, then learned. The finding
    is active when one of the last ``recent_points`` scored at least ``score_threshold``."""
    grouped: dict[tuple[str, ...], list[Mapping[str, Any]]] = {}
    for row in rows:
        key = tuple(str(row.get(name, "")) for name in rule.labels)
        grouped.setdefault(key, []).append(row)
    findings = []
    for key, points in grouped.items():
        labels = dict(zip(rule.labels, key, strict=True))
        effective = rule.for_labels(labels)
        state = states.get(key)
        if state is None:
            state = states[key] = SeriesState(DETECTORS[effective.detector]())
        for point in points:
            moment = point.get("t")
            if state.last_t is not None and moment is not None and moment <= state.last_t:
                continue
            value = float(point["value"] or 0.0)
            state.scores = [*state.scores, state.detector.score_one(value, moment)][
                -effective.recent_points:]
            state.detector.learn_one(value, moment)
            state.last_t = moment
            state.points += 1
        last = float(points[-1]["value"] or 0.0)
        if state.points < effective.min_samples:
            findings.append(Finding(effective, labels, last, "too_few_samples", state.points,
                                    detail=f"{state.points} points < {effective.min_samples}"))
            continue
        recent = max(state.scores, default=0.0)
        active: FindingState = "active" if recent >= effective.score_threshold else "inactive"
        findings.append(Finding(effective, labels, last, active, state.points,
                                detail=f"{effective.detector} score {recent:.2f}",
                                extra={"score": recent}))
    return findings
