"""No secret in anything the suite saw: subprocess logs, response headers and bodies.

The upstream token, the client API key and the admin key are distinctive strings
(``tests/conftest.py``); every fleet of this suite passes them on the gateway's command
line. Each fleet already checks its own logs and responses when it exits; this test adds
a workload built to provoke leaks -- DEBUG logging, credentials in the replica URLs,
rejected and wrong keys, Basic auth, adapter failures with replica error text, a replica
killed mid-stream, ``/health`` while degraded, status and metrics pages, a graceful
gateway restart, configuration errors -- and then greps everything: its own output, plus
every subprocess log file and every captured response of the whole test session so far.
"""

from __future__ import annotations

import base64
import subprocess
from pathlib import Path

import httpx

from tests.conftest import ADMIN_KEY, CLIENT_KEY, SECRETS, UPSTREAM_TOKEN
from tests.eventually import eventually
from tests.faults.procs import ADMIN, CAPTURES, PY, Fleet, fleet, log_files

URL_PASSWORD = "pw-TESTSECRET-replica-url-3Rt8"  # in every replica URL given to the gateway
ALL_SECRETS = (*SECRETS, URL_PASSWORD)
BODY = {"model": "tiny-base", "prompt": [1, 2, 3], "max_tokens": 4}


async def _provoke(f: Fleet) -> None:
    """Every path where a careless gateway would echo a credential."""
    c = f.client
    assert (await c.post("/v1/completions", json=BODY)).status_code == 200
    assert (await c.post("/v1/completions", json={**BODY, "stream": True})).status_code == 200
    # Rejected credentials, in every form a client can send them.
    anonymous = await c.post("/v1/completions", json=BODY, headers={"Authorization": ""})
    assert anonymous.status_code == 401
    wrong = {"Authorization": f"Bearer {CLIENT_KEY}x"}
    assert (await c.post("/v1/completions", json=BODY, headers=wrong)).status_code == 401
    basic = base64.b64encode(f"trl:{CLIENT_KEY}".encode()).decode()
    ok = await c.post("/v1/completions", json=BODY, headers={"Authorization": f"Basic {basic}"})
    assert ok.status_code == 200
    assert (await c.post("/pause")).status_code == 401  # the client key is not an admin key
    assert (await c.post("/resume", headers=ADMIN)).status_code == 200
    for path in ("/gateway/status", "/metrics", "/server_info", "/v1/models", "/version"):
        assert (await c.get(path)).status_code == 200, path
    tokenized = await c.post("/tokenize", json={"model": "tiny-base", "prompt": "hi"})
    assert tokenized.status_code == 200
    # Adapter failures carry the replicas' error text back to the trainer.
    assert (await f.load("sec-v1")).status_code == 200
    await f.faults(1, load_error=1)
    assert (await f.load("sec-v2")).status_code == 502
    await f.faults(0, load_not_found=-1)
    assert (await f.load("sec-v3")).status_code == 504
    await f.clear_faults(0)
    # A replica killed under a stream, then /health while degraded.
    body = {**BODY, "max_tokens": 200, "stream": True}
    async with c.stream("POST", "/v1/completions", json=body) as r:
        victim = int(r.headers["x-gateway-replica"])
        chunks = r.aiter_bytes()
        await anext(chunks)  # the first event is out: the stream is under way
        f.sims[victim].kill()
        tail = b"".join([chunk async for chunk in chunks])
    assert b"mid-stream" in tail, tail[-300:]
    for k in range(6):  # refused connections, retries, passive ejection
        await c.post("/v1/completions", json={**BODY, "prompt": [k + 1]})
    await eventually(lambda: _degraded(c), "/health to report the dead replica")
    await f.restart_sim(victim)
    await f.restart_gateway(kill=False)  # graceful: shutdown logs too


async def _degraded(c: httpx.AsyncClient) -> bool:
    return (await c.get("/health")).status_code == 503


async def test_no_secret_in_any_log_or_response(tmp_path: Path) -> None:
    settings = {"adapter_load_deadline_s": 0.3, "adapter_retry_initial_s": 0.05}
    async with fleet(
        tmp_path, 2, latency="decode=0.01", log_level="DEBUG", settings=settings,
        gateway_args=["--log-format", "text"], userinfo=f"trainer:{URL_PASSWORD}",
        check_secrets=False,
    ) as f:  # fmt: skip
        await _provoke(f)
        own = f.logs() + f.capture.text()

    # The workload reached the paths it was meant to: the grep below is not vacuous.
    for expected in ("Invalid or missing API key", "Invalid or missing admin key",
                     "Rolled back", "timed out", "mid-stream", "ejected", "gateway up",
                     "Shutting down", "DEBUG"):  # fmt: skip
        assert expected in own, expected
    assert "127.0.0.1" in own  # replicas are logged by host:port, without the userinfo

    session = [own]
    logs = log_files()
    session += [p.read_text("utf-8", "replace") for p in logs if p.exists()]
    session += [c.text() for c in CAPTURES]
    haystack = "\n".join(session)
    leaks = [s for s in ALL_SECRETS if s in haystack]
    where = {s: haystack[max(0, haystack.find(s) - 300) : haystack.find(s)] for s in leaks}
    assert not leaks, f"secrets found: {where}"
    print(f"secrets: grepped {len(haystack) / 1e3:.0f} kB from {len(logs)} log files "
          f"and {sum(len(c.items) for c in CAPTURES)} responses")  # fmt: skip


def test_configuration_errors_do_not_echo_secrets(tmp_path: Path) -> None:
    """A bad setting next to secrets: the error names the setting, never the secrets."""
    token_file = tmp_path / "token"
    token_file.write_text(UPSTREAM_TOKEN)
    missing = str(tmp_path / "none.yaml")
    yaml_token = tmp_path / "numeric-token.yaml"
    yaml_token.write_text("upstream_token: 8675309\n")  # wrong type: a number
    for bad in (["--max-staleness", "-1"], ["--health-interval-s", "0"],
                ["--replica", "http://127.0.0.1:1", "--config", missing],
                ["--replica", f"ftp://u:{URL_PASSWORD}@127.0.0.1:1"],  # pydantic input_value
                ["--config", str(yaml_token)], ["--log-level", "TRACE"]):  # fmt: skip
        r = subprocess.run(
            [PY, "-m", "gateway", "serve", "--replica",
             f"http://trainer:{URL_PASSWORD}@127.0.0.1:1", "--api-key", CLIENT_KEY,
             "--admin-key", ADMIN_KEY, "--upstream-token-file", str(token_file), *bad],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert r.returncode == 2, (bad, r.stderr[-500:])
        assert "invalid configuration" in r.stderr
        output = r.stdout + r.stderr
        assert not [s for s in (*ALL_SECRETS, "8675309") if s in output], (bad, output[-800:])
        assert "Traceback" not in output
