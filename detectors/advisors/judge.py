"""Judge agreement (the LLM-as-judge posts, JUDGE).

Where runs carry both an LLM judge's label (``label_source = 'judge'``) and a human's
(``'human'``), the judge is measured against the humans: raw agreement, Cohen's kappa
(agreement beyond what the two label rates give by chance), and the always-pass
baseline, a judge that says "correct" to everything, which scores the human pass rate
in agreement and kappa 0. A judge under ``judge_min_kappa`` is flagged: its verdicts
are not evidence, and its ``wrong`` labels are low-confidence. The finding has no dollar
figure (``saving_usd_per_day`` null): it is about trust.
"""

from __future__ import annotations

from dataclasses import dataclass

from loopwatch.detectors.advisors.base import Context, Finding

JUDGE, HUMAN = "judge", "human"


@dataclass(frozen=True)
class Confusion:
    """Judge verdict against human verdict, as counts ("pass" = correct)."""

    both_pass: int
    both_fail: int
    judge_pass_human_fail: int
    judge_fail_human_pass: int

    @property
    def total(self) -> int:
        return (self.both_pass + self.both_fail + self.judge_pass_human_fail
                + self.judge_fail_human_pass)

    @property
    def agreement(self) -> float:
        return (self.both_pass + self.both_fail) / self.total

    @property
    def human_pass_rate(self) -> float:
        return (self.both_pass + self.judge_fail_human_pass) / self.total

    @property
    def judge_pass_rate(self) -> float:
        return (self.both_pass + self.judge_pass_human_fail) / self.total

    @property
    def chance(self) -> float:
        """pe: the agreement two raters with these pass rates reach by chance."""
        h, j = self.human_pass_rate, self.judge_pass_rate
        return h * j + (1 - h) * (1 - j)

    @property
    def kappa(self) -> float:
        """Cohen's kappa; 0 where chance agreement is total (both raters constant).

        >>> Confusion(72, 12, 8, 8).kappa, round(Confusion(72, 12, 8, 8).chance, 12)
        (0.5, 0.68)
        >>> Confusion(80, 0, 20, 0).kappa, Confusion(80, 0, 20, 0).agreement
        (0.0, 0.8)
        """
        pe = self.chance
        return 0.0 if pe >= 1 else round((self.agreement - pe) / (1 - pe), 12)


PAIRS_SQL = """
SELECT agent,
       countIf(judge = 'correct' AND human = 'correct') AS both_pass,
       countIf(judge = 'wrong' AND human = 'wrong') AS both_fail,
       countIf(judge = 'correct' AND human = 'wrong') AS judge_pass_human_fail,
       countIf(judge = 'wrong' AND human = 'correct') AS judge_fail_human_pass
FROM (
    SELECT agent, run_id,
           argMaxIf(verdict, ts, label_source = 'judge') AS judge,
           argMaxIf(verdict, ts, label_source = 'human') AS human
    FROM labels FINAL
    WHERE ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')}
      AND ({agent:String} = '' OR agent = {agent:String})
      AND label_source IN ('judge', 'human')
    GROUP BY agent, run_id
    HAVING countIf(label_source = 'judge') > 0 AND countIf(label_source = 'human') > 0
)
GROUP BY agent
"""


SILENT_SQL = """
SELECT agent, countIf(status = 'closed') AS closed_runs,
       countIf(status = 'closed' AND outcome IN ('budget_exhausted', 'gave_up', 'looped',
                                                   'wrong')) AS silent_failures,
       countIf(status = 'closed' AND outcome = 'wrong' AND label_source = 'judge')
           AS judge_wrong_runs
FROM runs FINAL
WHERE started_ts >= {since:DateTime64(3, 'UTC')} AND started_ts < {until:DateTime64(3, 'UTC')}
  AND ({agent:String} = '' OR agent = {agent:String})
GROUP BY agent
"""


def _flip_rate(row: dict[str, object] | None) -> float | None:
    """Position flips over the judge labels that report it (None: none do)."""
    if not row or not int(row["reported"]):  # type: ignore[call-overload]
        return None
    return round(int(row["flipped"]) / int(row["reported"]), 4)  # type: ignore[call-overload]


