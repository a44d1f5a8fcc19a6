"""Subprocess harness for the fault-injection suite: real sims, a real gateway, real signals.

Every process is started with ``start_new_session=True`` (its own process group) and
killed by that group id in ``finally``; nothing else on the machine is touched. Each
process incarnation logs to its own file under the test's ``tmp_path``, so ``logs()`` can
return everything the suite produced, including processes that were SIGKILLed and
restarted.

* ``fleet(tmp_path, n=...)`` starts ``n`` ``python -m rollout_testbed sim-replica`` processes and
  one ``python -m gateway serve`` with distinctive upstream token, API key and admin key,
  JSON logs and a 0.2 s health interval, and waits until ``/health`` is 200.
* Each process is a ``rollout_testbed.procs.Proc``: ``kill()`` (SIGKILL), ``restart()``
  (same port), ``freeze()``/``thaw()`` (SIGSTOP/SIGCONT: the kernel still accepts
  connections, nobody answers), ``stop()`` (SIGTERM, then SIGKILL).
* ``Fleet.client`` is an ``httpx.AsyncClient`` whose transport records every response's
  headers and body (streams included, as far as they were read) into a ``Capture``;
  raw-socket tests add what they received with ``Capture.add_raw``. ``CAPTURES`` and
  ``log_files()`` hold everything of the session, which ``test_secrets`` greps for secrets.

``python -m tests.faults.procs echo-replica --port P`` runs a minimal raw-socket replica
that answers with the request line and headers it received, for header-hygiene tests
(``Authorization`` values are reported as a SHA-256 digest so the echo itself never puts
the upstream token into a response body).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import random
import re
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rollout_testbed.procs import Proc, free_ports, gateway_argv, sim_argv
from rollout_testbed.sim.server import VLLM_IDLE_S

from tests.conftest import ADMIN_KEY, CLIENT_KEY, SECRETS, UPSTREAM_TOKEN
from tests.deploy._proc import base_env
from tests.eventually import STALL_S

__all__ = [
    "ADMIN",
    "CAPTURES",
    "Capture",
    "Fleet",
    "digest",
    "fleet",
    "log_files",
    "metric",
]

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
"""Headers for admin calls (load/unload/pause/resume/reset)."""

CAPTURES: list[Capture] = []
"""Every ``Capture`` created in this session (responses the suite received)."""
_PROCS: list[Proc] = []
"""Every process a fleet of this session started."""


def log_files() -> list[Path]:
    """Every subprocess log file created in this session (all incarnations)."""
    return [log for proc in _PROCS for log in proc.log_files]


def digest(value: str) -> str:
    """What the echo replica reports instead of an ``Authorization`` value."""
    return "sha256:" + hashlib.sha256(value.encode("latin-1")).hexdigest()


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group(1) != name:
            continue
        have = dict(_LABEL.findall(m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


# --- response capture -----------------------------------------------------------------


@dataclass
class Captured:
    what: str
    status: int
    headers: str
    body: bytearray = field(default_factory=bytearray)


@dataclass
class Capture:
    """Every response (status line, headers, body bytes read) a test received."""

    items: list[Captured] = field(default_factory=list)

    def __post_init__(self) -> None:
        CAPTURES.append(self)

    def add(self, what: str, status: int, headers: str, body: bytes = b"") -> Captured:
        item = Captured(what, status, headers, bytearray(body))
        self.items.append(item)
        return item

    def add_raw(self, what: str, data: bytes) -> None:
        """Bytes received on a raw socket (status line, headers and body together)."""
        self.add(what, 0, "", data)

    def text(self) -> str:
        parts = []
        for item in self.items:
            body = bytes(item.body).decode("utf-8", "replace")
            parts.append(f"{item.what} {item.status}\n{item.headers}\n{body}")
        return "\n".join(parts)


class _Tee(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, sink: Captured) -> None:
        self._inner = inner
        self._sink = sink

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            self._sink.body += chunk
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


class RecordingTransport(httpx.AsyncBaseTransport):
    """An ``httpx`` transport that copies every response into a ``Capture``."""

    def __init__(self, capture: Capture) -> None:
        # Idle connections given up well before a sim closes them (VLLM_IDLE_S): one
        # reused as the sim's close crossed it was lost with "server disconnected".
        limits = httpx.Limits(max_connections=512, keepalive_expiry=VLLM_IDLE_S - STALL_S)
        self._inner = httpx.AsyncHTTPTransport(limits=limits)
        self._capture = capture

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        headers = "\n".join(f"{k}: {v}" for k, v in response.headers.multi_items())
        sink = self._capture.add(f"{request.method} {request.url}", response.status_code, headers)
        assert isinstance(response.stream, httpx.AsyncByteStream)
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_Tee(response.stream, sink),
            extensions=response.extensions,
            request=request,
        )

    async def aclose(self) -> None:
        await self._inner.aclose()


# --- the fleet --------------------------------------------------------------------------


@dataclass
class Fleet:
    sims: list[Proc]
    gateway: Proc
    client: httpx.AsyncClient
    """Recording client on the gateway, with the client API key."""
    control: httpx.AsyncClient
    """Recording client for the sims' ``/sim/...`` endpoints (absolute URLs)."""
    capture: Capture
    health_interval_s: float

    @property
    def url(self) -> str:
        return self.gateway.url

    def logs(self) -> str:
        """Everything every process of this fleet wrote, all incarnations."""
        return "".join(p.output() for p in [self.gateway, *self.sims])

    def gateway_records(self) -> list[dict[str, Any]]:
        """The gateway's JSON log records (non-JSON lines, e.g. a crash, are kept as text)."""
        records = []
        for line in self.gateway.output().splitlines():
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                records.append({"level": "RAW", "message": line})
        return records

    def gateway_errors(self) -> list[str]:
        """ERROR/CRITICAL records and raw (non-JSON) lines such as tracebacks."""
        return [
            str(r.get("message", "")) + str(r.get("exc", ""))
            for r in self.gateway_records()
            if r.get("level") in ("ERROR", "CRITICAL", "RAW")
        ]

    # -- gateway views --

    async def status(self) -> dict[str, Any]:
        r = await self.client.get("/gateway/status")
        r.raise_for_status()
        data: dict[str, Any] = r.json()
        return data

    async def routable(self, name: str) -> list[int]:
        """Replicas the gateway would send a request for adapter ``name`` to."""
        status = await self.status()
        for adapter in status["adapters"]["adapters"]:
            if adapter["name"] == name and adapter["state"] == "live":
                up = {r["index"] for r in status["adapters"]["replicas"] if r["state"] == "up"}
                return sorted(set(adapter["replicas"]) & up)
        return []

    async def healthy(self, index: int) -> bool:
        return bool((await self.status())["replicas"][index]["healthy"])

    async def metrics(self) -> str:
        return (await self.client.get("/metrics")).text

    async def in_flight(self) -> float:
        return metric(await self.metrics(), "gateway_replica_in_flight_requests")

    # -- sim control --

    async def faults(self, index: int, **values: Any) -> None:
        r = await self.control.post(f"{self.sims[index].url}/sim/faults", json=values)
        assert r.status_code == 200, r.text

    async def clear_faults(self, index: int) -> None:
        r = await self.control.delete(f"{self.sims[index].url}/sim/faults")
        assert r.status_code == 200, r.text

    async def sim_stats(self, index: int) -> dict[str, Any]:
        r = await self.control.get(f"{self.sims[index].url}/sim/stats")
        r.raise_for_status()
        data: dict[str, Any] = r.json()
        return data

    async def held(self, index: int) -> dict[str, str]:
        """Adapters replica ``index`` holds: name -> path."""
        held: dict[str, str] = (await self.sim_stats(index))["adapters"]
        return held

    async def sim_metrics(self, index: int) -> str:
        return (await self.control.get(f"{self.sims[index].url}/metrics")).text

    # -- lifecycle --

    async def wait_sim_up(self, index: int, timeout: float = 20.0) -> None:
        await self.sims[index].await_http("/health", timeout=timeout)

    async def restart_sim(self, index: int, timeout: float = 20.0) -> None:
        self.sims[index].restart()
        await self.wait_sim_up(index, timeout)

    async def restart_gateway(self, *, kill: bool = True, timeout: float = 20.0) -> None:
        """Restart the gateway on the same port (SIGKILL by default, else SIGTERM)."""
        if kill:
            self.gateway.kill()
        else:
            self.gateway.stop()
        self.gateway.start()
        await self.gateway.await_http("/health", timeout=timeout)

    async def load(self, name: str, path: str | None = None) -> httpx.Response:
        body = {"lora_name": name, "lora_path": path or f"/adapters/{name}"}
        return await self.client.post("/v1/load_lora_adapter", json=body, headers=ADMIN)


