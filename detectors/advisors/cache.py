"""Cache doctor (the prompt-caching post, CACHE).

Per agent and prompt version: how many calls after a run's first read nothing from the
prompt cache, which part of the prefix changed since the previous call (the
per-breakpoint hashes of llm.call: ``system_prompt_hash``, ``tools_hash``, and the
history: system and tools unchanged, nothing read, within the TTL), and how many calls
came after a gap longer than the cache's TTL. Only a broken pattern is a finding (most
later calls read nothing): a cache that works is not re-priced.

The saving is the observed spend against the seed's cached model of the same calls: a
run's stable block (its smallest prompt, the part every call re-sends) is written once
and read by every later call, the rest is paid in full; a call after a gap longer than
the TTL writes it again. With the 1-hour TTL a write costs 2x instead of 1.25x but
survives gaps of up to an hour.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from loopwatch.detectors.advisors.base import WINDOW_FILTER, Context, Finding, money
from loopwatch.processors.pricing import PriceTable

#: the fewest tokens a provider caches (Anthropic's minimum for Sonnet/Opus-class models)
MIN_CACHEABLE_TOKENS = 1024
#: a later call reading nothing this often is a broken cache, not a miss now and then
BROKEN_SHARE = 0.5
HOUR_S = 3600.0


@dataclass(frozen=True)
class CallSums:
    """One model's calls, summed as the cached model needs them (tokens)."""

    input_tokens: int
    output_tokens: int
    stable_first: int  # a run's first call: writes the stable block
    stable_in_ttl: int  # a later call within the TTL of the previous: reads it
    stable_gap_to_1h: int  # after a gap over the TTL but within 1 h
    stable_gap_over_1h: int  # after a gap over 1 h: every TTL re-writes


def modeled_cost(prices: PriceTable, model: str, sums: CallSums, ttl: str) -> float:
    """What these calls cost with the stable block cached at ``ttl`` ("5m" or "1h")."""
    price = prices.models.get(model) or prices.default
    if ttl == "1h":
        writes = sums.stable_first + sums.stable_gap_over_1h
        reads = sums.stable_in_ttl + sums.stable_gap_to_1h
        multiplier = prices.write_1h
    else:
        writes = sums.stable_first + sums.stable_gap_to_1h + sums.stable_gap_over_1h
        reads = sums.stable_in_ttl
        multiplier = prices.write_5m
    stable = writes + reads
    return (price.input * (sums.input_tokens - stable) + price.input * multiplier * writes
            + price.input * prices.read * reads + price.output * sums.output_tokens) / 1e6


def sums_of_run(calls: Iterable[tuple[int, int, float]], ttl_s: float) -> CallSums:
    """:class:`CallSums` of one run's calls, (input tokens, output tokens, seconds since
    the previous call) each, in order: what the SQL computes per run, for tests.

    >>> s = sums_of_run([(6000 + 400 * k, 0, 10.0) for k in range(15)], 300)
    >>> round(modeled_cost(PriceTable.load(), "claude-sonnet-4", s, "5m"), 4)
    0.1737
    """
    calls = list(calls)
    stable = min(tokens for tokens, _, _ in calls)
    first, in_ttl, gap_1h, over_1h = stable, 0, 0, 0
    for _, _, gap in calls[1:]:
        if gap <= ttl_s:
            in_ttl += stable
        elif gap <= HOUR_S:
            gap_1h += stable
        else:
            over_1h += stable
    return CallSums(sum(c[0] for c in calls), sum(c[1] for c in calls), first, in_ttl,
                    gap_1h, over_1h)


CALLS_SQL = f"""
SELECT agent, prompt_version, model,
       count() AS calls, uniqExact(run_id) AS runs, countIf(k > 0) AS later_calls,
       countIf(k > 0 AND cache_read_input_tokens = 0) AS later_reading_nothing,
       countIf(cache_creation_input_tokens > 0) AS writing_calls,
       countIf(k > 0 AND system_prompt_hash != '' AND system_prompt_hash != prev_system)
           AS system_changed,
       countIf(k > 0 AND tools_hash != '' AND tools_hash != prev_tools) AS tools_changed,
       countIf(k > 0 AND cache_read_input_tokens = 0 AND gap_s <= {{ttl_s:Float64}}
               AND system_prompt_hash = prev_system AND tools_hash = prev_tools
               AND history_hash != '') AS history_changed,
       countIf(k > 0 AND system_prompt_hash != '') AS hashed_later_calls,
       countIf(k > 0 AND gap_s > {{ttl_s:Float64}}) AS ttl_gaps,
       countIf(stable < {MIN_CACHEABLE_TOKENS}) AS too_short_calls,
       sum(cost_usd) AS observed_usd, sum(input_tokens) AS input_tokens,
       sum(output_tokens) AS output_tokens,
       sumIf(stable, k = 0) AS stable_first,
       sumIf(stable, k > 0 AND gap_s <= {{ttl_s:Float64}}) AS stable_in_ttl,
       sumIf(stable, k > 0 AND gap_s > {{ttl_s:Float64}} AND gap_s <= {HOUR_S})
           AS stable_gap_to_1h,
       sumIf(stable, k > 0 AND gap_s > {HOUR_S}) AS stable_gap_over_1h
FROM (
    SELECT agent, prompt_version, model, run_id, input_tokens, output_tokens, cost_usd,
           cache_read_input_tokens, cache_creation_input_tokens, system_prompt_hash,
           tools_hash, history_hash,
           row_number() OVER w - 1 AS k,
           lagInFrame(system_prompt_hash) OVER w AS prev_system,
           lagInFrame(tools_hash) OVER w AS prev_tools,
           dateDiff('millisecond', lagInFrame(ts) OVER w, ts) / 1000 AS gap_s,
           min(input_tokens) OVER (PARTITION BY run_id) AS stable
    FROM llm_calls FINAL
    WHERE {WINDOW_FILTER} AND is_error = 0 AND rate_limited = 0
    WINDOW w AS (PARTITION BY run_id ORDER BY ts, event_id
                 ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)
)
GROUP BY agent, prompt_version, model
"""

