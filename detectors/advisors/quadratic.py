"""Quadratic context ("long agent runs are quadratic", QUAD; "the transcript is a log",
TLOG).

A run that re-sends its whole history pays for step k's prefill ``a + s * k`` tokens:
the bill grows with the square of its length. Per run with at least ``quad_min_steps``
model calls this fits prefill tokens against the call's position (least squares); a
run whose history grows at least :data:`GROWTH_FACTOR` times faster than its output
plus a digest would (``s >= 2 * (out + digest)``, tightly: r >= :data:`MIN_R`) re-sends
raw tool results. The projection prices it at its length and at 2x and 4x, and with
each step's tool result cut to a ``quad_digest_tokens`` digest; the saving is the
re-sent history the digests remove, at the input price (:func:`digest_saving`), so a
cached stable prefix is priced as observed.
"""

from __future__ import annotations

import statistics

from loopwatch.detectors.advisors.base import WINDOW_FILTER, Context, Finding, money
from loopwatch.processors.pricing import Price

GROWTH_FACTOR = 2.0
MIN_R = 0.9


def projected_cost(n: int, intercept: float, slope: float, output: float,
                   price: Price) -> float:
    """A run of ``n`` calls whose prefill is ``intercept + slope * k`` (k = 0..n-1).

    QUAD (1,500-token system, 300 out, 600-token results: slope 900):

    >>> p = Price(3.0, 15.0)
    >>> [round(projected_cost(n, 1500, 900, 300, p), 4) for n in (10, 20, 40, 80)]
    [0.2115, 0.693, 2.466, 9.252]

    and with 40-token digests (slope 300 + 40):

    >>> round(projected_cost(80, 1500, 340, 300, p), 2)
    3.94
    """
    prefill = n * intercept + slope * n * (n - 1) / 2
    return (price.input * prefill + price.output * n * output) / 1e6


def digest_saving(n: int, slope: float, digest_slope: float, price: Price) -> float:
    """What a run of ``n`` calls saves when its history grows ``digest_slope`` tokens a
    step instead of ``slope``: the re-sent history, at the input price (the stable
    prefix, cached or not, is the same either way).

    >>> p = Price(3.0, 15.0)
    >>> whole = projected_cost(80, 1500, 900, 300, p) - projected_cost(80, 1500, 340, 300, p)
    >>> round(digest_saving(80, 900, 340, p), 4) == round(whole, 4)
    True
    """
    return max(0.0, price.input * (slope - digest_slope) * n * (n - 1) / 2 / 1e6)


