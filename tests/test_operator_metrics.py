"""What operators watch (issue 26): the fleet's pause and its age, the replica index ->
address map, build info and the process metrics, on a real gateway in front of sim
replicas (in-process, and ``serve --workers 2`` as users run it), plus the pure pieces.

The pause gauges: ``gateway_fleet_paused`` 1 and ``gateway_fleet_paused_since_seconds``
the pause's unix time while a fleet-wide ``/pause`` holds, both 0 otherwise.
``gateway_replica_info`` is the one URL label: it must never carry a password, a token
or a query string, and must follow discovery.
"""

from __future__ import annotations

import asyncio
import platform
import re
import time
from itertools import product
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rollout_testbed.procs import sim_fleet
from rollout_testbed.serve import serve_asgi

import gateway as gateway_package
from gateway import __version__
from gateway.app import build_gateway, create_app
from gateway.config import ReplicaSpec, load_settings
from gateway.core import Gateway
from gateway.fleet.admission import Refusal
from gateway.fleet.control import PAUSE, RESET, RESUME, FleetControl
from gateway.fleet.metrics import replica_address
from gateway.fleet.replicas import Replica
from gateway.http.upstream import BufferedResponse
from gateway.metrics import ADMISSION_REFUSALS, CONTROL_CALLS, UPSTREAM_ERROR_KINDS, ProbeResult
from gateway.workers.merge import merge_expositions
from tests.cluster import cluster, sims
from tests.conftest import UPSTREAM_TOKEN
from tests.eventually import eventually

HTTP = Path(gateway_package.__file__).parent / "http"
PASSWORDS = ("pw-TESTSECRET-static-0", "pw-TESTSECRET-file-1", "pw-TESTSECRET-file-2")
REPLICA_TOKEN = "tok-TESTSECRET-replica-5Kd1"
PROCESS_FAMILIES = (
    "process_cpu_seconds",
    "process_resident_memory_bytes",
    "process_virtual_memory_bytes",
    "process_start_time_seconds",
    "process_open_fds",
    "process_max_fds",
)


def families(text: str) -> dict[str, Any]:
    """Parsed families by name (parsing is the check that the exposition is valid)."""
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(text: str, name: str) -> float:
    (sample,) = families(text)[name].samples
    return float(sample.value)


def replica_info(text: str) -> dict[str, str]:
    """``{replica index: url}`` from ``gateway_replica_info``; every sample is 1."""
    samples = families(text)["gateway_replica_info"].samples
    assert all(s.value == 1 for s in samples), samples
    return {s.labels["replica"]: s.labels["url"] for s in samples}


def with_userinfo(url: str, user: str, password: str) -> str:
    return url.replace("http://", f"http://{user}:{password}@", 1)


# ------------------------------------------------------------------------- pure pieces


def test_replica_address_drops_credentials_query_and_fragment() -> None:
    cases = {
        "http://alice:pw@10.0.0.1:8000": "http://10.0.0.1:8000",
        "http://alice@vllm-0:8000/": "http://vllm-0:8000",
        "https://u:p@[::1]:8443/prefix/v1?key=k-secret#frag": "https://[::1]:8443/prefix/v1",
        "http://vllm-1": "http://vllm-1",
    }
    for raw, shown in cases.items():
        replica = Replica.from_spec(0, ReplicaSpec(url=raw), token="t-secret")
        assert replica_address(replica) == shown, raw


class _Replies:
    """A fan-out whose replicas all apply every call (the FleetControl's only I/O)."""

    async def __call__(self, method: str, path: str, **_: Any) -> list[BufferedResponse]:
        return [BufferedResponse(200, [], b"{}", replica=0)]


async def test_pause_since_is_the_first_pause_and_resume_clears_it() -> None:
    now = [1_700_000_000.0]
    control = FleetControl(_Replies(), lambda: 1, wall=lambda: now[0])

    def state() -> tuple[str | None, float | None]:
        return control.paused, control.paused_since

    assert state() == (None, None)
    await control.broadcast("POST", PAUSE, query="mode=keep")
    assert state() == ("mode=keep", 1_700_000_000.0)
    now[0] += 30
    await control.broadcast("POST", PAUSE)  # paused again while paused: the same pause
    assert state() == ("", 1_700_000_000.0)
    await control.broadcast("POST", RESUME)
    assert state() == (None, None)
    now[0] += 30
    await control.broadcast("POST", PAUSE)
    assert state() == ("", 1_700_000_060.0)