EVIDENCE_SQL = f"""
SELECT run_id, count() AS calls, countIf(cache_read_input_tokens > 0) AS reading_calls,
       countIf(cache_creation_input_tokens > 0) AS writing_calls,
       uniqExact(system_prompt_hash) AS system_prompts, uniqExact(tools_hash) AS tool_sets,
       round(sum(cost_usd), 6) AS cost_usd
FROM llm_calls FINAL
WHERE {WINDOW_FILTER} AND prompt_version = {{prompt_version:String}}
GROUP BY run_id
ORDER BY cost_usd DESC
LIMIT 20
"""


def _cause(row: dict[str, object]) -> tuple[str, str]:
    """Which part of the prefix breaks the cache, and what to do about it."""
    later = int(row["later_calls"]) or 1  # type: ignore[call-overload]
    system = int(row["system_changed"])  # type: ignore[call-overload]
    tools = int(row["tools_changed"])  # type: ignore[call-overload]
    history = int(row["history_changed"])  # type: ignore[call-overload]
    gaps = int(row["ttl_gaps"])  # type: ignore[call-overload]
    if system >= BROKEN_SHARE * later:
        return ("system", f"The system prompt changes between calls ({system} of {later} "
                "later calls): move volatile content (a timestamp, an id) below the cache "
                "breakpoint.")
    if tools >= BROKEN_SHARE * later:
        return ("tools", f"The tool definitions change between calls ({tools} of {later}): "
                "serialize them stably (sorted keys, fixed order).")
    if history >= BROKEN_SHARE * later:
        return ("history", f"The re-sent history changes between calls ({history} of "
                f"{later}): keep it append-only above the breakpoint.")
    if gaps >= BROKEN_SHARE * later:
        return ("ttl", f"{gaps} of {later} later calls came more than the cache TTL after "
                "the previous one: use the 1-hour TTL.")
    return ("unmarked", "Later calls read nothing from the cache: mark the stable prefix "
            "(system prompt and tools) with a cache breakpoint.")


class CacheAdvisor:
    kind = "cache"

    def findings(self, context: Context) -> list[Finding]:
        ttl_s = context.settings.cache_ttl_s
        results = []
        for row in context.rows(CALLS_SQL, ttl_s=ttl_s):
            finding = self._finding(context, row, ttl_s)
            if finding is not None:
                results.append(finding)
        return results

    def _finding(self, context: Context, row: dict[str, object], ttl_s: float
                 ) -> Finding | None:
        agent, version = str(row["agent"]), str(row["prompt_version"])
        model = str(row["model"])
        later = int(row["later_calls"])  # type: ignore[call-overload]
        missing = int(row["later_reading_nothing"])  # type: ignore[call-overload]
        calls = int(row["calls"])  # type: ignore[call-overload]
        if later == 0 or calls < context.settings.min_calls or missing < BROKEN_SHARE * later:
            return None
        if int(row["too_short_calls"]) > calls / 2:  # type: ignore[call-overload]
            return None  # below the provider's minimum: nothing to cache
        sums = CallSums(*(int(row[name]) for name in (  # type: ignore[call-overload]
            "input_tokens", "output_tokens", "stable_first", "stable_in_ttl",
            "stable_gap_to_1h", "stable_gap_over_1h")))
        observed = float(row["observed_usd"])  # type: ignore[arg-type]
        fixed = {ttl: modeled_cost(context.prices, model, sums, ttl) for ttl in ("5m", "1h")}
        best_ttl = min(fixed, key=lambda ttl: fixed[ttl])
        saving = context.per_day(agent, observed - fixed[best_ttl])
        if not context.worth(agent, saving):
            return None
        part, advice = _cause(row)
        ttl_note = (f" With the 1-hour TTL: {money(fixed['1h'])}." if best_ttl == "1h"
                    and part != "ttl" else "")
        evidence: dict[str, object] = {
            "model": model, "calls": calls, "runs": int(row["runs"]),  # type: ignore[call-overload]
            "later_calls": later, "later_calls_reading_nothing": missing,
            "writing_calls": int(row["writing_calls"]),  # type: ignore[call-overload]
            "prefix_changed": {name: int(row[f"{name}_changed"])  # type: ignore[call-overload]
                               for name in ("system", "tools", "history")},
            "ttl_gaps": int(row["ttl_gaps"]), "ttl_s": ttl_s,  # type: ignore[call-overload]
            "breaking_part": part,
            "observed_usd": round(observed, 6),
            "cached_usd": {ttl: round(value, 6) for ttl, value in fixed.items()},
            "formula": "cached = first call writes the run's stable block (its smallest "
                       "prompt), later calls read it, the rest at the input price; "
                       "saving = observed - cached, per day",
        }
        recommendation = (f"{advice} {version or 'this prompt'} costs {money(observed)} "
                          f"in the window; cached, {money(fixed[best_ttl])}.{ttl_note}")
        return Finding(kind="cache", agent=agent, subject=version or model,
                       evidence=evidence, recommendation=recommendation,
                       saving_usd_per_day=round(saving, 4),
                       query=context.query_text(EVIDENCE_SQL, agent=agent,
                                                prompt_version=version),
                       recommended=round(fixed[best_ttl] / calls, 8))
