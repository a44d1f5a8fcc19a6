"""Harness for several unmodified TRL runs sharing one fleet through one gateway (issue 18).

Used by ``tests/trl/test_trl_many_runs.py`` and ``bench/trl_many_runs.py``; runs with the
vLLM venv's python, as the rest of the TRL layer (``harness``).

* ``RunConf`` / ``gateway_config`` / ``MultiRunGateway``: one ``rollout-gateway serve``
  with a ``runs:`` YAML file (``docs/many-runs.md``), started as the layer's
  ``GatewayProcess`` with ``--config``; ``write_config`` and ``reload`` change its run set
  live (``tests/trl/test_trl_runs_live.py``);
* ``launch_run``: one TRL run (``harness.run_trl``) as its own OS process, in its own
  session (three trainers in one process would share TRL's, torch's and the recorder's
  global state); it streams its records to ``records.jsonl`` and writes ``result.json``;
* ``FleetSampler``: a background thread reading every replica's own ``/v1/models`` (and
  the gateway's ``/gateway/status``) every ``interval`` seconds; ``fleet_violations``
  checks the samples (run prefixes, home replicas, slot budget);
* ``TimedRolloutLoop`` (bench only): TRL's own rollout loop with each ``/v1/completions``
  turn timed (start, end, ok) into a JSONL file; it calls TRL's method unchanged.

The child entry: ``child('<RunSpec fields as JSON>')`` (``CHILD_CODE``, run with ``-c``).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_testbed.procs import Proc, free_port
from rollout_testbed.trl import harness as H

SEP = "~"  # replica-side adapter name: <run>~<client-side name>
ROLLOUT_LOG_ENV = "MANY_RUNS_ROLLOUT_LOG"  # TimedRolloutLoop appends here (bench only)
ADMIN_KEY = "many-runs-admin"
# The child's entry (not ``-m``: the module must be ``rollout_testbed.trl.many_runs``, not
# ``__main__``, for the rollout child to find ``TimedRolloutLoop`` by name).
CHILD_CODE = (
    "import sys; from rollout_testbed.trl.many_runs import child; sys.exit(child(sys.argv[1]))"
)


# --------------------------------------------------------------------------- gateway


@dataclass
class RunConf:
    """One run of the gateway's ``runs:`` list, and where its TRL process writes."""

    name: str
    out_dir: Path
    max_staleness: int = H.MAX_STALENESS

    @property
    def key(self) -> str:
        return f"key-{self.name}-0123456789"

    @property
    def trl_dir(self) -> Path:
        """TRL's ``output_dir``; its adapters land in ``trl_dir/.vllm_lora`` (the root)."""
        return self.out_dir / "trl"

    def base_url(self, gateway_port: int) -> str:
        """What the run gives TRL: its credentials in the URL (Basic auth)."""
        return f"http://{self.name}:{self.key}@127.0.0.1:{gateway_port}"

    def prepare(self) -> RunConf:
        """An empty ``out_dir`` with its ``trl_dir`` (the adapter root must exist before the
        gateway starts, which is before TRL creates it)."""
        H.fresh_dir(self.out_dir)
        self.trl_dir.mkdir()
        return self

    def lora_path(self, version: int) -> str:
        return os.path.join(os.path.abspath(self.trl_dir), ".vllm_lora", f"trl-policy-v{version}")


def gateway_config(runs: list[RunConf], *, slots: int | None, run_pause: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "admin_key": ADMIN_KEY,
        "run_pause": run_pause,
        "runs": [
            {"name": r.name, "key": r.key, "adapter_root": str(r.trl_dir.resolve()),
             "max_staleness": r.max_staleness}
            for r in runs
        ],
    }  # fmt: skip
    if slots is not None:
        cfg["lora_slots_per_replica"] = slots
    return cfg