def echo_argv(port: int) -> list[str]:
    return [PY, "-m", "tests.faults.procs", "echo-replica", "--port", str(port)]


def _proc(name: str, argv: list[str], log_dir: Path, env: dict[str, str], port: int) -> Proc:
    """One process of a fleet: its own session, a fresh log file per start (``NAME.N.log``),
    registered for ``log_files()``."""
    proc = Proc(name, argv, log_dir / f"{name}.log", env=env, cwd=ROOT,
                url=f"http://127.0.0.1:{port}", append=False, log_per_start=True)  # fmt: skip
    _PROCS.append(proc)
    return proc


@contextlib.asynccontextmanager
async def fleet(
    tmp_path: Path,
    n: int = 2,
    *,
    latency: str = "instant",
    health_interval_s: float = 0.2,
    settings: Mapping[str, Any] | None = None,
    gateway_args: Sequence[str] = (),
    log_level: str = "INFO",
    echo: bool = False,
    check_secrets: bool = True,
    userinfo: str | None = None,
) -> AsyncIterator[Fleet]:
    """``n`` sim replicas (or echo replicas) behind one gateway, all subprocesses.

    ``settings`` become ``GATEWAY_<NAME>`` variables (for settings without a flag);
    ``userinfo`` (``user:password``) is put into the replica URLs the gateway is given.
    On a clean exit, the fleet's logs and captured responses are checked for secrets.
    """
    log_dir = tmp_path / "procs"
    log_dir.mkdir(exist_ok=True)
    sims: list[Proc] = []
    *sim_ports, gw_port = free_ports(n + 1)
    for i, port in enumerate(sim_ports):
        argv = echo_argv(port) if echo else sim_argv(port, latency=latency, max_loras=8)
        sims.append(_proc(f"sim{i}", argv, log_dir, base_env({}), port))
    urls = [s.url.replace("://", f"://{userinfo}@") if userinfo else s.url for s in sims]
    extra = ["--upstream-token", UPSTREAM_TOKEN, "--api-key", CLIENT_KEY,
             "--admin-key", ADMIN_KEY, "--health-interval-s", str(health_interval_s),
             "--log-format", "json", "--log-level", log_level, *gateway_args]  # fmt: skip
    argv = gateway_argv(gw_port, urls, extra=extra)
    env = base_env({f"GATEWAY_{k.upper()}": str(v) for k, v in (settings or {}).items()})
    gateway = _proc("gateway", argv, log_dir, env, gw_port)
    capture = Capture()
    timeout = httpx.Timeout(30.0, connect=5.0)
    transport = RecordingTransport(capture)
    client = httpx.AsyncClient(
        base_url=gateway.url, transport=transport, timeout=timeout,
        headers={"Authorization": f"Bearer {CLIENT_KEY}"},
    )  # fmt: skip
    control = httpx.AsyncClient(transport=RecordingTransport(capture), timeout=timeout)
    f = Fleet(sims, gateway, client, control, capture, health_interval_s)
    ok = False
    try:
        # All at once: the gateway's start-up overlaps the sims'; it admits each replica
        # on the first good probe, and /health is 200 once every one is in.
        for proc in [*sims, gateway]:
            proc.start()
        await asyncio.gather(*(f.wait_sim_up(i) for i in range(n)))
        await gateway.await_http("/health", timeout=20.0)
        yield f
        ok = True
    finally:
        for proc in [gateway, *sims]:
            if proc.frozen:
                proc.thaw()
            proc.kill()
        await client.aclose()
        await control.aclose()
    if ok and check_secrets:
        assert_no_secrets(f.logs() + f.capture.text(), "this fleet's logs and responses")