def compacted_cost(n: int, system: float, output: float, digest_tokens: float,
                   price: Price, every: int = 10) -> float:
    """TLOG: every step re-sends one digest per prior chunk of ``every`` raw steps.

    >>> p = Price(3.0, 15.0)
    >>> [round(compacted_cost(n, 1500, 300, 50, p), 3) for n in (100, 500, 2000, 5000)]
    [0.968, 6.338, 47.85, 232.125]
    """
    chunks = sum((k - 1) // every for k in range(1, n + 1))
    return (price.input * (n * system + chunks * digest_tokens)
            + price.output * n * output) / 1e6


RUNS_SQL = f"""
SELECT agent, run_id, any(model) AS model, count() AS n,
       (simpleLinearRegression(k, input_tokens)).1 AS slope,
       (simpleLinearRegression(k, input_tokens)).2 AS intercept,
       corr(k, input_tokens) AS r, avg(output_tokens) AS output, sum(cost_usd) AS cost_usd
FROM (
    SELECT agent, run_id, model, input_tokens, output_tokens, cost_usd,
           row_number() OVER (PARTITION BY run_id ORDER BY ts, event_id) - 1 AS k
    FROM llm_calls FINAL
    WHERE {WINDOW_FILTER} AND is_error = 0 AND rate_limited = 0
)
GROUP BY agent, run_id
HAVING n >= {{min_steps:UInt32}}
"""

EVIDENCE_SQL = f"""
SELECT run_id, step, input_tokens, output_tokens, round(cost_usd, 6) AS cost_usd
FROM llm_calls FINAL
WHERE {WINDOW_FILTER} AND run_id IN (
    SELECT run_id FROM llm_calls FINAL WHERE {WINDOW_FILTER}
    GROUP BY run_id ORDER BY count() DESC LIMIT 3)
ORDER BY run_id, ts
"""


class QuadraticAdvisor:
    kind = "quadratic_context"

    def findings(self, context: Context) -> list[Finding]:
        settings = context.settings
        digest = float(settings.quad_digest_tokens)
        flagged: dict[str, list[dict[str, object]]] = {}
        for row in context.rows(RUNS_SQL, min_steps=settings.quad_min_steps):
            slope, r = row["slope"], row["r"]
            if slope is None or r is None:
                continue
            output = float(row["output"])  # type: ignore[arg-type]
            if float(slope) >= GROWTH_FACTOR * (output + digest) \
                    and float(r) >= MIN_R:  # type: ignore[arg-type]
                flagged.setdefault(str(row["agent"]), []).append(row)
        results = []
        for agent, runs in flagged.items():
            finding = self._finding(context, agent, runs, digest)
            if finding is not None:
                results.append(finding)
        return results

    def _finding(self, context: Context, agent: str, runs: list[dict[str, object]],
                 digest: float) -> Finding | None:
        observed = with_digests = 0.0
        for run in runs:
            price = context.prices.models.get(str(run["model"])) or context.prices.default
            cost = float(run["cost_usd"])  # type: ignore[arg-type]
            observed += cost
            with_digests += cost - digest_saving(
                int(run["n"]), float(run["slope"]),  # type: ignore[call-overload, arg-type]
                float(run["output"]) + digest, price)  # type: ignore[arg-type]
        saving = context.per_day(agent, observed - with_digests)
        if not context.worth(agent, saving):
            return None
        slopes = [float(run["slope"]) for run in runs]  # type: ignore[arg-type]
        lengths = [int(run["n"]) for run in runs]  # type: ignore[call-overload]
        typical = max(runs, key=lambda run: int(run["n"]))  # type: ignore[call-overload]
        price = context.prices.models.get(str(typical["model"])) or context.prices.default
        n = int(typical["n"])  # type: ignore[call-overload]
        a, s = float(typical["intercept"]), float(typical["slope"])  # type: ignore[arg-type]
        out = float(typical["output"])  # type: ignore[arg-type]
        evidence: dict[str, object] = {
            "runs": len(runs), "median_slope_tokens_per_step": round(statistics.median(slopes), 1),
            "median_calls": statistics.median(lengths),
            "longest_run": {"run_id": str(typical["run_id"]), "calls": n,
                            "intercept_tokens": round(a, 1), "slope_tokens_per_step": round(s, 1),
                            "digest_slope_tokens_per_step": round(out + digest, 1),
                            "projected_usd": {str(m * n): round(projected_cost(
                                m * n, a, s, out, price), 6) for m in (1, 2, 4)},
                            "with_digests_usd": {str(m * n): round(projected_cost(
                                m * n, a, out + digest, out, price), 6) for m in (1, 2, 4)}},
            "observed_usd": round(observed, 6), "with_digests_usd": round(with_digests, 6),
            "digest_tokens": digest,
            "formula": "prefill(k) = a + s*k; cost(N) = p_in*(N*a + s*N(N-1)/2) + "
                       "p_out*N*out; digests: s -> out + digest; saving per run = "
                       "p_in*(s - out - digest)*N(N-1)/2",
        }
        recommendation = (
            f"{len(runs)} runs re-send their history (prefill grows "
            f"{statistics.median(slopes):.0f} tokens per step): cut tool results to "
            f"{digest:.0f}-token digests, keep the transcript as a log with retrieval, or "
            f"hand long subtasks to sub-agents. These runs cost {money(observed)}; with "
            f"digests {money(with_digests)}.")
        return Finding(kind="quadratic_context", agent=agent, subject="prefill_growth",
                       evidence=evidence, recommendation=recommendation,
                       saving_usd_per_day=round(saving, 4),
                       query=context.query_text(EVIDENCE_SQL, agent=agent),
                       recommended=round(statistics.median(slopes), 1))