class MultiRunGateway(H.GatewayProcess):
    """The layer's gateway process, configured for several runs by a YAML file."""

    def __init__(
        self,
        replica_urls: list[str],
        runs: list[RunConf],
        *,
        work: Path,
        slots: int | None,
        run_pause: str = "scoped",
        settings: dict[str, Any] | None = None,
        workers: int | None = None,
    ) -> None:
        import yaml

        work.mkdir(parents=True, exist_ok=True)
        self.config_path = work / "gateway.yaml"
        # ``settings``: more top-level keys of the file (e.g. ``discovery_interval_s``)
        self.config = {**gateway_config(runs, slots=slots, run_pause=run_pause),
                       **(settings or {})}  # fmt: skip
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self.runs = {r.name: r for r in runs}
        super().__init__(replica_urls, port=free_port(), log_path=work / "gateway.log",
                         extra_args=("--config", str(self.config_path)),
                         workers=workers)  # fmt: skip

    def start(self, timeout: float = 90.0, require_healthy: bool = True) -> None:
        """Up, every replica healthy by its own status, and every run placed."""
        super().start(timeout, require_healthy=False)

        def ready() -> bool:
            st = self.status()
            ok = all(r.get("healthy") for r in st.get("replicas", []))
            return not require_healthy or (ok and set(run_table(st)) >= set(self.runs))

        try:
            H.wait_for(ready, timeout, "the multi-run gateway to place every run")
        except AssertionError as exc:
            raise H.LayerError(f"{exc}\n{self.log_tail()}") from None

    def status(self, key: str = ADMIN_KEY) -> dict[str, Any]:
        return dict(get_json(self.url + "/gateway/status", key))

    def server_info(self, run: str) -> dict[str, Any]:
        """``/server_info`` as the run sees it (its own Basic credentials)."""
        conf = self.runs[run]
        return dict(get_json(self.url + "/server_info?config_format=json", conf.key, run))

    def write_config(self, runs: list[RunConf]) -> None:
        """Rewrite the config file with ``runs`` as its ``runs:`` (every other key kept),
        atomically (a file watch never reads half a file); ``runs`` become ``self.runs``.
        The gateway applies it at its next reload (``reload``, SIGHUP or its file watch)."""
        import yaml

        entries = gateway_config(runs, slots=None, run_pause="scoped")["runs"]
        self.config = {**self.config, "runs": entries}
        tmp = self.config_path.with_name(self.config_path.name + ".tmp")
        tmp.write_text(yaml.safe_dump(self.config, sort_keys=False))
        os.replace(tmp, self.config_path)
        self.runs = {r.name: r for r in runs}

    def reload(self, timeout: float = 120.0) -> tuple[int, dict[str, Any]]:
        """``POST /gateway/runs/reload`` with the admin key: its status and JSON answer
        (``{"outcome", "added", "removed", ...}``, or the error body)."""
        status, body = request("POST", self.url + "/gateway/runs/reload", ADMIN_KEY,
                               timeout=timeout)  # fmt: skip
        try:
            answer = json.loads(body) if body else {}
        except ValueError:
            answer = {"body": body[:500].decode(errors="replace")}
        return status, dict(answer) if isinstance(answer, dict) else {"body": answer}

    def metrics(self) -> list[tuple[str, str, float]]:
        text = request("GET", self.url + "/metrics", ADMIN_KEY)[1].decode()
        out = []
        for line in text.splitlines():
            m = H._METRIC.match(line)
            if m:
                out.append((m.group(1), m.group(2) or "", float(m.group(3))))
        return out


def request(
    method: str, url: str, key: str | None = None, user: str | None = None,
    body: dict[str, Any] | None = None, timeout: float = 10.0,
) -> tuple[int, bytes]:  # fmt: skip
    """One HTTP call with ``Bearer key`` (or Basic ``user:key``); error statuses returned."""
    headers = {"Content-Type": "application/json"}
    if key is not None and user is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{key}".encode()).decode()
    elif key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def get_json(url: str, key: str | None = None, user: str | None = None) -> Any:
    status, body = request("GET", url, key, user)
    if status != 200:
        raise H.LayerError(f"GET {url}: HTTP {status} {body[:300]!r}")
    return json.loads(body)


