"""The adapter manager's pure checks: what a load request must pass, what a replica's
``/v1/models`` and ``/server_info`` say, and how a failed load is explained to TRL.

Pure (``check_path`` excepted, which reads the filesystem): kept apart from the manager's
I/O so each rule is unit-tested on its own.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from gateway.adapters.state import Failure, ListedAdapter, Settlement
from gateway.errors import (
    BadRequest,
    BroadcastFailed,
    GatewayError,
    UpstreamTimeout,
    UpstreamUnavailable,
)

__all__ = [
    "check_capacity", "check_path", "load_error", "parse_models", "replica_list", "require_str",
]  # fmt: skip

_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def require_str(body: Mapping[str, Any], key: str) -> str:
    """A string field. Control characters are refused at once: a NUL breaks path
    handling, a CR/LF would split log lines, and vLLM would answer either with a 404
    that the mount-lag retry waits out for the whole deadline."""
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"'{key}' must be a string.", param=key)
    if value and _CONTROL_CHARS.search(value):
        raise BadRequest(f"'{key}' must not contain control characters.", param=key)
    return value or ""


def parse_models(content: bytes) -> tuple[list[ListedAdapter], list[str]]:
    """A replica's ``/v1/models``: (adapters, base model ids). Adapters have a parent."""
    data = orjson.loads(content)
    adapters, bases = [], []
    for entry in data.get("data", []) if isinstance(data, dict) else []:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            continue
        if entry.get("parent"):
            adapters.append(ListedAdapter(entry["id"], str(entry.get("root") or "")))
        else:
            bases.append(entry["id"])
    return adapters, bases


def check_path(path: str, roots: Sequence[Path]) -> str:
    """The ``lora_path`` to send to the replicas: ``path`` resolved (symlinks included)
    below the root it lies in; BadRequest unless it lies inside one of ``roots``. No
    roots: no check, ``path`` as given (the gateway may not even see the filesystem).

    Why the resolved path is sent rather than the client's: a run that can write inside
    its root could otherwise pass the check with a symlink into its root and then point it
    elsewhere (another run's root, any folder the replicas can read) before a replica
    reads it -- and a replica reads it later, maybe several times (mount-lag retries, a
    replay on a restarted replica). The resolved path has no symlink below the root, so
    swapping one cannot redirect the replica. The root itself is kept as configured (the
    operator's path, the one the replicas mount; on the gateway's host it may be a
    symlink to another mount point). What remains (the folder's contents, a component
    that did not exist yet at the check) is in docs/many-runs.md, "Trust model between
    runs".

    Blocking filesystem I/O: call it in a thread. Relative paths are refused, since the
    replica would resolve them against its own working directory, not ours.
    """
    if not roots:
        return path
    candidate = Path(path)
    if not candidate.is_absolute():
        raise BadRequest("'lora_path' must be an absolute path.", param="lora_path")
    try:
        resolved = candidate.resolve(strict=False)
        for root in roots:
            real_root = root.resolve(strict=False)
            if resolved.is_relative_to(real_root):
                _check_files(resolved, real_root)
                return str(root.absolute() / resolved.relative_to(real_root))
    except (OSError, ValueError, RuntimeError) as exc:  # a symlink loop, a name too long
        raise BadRequest(f"'lora_path' cannot be resolved ({exc.__class__.__name__}).",
                         param="lora_path") from None  # fmt: skip
    raise BadRequest(
        f"'lora_path' {path!r} resolves outside the allowed adapter roots.", param="lora_path"
    )


def _check_files(folder: Path, real_root: Path) -> None:
    """BadRequest if a file of the adapter folder is a symlink resolving outside
    ``real_root``: the replica would read another run's weights, or any file it can read,
    as this run's adapter. Only the folder's own entries (what vLLM reads); a folder the
    gateway cannot list yet (mount lag) is left to the replica. A check, not a guarantee:
    the files can still change after it (docs/many-runs.md, "Trust model between runs")."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if entry.is_symlink() and not Path(entry.path).resolve().is_relative_to(real_root):
            raise BadRequest(
                f"'lora_path' holds {entry.name!r}, a symlink that resolves outside the "
                "allowed adapter roots.",
                param="lora_path",
            )


def check_capacity(infos: Mapping[int, Mapping[str, Any]], max_staleness: int | None) -> list[str]:
    """Warnings for replicas whose LoRA slots cannot hold the staleness window.

    TRL itself needs ``max_loras >= max_staleness + 2`` (the window plus the version
    being loaded); vLLM's host cache (``max_cpu_loras``, default ``max_loras``) must hold
    as many, or registered adapters are evicted and re-read from disk on every use.
    """
    if max_staleness is None:
        return []
    need = max_staleness + 2
    warnings = []
    for r, info in sorted(infos.items()):
        lora = (info.get("vllm_config") or {}).get("lora_config")
        if not isinstance(lora, Mapping):
            warnings.append(f"replica {r} reports no lora_config: runtime LoRA is disabled")
            continue
        max_loras = lora.get("max_loras")
        cpu = lora.get("max_cpu_loras") or max_loras
        if isinstance(max_loras, int) and max_loras < need:
            warnings.append(f"replica {r}: max_loras={max_loras} < max_staleness+2={need}")
        if isinstance(cpu, int) and cpu < need:
            warnings.append(f"replica {r}: max_cpu_loras={cpu} < max_staleness+2={need}")
    return warnings


def replica_list(indices: Iterable[int]) -> str:
    items = sorted(indices)
    return ("replica " if len(items) == 1 else "replicas ") + ", ".join(map(str, items))


def load_error(settled: Settlement, path: str, deadline: float, replaced: bool) -> GatewayError:
    name = settled.name
    undo = ""
    if replaced:
        undo = " The previous weights of this name keep serving."
    elif settled.rolled_back:
        undo = f" Rolled back on {replica_list(settled.rolled_back)}."
    failed = [r for r, _ in settled.failures]
    if settled.failure is Failure.NO_REPLICAS:
        return UpstreamUnavailable(
            f"No healthy replica to load LoRA adapter '{name}' onto.",
            headers={"Retry-After": "2"},
        )
    if settled.failure is Failure.NOT_FOUND_TIMEOUT:
        # Never 404: TRL reads a 404 here as "runtime LoRA updating is disabled".
        return UpstreamTimeout(
            f"Loading LoRA adapter '{name}' timed out: {replica_list(failed)} still found no "
            f"adapter at {path!r} after {deadline:g}s (shared filesystem not caught up?)." + undo
        )
    reasons = "; ".join(
        f"replica {r}: " + (f"HTTP {res.status}: " if res.status else "") + res.detail
        for r, res in settled.failures
    )
    return BroadcastFailed(
        f"Loading LoRA adapter '{name}' failed on {replica_list(failed)} ({reasons})." + undo
    )
