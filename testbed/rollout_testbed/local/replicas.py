"""Start, stop and inspect N local vLLM (or sim) replicas on 127.0.0.1.

    rollout-testbed replicas up [--n 2] [--model-dir DIR] [--base-port 8101] [--max-staleness 4]
                               [--state-file .run/replicas.json] [--vllm-python PATH] [--sim]
                               [--timeout 300]
    rollout-testbed replicas status [--state-file ...]
    rollout-testbed replicas down [--state-file ...] [--purge]

Python API (used by the e2e session fixture)::

    rs = start_replicas(2, model_dir)      # -> ReplicaSet, healthy and warmed up
    rs.urls                                # ["http://127.0.0.1:8101", ...]
    stop_replicas(rs)                      # or stop_replicas(path_to_state_file)

Every replica runs in its own session/process group (``start_new_session=True``); it is
stopped by SIGTERM to that process group, then SIGKILL after a grace period. A group is
only signalled when one of its live members carries this run's marker in its environment,
so a stale state file can never make ``down`` kill someone else's processes.
Only the standard library is used, so this runs in the gateway venv (no torch).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollout_testbed.local.netns import Netns
from rollout_testbed.local.vllm_env import VllmNotInstalledError, check_vllm_python, package_root

STATE_VERSION = 1
DEFAULT_STATE_FILE = ".run/replicas.json"
DEFAULT_MODEL_DIR = ".run/tiny-model"
DEFAULT_BASE_PORT = 8101
DEFAULT_MAX_STALENESS = 4
DEFAULT_TIMEOUT = 300.0
SERVED_MODEL_NAME = "tiny-base"
MARKER_ENV = "ROLLOUT_GATEWAY_REPLICA_RUN"
# AF_UNIX paths are limited to 107 bytes; vLLM puts "<TMPDIR>/<uuid4>" ZMQ sockets there.
MAX_TMPDIR_LEN = 60


log = logging.getLogger("rollout_testbed.local.replicas")


class ReplicaError(RuntimeError):
    """A replica failed to start, or the state file is unusable."""


@dataclass
class Replica:
    index: int
    port: int
    url: str
    pid: int
    pgid: int
    core: int | None
    log: str
    tmpdir: str
    cmd: list[str]
    start_ticks: int | None = None


@dataclass
class ReplicaSet:
    kind: str  # "vllm" | "sim"
    run_id: str
    run_dir: str
    state_file: str
    host: str
    served_model_name: str
    model_dir: str | None
    max_staleness: int
    max_loras: int
    python: str
    started_at: float
    replicas: list[Replica] = field(default_factory=list)
    cold_start_s: list[float] = field(default_factory=list)
    version: int = STATE_VERSION
    # Popen handles when this process started the replicas (not serialized): lets us reap.
    _procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def serve_command(self) -> str:
        reps = " ".join(f"--replica {u}" for u in self.urls)
        return f"rollout-gateway serve {reps}"

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in vars(self).items() if k != "_procs"}
        d["replicas"] = [asdict(r) for r in self.replicas]
        return d

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ReplicaSet:
        if data.get("version") != STATE_VERSION:
            raise ReplicaError(f"unsupported state file version {data.get('version')!r}")
        data = dict(data)
        data.pop("_procs", None)
        reps = [Replica(**r) for r in data.pop("replicas")]
        return cls(**data, replicas=reps)

    def save(self) -> None:
        path = Path(self.state_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        tmp.replace(path)

    @classmethod
    def load(cls, state_file: str | os.PathLike[str]) -> ReplicaSet:
        path = Path(state_file)
        try:
            return cls.from_json(json.loads(path.read_text()))
        except FileNotFoundError:
            raise
        except (ValueError, TypeError, KeyError) as exc:
            raise ReplicaError(f"cannot read state file {path}: {exc}") from exc


# ---------------------------------------------------------------------------------------
# /proc helpers: process groups, liveness, ownership
# ---------------------------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, pgrp, starttime ticks) of a pid, or None if it does not exist."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    rest = raw[raw.rfind(")") + 2 :].split()
    # fields after "(comm)": state(3) ppid(4) pgrp(5) ... starttime(22)
    return rest[0], int(rest[2]), int(rest[19])


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids whose process group is ``pgid``."""
    out: list[int] = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        st = _proc_stat(int(entry.name))
        if st and st[1] == pgid and st[0] not in ("Z", "X"):
            out.append(int(entry.name))
    return out


