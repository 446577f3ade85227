"""Redaction: secrets and personal data replaced before anything leaves the process.

Captured prompts, responses and tool payloads (docs/capture.md) are the most sensitive
data loopwatch touches, and once a body is in Kafka or ClickHouse it is copied,
replicated and retained; so redaction runs at the edge, in the emitter and in the OTLP
receiver, before a body is hashed, serialised or sent. A match is replaced by
``[REDACTED:<name>]`` so a reader of a replay sees *that* something was there and what
kind of thing it was, and the count travels with the part.

Built-in patterns (select them by name, as ``LOOPWATCH_REDACT`` does):

- ``email``: ``local@domain.tld``;
- ``api_key``: provider key shapes (``sk-…``, ``sk-ant-…``, ``sk-proj-…``, AWS ``AKIA…``,
  GitHub ``ghp_``/``gho_``/``ghs_``/``ghu_``/``ghr_``, ``github_pat_…``), and the value
  of a generic ``api_key=…`` / ``"api_key": "…"`` assignment (the name is kept);
- ``bearer_token``: the token after ``Bearer``;
- ``card_number``: 13-19 digits, optionally grouped by spaces or dashes, starting with
  2-6 (the card networks' ranges) and passing the Luhn check, so order numbers, epoch
  milliseconds and phone numbers mostly survive.

``extra`` adds name -> regular expression (``LOOPWATCH_REDACT_EXTRA``); a pattern with a
named group ``secret`` replaces only that group.

>>> redact = Redactor()
>>> redact("mail ann@example.com, key sk-ant-api03-AbCdEfGhIjKlMnOpQrSt, order 4111111111111112")
('mail [REDACTED:email], key [REDACTED:api_key], order 4111111111111112', 2)
>>> redact({"headers": {"Authorization": "Bearer eyJhbGciOiJIUzI1NiJ9.e30.x"},
...         "card": "4111 1111 1111 1111", "n": 7})  # doctest: +NORMALIZE_WHITESPACE
({'headers': {'Authorization': 'Bearer [REDACTED:bearer_token]'},
  'card': '[REDACTED:card_number]', 'n': 7}, 2)
>>> redact('{"api_key": "abcd1234efgh5678"} and api_key=zyxw9876vuts')
('{"api_key": "[REDACTED:api_key]"} and api_key=[REDACTED:api_key]', 2)
>>> Redactor(["email"], {"ticket": r"TCK-\\d{6}"})(["TCK-123456 from bo@x.io"])
(['[REDACTED:ticket] from [REDACTED:email]'], 2)
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Mapping
from typing import Any

_KEY_NAMES = r"(?:api[_-]?key|apikey|x-api-key|secret[_-]?key|access[_-]?key|access[_-]?token)"
_KEY_HINTS = ("api_key", "api-key", "apikey", "secret_key", "secret-key", "access_key",
              "access-key", "access_token", "access-token")

#: The built-in patterns by name. Each is split into pieces that start with a literal
#: (which the regex engine finds with a fast scan) or carry hints: substrings of the
#: lower-cased text without which the piece cannot match, so it is not run at all.
#: Redacting a 20 KB prompt is what every captured step pays: the hot path of capture.
BUILTIN_PATTERNS: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "email": [(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}", ("@",))],
    "api_key": [
        (r"sk-(?:ant-|proj-)?[A-Za-z0-9_-]{16,}", ()),
        (r"(?:AKIA|ASIA)[0-9A-Z]{16}", ()),
        (r"gh[pousr]_[A-Za-z0-9]{20,}", ()),
        (r"github_pat_[A-Za-z0-9_]{20,}", ()),
        (r"(?i:" + _KEY_NAMES + r")[\"']?\s*[:=]\s*[\"']?(?P<secret>[A-Za-z0-9_\-./+]{8,})",
         _KEY_HINTS),
    ],
    "bearer_token": [(r"(?i:bearer)\s+(?P<secret>[A-Za-z0-9\-._~+/]{8,}=*)", ("bearer",))],
    "card_number": [(r"[2-6](?:[ -]?[0-9]){12,18}", ())],
}
#: A dict key naming a secret: its string value is replaced whole (e.g. ``{"api_key": …}``).
SECRET_KEY = re.compile(r"(?i)^" + _KEY_NAMES + r"$|^authorization$|^password$")
#: Strings at least this long are remembered once redacted: an agent re-sends its system
#: prompt and the whole conversation so far on every call, so most are repeats. So are
#: short ones (roles, names, tool names); the cache is bounded (oldest entry out first).
CACHE_MIN_CHARS = 512
CACHE_MAX_SHORT = 64
CACHE_ENTRIES = 2048
CACHE_CHARS = 4_000_000
#: No pattern matches fewer characters (``a@b.io``).
SHORTEST_SECRET = 6


def luhn_ok(digits: str) -> bool:
    """The card-number checksum: why ordinary long numbers are not redacted.

    >>> luhn_ok("4111111111111111"), luhn_ok("4111111111111112")
    (True, False)
    """
    total = 0
    for index, char in enumerate(reversed(digits)):
        value = ord(char) - 48
        if index % 2:
            value *= 2
            if value > 9:
                value -= 9
        total += value
    return total % 10 == 0


class Redactor:
    """Replaces every match of the chosen patterns in every string of a JSON-able value.

    Keys of dicts are kept (they are the structure a replay needs), except that the
    value under a key naming a secret (``api_key``, ``authorization``, ``password``…)
    is redacted whole when it is a string. Usable as the ``redact`` callable of
    :mod:`loopwatch.ingest.capture`: ``(value) -> (redacted value, replacements)``; the input is
    never modified.
    """

    def __init__(self, names: Iterable[str] | None = None,
                 extra: Mapping[str, str] | None = None) -> None:
        chosen = list(BUILTIN_PATTERNS if names is None else names)
        unknown = [name for name in chosen if name not in BUILTIN_PATTERNS]
        if unknown:
            raise ValueError(f"unknown redaction pattern(s) {', '.join(unknown)} "
                             f"(built in: {', '.join(BUILTIN_PATTERNS)})")
        self.patterns: list[tuple[str, re.Pattern[str], tuple[str, ...]]] = [
            (name, re.compile(pattern), hints)
            for name in chosen for pattern, hints in BUILTIN_PATTERNS[name]]
        for name, pattern in (extra or {}).items():
            self.patterns.append((name, re.compile(pattern), ()))
        self._lower_needed = any(hints for _, _, hints in self.patterns)
        self._cache: dict[str, tuple[str, int]] = {}
        self._cached_chars = 0
        self._lock = threading.Lock()  # the SDK redacts from the agent's threads
        self._key_redaction = "api_key" in chosen

    @classmethod
    def from_settings(cls, settings: Any) -> Redactor:
        """From anything with ``redact`` (names) and ``redact_extra`` (name -> regex)."""
        return cls(getattr(settings, "redact", None), getattr(settings, "redact_extra", None))

    @staticmethod
    def _replacement(name: str, match: re.Match[str]) -> str | None:
        """What replaces ``match``; None to leave it (a card-like number failing Luhn)."""
        text, at, end = match.string, match.start(), match.end()
        if name in BUILTIN_PATTERNS and (
                (at > 0 and (text[at - 1].isalnum() or text[at - 1] in "-_"))
                or (end < len(text) and text[end].isdigit() and name == "card_number")):
            return None  # inside a longer word or number: the built-ins want boundaries
        if name == "card_number" and not luhn_ok(re.sub(r"[ -]", "", match.group(0))):
            return None
        mark = f"[REDACTED:{name}]"
        if "secret" in match.re.groupindex and match.group("secret") is not None:
            text, offset = match.group(0), match.start()
            start, end = match.span("secret")
            return text[:start - offset] + mark + text[end - offset:]
        return mark

    def text(self, value: str) -> tuple[str, int]:
        """One string: (redacted, replacements)."""
        if len(value) < SHORTEST_SECRET:
            return value, 0
        cacheable = len(value) >= CACHE_MIN_CHARS or len(value) <= CACHE_MAX_SHORT
        if cacheable:
            cached = self._cache.get(value)
            if cached is not None:
                return cached
        original = value
        count = 0
        lowered = value.lower() if self._lower_needed else value
        for name, pattern, hints in self.patterns:
            if hints and not any(hint in lowered for hint in hints):
                continue
            if pattern.search(value) is None:  # the common case: one scan, no rebuild
                continue

            def replace(match: re.Match[str], name: str = name) -> str:
                nonlocal count
                replacement = self._replacement(name, match)
                if replacement is None:
                    return match.group(0)
                count += 1
                return replacement

            value = pattern.sub(replace, value)
        if cacheable and len(original) <= CACHE_CHARS // 8:
            self._remember(original, value, count)
        return value, count

    def _remember(self, original: str, value: str, count: int) -> None:
        """Bounded in entries and in characters, oldest out first (dicts keep order)."""
        with self._lock:
            while self._cache and (len(self._cache) >= CACHE_ENTRIES
                                   or self._cached_chars + len(original) > CACHE_CHARS):
                oldest = next(iter(self._cache))
                self._cached_chars -= len(oldest)
                del self._cache[oldest]
            if original not in self._cache:
                self._cache[original] = (value, count)
                self._cached_chars += len(original)

    def __call__(self, value: Any) -> tuple[Any, int]:
        """A JSON-able value with every string redacted, and how many replacements."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            out: dict[Any, Any] = {}
            total = 0
            for key, item in value.items():
                if (self._key_redaction and isinstance(item, str) and isinstance(key, str)
                        and item and not item.startswith("[REDACTED:")
                        and SECRET_KEY.match(key)):
                    out[key], found = "[REDACTED:api_key]", 1
                    if item.lower().startswith("bearer "):
                        out[key], found = self.text(item)
                        if not found:
                            out[key], found = "[REDACTED:api_key]", 1
                else:
                    out[key], found = self(item)
                total += found
            return out, total
        if isinstance(value, list | tuple):
            items = []
            total = 0
            for item in value:
                redacted, found = self(item)
                items.append(redacted)
                total += found
            return items, total
        return value, 0

