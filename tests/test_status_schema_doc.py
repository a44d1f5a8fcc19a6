"""``docs/status.md`` cannot drift from ``/gateway/status``: real gateways on simulated
replicas (single-run; multi-run, the admin and a run's view; ``--workers 2``) are asked
for their status, and every key of every answer must be in the doc's schema table, with a
value of the documented type, and every documented key must appear in the modes its *in*
column names."""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from rollout_testbed.procs import Proc, free_port, sim_argv

from tests.conftest import ADMIN_KEY, CLIENT_KEY
from tests.deploy._proc import base_env
from tests.eventually import eventually_sync

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "status.md"
PY = sys.executable
pytestmark = pytest.mark.timeout(240)

RUN_B_KEY = "sk-status-doc-run-b"
# An adapter snapshot per run (the admin view) has the keys of ``adapters.*``.
ALIASES = {"adapters.<run>": "adapters"}
TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "null": (type(None),),
}


@dataclass(frozen=True)
class Row:
    """One row of the doc's schema table."""

    path: str
    types: str
    where: str


def schema() -> dict[str, Row]:
    """The schema table of ``docs/status.md``, by path."""
    rows: dict[str, Row] = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"\| `([^`]+)` \| ([^|]+) \| ([^|]+) \|", line)
        if m:
            path, types, where = (g.strip() for g in m.groups())
            assert path not in rows, f"{path} is documented twice"
            rows[path] = Row(path, types, where)
    assert len(rows) > 20, "the schema table of docs/status.md was not found"
    return rows


def type_ok(value: Any, types: str) -> bool:
    """Whether ``value`` is one of ``types`` (``string or null``, ``array of integer``)."""
    for option in types.split(" or "):
        if option.startswith("array of "):
            element = option.removeprefix("array of ")
            if isinstance(value, list) and all(type_ok(v, element) for v in value):
                return True
            continue
        # bool is an int in Python, never a number in JSON
        numeric = option in ("integer", "number")
        if isinstance(value, TYPES[option]) and not (numeric and isinstance(value, bool)):
            return True
    return False


def walk(value: Any, path: str, rows: dict[str, Row], seen: set[str], errors: list[str]) -> None:
    """Record every documented path under ``value`` in ``seen``; an undocumented key or a
    value of another type is an error."""
    if isinstance(value, list):
        for element in value:
            if isinstance(element, dict):
                walk(element, f"{path}[]", rows, seen, errors)
        return
    if not isinstance(value, dict):
        return
    for key, child in value.items():
        here = f"{path}.{key}" if path else key
        if here not in rows:
            maps = [p for p in rows if re.fullmatch(re.escape(path) + r"\.<[^>]+>", p)]
            if not maps:
                errors.append(f"{here}: returned but not documented in docs/status.md")
                continue
            here = maps[0]
        seen.add(here)
        if not type_ok(child, rows[here].types):
            errors.append(f"{here}: {child!r} is not {rows[here].types}")
        walk(child, ALIASES.get(here, here), rows, seen, errors)


def check(status: dict[str, Any], modes: set[str], what: str) -> None:
    """``status`` has exactly the documented keys that the doc says ``modes`` have."""
    rows = schema()
    seen: set[str] = set()
    errors: list[str] = []
    walk(status, "", rows, seen, errors)
    for row in rows.values():
        if row.where in modes and row.path not in seen:
            errors.append(f"{row.path}: documented ({row.where}) but absent")
    problems = "\n".join(errors)
    assert not errors, f"{what}: /gateway/status and docs/status.md disagree:\n{problems}"


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Two simulated replicas for the module's gateways."""
    logs = tmp_path_factory.mktemp("sims")
    procs = []
    for i in range(2):
        port = free_port()
        procs.append(Proc(f"sim-{i}", sim_argv(port, python=PY), logs / f"sim-{i}.log",
                          env=base_env(), cwd=REPO, url=f"http://127.0.0.1:{port}",
                          new_session=False))  # fmt: skip
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.wait_http("/health")
        yield [p.url for p in procs]
    finally:
        for proc in procs:
            proc.stop(grace=10, kill_wait=5)