def assert_no_secrets(text: str, where: str) -> None:
    for secret in SECRETS:
        at = text.find(secret)
        assert at < 0, f"a secret leaked into {where}: ...{text[max(0, at - 200) : at]}"


# --- closed-loop load ---------------------------------------------------------------------


@dataclass
class Outcome:
    """One completion request as the client saw it."""

    stream: bool
    model: str
    started: float
    status: int = 0
    replica: str | None = None
    body: bytes = b""
    first_chunk: float | None = None
    ended: float | None = None
    error: str | None = None
    """A client-side failure (timeout, reset); None if an HTTP answer came back whole."""

    def events(self) -> list[str]:
        return [ln[6:] for ln in self.body.decode("utf-8", "replace").split("\n")
                if ln.startswith("data: ")]  # fmt: skip

    @property
    def sse_done(self) -> bool:
        return self.stream and self.events()[-1:] == ["[DONE]"]

    @property
    def sse_error(self) -> dict[str, Any] | None:
        """The final SSE event, if it is the gateway's ``{"error": {...}}`` event."""
        events = self.events()
        if not self.stream or not events or not events[-1].startswith("{"):
            return None
        last = json.loads(events[-1])
        error = last.get("error") if isinstance(last, dict) else None
        return error if isinstance(error, dict) else None


