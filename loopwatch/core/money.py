"""Money as text, one rule for the CLI and the web view (``dashboards/web/static/money.js``
implements the same rule; ``tests/test_money.py`` checks both give identical strings).

The rule: take the number as it reads (its shortest round-trip decimal, ``repr``), round
half away from zero at ``decimals`` places, group thousands with commas, and put the
sign before the dollar: ``-$1,234.5000``. A value that rounds to zero has no sign.

Rounding the binary value instead (``f"{0.02175:.4f}"``, which sees 0.0217499...) is
why the CLI said $0.0217 where the page, whose ``toLocaleString`` rounds the decimal,
said $0.0218 for the same cost.
"""

from __future__ import annotations

import math
from decimal import ROUND_HALF_UP, Decimal

#: shown for a missing or non-finite amount
MISSING = "\N{EN DASH}"


def usd(value: float | int | None, decimals: int = 4) -> str:
    """``value`` dollars at ``decimals`` places.

    >>> usd(0.02175), usd(0.01635), usd(1234.5, 2), usd(-0.00004), usd(None) == MISSING
    ('$0.0218', '$0.0164', '$1,234.50', '$0.0000', True)
    """
    if value is None or isinstance(value, bool) or not math.isfinite(value):
        return MISSING
    amount = Decimal(repr(float(value))).quantize(Decimal(1).scaleb(-decimals),
                                                  rounding=ROUND_HALF_UP)
    sign = "-" if amount < 0 else ""
    return f"{sign}${abs(amount):,.{decimals}f}"