@contextlib.contextmanager
def gateway(sims: list[str], log: Path, *args: str) -> Iterator[str]:
    """``rollout-gateway serve ARGS`` in front of ``sims``; yields its URL once it serves."""
    port = free_port()
    argv = [PY, "-m", "gateway", "serve", "--port", str(port), *args]
    for url in sims:
        argv += ["--replica", url]
    proc = Proc("gateway", argv, log, env=base_env(), cwd=REPO,
                url=f"http://127.0.0.1:{port}", new_session=False)  # fmt: skip
    with proc:
        proc.wait_http("/health")
        yield proc.url
        proc.stop(grace=15, kill_wait=5)


def exercise(url: str, auth: tuple[str, str] | None, lora_path: str) -> None:
    """Load one adapter and route one rollout naming it, as TRL would."""
    with httpx.Client(base_url=url, auth=auth, timeout=30) as client:
        load = {"lora_name": "trl-policy-v1", "lora_path": lora_path}
        assert client.post("/v1/load_lora_adapter", json=load).status_code == 200
        body = {"model": "trl-policy-v1", "prompt": list(range(1, 65)), "max_tokens": 2}
        assert client.post("/v1/completions", json=body).status_code == 200


def status(url: str, auth: tuple[str, str] | None, *need: str) -> dict[str, Any]:
    """``/gateway/status`` once it holds a routing decision (and each key of ``need``)."""

    def fetch() -> dict[str, Any] | None:
        answer = httpx.get(f"{url}/gateway/status", auth=auth, timeout=10)
        assert answer.status_code == 200, answer.text
        body: dict[str, Any] = answer.json()
        return body if body["routing"] and all(k in body for k in need) else None

    found = eventually_sync(fetch, "a /gateway/status with a routing decision")
    assert found is not None
    return found


def test_single_run(sims: list[str], tmp_path: Path) -> None:
    """Single-run mode, with client and admin keys: the doc's ``always`` keys, no other."""
    args = ("--api-key", CLIENT_KEY, "--admin-key", ADMIN_KEY)
    with gateway(sims, tmp_path / "gateway.log", *args) as url:
        exercise(url, ("trl", ADMIN_KEY), str(tmp_path / "trl-policy-v1"))
        assert httpx.get(f"{url}/gateway/status", timeout=10).status_code == 401
        body = status(url, ("trl", CLIENT_KEY))
    check(body, {"always"}, "single-run")


def test_multi_run(sims: list[str], tmp_path: Path) -> None:
    """Multi-run mode: the admin view (every run) and a run's own view."""
    config = tmp_path / "runs.yaml"
    (tmp_path / "a").mkdir()  # adapter roots must exist at start
    (tmp_path / "b").mkdir()
    config.write_text(
        f"admin_key: {ADMIN_KEY}\n"
        "runs:\n"
        f"  - {{name: run-a, key: {CLIENT_KEY}, adapter_root: {tmp_path}/a, max_staleness: 1}}\n"
        f"  - {{name: run-b, key: {RUN_B_KEY}, adapter_root: {tmp_path}/b, max_staleness: 1}}\n"
    )
    with gateway(sims, tmp_path / "gateway.log", "--config", str(config)) as url:
        exercise(url, ("run-a", CLIENT_KEY), f"{tmp_path}/a/trl-policy-v1")
        admin = status(url, ("admin", ADMIN_KEY), "runs")
        own = status(url, ("run-a", CLIENT_KEY), "runs")
    check(admin, {"always", "multi-run", "multi-run admin"}, "multi-run, admin view")
    assert {r["name"] for r in admin["runs"]} == {"run-a", "run-b"}
    check(own, {"always", "multi-run"}, "multi-run, run view")
    assert [r["name"] for r in own["runs"]] == ["run-a"]
    assert own["adapters"]["adapters"][0]["name"] == "trl-policy-v1"


def test_workers(sims: list[str], tmp_path: Path) -> None:
    """``--workers 2``: the owner's answer adds ``owner_pid`` and ``workers``."""
    with gateway(sims, tmp_path / "gateway.log", "--workers", "2") as url:
        exercise(url, None, str(tmp_path / "trl-policy-v1"))
        body = status(url, None, "workers")
    check(body, {"always", "workers"}, "--workers 2")