def run_table(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``/gateway/status``'s ``runs``, keyed by run name (a list of objects or a mapping)."""
    runs = status.get("runs") or {}
    if isinstance(runs, list):
        return {str(r.get("name")): r for r in runs if isinstance(r, dict)}
    return {str(k): v for k, v in runs.items() if isinstance(v, dict)}


def homes_of(status: dict[str, Any]) -> dict[str, list[int]]:
    """Each run's home replicas (indices) as the status reports them."""
    out = {}
    for name, run in run_table(status).items():
        homes = run.get("home_replicas", run.get("homes", []))
        out[name] = sorted(int(h["index"] if isinstance(h, dict) else h) for h in homes)
    return out


# --------------------------------------------------------------------------- replicas


def unload_all(urls: list[str], keep: set[str] | None = None) -> dict[int, dict[str, str]]:
    """Unload every adapter a replica lists (but ``keep``), directly; returns what was held."""
    held = {}
    for i, url in enumerate(urls):
        held[i] = H.replica_adapters(url)
        for name in held[i]:
            if keep is None or name not in keep:
                H.post(url + "/v1/unload_lora_adapter", {"lora_name": name})
    return held


def load_direct(url: str, adapters: dict[str, str]) -> list[int]:
    """Load ``{name: path}`` on a replica directly (to put leftovers back); the statuses."""
    have = H.replica_adapters(url)
    return [
        H.post(url + "/v1/load_lora_adapter", {"lora_name": n, "lora_path": p}, timeout=60)
        for n, p in adapters.items()
        if have.get(n) != p and os.path.isdir(p)
    ]


def leftover_adapter(model_dir: Path, out: Path) -> Path:
    """A LoRA adapter of the layer's model as TRL saves one (r=8, all-linear), built once:
    what an earlier run leaves on a replica."""
    if (out / "adapter_config.json").exists():
        return out
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                     bias="none", task_type="CAUSAL_LM")  # fmt: skip
    get_peft_model(model, cfg).save_pretrained(str(out))
    return out


@dataclass
class FleetSample:
    t: float
    held: dict[int, dict[str, str]]  # replica -> {replica-side name: path}
    homes: dict[str, list[int]] | None  # from /gateway/status, when read this round
    paused: dict[int, bool]  # replica -> its own GET /is_paused