def _gateway() -> Gateway:
    return build_gateway(
        load_settings({"replicas": ["http://127.0.0.1:9000", "http://127.0.0.1:9001"]}, environ={})
    )


def test_merged_metrics_keep_the_owners_pause_info_and_process_series() -> None:
    """``--workers N``: the workers never apply a control call (their pause is always
    off), so the owner's pause is what /metrics says; info series and process_* are the
    owner's too, never a sum over processes."""
    owner, w1, w2 = _gateway(), _gateway(), _gateway()
    owner.control.paused, owner.control.paused_since = "", 1_700_000_123.0
    own = owner.metrics.render().decode()
    text = merge_expositions(own, [w.metrics.render().decode() for w in (w1, w2)]).decode()
    assert value(text, "gateway_fleet_paused") == 1
    assert value(text, "gateway_fleet_paused_since_seconds") == 1_700_000_123.0
    assert replica_info(text) == {"0": "http://127.0.0.1:9000", "1": "http://127.0.0.1:9001"}
    assert value(text, "gateway_build_info") == 1
    merged, owners = families(text), families(own)
    for name in (*PROCESS_FAMILIES, "python_info"):
        assert merged[name].samples == owners[name].samples, name


# ------------------------------------------------------------- through a real gateway


async def test_pause_gauges_follow_pause_and_resume() -> None:
    async with cluster(2) as c, httpx.AsyncClient(base_url=c.url, timeout=10) as client:
        text = (await client.get("/metrics")).text
        assert value(text, "gateway_fleet_paused") == 0
        assert value(text, "gateway_fleet_paused_since_seconds") == 0
        before = time.time()
        assert (await client.post("/pause", params={"mode": "keep"})).status_code == 200
        text = (await client.get("/metrics")).text
        assert value(text, "gateway_fleet_paused") == 1
        since = value(text, "gateway_fleet_paused_since_seconds")
        assert before <= since <= time.time()
        assert all(c.sim(i).paused for i in range(2))  # the gauge says what the fleet is
        assert (await client.post("/resume")).status_code == 200
        text = (await client.get("/metrics")).text
        assert value(text, "gateway_fleet_paused") == 0
        assert value(text, "gateway_fleet_paused_since_seconds") == 0


async def test_build_info_and_process_metrics_are_exported() -> None:
    async with cluster(1) as c, httpx.AsyncClient(base_url=c.url, timeout=10) as client:
        found = families((await client.get("/metrics")).text)
    (build,) = found["gateway_build_info"].samples
    labels = dict(build.labels)
    assert labels.pop("commit")  # tests/test_build_info.py says which
    assert labels == {"version": __version__, "python": platform.python_version()}
    assert build.value == 1
    for name in PROCESS_FAMILIES:
        assert name in found, name
    assert found["process_resident_memory_bytes"].samples[0].value > 0
    assert 0 < found["process_start_time_seconds"].samples[0].value <= time.time()
    assert found["python_info"].samples[0].value == 1


