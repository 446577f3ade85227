"""Where two recordings part ways, step by step (the guide's diff replay, §2.2).

Steps are aligned by position. Each aligned pair is checked in the guide's order, tool
name, tool input, tool output, then the model's response and finally the prompt, and
reports only the first thing that differs: later fields of a diverged step follow from
the earlier one. Steps one recording has and the other lacks are ``missing_step``
(only in A) and ``extra_step`` (only in B). The first divergence is usually the cause;
the rest are consequences, listed so that a reader can see how far they spread.

>>> a = [Step(index=0, step=0, type="tool", tool="search", args={"q": "x"}, output=[1])]
>>> b = [Step(index=0, step=0, type="tool", tool="search", args={"q": "y"}, output=[1])]
>>> [(d.index, d.kind, d.a, d.b) for d in diff_steps(a, b)]
[(0, 'tool_input', {'q': 'x'}, {'q': 'y'})]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from loopwatch.processors.replay.recording import Recording, Step

DivergenceKind = Literal["tool_name", "tool_input", "tool_output", "response", "prompt",
                         "missing_step", "extra_step"]
#: (kind, the Step attribute it compares), in the order they are checked.
CHECKS: Final[tuple[tuple[DivergenceKind, str], ...]] = (
    ("tool_name", "tool"), ("tool_input", "args"), ("tool_output", "output"),
    ("response", "response"), ("prompt", "prompt"))


@dataclass(frozen=True)
class Divergence:
    """One place where B is not A: ``a`` is what A recorded, ``b`` what B did."""

    index: int
    kind: DivergenceKind
    a: Any
    b: Any
    step_a: int | None = None
    step_b: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "kind": self.kind, "step_a": self.step_a,
                "step_b": self.step_b, "a": self.a, "b": self.b}

    def describe(self) -> str:
        """One line for people: which step, what kind, expected vs actual."""
        where = f"step #{self.index}"
        if self.kind == "missing_step":
            return f"{where}: only in A ({_summary_of(self.a)}); B stopped before it"
        if self.kind == "extra_step":
            return f"{where}: only in B ({_summary_of(self.b)}); A had stopped"
        label = self.kind.replace("_", " ")
        return f"{where}: {label} differs: A {_short(self.a)} vs B {_short(self.b)}"


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _summary_of(value: Any) -> str:
    if isinstance(value, dict):
        return f"{value.get('type')} {value.get('tool') or ''}".strip()
    return _short(value)


def _step_summary(step: Step) -> dict[str, Any]:
    return {"type": step.type, "tool": step.tool, "step": step.step}


def compare_step(index: int, a: Step, b: Step, bodies: bool = True) -> Divergence | None:
    """The first field, in :data:`CHECKS` order, where ``b`` differs from ``a``.

    An LLM step against a tool step differs in tool name (``None`` vs the tool), as in
    the guide, where a step without a tool has ``tool_name`` None. ``bodies=False``
    compares tool names only (a recording without captured bodies has ``None`` there,
    which is not a difference in what the agent did).
    """
    for kind, attribute in CHECKS if bodies else CHECKS[:1]:
        left, right = getattr(a, attribute), getattr(b, attribute)
        if left != right:
            return Divergence(index, kind, left, right, a.step, b.step)
    return None


def diff_steps(a: Sequence[Step], b: Sequence[Step], bodies: bool = True) -> list[Divergence]:
    """Every divergence of ``b`` from ``a``, at most one per aligned step."""
    found = [d for index, (left, right) in enumerate(zip(a, b, strict=False))
             if (d := compare_step(index, left, right, bodies)) is not None]
    for index in range(len(b), len(a)):
        found.append(Divergence(index, "missing_step", _step_summary(a[index]), None,
                                a[index].step, None))
    for index in range(len(a), len(b)):
        found.append(Divergence(index, "extra_step", None, _step_summary(b[index]),
                                None, b[index].step))
    return found


def diff_recordings(a: Recording, b: Recording) -> list[Divergence]:
    """Every divergence of run B from run A; the first is where they part ways.

    Bodies are compared only when both runs have them (see :func:`compare_step`).
    """
    return diff_steps(a.steps, b.steps, bodies=a.has_bodies and b.has_bodies)


def diff_json(a: Recording, b: Recording) -> dict[str, Any]:
    """What ``loopwatch diff --json`` prints."""
    found = diff_recordings(a, b)
    return {"run_a": a.run_id, "run_b": b.run_id, "steps_a": len(a.steps),
            "steps_b": len(b.steps),
            "compared": "bodies" if a.has_bodies and b.has_bodies else "tool names only",
            "first": found[0].to_json() if found else None,
            "divergences": [d.to_json() for d in found]}
