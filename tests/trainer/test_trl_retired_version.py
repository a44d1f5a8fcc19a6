"""TRL's own rollout retry, naming a version the gateway has retired, ends at once.

The trap (issue 27): TRL retries a failed rollout with the version it first named, on any
error, 30 attempts with backoff up to 16 s (about 7 minutes). After a gateway restart and
a few fast syncs, that version is gone, and vLLM's answer is a 404, retried to the end.
The gateway serves it with the oldest live version of the family instead; TRL's trainer
drops the sample as stale (docs/adapters.md, "Retired versions"). Run by the vLLM venv's
python (the trainer layer), against simulated replicas behind a real gateway process.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import pytest

# Importing TRL warns about the installed vLLM version (pytest makes warnings errors):
# TRL's own declared range, documented in deploy/versions.env.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from tests.e2e.trl_probe import rollout
from trainer.metrics import parse_prometheus
from trainer.stack import sim_gateway

pytestmark = pytest.mark.timeout(240)

PROMPT = list(range(5, 45))
BOUND_S = 60.0  # TRL's loop would take ~7 minutes; one answer takes well under a second


def post(url: str, body: dict[str, object]) -> int:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def load(url: str, tmp: Path, version: int) -> None:
    path = tmp / f"trl-policy-v{version}"
    path.mkdir(exist_ok=True)
    status = post(url + "/v1/load_lora_adapter",
                  {"lora_name": f"trl-policy-v{version}", "lora_path": str(path)})  # fmt: skip
    assert status == 200


def retired_rollouts(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        samples = parse_prometheus(r.read().decode())
    return sum(v for _, v in samples.get("gateway_retired_version_rollouts_total", []))


def test_trls_retry_of_a_version_retired_across_a_gateway_restart_ends(tmp_path: Path) -> None:
    with sim_gateway(2, 2, tmp_path / "logs") as fleet:
        for v in (1, 2, 3):
            load(fleet.url, tmp_path, v)
        fleet.gateway.restart()
        fleet.gateway.wait_http(timeout=60)
        for v in (4, 5, 6):  # fast syncs after the restart: the window is now v4..v6
            load(fleet.url, tmp_path, v)

        async def trl_rollout(model: str) -> tuple[list[int], list[float]]:
            return await asyncio.wait_for(rollout(fleet.url, model, PROMPT), BOUND_S)

        tokens, logprobs = asyncio.run(trl_rollout("trl-policy-v1"))
        assert tokens and len(logprobs) == len(tokens)
        assert retired_rollouts(fleet.url) == 1
        # what stays vLLM's 404: a version newer than every live one, and a plain name
        body = {"prompt": PROMPT, "max_tokens": 2}
        assert post(fleet.url + "/v1/completions", {**body, "model": "trl-policy-v9"}) == 404
        assert post(fleet.url + "/v1/completions", {**body, "model": "other"}) == 404
        assert retired_rollouts(fleet.url) == 1