def group_rss_bytes(pgid: int) -> int:
    """Resident set size summed over the live members of a process group."""
    total = 0
    for pid in group_members(pgid):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            continue
    return total


def _has_marker(pid: int, run_id: str) -> bool:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{MARKER_ENV}={run_id}".encode() in env.split(b"\0")


def owned_group_members(pgid: int, run_id: str) -> list[int]:
    """Members of ``pgid`` if at least one carries this run's marker; else []."""
    members = group_members(pgid)
    if any(_has_marker(p, run_id) for p in members):
        return members
    return []


def _reap(rs: ReplicaSet) -> None:
    for proc in rs._procs.values():
        proc.poll()


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


# ---------------------------------------------------------------------------------------
# HTTP helpers (stdlib only)
# ---------------------------------------------------------------------------------------


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def http_post_json(url: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[int, bytes]:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def health(url: str, timeout: float = 2.0) -> int | None:
    try:
        return http_get(url.rstrip("/") + "/health", timeout=timeout)[0]
    except (OSError, ValueError):
        return None


def free_base_port(n: int, host: str = "127.0.0.1", lo: int = 20000, hi: int = 32000) -> int:
    """A base port such that ``base .. base+n-1`` are all free now (below the ephemeral range)."""
    import random

    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(lo, hi - n)
        socks: list[socket.socket] = []
        try:
            for p in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((host, p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise ReplicaError(f"no {n} consecutive free ports found in [{lo}, {hi})")


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def log_tail(path: str | os.PathLike[str], lines: int = 40) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


# ---------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------


def vllm_command(
    python: str,
    model_dir: str,
    *,
    port: int,
    host: str,
    max_loras: int,
    max_cpu_loras: int,
    served_model_name: str = SERVED_MODEL_NAME,
    max_model_len: int = 512,
    extra_args: Sequence[str] = (),
) -> list[str]:
    return [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_dir,
        "--served-model-name", served_model_name,
        "--host", host,
        "--port", str(port),
        "--dtype", "bfloat16",
        "--max-model-len", str(max_model_len),
        "--max-num-seqs", "16",
        "--max-num-batched-tokens", "2048",
        "--kv-cache-memory-bytes", str(256 * 1024 * 1024),
        "--block-size", "32",
        "--enable-lora",
        "--max-loras", str(max_loras),
        "--max-lora-rank", "8",
        "--max-cpu-loras", str(max_cpu_loras),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
        *extra_args,
    ]  # fmt: skip


def sim_command(
    python: str,
    *,
    port: int,
    host: str,
    max_loras: int,
    served_model_name: str,
    extra_args: Sequence[str] = (),
) -> list[str]:
    # `python -m rollout_testbed sim-replica` is the wired CLI; calling the module's main directly
    # keeps this independent of the CLI wiring.
    code = "import sys; from rollout_testbed.sim.server import main; sys.exit(main(sys.argv[1:]))"
    return [
        python, "-c", code,
        "--port", str(port), "--host", host,
        "--model", served_model_name, "--max-loras", str(max_loras), *extra_args,
    ]  # fmt: skip


def _replica_env(
    kind: str, run_id: str, *, core: int, tmpdir: Path, cache_dir: Path
) -> dict[str, str]:
    env = dict(os.environ)
    # Never inherit the gateway venv into the vLLM venv (or vice versa).
    for k in ("VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(k, None)
    env.update(
        {
            MARKER_ENV: run_id,
            "TMPDIR": str(tmpdir),
            "PYTHONUNBUFFERED": "1",
        }
    )
    if kind == "sim":
        root = str(package_root())
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if "PYTHONPATH" in env else "")
        return env
    env.pop("PYTHONPATH", None)
    env.update(
        {
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(core),
            "VLLM_HOST_IP": "127.0.0.1",
            "TORCHINDUCTOR_CACHE_DIR": str(cache_dir / "inductor"),
            "TRITON_CACHE_DIR": str(cache_dir / "triton"),
            "VLLM_CACHE_ROOT": str(cache_dir / "vllm"),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    return env


def _private_tmpdir(run_dir: Path, index: int, run_id: str) -> Path:
    cand = run_dir / f"r{index}" / "tmp"
    if len(str(cand)) <= MAX_TMPDIR_LEN:
        cand.mkdir(parents=True, exist_ok=True)
        return cand
    # Too long for ZMQ's AF_UNIX sockets: use a short private dir; `down` removes it.
    return Path(tempfile.mkdtemp(prefix=f"rg-{run_id[:8]}-r{index}-"))


def ensure_tiny_model(model_dir: Path, python: str, timeout: float = 600.0) -> None:
    """Build the tiny model with the vLLM venv's python when ``model_dir`` is missing."""
    if (model_dir / "config.json").exists():
        return
    script = Path(__file__).resolve().with_name("tiny_model.py")
    log.info("building the tiny model in %s", model_dir)
    res = subprocess.run(
        [python, str(script), str(model_dir), "--force"],
        env=dict(os.environ, ROLLOUT_GATEWAY_TINY_MODEL_NO_DELEGATE="1", PYTHONPATH=""),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if res.returncode != 0:
        raise ReplicaError(
            f"building the tiny model failed (exit {res.returncode}):\n{res.stderr[-2000:]}"
        )


def _wait_healthy(rs: ReplicaSet, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = {r.index: r for r in rs.replicas}
    t0 = rs.started_at
    cold = dict.fromkeys(pending, 0.0)
    while pending:
        for idx, r in list(pending.items()):
            proc = rs._procs.get(r.pid)
            if proc is not None and proc.poll() is not None:
                raise ReplicaError(
                    f"replica {idx} (port {r.port}) exited with code {proc.returncode} "
                    f"before becoming healthy. Log {r.log}:\n{log_tail(r.log)}"
                )
            if health(r.url) == 200:
                cold[idx] = time.time() - t0
                log.info("%s healthy after %.1f s", r.url, cold[idx])
                del pending[idx]
        if not pending:
            break
        if time.monotonic() > deadline:
            tails = "\n".join(
                f"--- replica {r.index} ({r.log}):\n{log_tail(r.log, 20)}" for r in pending.values()
            )
            raise ReplicaError(f"replicas not healthy after {timeout:.0f} s:\n{tails}")
        time.sleep(0.5)
    rs.cold_start_s = [round(cold[r.index], 2) for r in rs.replicas]


def warm_up(rs: ReplicaSet, requests: int = 1, timeout: float = 180.0) -> float:
    """Send completions with logprobs to every replica, concurrently; returns seconds taken.

    The first request with logprobs compiles a kernel and stalls the engine for 2-12 s.
    """
    from concurrent.futures import ThreadPoolExecutor

    def one(r: Replica) -> str | None:
        for i in range(max(requests, 0)):
            body = {
                "model": rs.served_model_name,
                "prompt": f"Warm-up request {i}: hello",
                "max_tokens": 4,
                "temperature": 0.0,
                "logprobs": 1,
            }
            try:
                status, payload = http_post_json(r.url + "/v1/completions", body, timeout=timeout)
            except OSError as exc:
                return f"warm-up on {r.url} failed: {exc}\n{log_tail(r.log)}"
            if status != 200:
                return (
                    f"warm-up on {r.url} failed: HTTP {status} {payload[:500]!r}\n{log_tail(r.log)}"
                )
        return None

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(len(rs.replicas), 1)) as pool:
        errors = [e for e in pool.map(one, rs.replicas) if e]
    if errors:
        raise ReplicaError("\n".join(errors))
    return time.monotonic() - t0


def start_replicas(
    n: int = 2,
    model_dir: str | os.PathLike[str] | None = None,
    *,
    base_port: int = DEFAULT_BASE_PORT,
    ports: Sequence[int] | None = None,
    max_staleness: int = DEFAULT_MAX_STALENESS,
    state_file: str | os.PathLike[str] = DEFAULT_STATE_FILE,
    run_dir: str | os.PathLike[str] | None = None,
    vllm_python: str | os.PathLike[str] | None = None,
    sim: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
    host: str = "127.0.0.1",
    warmup_requests: int = 1,
    served_model_name: str = SERVED_MODEL_NAME,
    extra_args: Sequence[str] = (),
    pin_cores: bool = True,
    netns: Sequence[Netns] = (),
) -> ReplicaSet:
    """Start ``n`` replicas, wait for /health 200, warm them up, write the state file.

    ``ports`` overrides ``base_port`` (replica i gets ``ports[i]``); see
    ``rollout_testbed.procs.free_ports``. ``netns``: replica i runs inside ``netns[i]``
    and listens on its address instead of ``host`` (``rollout_testbed.local.netns``).
    ``extra_args`` are added to each replica's command line (vLLM's flags, or with ``sim``
    the simulated replica's: ``--latency-model``, ``--max-num-seqs``, ...).
    On any failure every replica started so far is stopped before the error propagates.
    Raises VllmNotInstalledError (vLLM missing) or ReplicaError.
    """
    if n < 1:
        raise ReplicaError("--n must be >= 1")
    state_path = Path(state_file).resolve()
    if state_path.exists():
        try:
            old = ReplicaSet.load(state_path)
        except ReplicaError:
            old = None
        if old is not None and any(owned_group_members(r.pgid, old.run_id) for r in old.replicas):
            raise ReplicaError(
                f"replicas from {state_path} are still running; run `replicas down` first"
            )
    port_list = list(ports) if ports is not None else list(range(base_port, base_port + n))
    if len(port_list) != n or len(set(port_list)) != n:
        raise ReplicaError(f"need {n} distinct ports, got {port_list}")
    if netns and len(netns) != n:
        raise ReplicaError(f"need {n} namespaces, got {len(netns)}")
    busy = [] if netns else [p for p in port_list if port_in_use(host, p)]
    if busy:
        raise ReplicaError(f"port(s) already in use on {host}: {busy}")

    kind = "sim" if sim else "vllm"
    python = sys.executable if sim else str(check_vllm_python(vllm_python))
    mdir: Path | None = None
    if not sim:
        mdir = Path(model_dir or state_path.parent / "tiny-model").resolve()
        ensure_tiny_model(mdir, python)

    run_id = uuid.uuid4().hex
    rdir = Path(run_dir).resolve() if run_dir else state_path.parent / f"replicas-{run_id[:8]}"
    rdir.mkdir(parents=True, exist_ok=True)
    cache_root = state_path.parent / "vllm-cache"
    max_loras = max_staleness + 2
    ncpu = os.cpu_count() or 1
    rs = ReplicaSet(
        kind=kind,
        run_id=run_id,
        run_dir=str(rdir),
        state_file=str(state_path),
        host=host,
        served_model_name=served_model_name,
        model_dir=str(mdir) if mdir else None,
        max_staleness=max_staleness,
        max_loras=max_loras,
        python=python,
        started_at=time.time(),
    )
    taskset = shutil.which("taskset") if pin_cores else None
    try:
        for i in range(n):
            port = port_list[i]
            rhost = netns[i].ns_ip if netns else host
            core = i % ncpu
            tmpdir = _private_tmpdir(rdir, i, run_id)
            cache_dir = cache_root / f"r{i}"
            env = _replica_env(kind, run_id, core=core, tmpdir=tmpdir, cache_dir=cache_dir)
            if sim:
                cmd = sim_command(
                    python, port=port, host=rhost, max_loras=max_loras,
                    served_model_name=served_model_name, extra_args=extra_args,
                )  # fmt: skip
            else:
                assert mdir is not None
                cmd = vllm_command(
                    python, str(mdir), port=port, host=rhost, max_loras=max_loras,
                    max_cpu_loras=max_loras + 2, served_model_name=served_model_name,
                    extra_args=extra_args,
                )  # fmt: skip
                if taskset:
                    cmd = [taskset, "-c", str(core), *cmd]
            if netns:
                cmd = [*netns[i].prefix(), *cmd]
            log_path = rdir / f"replica-{i}.log"
            with open(log_path, "ab") as logf:
                proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=str(rdir),
                    start_new_session=True,
                )
            rs._procs[proc.pid] = proc
            st = _proc_stat(proc.pid)
            rs.replicas.append(
                Replica(
                    index=i,
                    port=port,
                    url=f"http://{rhost}:{port}",
                    pid=proc.pid,
                    pgid=proc.pid,  # start_new_session: the child leads its own group
                    core=core if (taskset and not sim) else None,
                    log=str(log_path),
                    tmpdir=str(tmpdir),
                    cmd=cmd,
                    start_ticks=st[2] if st else None,
                )
            )
        rs.save()  # early, so `down` can clean up even if we die while waiting
        _wait_healthy(rs, timeout)
        log.info("warm-up done in %.1f s", warm_up(rs, warmup_requests))
        rs.save()
    except BaseException:
        stop_replicas(rs)
        raise
    return rs


def stop_replicas(
    state: ReplicaSet | str | os.PathLike[str],
    *,
    grace: float = 30.0,
    purge: bool = False,
) -> list[str]:
    """SIGTERM each replica's process group, wait up to ``grace`` s, then SIGKILL.

    Removes the private temp dirs (and the whole run dir with ``purge``) and the state
    file. Returns human-readable notes about what was done. Idempotent.
    """
    rs = state if isinstance(state, ReplicaSet) else ReplicaSet.load(state)
    notes: list[str] = []
    groups = {r.pgid: r for r in rs.replicas}
    live = {g: owned_group_members(g, rs.run_id) for g in groups}
    for g, members in live.items():
        if members:
            _signal_group(g, signal.SIGTERM)
            notes.append(f"SIGTERM pgid {g} ({len(members)} processes)")
        else:
            notes.append(f"pgid {g}: not running")
    deadline = time.monotonic() + grace
    remaining = [g for g, m in live.items() if m]
    while remaining and time.monotonic() < deadline:
        _reap(rs)
        remaining = [g for g in remaining if group_members(g)]
        if remaining:
            time.sleep(0.2)
    for g in remaining:
        if owned_group_members(g, rs.run_id):
            _signal_group(g, signal.SIGKILL)
            notes.append(f"SIGKILL pgid {g} (did not exit within {grace:.0f} s)")
    kill_deadline = time.monotonic() + 10.0
    while remaining and time.monotonic() < kill_deadline:
        _reap(rs)
        remaining = [g for g in remaining if group_members(g)]
        if remaining:
            time.sleep(0.1)
    for proc in rs._procs.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1.0)
    if remaining:
        notes.append(f"WARNING: process groups still alive: {remaining}")
    # Temp files: private TMPDIRs (ZMQ sockets etc.), wherever they are.
    for r in rs.replicas:
        shutil.rmtree(r.tmpdir, ignore_errors=True)
    if purge:
        shutil.rmtree(rs.run_dir, ignore_errors=True)
    Path(rs.state_file).unlink(missing_ok=True)
    return notes


def replica_status(rs: ReplicaSet) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for r in rs.replicas:
        members = owned_group_members(r.pgid, rs.run_id)
        code = health(r.url) if members else None
        rss = sum(group_rss_bytes(g) for g in {r.pgid}) if members else 0
        models: list[str] = []
        if code == 200:
            try:
                status, body = http_get(r.url + "/v1/models", timeout=5.0)
                if status == 200:
                    models = [m["id"] for m in json.loads(body).get("data", [])]
            except (OSError, ValueError, KeyError, TypeError):
                pass
        out.append(
            {
                "index": r.index,
                "url": r.url,
                "pid": r.pid,
                "processes": len(members),
                "rss_mib": round(rss / 2**20, 1),
                "health": code,
                "models": models,
            }
        )
    return out


# ---------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rollout-testbed replicas",
        description="Local vLLM (or sim) replicas on 127.0.0.1, each pinned to its own core.",
    )
    sub = p.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="start N replicas and wait until healthy")
    up.add_argument("--n", type=int, default=2)
    up.add_argument("--model-dir", default=None, help="default: <state dir>/tiny-model (built)")
    up.add_argument("--base-port", type=int, default=DEFAULT_BASE_PORT)
    up.add_argument(
        "--max-staleness",
        type=int,
        default=DEFAULT_MAX_STALENESS,
        help="TRL's max_staleness; vLLM gets --max-loras max_staleness+2",
    )
    up.add_argument(
        "--vllm-python",
        default=None,
        help="python of the vLLM venv (default: $ROLLOUT_TESTBED_VLLM_PYTHON, then .venv-vllm)",
    )
    up.add_argument("--sim", action="store_true", help="start sim replicas instead of vLLM")
    up.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds to wait for /health"
    )
    up.add_argument("--warmup", type=int, default=1, help="warm-up requests per replica")
    up.add_argument("--host", default="127.0.0.1")
    down = sub.add_parser("down", help="stop the replicas (SIGTERM, then SIGKILL)")
    down.add_argument("--purge", action="store_true", help="also remove logs and the run dir")
    down.add_argument("--grace", type=float, default=30.0, help="seconds before SIGKILL")
    status = sub.add_parser("status", help="health per replica")
    status.add_argument("--json", action="store_true")
    for sp in (up, down, status):
        sp.add_argument("--state-file", default=DEFAULT_STATE_FILE)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("replicas: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    if args.action == "up":
        try:
            rs = start_replicas(
                args.n,
                args.model_dir,
                base_port=args.base_port,
                max_staleness=args.max_staleness,
                state_file=args.state_file,
                vllm_python=args.vllm_python,
                sim=args.sim,
                timeout=args.timeout,
                host=args.host,
                warmup_requests=args.warmup,
            )
        except VllmNotInstalledError as exc:
            print(f"replicas up: {exc}", file=sys.stderr)
            return 2
        except ReplicaError as exc:
            print(f"replicas up: {exc}", file=sys.stderr)
            return 1
        print(f"{len(rs.replicas)} {rs.kind} replicas up (state: {rs.state_file})")
        for r, t in zip(rs.replicas, rs.cold_start_s, strict=False):
            print(f"  {r.url}  pid {r.pid}  core {r.core}  ready in {t:.1f} s  log {r.log}")
        print("Start the gateway with:")
        print(f"  {rs.serve_command()}")
        return 0
    try:
        rs = ReplicaSet.load(args.state_file)
    except FileNotFoundError:
        print(f"replicas {args.action}: no state file {args.state_file} (nothing running)")
        return 0 if args.action == "down" else 1
    except ReplicaError as exc:
        print(f"replicas {args.action}: {exc}", file=sys.stderr)
        return 1
    if args.action == "down":
        for note in stop_replicas(rs, grace=args.grace, purge=args.purge):
            print(f"  {note}")
        print(f"replicas down ({rs.kind}, {len(rs.replicas)} replicas)")
        return 0
    rows = replica_status(rs)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for row in rows:
            h = row["health"] if row["health"] is not None else "down"
            models = ",".join(row["models"]) or "-"
            print(f"  {row['url']}  pid {row['pid']}  procs {row['processes']}  "
                  f"rss {row['rss_mib']} MiB  health {h}  models {models}")  # fmt: skip
    return 0 if all(row["health"] == 200 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
