"""Runs: who a request belongs to, and what its adapter names are called on the replicas.

Pure (no I/O). In multi-run mode a run is identified by its credential, the only thing an
unmodified TRL run can vary: ``http://NAME:KEY@gateway`` arrives as ``Basic`` auth, and
``Bearer KEY`` works too. Every run publishes the same names (``trl-policy-v1``, ...),
and vLLM holds one adapter per name, so on the replicas a run's names carry its prefix
(``NAME~trl-policy-v1``): unique per run, and a name's owner is read off the name. A run
never sees the prefix (``unscope``). In single-run mode there is one implicit run with
no name and no prefix, so every path is the same code.
"""

from __future__ import annotations

import hmac
import json
from base64 import b64decode, b64encode
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.adapters.placement import run_slots

__all__ = ["SEP", "Run", "RunTable", "owner_of", "presented_credential"]

SEP = "~"  # not allowed in run names: the first one ends the owner's prefix


@dataclass(frozen=True, slots=True)
class Run:
    """One run's identity and limits; ``name == ""`` is single-run mode's implicit run."""

    name: str
    key: bytes | None
    max_staleness: int
    roots: tuple[Path, ...] = ()
    max_in_flight: int | None = None
    remove_grace_s: float = 30.0
    """Once a reload removed it: how long its rollouts may finish before they are aborted."""
    key_overlap_s: float = 60.0
    """Once a reload rotated its key: how long the old one keeps working."""
    weight: float = 1.0
    """Its share of a saturated replica (``gateway.runs.fairshare``)."""
    prefix: str = field(init=False, repr=False, compare=False)
    """``NAME~`` on the replicas ("" in single-run mode); read on every rollout: stored."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix", f"{self.name}{SEP}" if self.name else "")

    @property
    def slots(self) -> int:
        """Adapter slots it needs on each home replica: ``max_staleness + 1`` live versions,
        and one more while a sync loads the next (TRL's own ``max_staleness + 2`` check)."""
        return run_slots(self.max_staleness)

    def replica_name(self, name: str) -> str:
        return self.prefix + name

    def to_wire(self) -> dict[str, Any]:
        """The run as the owner sends it to its data-plane workers when a reload changed
        the run set (``gateway.workers``: a private Unix socket of the gateway's own
        processes, which hold the keys already; never logged)."""
        return {
            "name": self.name,
            "key": None if self.key is None else b64encode(self.key).decode(),
            "max_staleness": self.max_staleness,
            "roots": [str(r) for r in self.roots],
            "max_in_flight": self.max_in_flight,
            "remove_grace_s": self.remove_grace_s,
            "key_overlap_s": self.key_overlap_s,
            "weight": self.weight,
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Run:
        key = data["key"]
        return cls(
            data["name"], None if key is None else b64decode(key), data["max_staleness"],
            tuple(Path(r) for r in data["roots"]), data["max_in_flight"],
            data["remove_grace_s"], data["key_overlap_s"], data["weight"],
        )  # fmt: skip

    def client_name(self, replica_name: str) -> str | None:
        """The name this run knows, or None if the replica-side name is not its own."""
        prefix = self.prefix
        if not prefix:
            return replica_name
        return replica_name[len(prefix) :] if replica_name.startswith(prefix) else None

    def unscope(self, data: bytes) -> bytes:
        """A control-path or error body (no generated text) as this run must read it: the
        prefix goes wherever it is, also where a JSON body spells it with ``\\u`` escapes."""
        if not self.prefix:
            return data
        data = data.replace(self.prefix.encode(), b"")
        return _unescaped(data, self.prefix) if b"\\u" in data else data

    def unscope_text(self, text: str) -> str:
        return text.replace(self.prefix, "") if self.prefix else text

    def homes_at_start(self, replicas: Sequence[int]) -> Sequence[int]:
        """Its adapter manager's replicas before placement: every one for the implicit
        run, none for a named run (its homes come with placement)."""
        return () if self.prefix else replicas

    def owns(self) -> Callable[[str], bool] | None:
        """Which replica-side adapter names are its own (None: every name)."""
        prefix = self.prefix
        return (lambda name: name.startswith(prefix)) if prefix else None


def _unescaped(data: bytes, prefix: str) -> bytes:
    """A JSON ``data`` without ``prefix`` in any of its strings, keys included, once its
    escapes are read (rare: vLLM escapes only control characters); as it was when it is
    not JSON or holds no escaped prefix."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return data
    changed = False

    def clean(node: Any) -> Any:
        nonlocal changed
        if isinstance(node, str):
            if prefix in node:
                changed = True
                return node.replace(prefix, "")
            return node
        if isinstance(node, dict):
            return {clean(k): clean(v) for k, v in node.items()}
        if isinstance(node, list):
            return [clean(v) for v in node]
        return node

    try:
        cleaned = clean(doc)
    except RecursionError:
        return data
    return json.dumps(cleaned, separators=(",", ":")).encode() if changed else data


def owner_of(replica_name: str) -> str | None:
    """The run a replica-side adapter name belongs to (None: no run's, e.g. a leftover of
    single-run mode or a manual load)."""
    owner, sep, rest = replica_name.partition(SEP)
    return owner if sep and owner and rest else None


def presented_credential(value: bytes | None) -> tuple[bytes | None, bytes | None]:
    """(user, key) from an ``Authorization`` value: ``Bearer KEY`` (no user) or ``Basic``
    (``user:key``, all TRL can send). (None, None) when there is none or it is malformed."""
    if not value:
        return None, None
    scheme, _, rest = value.partition(b" ")
    scheme = scheme.lower()
    if scheme == b"bearer":
        return None, rest.strip()
    if scheme == b"basic":
        try:
            decoded = b64decode(rest.strip(), validate=True)
        except ValueError:
            return None, None
        user, sep, key = decoded.partition(b":")
        return (user, key) if sep else (None, None)
    return None, None


class RunTable:
    """The configured runs, and which one a credential names; ``retired``: (run, key)
    pairs of keys a reload rotated away that still name their run (``key_overlap_s``)."""

    __slots__ = ("_by_name", "multi", "retired", "runs")

    def __init__(self, runs: Iterable[Run], retired: Iterable[tuple[str, bytes]] = ()) -> None:
        self.runs = tuple(runs)
        self.multi = any(r.name for r in self.runs)
        if self.multi and not all(r.name and r.key for r in self.runs):
            raise ValueError("in multi-run mode every run needs a name and a key")
        self._by_name = {r.name: r for r in self.runs}
        self.retired = tuple((name, key) for name, key in retired if name in self._by_name)

    def __getitem__(self, name: str) -> Run:
        return self._by_name[name]

    def __iter__(self) -> Iterable[Run]:
        return iter(self.runs)

    def identify(self, authorization: bytes | None) -> Run | None:
        """The run whose key is presented (a Basic user, if given, must be its name).

        Compares against every key, always: constant time in the key material, and the
        answer does not tell which run names exist."""
        user, presented = presented_credential(authorization)
        found: Run | None = None
        for run in self.runs:
            assert run.key is not None
            match = presented is not None and hmac.compare_digest(presented, run.key)
            if match and (user is None or user == b"" or user == run.name.encode()):
                found = run
        for name, key in self.retired:
            match = presented is not None and hmac.compare_digest(presented, key)
            if match and found is None and (not user or user == name.encode()):
                found = self._by_name[name]
        return found
