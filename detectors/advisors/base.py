"""What every advisor shares: the finding it yields, the window it reads, and the rule
that a finding is raised only where it is worth it (docs/advisors.md).

An advisor turns stored events into a decision a team can take ("raise this timeout",
"move the timestamp below the cache breakpoint"), with the arithmetic that justifies it
priced at the observed volume. Its SQL goes through the store's reader, the same
guarded path as ``loopwatch query``, so an advisor can never write.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal, Protocol

from clickhouse_connect.driver.binding import format_query_value
from pydantic import BaseModel, ConfigDict, Field

from loopwatch.core.config import AdvisorSettings
from loopwatch.processors.pricing import PriceTable
from loopwatch.store.clickhouse import clickhouse_time, read_time
from loopwatch.store.reader import Reader

Kind = Literal["timeout", "cache", "retry_amplification", "quadratic_context",
               "judge_agreement", "pipeline_candidate"]
KINDS: tuple[str, ...] = ("timeout", "cache", "retry_amplification", "quadratic_context",
                          "judge_agreement", "pipeline_candidate")
DAY_S = 86400.0


class Finding(BaseModel):
    """One decision: what was seen (``evidence``, and the ``query`` that shows it), what
    to change, and what that is worth per day (None where no dollar figure applies).

    ``recommended`` is the recommended value the info alert watches for moves; it is
    not part of the JSON a user sees (the shape is the issue's, exactly).
    """

    model_config = ConfigDict(frozen=True)

    kind: Kind
    agent: str
    subject: str
    evidence: dict[str, Any]
    recommendation: str
    saving_usd_per_day: float | None
    query: str
    recommended: float | None = Field(None, exclude=True)

    @property
    def identity(self) -> tuple[str, str, str]:
        return (self.kind, self.agent, self.subject)


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Largest saving first, findings without a dollar figure last; ties by identity.

    >>> f = lambda s, x: Finding(kind="cache", agent="a", subject=s, evidence={},
    ...                          recommendation="", saving_usd_per_day=x, query="")
    >>> [x.subject for x in sort_findings([f("n", None), f("s", 1.0), f("b", 9.0)])]
    ['b', 's', 'n']
    """
    return sorted(findings, key=lambda f: (f.saving_usd_per_day is None,
                                           -(f.saving_usd_per_day or 0.0), f.identity))


@dataclass(frozen=True)
class Scope:
    """The event-time window read, and one agent or all ('')."""

    since: datetime
    until: datetime
    agent: str = ""

    @property
    def parameters(self) -> dict[str, Any]:
        return {"since": clickhouse_time(self.since), "until": clickhouse_time(self.until),
                "agent": self.agent}

    def previous(self) -> Scope:
        """The window of the same length just before this one (has the tail moved?)."""
        length = self.until - self.since
        return Scope(self.since - length, self.since, self.agent)


WINDOW_FILTER = ("ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')} "
                 "AND ({agent:String} = '' OR agent = {agent:String})")
_PLACEHOLDER = re.compile(r"\{(\w+):([^{}]+)\}")


def literal_sql(sql: str, parameters: dict[str, Any]) -> str:
    """``sql`` with its ``{name:Type}`` parameters written in as quoted literals, so a
    finding's query runs as it is under ``loopwatch query``.

    >>> literal_sql("SELECT 1 WHERE agent = {agent:String}", {"agent": "o'k"})
    "SELECT 1 WHERE agent = 'o\\\\'k'"
    """
    def value(match: re.Match[str]) -> str:
        name, kind = match.group(1), match.group(2)
        literal = format_query_value(parameters[name])
        return f"toDateTime64({literal}, 3, 'UTC')" if kind.startswith("DateTime") \
            else str(literal)

    return _PLACEHOLDER.sub(value, sql)


@dataclass(frozen=True)
class Volume:
    """An agent's model spend in the window and the span its traffic covers."""

    spend_usd: float
    span_s: float


AGENT_VOLUME_SQL = f"""
SELECT agent, sum(cost_usd) AS spend_usd,
       dateDiff('millisecond', min(ts), max(ts)) / 1000 AS span_s
FROM llm_calls FINAL
WHERE {WINDOW_FILTER}
GROUP BY agent
"""


@dataclass
class Context:
    """What an advisor reads from: the store's reader, the window, the settings, the
    price table; the agents' volumes are read once and shared."""

    reader: Reader
    scope: Scope
    settings: AdvisorSettings
    prices: PriceTable = field(default_factory=PriceTable.load)
    _volumes: dict[str, Volume] | None = None

    def rows(self, sql: str, **extra: Any) -> list[dict[str, Any]]:
        return self.reader.query(sql, {**self.scope.parameters, **extra}).records()

    def query_text(self, sql: str, **extra: Any) -> str:
        return literal_sql(sql.strip(), {**self.scope.parameters, **extra})

    def volume(self, agent: str) -> Volume:
        if self._volumes is None:
            self._volumes = {
                str(row["agent"]): Volume(float(row["spend_usd"] or 0.0),
                                          float(row["span_s"] or 0.0))
                for row in self.rows(AGENT_VOLUME_SQL)}
        return self._volumes.get(agent, Volume(0.0, 0.0))

    def days(self, span_s: float) -> float:
        """The days ``span_s`` of observed traffic stand for, at least ``min_span_h``:
        a few minutes of traffic are not extrapolated to a day as if they were hours."""
        return max(span_s, self.settings.min_span_h * 3600.0) / DAY_S

    def per_day(self, agent: str, dollars_in_window: float) -> float:
        return dollars_in_window / self.days(self.volume(agent).span_s)

    def worth(self, agent: str, saving_usd_per_day: float) -> bool:
        """At least ``min_saving_usd_per_day`` and ``min_saving_share`` of the agent's
        model spend per day: a flat cost curve or a rounding error is no finding."""
        spend_per_day = self.per_day(agent, self.volume(agent).spend_usd)
        return (saving_usd_per_day >= self.settings.min_saving_usd_per_day
                and saving_usd_per_day >= self.settings.min_saving_share * spend_per_day)


class Advisor(Protocol):
    """One advisor: a kind and the findings it computes from the store."""

    kind: str

    def findings(self, context: Context) -> list[Finding]: ...


EVENT_NOW_SQL = "SELECT max(ts) AS latest FROM events WHERE ts <= {limit:DateTime64(3, 'UTC')}"


def window_ending_now(reader: Reader, settings: AdvisorSettings, agent: str,
                      wall_now: datetime, max_clock_skew: timedelta) -> Scope | None:
    """The window of ``window_h`` hours ending at the newest stored event (event time,
    as the detectors go), or None for an empty store."""
    rows = reader.query(EVENT_NOW_SQL, {"limit": clickhouse_time(wall_now + max_clock_skew)})
    latest = read_time(rows.scalar()) if rows.rows else None
    if latest is None or latest.year < 1971:
        return None
    until = latest + timedelta(milliseconds=1)
    return Scope(until - timedelta(hours=settings.window_h), until, agent)


def money(value: float) -> str:
    """Dollars as a finding says them.

    >>> money(198.0), money(0.0184)
    ('$198.00', '$0.0184')
    """
    return f"${value:,.2f}" if abs(value) >= 1 else f"${value:.4f}"