class Load:
    """``workers`` closed-loop clients sending completions until ``stop()``.

    Requests alternate streaming / non-streaming and cycle through ``models``; prompts are
    random token ids (so the prefix router spreads them over every replica). ``live`` holds
    the requests in progress, so a test can wait for e.g. a stream that is mid-body on a
    given replica before injecting its fault.
    """

    def __init__(
        self, f: Fleet, workers: int, models: Sequence[str] = ("tiny-base",), *,
        stream_every: int = 2, max_tokens: tuple[int, int] = (8, 20), seed: int = 0,
        request_timeout: float = 20.0, max_requests: int = 20_000,
    ) -> None:  # fmt: skip
        self.f = f
        self.models = list(models)
        self.stream_every = stream_every
        self.max_tokens = max_tokens
        self.request_timeout = request_timeout
        self.max_requests = max_requests
        self.outcomes: list[Outcome] = []
        self.live: dict[int, Outcome] = {}
        self._rng = random.Random(seed)
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._worker(w)) for w in range(workers)]
        self._sent = 0

    async def _worker(self, w: int) -> None:
        k = 0
        while not self._stop.is_set() and self._sent < self.max_requests:
            self._sent += 1
            k += 1
            await self.one(stream=(w + k) % self.stream_every == 0,
                           model=self.models[(w + k) % len(self.models)])  # fmt: skip

    async def one(self, *, stream: bool, model: str) -> Outcome:
        rng = self._rng
        prompt = [rng.randrange(1, 2000) for _ in range(rng.randint(4, 48))]
        body = {"model": model, "prompt": prompt, "stream": stream,
                "max_tokens": rng.randint(*self.max_tokens)}  # fmt: skip
        out = Outcome(stream, model, time.monotonic())
        key = id(out)
        self.live[key] = out
        try:
            async with asyncio.timeout(self.request_timeout):
                async with self.f.client.stream("POST", "/v1/completions", json=body) as r:
                    out.status = r.status_code
                    out.replica = r.headers.get("x-gateway-replica")
                    async for chunk in r.aiter_bytes():
                        if out.first_chunk is None:
                            out.first_chunk = time.monotonic()
                        out.body += chunk
        except (TimeoutError, httpx.HTTPError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"
        finally:
            out.ended = time.monotonic()
            del self.live[key]
            self.outcomes.append(out)
        return out

    def live_on(self, replica: int, *, stream: bool, mid_body: bool) -> list[Outcome]:
        return [
            o for o in self.live.values()
            if o.replica == str(replica) and o.stream == stream
            and (o.first_chunk is not None or not mid_body)
        ]  # fmt: skip

    async def stop(self, timeout: float = 30.0) -> list[Outcome]:
        self._stop.set()
        async with asyncio.timeout(timeout):
            await asyncio.gather(*self._tasks)
        return self.outcomes


# --- echo replica (raw sockets) ---------------------------------------------------------


_ECHO_HOP = [
    (b"Connection", b"keep-alive, X-Hop-Resp"),
    (b"X-Hop-Resp", b"must-not-pass"),
    (b"Keep-Alive", b"timeout=30"),
    (b"Proxy-Authenticate", b'Basic realm="replica"'),
    (b"Proxy-Connection", b"keep-alive"),
    (b"Trailer", b"X-Checksum"),
    (b"X-Echo-Custom", b"kept"),
    # Not hop-by-hop, but the gateway's to set: the replica's values must not pass.
    (b"X-Request-Id", b"from-the-replica"),
    (b"X-Gateway-Replica", b"99"),
]
_ECHO_SEEN: list[dict[str, Any]] = []
"""Every request the echo replica received (``GET /echo/requests`` returns them)."""


def _echo_payload(method: str, target: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
    shown = [(k, digest(v) if k.lower() == "authorization" else v) for k, v in headers]
    return json.dumps(
        {"method": method, "target": target, "headers": shown, "body": body.decode("latin-1")}
    ).encode()


async def _echo_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                return
            lines = head[:-4].split(b"\r\n")
            method, target, _ = lines[0].decode("latin-1").split(" ", 2)
            headers = []
            for line in lines[1:]:
                name, _, value = line.decode("latin-1").partition(":")
                headers.append((name, value.strip()))
            length = next((int(v) for k, v in headers if k.lower() == "content-length"), 0)
            body = await reader.readexactly(length) if length else b""
            extra: list[tuple[bytes, bytes]] = []
            if target not in ("/health", "/echo/requests"):
                shown = json.loads(_echo_payload(method, target, headers, body))
                _ECHO_SEEN.append(shown)
            if target == "/echo/requests":
                payload, ctype = json.dumps(_ECHO_SEEN).encode(), b"application/json"
            elif target == "/health":
                payload, ctype = b"", b"text/plain"
            elif target == "/v1/models":
                payload = json.dumps({"object": "list", "data": [
                    {"id": "tiny-base", "object": "model", "root": "tiny-base", "parent": None}
                ]}).encode()  # fmt: skip
                ctype = b"application/json"
            else:
                payload, ctype = _echo_payload(method, target, headers, body), b"application/json"
                extra = _ECHO_HOP
            out = [b"HTTP/1.1 200 OK", b"Content-Type: " + ctype,
                   b"Content-Length: " + str(len(payload)).encode()]  # fmt: skip
            out += [k + b": " + v for k, v in extra]
            writer.write(b"\r\n".join(out) + b"\r\n\r\n" + payload)
            await writer.drain()
    finally:
        writer.close()


async def _echo_main(port: int) -> None:
    server = await asyncio.start_server(_echo_conn, "127.0.0.1", port, reuse_address=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.faults.procs")
    sub = parser.add_subparsers(dest="command", required=True)
    echo = sub.add_parser("echo-replica", help="raw-socket replica that echoes request headers")
    echo.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_echo_main(args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