@dataclass
class FleetSampler:
    """Every ``interval`` s: each replica's own ``/v1/models`` and ``/is_paused``, and the
    gateway's status."""

    urls: list[str]
    gateway: MultiRunGateway | None = None
    interval: float = 0.5
    samples: list[FleetSample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            t = time.time()
            held, paused = {}, {}
            for i, url in enumerate(self.urls):
                try:
                    held[i] = H.replica_adapters(url, timeout=5)
                    paused[i] = bool(H.get_json(url + "/is_paused", timeout=5)["is_paused"])
                except (OSError, ValueError, KeyError, H.LayerError) as exc:
                    self.errors.append(f"{t:.1f} replica {i}: {exc!r}"[:200])
            homes = None
            if self.gateway is not None:
                try:
                    homes = homes_of(self.gateway.status())
                except (OSError, ValueError, H.LayerError) as exc:
                    self.errors.append(f"{t:.1f} status: {exc!r}"[:200])
            self.samples.append(FleetSample(t, held, homes, paused))
            self._stop.wait(max(0.0, self.interval - (time.time() - t)))

    def __enter__(self) -> FleetSampler:
        self._thread = threading.Thread(target=self._loop, name="fleet-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)


def fleet_violations(
    samples: list[FleetSample],
    runs: list[str],
    homes: dict[str, list[int]],
    slots: int,
    foreign_ok: frozenset[str] = frozenset(),
) -> list[str]:
    """What no sample may show: a name with no run prefix or a prefix of an unknown run
    (but ``foreign_ok``, leftovers from before the gateway started), a run's name on a
    replica that is not its home, more than ``slots`` adapters on a replica, homes that
    changed. One line per distinct problem (first time seen)."""
    seen: dict[str, str] = {}

    def bad(key: str, t: float) -> None:
        seen.setdefault(key, f"t={t:.1f}: {key}")

    for s in samples:
        if s.homes is not None and s.homes != homes:
            bad(f"homes {s.homes} != {homes}", s.t)
        for r, held in s.held.items():
            if len(held) > slots:
                bad(f"replica {r} holds {len(held)} > {slots} adapters: {sorted(held)}", s.t)
            for name in held:
                run, sep, _ = name.partition(SEP)
                if not sep or run not in runs:
                    if name not in foreign_ok:
                        bad(f"replica {r}: {name!r} carries no run prefix of {runs}", s.t)
                elif name.count(SEP) != 1:
                    bad(f"replica {r}: {name!r} carries more than one prefix", s.t)
                elif r not in homes.get(run, []):
                    bad(f"replica {r}: {name!r} of run {run} (homes {homes.get(run)})", s.t)
    return list(seen.values())


# --------------------------------------------------------------------------- TRL runs


def launch_run(
    conf: RunConf,
    gateway: MultiRunGateway,
    steps: int,
    *,
    seed: int = 0,
    timed_rollouts: bool = False,
) -> Proc:
    """One TRL run through ``gateway`` as a child process in its own session (its records
    go to ``conf.out_dir``, prepared before the gateway started)."""
    spec = {
        "name": conf.name, "base_url": conf.base_url(gateway.port),
        "output_dir": str(conf.trl_dir), "max_steps": steps, "seed": seed,
        "replica_urls": gateway.replica_urls, "max_staleness": conf.max_staleness,
        "record_path": str(conf.out_dir / "records.jsonl"),
    }  # fmt: skip
    env = dict(os.environ, PYTHONPATH=f"{H.REPO}{os.pathsep}{H.REPO / 'testbed'}")
    if timed_rollouts:
        env[ROLLOUT_LOG_ENV] = str(conf.out_dir / "rollouts.jsonl")
    argv = [sys.executable, "-c", CHILD_CODE, json.dumps(spec)]
    return Proc(f"trl-{conf.name}", argv, log=conf.out_dir / "child.log", env=env,
                cwd=H.REPO).start()  # fmt: skip


def wait_runs(procs: list[Proc], timeout: float) -> list[int | None]:
    """Wait for every run (bounded); one still running at the deadline is killed."""
    deadline = time.monotonic() + timeout
    for p in procs:
        assert p.popen is not None
        with contextlib.suppress(Exception):
            p.popen.wait(max(0.0, deadline - time.monotonic()))
        if p.alive:
            p.kill()
    return [p.returncode for p in procs]


def records(conf: RunConf, name: str = "records.jsonl") -> list[dict[str, Any]]:
    path = conf.out_dir / name
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def result(conf: RunConf) -> dict[str, Any]:
    """The run's ``result.json`` (its summary), or what its records show if it died."""
    path = conf.out_dir / "result.json"
    if path.exists():
        return dict(json.loads(path.read_text()))
    recs = records(conf)
    steps = [r for r in recs if r["kind"] == "log" and "reward" in r]
    err = "no result.json: the run was killed or crashed (see its child.log)"
    return {
        "summary": {"name": conf.name, "global_step": len(steps), "error": err},
        "global_step": len(steps),
        "model_version": None,
        "lora_sync": False,
        "weight_transfer": "",
        "calls": [r for r in recs if r["kind"] == "call"],
        "logs": steps,
        "error": err,
    }


def child(spec_json: str) -> int:
    spec = json.loads(spec_json)
    for k in ("output_dir", "record_path"):
        spec[k] = Path(spec[k])
    if os.environ.get(ROLLOUT_LOG_ENV):
        from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

        AsyncRolloutWorker._loop_cls = __getattr__("TimedRolloutLoop")
    res = H.run_trl(H.RunSpec(**spec))
    out = {
        "summary": res.summary(),
        "global_step": res.global_step,
        "model_version": res.model_version,
        "lora_sync": res.lora_sync,
        "weight_transfer": res.weight_transfer,
        "calls": [vars(c) for c in res.calls],
        "logs": res.logs,
        "error": res.error,
    }
    (spec["output_dir"].parent / "result.json").write_text(json.dumps(out, default=str))
    return 0 if res.error is None else 1


# --------------------------------------------------------------------------- timed rollouts


def _log_turn(t0: float, t1: float, ok: bool) -> None:
    path = os.environ.get(ROLLOUT_LOG_ENV)
    if path:  # one short line per turn (microseconds next to a rollout)
        with open(path, "a") as fh:
            fh.write(json.dumps({"t0": t0, "t1": t1, "ok": ok}) + "\n")


def _timed_loop_cls() -> type:
    """TRL's ``_AsyncRolloutLoop`` with each generation turn timed (bench only). Built on
    first use (``__getattr__``) so importing this module does not import TRL; spawn's
    pickle finds it again in the rollout child as
    ``rollout_testbed.trl.many_runs.TimedRolloutLoop``."""
    from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop

    class TimedRolloutLoop(_AsyncRolloutLoop):  # type: ignore[misc]
        async def _generate_one_turn(self, prompt_ids: list[int]) -> Any:
            t0, ok = time.time(), False
            try:
                out = await super()._generate_one_turn(prompt_ids)
                ok = True
                return out
            finally:
                _log_turn(t0, time.time(), ok)

    TimedRolloutLoop.__module__ = __name__
    TimedRolloutLoop.__qualname__ = "TimedRolloutLoop"
    return TimedRolloutLoop


def __getattr__(name: str) -> Any:
    if name == "TimedRolloutLoop":
        cls = globals()["TimedRolloutLoop"] = _timed_loop_cls()
        return cls
    raise AttributeError(name)
