"""Named investigation queries (``store/investigations.sql``), shown in docs/investigations.md and
run by ``loopwatch investigate NAME``.

>>> sorted(investigations())[:2]
['cache_hit_rate_by_deployment', 'loop_pattern']
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources


@dataclass(frozen=True)
class Investigation:
    name: str
    purpose: str
    sql: str

    @property
    def parameters(self) -> list[str]:
        return sorted(set(re.findall(r"\{(\w+):", self.sql)))


def investigations() -> dict[str, Investigation]:
    text = resources.files("loopwatch.store").joinpath("investigations.sql").read_text()
    found: dict[str, Investigation] = {}
    for block in text.split("-- name: ")[1:]:
        name, purpose_line, *body = block.strip().splitlines()
        sql = "\n".join(body).strip().rstrip(";")
        found[name.strip()] = Investigation(name.strip(), purpose_line.removeprefix("-- "), sql)
    return found