def low_confidence(row: dict[str, object] | None) -> dict[str, object]:
    """The silent-failure ratio as stored, and without the runs only this judge calls
    wrong (its labels are low-confidence once it is flagged).

    >>> shown = low_confidence({"closed_runs": 100, "silent_failures": 20,
    ...                         "judge_wrong_runs": 5})
    >>> shown["silent_failure_ratio"], shown["silent_failure_ratio_without_judge_wrong"]
    (0.2, 0.1579)
    """
    closed = int(row["closed_runs"]) if row else 0  # type: ignore[call-overload]
    silent = int(row["silent_failures"]) if row else 0  # type: ignore[call-overload]
    judged = int(row["judge_wrong_runs"]) if row else 0  # type: ignore[call-overload]
    return {"judge_wrong_runs": judged,
            "silent_failure_ratio": round(silent / closed, 4) if closed else None,
            "silent_failure_ratio_without_judge_wrong":
                round((silent - judged) / (closed - judged), 4) if closed > judged else None}


FLIPS_SQL = """
SELECT agent, count() AS reported,
       countIf(JSONExtract(payload, 'position_flipped', 'Nullable(Bool)')) AS flipped
FROM events FINAL
WHERE event_type = 'label' AND JSONExtractString(payload, 'label_source') = 'judge'
  AND JSONExtract(payload, 'position_flipped', 'Nullable(Bool)') IS NOT NULL
  AND ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')}
  AND ({agent:String} = '' OR agent = {agent:String})
GROUP BY agent
"""


class JudgeAdvisor:
    kind = "judge_agreement"

    def findings(self, context: Context) -> list[Finding]:
        results = []
        silent = {str(row["agent"]): row for row in context.rows(SILENT_SQL)}
        flips = {str(row["agent"]): row for row in context.rows(FLIPS_SQL)}
        for row in context.rows(PAIRS_SQL):
            confusion = Confusion(*(int(row[name]) for name in (  # type: ignore[call-overload]
                "both_pass", "both_fail", "judge_pass_human_fail", "judge_fail_human_pass")))
            agent = str(row["agent"])
            if confusion.total < context.settings.judge_min_pairs:
                continue
            kappa = confusion.kappa
            if kappa >= context.settings.judge_min_kappa:
                continue
            baseline = confusion.human_pass_rate
            evidence: dict[str, object] = {
                "pairs": confusion.total, "kappa": round(kappa, 4),
                "agreement": round(confusion.agreement, 4),
                "chance_agreement": round(confusion.chance, 4),
                "always_pass_agreement": round(baseline, 4), "always_pass_kappa": 0.0,
                "confusion": {"judge_pass": {"human_pass": confusion.both_pass,
                                             "human_fail": confusion.judge_pass_human_fail},
                              "judge_fail": {"human_pass": confusion.judge_fail_human_pass,
                                             "human_fail": confusion.both_fail}},
                "min_kappa": context.settings.judge_min_kappa,
                "low_confidence": low_confidence(silent.get(agent)),
                "position_flip_rate": _flip_rate(flips.get(agent)),
                "formula": "kappa = (po - pe) / (1 - pe), pe = h*j + (1-h)*(1-j)",
            }
            recommendation = (
                f"Do not trust this judge: kappa {kappa:.2f} against {confusion.total} human "
                f"labels (agreement {confusion.agreement:.0%}; a judge that passes "
                f"everything agrees {baseline:.0%}, kappa 0). Treat its 'wrong' labels as "
                f"low-confidence and recalibrate it (rubric, position swap, a stronger "
                f"model) until kappa >= {context.settings.judge_min_kappa:g}.")
            results.append(Finding(
                kind="judge_agreement", agent=agent, subject=JUDGE, evidence=evidence,
                recommendation=recommendation, saving_usd_per_day=None,
                query=context.query_text(PAIRS_SQL), recommended=round(kappa, 4)))
        return results
