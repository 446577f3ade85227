"""Pipeline candidate ("when a pipeline beats an agent", PIPE; NOAGENT).

An agent earns its cost by choosing the next step. Per agent and task type, each run's
tool sequence is read, and every choice is counted against its context (the position
and the previous tool): where the most common next step is taken at least
``pipeline_determinism`` of the time, the model decides nothing a fixed pipeline would
not. The saving is the agent's spend on those runs against one structured call per run
(its base prompt once, its mean output once): NOAGENT's 10-step agent reads
``10 x 4000 + 800 x (0+...+9) = 76,000`` input tokens where one call reads 4,000.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from loopwatch.detectors.advisors.base import WINDOW_FILTER, Context, Finding, money

START = "(start)"


def agent_input_tokens(steps: int, base: int, per_step: int) -> int:
    """Input tokens of an agent loop whose every step re-sends the conversation so far.

    >>> agent_input_tokens(10, 4000, 800)
    76000
    """
    return steps * base + per_step * steps * (steps - 1) // 2


def determinism(paths: Iterable[Sequence[str]]) -> tuple[float, int, list[str]]:
    """Share of next-step choices that follow the commonest choice in their context,
    the number of choices, and the commonest path.

    >>> share, choices, path = determinism([["a", "b"], ["a", "b"], ["a", "c"]])
    >>> round(share, 4), choices, path
    (0.8333, 6, ['a', 'b'])
    """
    contexts: dict[tuple[int, str], Counter[str]] = {}
    whole: Counter[tuple[str, ...]] = Counter()
    for path in paths:
        whole[tuple(path)] += 1
        previous = START
        for position, tool in enumerate(path):
            contexts.setdefault((position, previous), Counter())[tool] += 1
            previous = tool
    choices = sum(sum(c.values()) for c in contexts.values())
    if not choices:
        return 0.0, 0, []
    followed = sum(c.most_common(1)[0][1] for c in contexts.values())
    return followed / choices, choices, list(whole.most_common(1)[0][0])


PATHS_SQL = f"""
SELECT agent, task_type, run_id,
       arrayMap(x -> x.3, arraySort(groupArray((ts, event_id, tool)))) AS path
FROM tool_calls FINAL
WHERE {WINDOW_FILTER}
GROUP BY agent, task_type, run_id
"""

RUN_COST_SQL = f"""
SELECT agent, task_type, run_id, any(model) AS model, sum(cost_usd) AS cost_usd,
       min(input_tokens) AS base_tokens, avg(output_tokens) AS mean_output_tokens,
       sum(input_tokens) AS run_input_tokens
FROM llm_calls FINAL
WHERE {WINDOW_FILTER}
GROUP BY agent, task_type, run_id
"""

EVIDENCE_SQL = f"""
SELECT path, count() AS runs
FROM (
    SELECT run_id, arrayMap(x -> x.3, arraySort(groupArray((ts, event_id, tool)))) AS path
    FROM tool_calls FINAL
    WHERE {WINDOW_FILTER} AND task_type = {{task_type:String}}
    GROUP BY run_id
)
GROUP BY path
ORDER BY runs DESC
LIMIT 20
"""


class PipelineAdvisor:
    kind = "pipeline_candidate"

    def findings(self, context: Context) -> list[Finding]:
        paths: dict[tuple[str, str], dict[str, list[str]]] = {}
        for row in context.rows(PATHS_SQL):
            key = (str(row["agent"]), str(row["task_type"]))
            paths.setdefault(key, {})[str(row["run_id"])] = [str(t) for t in row["path"]]  # type: ignore[attr-defined]
        costs: dict[tuple[str, str], list[dict[str, object]]] = {}
        for row in context.rows(RUN_COST_SQL):
            costs.setdefault((str(row["agent"]), str(row["task_type"])), []).append(row)
        results = []
        for (agent, task_type), runs in paths.items():
            if len(runs) < context.settings.min_calls:
                continue
            share, choices, common = determinism(runs.values())
            if share < context.settings.pipeline_determinism:
                continue
            finding = self._finding(context, agent, task_type, runs, share, choices, common,
                                    [r for r in costs.get((agent, task_type), [])
                                     if str(r["run_id"]) in runs])
            if finding is not None:
                results.append(finding)
        return results

    def _finding(self, context: Context, agent: str, task_type: str,
                 runs: dict[str, list[str]], share: float, choices: int, common: list[str],
                 costs: list[dict[str, object]]) -> Finding | None:
        observed = pipeline = 0.0
        agent_tokens = pipeline_tokens = 0
        for run in costs:
            model = str(run["model"])
            base = int(run["base_tokens"])  # type: ignore[call-overload]
            output = round(float(run["mean_output_tokens"]))  # type: ignore[arg-type]
            observed += float(run["cost_usd"])  # type: ignore[arg-type]
            pipeline += context.prices.cost(model, base, output, 0, 0).cost_usd
            agent_tokens += int(run["run_input_tokens"])  # type: ignore[call-overload]
            pipeline_tokens += base
        saving = context.per_day(agent, observed - pipeline)
        if not context.worth(agent, saving):
            return None
        evidence: dict[str, object] = {
            "runs": len(runs), "choices": choices, "determinism": round(share, 4),
            "commonest_path": common, "agent_input_tokens": agent_tokens,
            "pipeline_input_tokens": pipeline_tokens, "observed_usd": round(observed, 6),
            "pipeline_usd": round(pipeline, 6),
            "formula": "determinism = choices following the commonest next step in their "
                       "(position, previous tool) context / all choices; pipeline = one "
                       "call per run with its base prompt and mean output",
        }
        recommendation = (
            f"{task_type or 'This task'} runs take the same next step {share:.0%} of the "
            f"time ({' -> '.join(common)}): replace the agent loop by a fixed pipeline with "
            f"one structured call. {money(observed)} in the window as an agent, "
            f"{money(pipeline)} as a pipeline.")
        return Finding(kind="pipeline_candidate", agent=agent, subject=task_type,
                       evidence=evidence, recommendation=recommendation,
                       saving_usd_per_day=round(saving, 4),
                       query=context.query_text(EVIDENCE_SQL, agent=agent, task_type=task_type),
                       recommended=round(share, 4))
