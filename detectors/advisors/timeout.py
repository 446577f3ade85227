"""Timeout recommender ("your timeout is a bet", TMO).

Each tool's true durations, the timed-out calls included at the duration they would
have taken (``late_completion_ms``; a timed-out call whose true duration is unknown
counts as hung), price every timeout T: a call of duration d costs ``IDLE_RATE * d`` if
d <= T, else ``IDLE_RATE * T + CALL_COST * RETRY_MULT``. Between two observed durations
the cost only rises with T, so the minimum sits at an observed duration: one sorted
pass prices them all. The recommendation is that argmin, rounded up to two significant
figures; the saving is its cost against the configured T's, at the observed volume.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass

from loopwatch.detectors.advisors.base import WINDOW_FILTER, Context, Finding, money

#: a timed-out call whose true duration is unknown: it never finished (hung)
HUNG = math.inf


@dataclass(frozen=True)
class Rates:
    idle_usd_per_s: float = 0.002
    call_cost_usd: float = 0.10
    retry_mult: float = 1.2


class CostCurve:
    """Expected cost per call of any timeout over one duration distribution (seconds)."""

    def __init__(self, durations: Iterable[tuple[float, int]], rates: Rates) -> None:
        counts: dict[float, int] = {}
        for duration, n in durations:
            counts[duration] = counts.get(duration, 0) + n
        self.rates = rates
        self.total = sum(counts.values())
        self.finite = sorted(d for d in counts if d != HUNG)
        self.cum_n: list[int] = []
        self.cum_d: list[float] = []
        n_sum, d_sum = 0, 0.0
        for d in self.finite:
            n_sum += counts[d]
            d_sum += d * counts[d]
            self.cum_n.append(n_sum)
            self.cum_d.append(d_sum)

    def cost(self, timeout_s: float) -> float:
        """Mean cost per call with timeout ``timeout_s``.

        >>> round(CostCurve([(1.0, 1), (HUNG, 1)], Rates()).cost(2.0), 4)
        0.063
        """
        k = bisect.bisect_right(self.finite, timeout_s)
        done_n = self.cum_n[k - 1] if k else 0
        done_d = self.cum_d[k - 1] if k else 0.0
        cut = self.total - done_n
        rates = self.rates
        dollars = (rates.idle_usd_per_s * (done_d + timeout_s * cut)
                   + rates.call_cost_usd * rates.retry_mult * cut)
        return dollars / self.total

    def optimum(self) -> float:
        """The timeout (s) of least expected cost: an observed duration (the longest
        call if none is cheaper; the shortest wins a tie)."""
        return min(self.finite, key=self.cost) if self.finite else HUNG


def round_up(seconds: float) -> float:
    """Up to two significant figures: a timeout someone would type.

    >>> round_up(29.99), round_up(1.234), round_up(0.0871)
    (30.0, 1.3, 0.088)
    """
    if seconds <= 0 or math.isinf(seconds):
        return seconds
    step = 10 ** (math.floor(math.log10(seconds)) - 1)
    return float(round(math.ceil(round(seconds / step, 9)) * step, 9))


def bin_ms(d_ms: float) -> float:
    """A duration (ms) to three significant figures, as :data:`DURATIONS_SQL` bins it
    (so a tool's distribution is at most ~2,700 rows per three decades).

    >>> bin_ms(1234.5678), bin_ms(0.4)
    (1230.0, 0.4)
    """
    return round(d_ms, 2 - math.floor(math.log10(max(d_ms, 1.0))))


DURATIONS_SQL = f"""
SELECT agent, tool, d_ms, count() AS calls
FROM (
    SELECT agent, tool,
           if(timed_out = 1 AND late_completion_ms IS NULL, -1,
              round(coalesce(late_completion_ms, latency_ms),
                    2 - toInt32(floor(log10(greatest(coalesce(late_completion_ms,
                                                            latency_ms), 1)))))) AS d_ms
    FROM tool_calls FINAL
    WHERE {WINDOW_FILTER} AND tool IN (
        SELECT tool FROM tool_calls FINAL WHERE {WINDOW_FILTER} AND timeout_ms IS NOT NULL)
)
GROUP BY agent, tool, d_ms
ORDER BY agent, tool, d_ms
"""

TIMEOUTS_SQL = f"""
SELECT agent, tool, argMax(timeout_ms, ts) AS current_timeout_ms, count() AS calls,
       sum(timed_out) AS timeouts, countIf(near_miss = 1) AS near_misses,
       dateDiff('millisecond', min(ts), max(ts)) / 1000 AS span_s
FROM tool_calls FINAL
WHERE {WINDOW_FILTER} AND timeout_ms IS NOT NULL
GROUP BY agent, tool
"""

EVIDENCE_SQL = """
SELECT tool, count() AS calls, sum(timed_out) AS timeouts,
       countIf(near_miss = 1) AS near_misses, max(timeout_ms) AS max_timeout_ms,
       round(quantileExact(0.5)(coalesce(late_completion_ms, latency_ms))) AS p50_true_ms,
       round(quantileExact(0.99)(coalesce(late_completion_ms, latency_ms))) AS p99_true_ms
FROM tool_calls FINAL
WHERE agent = {agent:String} AND tool = {tool:String}
  AND ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')}
GROUP BY tool
"""

#: the cost(T) curve's points, as multiples of the configured timeout (plus the optimum)
CURVE_FACTORS = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0)


def curves(rows: Iterable[dict[str, object]], rates: Rates) -> dict[tuple[str, str], CostCurve]:
    """One cost curve per (agent, tool) from :data:`DURATIONS_SQL` rows (ms; -1 hung)."""
    grouped: dict[tuple[str, str], list[tuple[float, int]]] = {}
    for row in rows:
        d_ms = float(row["d_ms"])  # type: ignore[arg-type]
        grouped.setdefault((str(row["agent"]), str(row["tool"])), []).append(
            (HUNG if d_ms < 0 else d_ms / 1000.0, int(row["calls"])))  # type: ignore[call-overload]
    return {key: CostCurve(values, rates) for key, values in grouped.items()}


class TimeoutAdvisor:
    kind = "timeout"

    def findings(self, context: Context) -> list[Finding]:
        settings = context.settings
        rates = Rates(settings.timeout_idle_usd_per_s, settings.timeout_call_cost_usd,
                      settings.timeout_retry_mult)
        found = curves(context.rows(DURATIONS_SQL), rates)
        previous = _previous_optima(context, rates)
        results = []
        for row in context.rows(TIMEOUTS_SQL):
            agent, tool = str(row["agent"]), str(row["tool"])
            curve = found.get((agent, tool))
            if curve is None or int(row["calls"]) < settings.min_calls:
                continue
            finding = self._finding(context, row, curve, previous.get((agent, tool)))
            if finding is not None:
                results.append(finding)
        return results

    def _finding(self, context: Context, row: dict[str, object], curve: CostCurve,
                 previous_s: float | None) -> Finding | None:
        agent, tool = str(row["agent"]), str(row["tool"])
        current_s = float(row["current_timeout_ms"]) / 1000.0  # type: ignore[arg-type]
        best_s = round_up(curve.optimum())
        if math.isinf(best_s):
            return None
        calls = int(row["calls"])  # type: ignore[call-overload]
        per_call = curve.cost(current_s) - curve.cost(best_s)
        saving = context.per_day(agent, per_call * calls) if per_call > 0 else 0.0
        if not context.worth(agent, saving):
            return None
        points = sorted({*(round(current_s * f, 6) for f in CURVE_FACTORS), best_s})
        evidence: dict[str, object] = {
            "calls": calls, "timeouts": int(row["timeouts"]),  # type: ignore[call-overload]
            "near_misses": int(row["near_misses"]),  # type: ignore[call-overload]
            "timeout_ms": round(current_s * 1000, 3),
            "recommended_timeout_ms": round(best_s * 1000, 3),
            "cost_per_call_usd": {"current": round(curve.cost(current_s), 6),
                                  "recommended": round(curve.cost(best_s), 6)},
            "cost_curve": [[round(t * 1000, 3), round(curve.cost(t), 6)] for t in points],
            "rates": {"idle_usd_per_s": curve.rates.idle_usd_per_s,
                      "call_cost_usd": curve.rates.call_cost_usd,
                      "retry_mult": curve.rates.retry_mult},
            "formula": "cost(d, T) = IDLE_RATE*d if d <= T else IDLE_RATE*T + "
                       "CALL_COST*RETRY_MULT; saving = (cost(T_now) - cost(T_best)) * calls/day",
        }
        moved = ""
        if previous_s is not None:
            evidence["previous_window_recommended_timeout_ms"] = round(previous_s * 1000, 3)
            if abs(previous_s - best_s) > context.settings.alert_move_share * previous_s:
                moved = (f" The optimum moved from {previous_s:g} s in the previous window: "
                         "the latency tail shifted.")
        direction = "Raise" if best_s > current_s else "Lower"
        recommendation = (
            f"{direction} {tool}'s timeout from {current_s:g} s to {best_s:g} s: expected "
            f"cost per call {money(curve.cost(current_s))} -> {money(curve.cost(best_s))} "
            f"over {calls} calls ({evidence['near_misses']} of {evidence['timeouts']} "
            f"timeouts were near misses).{moved}")
        return Finding(kind="timeout", agent=agent, subject=tool, evidence=evidence,
                       recommendation=recommendation, saving_usd_per_day=round(saving, 4),
                       query=context.query_text(EVIDENCE_SQL, agent=agent, tool=tool),
                       recommended=best_s * 1000)


def _previous_optima(context: Context, rates: Rates) -> dict[tuple[str, str], float]:
    """The optimum each tool had over the previous window, where it had enough calls."""
    earlier = Context(context.reader, context.scope.previous(), context.settings,
                      context.prices)
    result = {}
    for key, curve in curves(earlier.rows(DURATIONS_SQL), rates).items():
        if curve.total >= context.settings.min_calls and curve.finite:
            result[key] = round_up(curve.optimum())
    return result
