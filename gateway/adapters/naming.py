"""Adapter names: ``<family>-v<N>`` parsing.

TRL publishes one adapter per weight sync, named ``trl-policy-v1``, ``trl-policy-v2``, …
The *family* (``trl-policy``) groups the versions of one policy so the registry can keep
a staleness window per family; the *version* orders them. Names that do not match the
pattern are plain adapters: no family, no version, never evicted by the window.

The pattern is configurable; it must define the named groups ``family`` and ``version``
(the latter must match decimal digits only).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["DEFAULT_PATTERN", "AdapterName", "NamePattern", "retired_successor"]

DEFAULT_PATTERN = r"^(?P<family>.+)-v(?P<version>\d+)$"


@dataclass(frozen=True, slots=True)
class AdapterName:
    """A parsed adapter name. ``family`` and ``version`` are both set or both ``None``."""

    name: str
    family: str | None = None
    version: int | None = None

    @property
    def versioned(self) -> bool:
        return self.version is not None


class NamePattern:
    """Compiled ``<family>-v<N>`` parser; ``parse`` never raises for any string."""

    __slots__ = ("_regex",)

    def __init__(self, pattern: str = DEFAULT_PATTERN) -> None:
        try:
            regex = re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"invalid adapter name pattern {pattern!r}: {exc}") from exc
        missing = {"family", "version"} - set(regex.groupindex)
        if missing:
            raise ValueError(
                f"adapter name pattern {pattern!r} lacks named group(s) {sorted(missing)}"
            )
        self._regex = regex

    @property
    def pattern(self) -> str:
        return self._regex.pattern

    def parse(self, name: str) -> AdapterName:
        match = self._regex.fullmatch(name)
        if match is None:
            return AdapterName(name)
        family, version = match.group("family"), match.group("version")
        # ``\d`` also matches non-ASCII decimal digits (which int() accepts): require
        # ASCII so that such a name stays a plain adapter rather than a version.
        if not family or not version or not (version.isascii() and version.isdecimal()):
            return AdapterName(name)
        return AdapterName(name, family, int(version))

    def __repr__(self) -> str:
        return f"NamePattern({self.pattern!r})"


def retired_successor(pattern: NamePattern, name: str, live: Iterable[str]) -> str | None:
    """The oldest live version of ``name``'s family, when ``name`` is a version older
    than every live one (retired by the staleness window, or before a gateway restart);
    else None.

    Why a successor rather than vLLM's 404: TRL retries a rollout with the version it
    first named, on any error, for about 7 minutes. Its trainer drops every sample older
    than ``max_staleness`` versions, and a version the window retired is older than that
    (the gateway's window is TRL's), so the successor's answer is discarded as stale, as
    the retired version's would have been, and the loop ends at once. A name newer than
    the live ones (another run's numbering) or without a version is not retired."""
    asked = pattern.parse(name)
    if asked.version is None:
        return None
    oldest: tuple[int, str] | None = None
    for other in live:
        parsed = pattern.parse(other)
        if parsed.family != asked.family or parsed.version is None:
            continue
        if oldest is None or (parsed.version, other) < oldest:
            oldest = (parsed.version, other)
    return oldest[1] if oldest is not None and asked.version < oldest[0] else None