async def test_replica_info_shows_addresses_never_credentials() -> None:
    """Static replicas, one with a password in its URL (sent as Basic auth), one with a
    password and its own token, and a global upstream token: /metrics names each by its
    bare URL and holds none of them; the replicas still get their credentials."""
    async with sims(2) as replicas:
        bare = [r.url for r in replicas]
        settings = load_settings(
            {
                "replicas": [
                    with_userinfo(bare[0], "alice", PASSWORDS[0]),
                    {"url": with_userinfo(bare[1], "bob", PASSWORDS[1]), "token": REPLICA_TOKEN},
                ],
                "upstream_token": UPSTREAM_TOKEN,
                "health_interval_s": 0.2,
            },
            environ={},
        )
        app = create_app(settings)
        async with serve_asgi(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as client:
            text = (await client.get("/metrics")).text
            assert replica_info(text) == {"0": bare[0], "1": bare[1]}
            for secret in (*PASSWORDS[:2], REPLICA_TOKEN, UPSTREAM_TOKEN, "alice", "bob"):
                assert secret not in text, secret
            r = await client.post("/v1/completions", json={"model": "tiny-base", "prompt": "hi",
                                                           "max_tokens": 2})  # fmt: skip
            assert r.status_code == 200, r.text


async def test_replica_info_follows_discovery(tmp_path: Path) -> None:
    """A replicas file (with passwords in its URLs): a replica removed leaves
    gateway_replica_info at the next scrape, one added joins under the next index."""
    async with sims(3) as replicas:
        bare = [r.url for r in replicas]
        listing = tmp_path / "replicas.txt"
        creds = [with_userinfo(u, f"user{i}", PASSWORDS[i]) for i, u in enumerate(bare)]
        listing.write_text(f"{creds[0]}\n{creds[1]}\n")
        settings = load_settings(
            {"replicas_file": str(listing), "discovery_interval_s": 0.1,
             "health_interval_s": 0.2, "upstream_token": UPSTREAM_TOKEN},
            environ={},
        )  # fmt: skip
        app = create_app(settings)
        async with serve_asgi(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as client:

            async def info() -> dict[str, str]:
                text = (await client.get("/metrics")).text
                assert not any(s in text for s in (*PASSWORDS, UPSTREAM_TOKEN)), "a secret"
                return replica_info(text)

            assert await info() == {"0": bare[0], "1": bare[1]}
            listing.write_text(f"# replica 0 gone, a third one in\n{creds[1]}\n{creds[2]}\n")

            async def followed() -> bool:
                return await info() == {"1": bare[1], "2": bare[2]}

            await eventually(followed, "gateway_replica_info to follow the file")


# --------------------------------------------------------- serve --workers 2, processes

WORKERS_PROBES = 8  # fresh connections, spread over both workers by SO_REUSEPORT


async def _scrapes(url: str) -> list[str]:
    """/metrics over ``WORKERS_PROBES`` new connections (whichever worker takes each)."""

    async def one() -> str:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            r = await client.get("/metrics")
            assert r.status_code == 200, r.text
            return r.text

    return list(await asyncio.gather(*(one() for _ in range(WORKERS_PROBES))))


@pytest.mark.timeout(180)
async def test_with_two_workers_every_scrape_shows_the_owners_pause(tmp_path: Path) -> None:
    with sim_fleet(2, tmp_path, gateway_args=["--workers", "2"]) as f:
        async with httpx.AsyncClient(base_url=f.url, timeout=10) as client:
            for text in await _scrapes(f.url):
                assert value(text, "gateway_fleet_paused") == 0
            before = time.time()
            assert (await client.post("/pause", params={"mode": "keep"})).status_code == 200
            paused = await _scrapes(f.url)
            sinces = {value(t, "gateway_fleet_paused_since_seconds") for t in paused}
            assert len(sinces) == 1 and before <= sinces.pop() <= time.time()
            for text in paused:
                assert value(text, "gateway_fleet_paused") == 1  # the owner's, not 0 or 3
                assert value(text, "gateway_build_info") == 1
                assert set(replica_info(text)) == {"0", "1"}
                found = families(text)
                for name in PROCESS_FAMILIES:
                    assert len(found[name].samples) == 1, name
            assert (await client.post("/resume")).status_code == 200
            for text in await _scrapes(f.url):
                assert value(text, "gateway_fleet_paused") == 0
                assert value(text, "gateway_fleet_paused_since_seconds") == 0


# ------------------------------------------- health probes: their own series (issue 34)


def total(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of family ``name`` whose labels include ``labels``."""
    found = families(text).get(name)
    samples = found.samples if found is not None else []
    return float(sum(s.value for s in samples if labels.items() <= s.labels.items()))


@pytest.mark.timeout(180)
async def test_a_replica_down_counts_failed_probes_not_upstream_errors(tmp_path: Path) -> None:
    """The real CLI over two sim replicas; one stops and stays down. Its failed probes
    count in gateway_health_probes_total{result="unreachable"} and it leaves rotation,
    while gateway_upstream_errors_total stays at 0 (no request went to it): one outage,
    one page (RolloutGatewayReplicaDown), not a second one for upstream errors."""
    args = ["--health-interval-s", "0.2", "--health-timeout-s", "1"]
    with sim_fleet(2, tmp_path, gateway_args=args) as f:
        async with httpx.AsyncClient(base_url=f.url, timeout=10) as client:
            start = (await client.get("/metrics")).text
            series = {
                tuple(s.labels.values()) for s in families(start)["gateway_health_probes"].samples
            }
            assert series == set(product(("0", "1"), ProbeResult)), series  # each at start
            assert total(start, "gateway_upstream_errors") == 0
            f.sims[1].stop()

            async def down_a_while() -> str | None:
                text = (await client.get("/metrics")).text
                failed = total(text, "gateway_health_probes", replica="1", result="unreachable")
                healthy = total(text, "gateway_replica_healthy", replica="1")
                return text if failed >= 10 and healthy == 0 else None

            down = await eventually(down_a_while, "10 failed probes of the stopped replica")
            assert down is not None

            def probes(text: str, replica: str, result: str) -> float:
                return total(text, "gateway_health_probes", replica=replica, result=result)

            async def later() -> str | None:  # 5 more failed probes, while it stays down
                text = (await client.get("/metrics")).text
                more = probes(text, "1", "unreachable") - probes(down, "1", "unreachable")
                return text if more >= 5 else None

            text = await eventually(later, "5 more failed probes")
            assert text is not None
            errors = [s for s in families(text)["gateway_upstream_errors"].samples if s.value]
            assert not errors, errors
            assert total(text, "gateway_replica_ejections", replica="1") == 1
            assert probes(text, "1", "ok") == probes(down, "1", "ok")
            assert probes(text, "0", "ok") > probes(down, "0", "ok")


def test_the_label_sets_born_at_zero_cover_the_codes_values() -> None:
    """The closed sets ``gateway.metrics`` exports at 0 hold every value the code can
    record: each upstream failure kind the HTTP layer names, each admission refusal,
    each control call path."""
    source = "\n".join(p.read_text() for p in Path(gateway_package.__file__).parent.rglob("*.py"))
    kinds = set(re.findall(r'ReplicaConnectError\([^()]*?,\s*"([a-z_]+)"\)', source))
    kinds |= set(re.findall(r'ConnectFailed\("([a-z_]+)"', source))
    kinds |= set(re.findall(r'^\s+return "([a-z_]+)"$', (HTTP / "failures.py").read_text(),
                            re.MULTILINE))  # fmt: skip
    kinds |= {"timeout", "ejected"}  # a control call that got no answer (FanOut, Rotation.lost)
    assert {"refused", "connect_timeout", "reset", "dns", "tls"} <= kinds, kinds
    assert kinds <= set(UPSTREAM_ERROR_KINDS), kinds - set(UPSTREAM_ERROR_KINDS)
    assert {r.value for r in Refusal} == set(ADMISSION_REFUSALS)
    paths = {p.rsplit("/", 1)[-1] for p in (PAUSE, RESUME, RESET)}
    assert paths == set(CONTROL_CALLS)


@pytest.mark.timeout(180)
async def test_with_two_workers_a_refused_connection_counts_once(tmp_path: Path) -> None:
    """``serve --workers 2``: a worker that cannot reach a replica counts the upstream
    error in its own series and tells the owner, which ejects the replica without
    counting it again (the merged /metrics sums both). Each refused connection is retried
    on the other replica, so upstream errors equal retries."""
    args = ["--workers", "2", "--health-interval-s", "60"]  # no probe ejects it first
    with sim_fleet(2, tmp_path, gateway_args=args) as f:
        f.sims[1].stop()
        async with httpx.AsyncClient(base_url=f.url, timeout=10) as client:

            async def ejected() -> str | None:
                for i in range(4):  # fresh connections: both workers take some
                    async with httpx.AsyncClient(base_url=f.url, timeout=10) as one:
                        body = {"model": "tiny-base", "prompt": f"question {i} " * 20,
                                "max_tokens": 2}  # fmt: skip
                        r = await one.post("/v1/completions", json=body)
                        assert r.status_code == 200, r.text
                text = (await client.get("/metrics")).text
                return text if total(text, "gateway_replica_healthy", replica="1") == 0 else None

            text = await eventually(ejected, "replica 1 ejected by a refused connection")
            assert text is not None
            errors = total(text, "gateway_upstream_errors", replica="1")
            retries = total(text, "gateway_upstream_retries")
            assert errors >= 1 and errors == retries, (errors, retries)
