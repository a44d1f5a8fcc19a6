"""deploy/hf-jobs/launch.sh, checked offline through huggingface_hub's own ``hf`` CLI.

``DRY_RUN=1`` makes launch.sh call the real ``hf jobs run --dry-run`` for every Job, so what
is read here is the Job configuration as huggingface_hub resolves and prints it (no token,
no network: ``HF_HUB_OFFLINE=1`` and an empty ``HF_HOME``), not launch.sh's own idea of its
arguments. A real run is driven against a fake ``hf`` that answers ``jobs run`` and ``jobs
inspect`` the way huggingface_hub 2.4 does in ``--format json``, which is how the replica
URLs are shown to come from each Job's ``expose_urls``. ``hf`` comes from the gateway venv's
dev extra (``huggingface_hub`` in pyproject.toml), so this runs in the fast layer.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from huggingface_hub.utils import parse_hf_mount
from packaging.requirements import Requirement

from gateway.config import Settings
from tests.deploy._proc import REPO, VENV_BIN, base_env
from tests.deploy.test_versions import read_versions

HF_DIR = REPO / "deploy" / "hf-jobs"
LAUNCH = HF_DIR / "launch.sh"
TOKEN = "hf_fake_TESTSECRET_9Zq4"  # never a real token; must never be printed
REV = "0123456789abcdef0123456789abcdef01234567"
SETTINGS_OK = {
    "BUCKET": "org/grpo-run",
    "TRAINER_IMAGE": "ghcr.io/org/trl-trainer:1.16.0",
    "TRAIN_CMD": "python train.py --max-steps 500",
    "SIDECAR_REPO": "https://github.com/org/rollout-gateway",
    "SIDECAR_REV": REV,
}
# Documented by huggingface_hub (HfApi.run_job, `expose`): https://<job_id>--8000.hf.jobs
DOCUMENTED_URL = re.compile(r"https://(?P<job_id>[A-Za-z0-9-]+?)--8000\.hf\.jobs")
GATEWAY_SETTINGS = {f"GATEWAY_{n.upper()}" for n in Settings.model_fields}
# Anything of the caller's that would change what launch.sh or hf does.
LEAKS = (
    "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_ENDPOINT", "NAMESPACE",
    "RUN_NAME", "HF", "PYTHON", "REPLICAS", "MODEL", "MAX_STALENESS", "MAX_LORAS", "MOUNT",
    "MAX_LORA_RANK", "REPLICA_FLAVOR", "TRAINER_FLAVOR", "TIMEOUT", "VLLM_IMAGE",
    "SIDECAR_INSTALL", "DRY_RUN", *SETTINGS_OK,
)  # fmt: skip


def hf_cli() -> str:
    """The real ``hf`` of the test venv; its absence is a broken venv, not a reason to skip."""
    path = shutil.which("hf", path=str(VENV_BIN))
    if path is None:
        pytest.fail("no `hf` in the test venv: `make venv` (huggingface_hub is a dev dependency)")
    return path


def launch(
    home: Path,
    settings: dict[str, str],
    *,
    hf: str | None = None,
    token: bool = True,
    dry_run: bool = True,
) -> subprocess.CompletedProcess[str]:
    """launch.sh with only ``settings``, an isolated, offline huggingface_hub (no stored
    token, no network: even a real run could not start a Job) and, unless ``token`` is
    false, the fake token as ``HF_TOKEN``."""
    env = {k: v for k, v in base_env().items() if k not in LEAKS}
    env.update(HOME=str(home), HF_HOME=str(home / "hf"), HF_HUB_OFFLINE="1",
               HF=hf or hf_cli(), PYTHON=sys.executable, DRY_RUN=str(int(dry_run)))  # fmt: skip
    env.update(settings)
    if token:
        env["HF_TOKEN"] = TOKEN
    return subprocess.run(["bash", str(LAUNCH)], env=env, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip


def parse_dry_run(stdout: str) -> dict[str, dict[str, list[str]]]:
    """launch.sh's ``== NAME ==`` headers, each followed by hf's printed configuration:
    ``  key  value`` lines, continuation lines indented to the value column."""
    jobs: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    key, column = "", 0
    for line in stdout.splitlines():
        if m := re.fullmatch(r"== (.+) ==", line):
            current, key, column = jobs.setdefault(m.group(1), {}), "", 0
        elif line in ("Job configuration:", "(dry run) Job not submitted."):
            continue
        elif not column and (m := re.match(r"  (\S+)\s+", line)):
            column = m.end()
            key = m.group(1)
            current[key] = [line[column:]]
        elif line[:column].strip():
            key = line[:column].strip()
            current[key] = [line[column:]]
        else:
            current[key].append(line[column:])
    return jobs


def command_of(job: dict[str, list[str]]) -> list[str]:
    return shlex.split("\n".join(job["command"]))


def env_of(job: dict[str, list[str]]) -> dict[str, str]:
    return dict(line.split("=", 1) for line in job.get("env", []))


def test_dry_run_resolved_by_hf(tmp_path: Path) -> None:
    res = launch(tmp_path, {**SETTINGS_OK, "REPLICAS": "3"})
    assert res.returncode == 0, res.stderr
    assert TOKEN not in res.stdout + res.stderr
    jobs = parse_dry_run(res.stdout)
    assert list(jobs) == ["replica 0", "replica 1", "replica 2", "trainer"]
    trainer = jobs.pop("trainer")
    versions = read_versions()

    # One bucket, mounted at one path in every Job: replicas read it, the trainer writes it.
    mounts = {name: [parse_hf_mount(v) for v in job["volumes"]] for name, job in jobs.items()}
    mounts["trainer"] = [parse_hf_mount(v) for v in trainer["volumes"]]
    assert all(len(m) == 1 for m in mounts.values()), mounts
    assert {(m[0].source.type, m[0].source.id) for m in mounts.values()} == {
        ("bucket", SETTINGS_OK["BUCKET"])
    }
    (mount,) = {m[0].mount_path for m in mounts.values()}
    assert [m[0].read_only for m in mounts.values()] == [True, True, True, False]

    for job in [*jobs.values(), trainer]:
        # HF_TOKEN travels as a secret (hf shows it masked), never as an env value.
        assert job["secrets"] == ["HF_TOKEN=***"]
        assert not any(k.startswith("HF_TOKEN") for k in env_of(job))

    for name, job in jobs.items():
        assert job["image"] == [versions["VLLM_GPU_IMAGE"]], name
        assert job["expose"] == ["8000"], name
        argv = command_of(job)
        assert argv[:2] == ["vllm", "serve"]
        opts = dict(zip(argv, [*argv[1:], ""], strict=True))
        assert opts["--host"] == "0.0.0.0" and opts["--port"] == "8000"
        assert opts["--generation-config"] == "vllm"
        assert opts["--logprobs-mode"] == "processed_logprobs"
        assert "--enable-lora" in argv and int(opts["--max-loras"]) >= 4 + 2
        env = env_of(job)
        assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
        assert env["VLLM_SERVER_DEV_MODE"] == "1"

    # The trainer: no exposed port; gateway settings real; entry script sent verbatim.
    assert "expose" not in trainer
    assert trainer["image"] == [SETTINGS_OK["TRAINER_IMAGE"]]
    env = env_of(trainer)
    assert {k for k in env if k.startswith("GATEWAY_")} <= GATEWAY_SETTINGS
    assert env["GATEWAY_ADAPTER_ROOTS"] == mount
    assert env["ADAPTER_DIR"].startswith(mount + "/")
    argv = command_of(trainer)
    assert argv[:2] == ["bash", "-c"]
    assert argv[2] == (HF_DIR / "trainer-entry.sh").read_text().rstrip("\n")
    assert argv[3] == "trainer-entry"
    args = dict(a.split("=", 1) for a in argv[4:])
    assert args["TRAIN_CMD"] == SETTINGS_OK["TRAIN_CMD"]

    # Replica URLs: huggingface_hub's documented pattern (a dry run has no Job status to
    # read), one per replica Job, and launch.sh says it used the fallback.
    urls = args["GATEWAY_REPLICAS"].split(",")
    ids = [DOCUMENTED_URL.fullmatch(u) for u in urls]
    assert all(ids), urls
    assert [m.group("job_id") for m in ids if m] == [f"dry-run-job-{n}" for n in (1, 2, 3)]
    assert res.stderr.count("status has no expose_urls") == 3

    # The gateway comes from the repository at the pinned revision, not from a package index.
    req = Requirement(args["SIDECAR_INSTALL"])
    assert req.name == "rollout-gateway" and req.url is not None
    assert req.url == f"git+{SETTINGS_OK['SIDECAR_REPO']}@{REV}"


def test_dry_run_needs_no_token(tmp_path: Path) -> None:
    """Offline, no token anywhere: hf resolves the plan and marks the secret not set."""
    res = launch(tmp_path, {**SETTINGS_OK, "REPLICAS": "1"}, token=False)
    assert res.returncode == 0, res.stderr
    jobs = parse_dry_run(res.stdout)
    assert [job["secrets"] for job in jobs.values()] == [["HF_TOKEN=<not set>"]] * 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"BUCKET": ""}, "BUCKET"),
        ({"TRAIN_CMD": ""}, "TRAIN_CMD"),
        ({"TRAINER_IMAGE": ""}, "TRAINER_IMAGE"),
        ({"SIDECAR_REPO": "", "SIDECAR_REV": ""}, "SIDECAR_REPO SIDECAR_REV"),
        ({"SIDECAR_REPO": "rollout-gateway"}, "SIDECAR_REPO"),  # a bare (PyPI) name
        ({"MAX_STALENESS": "4", "MAX_LORAS": "5"}, "MAX_LORAS (5) must be >= MAX_STALENESS + 2"),
        ({"BUCKET": "no-namespace"}, "BUCKET"),
        ({"REPLICAS": "0"}, "REPLICAS"),
    ],
)
def test_bad_settings_are_refused_before_any_job(
    tmp_path: Path, change: dict[str, str], message: str
) -> None:
    settings = {k: v for k, v in {**SETTINGS_OK, **change}.items() if v}
    res = launch(tmp_path, settings)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert message in res.stderr
    assert "Job configuration" not in res.stdout


def load_replica_url() -> ModuleType:
    spec = importlib.util.spec_from_file_location("replica_url", HF_DIR / "replica_url.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


JOB = "687fb701029421ae5549d998"


def inspect_output(**status: Any) -> str:
    """``hf jobs inspect --format json JOB``: a list of jobs, ``None`` fields dropped."""
    return json.dumps([{"id": JOB, "status": {"stage": "RUNNING", **status}}])


def test_replica_url_reads_the_jobs_status() -> None:
    replica_url = load_replica_url().replica_url
    on_8000 = f"https://{JOB}--8000.hf.jobs"
    assert replica_url(inspect_output(expose_urls=[on_8000]), JOB) == (on_8000, True)
    # Several exposed ports: the one for 8000. A host the status names is taken as is.
    other = f"https://{JOB.upper()}--8000.eu.hf.jobs/"
    listed = [f"https://{JOB}--9000.hf.jobs", other]
    assert replica_url(inspect_output(expose_urls=listed), JOB) == (other.rstrip("/"), True)
    # No URL in the status (None is dropped from the JSON): the documented pattern, flagged.
    for doc in (inspect_output(), inspect_output(expose_urls=[]), "[]", ""):
        assert replica_url(doc, JOB) == (on_8000, False)
    # URLs listed, none for 8000 (or not https): port 8000 is not exposed; no guessing.
    for urls in ([f"https://{JOB}--9000.hf.jobs"], [f"http://{JOB}--8000.hf.jobs"]):
        with pytest.raises(ValueError, match="none of them port 8000"):
            replica_url(inspect_output(expose_urls=urls), JOB)


FAKE_HF = """#!{python}
# `hf` as huggingface_hub 2.4 answers with --format json: `jobs run --detach` prints
# {{"id", "name", "url"}}, `jobs inspect` a list of jobs with status.expose_urls.
import json, os, sys
log = os.environ["FAKE_HF_LOG"]
with open(log, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
n = sum(1 for _ in open(log))
if sys.argv[1:3] == ["jobs", "run"]:
    job = "%024x" % (0x687fb701029421ae55490000 + n)
    print(json.dumps({{"id": job, "name": "x", "url": "https://huggingface.co/jobs/o/" + job}}))
elif sys.argv[1:3] == ["jobs", "inspect"]:
    job = sys.argv[-1]
    status = {{"stage": "SCHEDULING"}}
    if n != 4:  # the second replica's status has no URL yet: launch.sh falls back
        status["expose_urls"] = ["https://" + job + "--8000.hf.jobs"]
    print(json.dumps([{{"id": job, "status": status}}]))
else:
    sys.exit("fake hf: unexpected " + repr(sys.argv))
"""


def test_real_run_takes_urls_from_expose_urls(tmp_path: Path) -> None:
    fake = tmp_path / "hf"
    fake.write_text(FAKE_HF.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "calls.jsonl"
    settings = {**SETTINGS_OK, "REPLICAS": "2", "FAKE_HF_LOG": str(log)}
    res = launch(tmp_path, settings, hf=str(fake), dry_run=False)
    assert res.returncode == 0, res.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c[:2] for c in calls] == [["jobs", "run"], ["jobs", "inspect"]] * 2 + [["jobs", "run"]]
    runs = [c for c in calls if c[1] == "run"]
    for argv in runs:
        opts = argv[: argv.index("--")]  # every hf option before `--`, image and command after
        assert "--detach" in opts and opts[opts.index("--format") + 1] == "json"
        assert TOKEN not in json.dumps(argv)
    for argv in runs[:2]:
        opts = argv[: argv.index("--")]
        assert opts[opts.index("--expose") + 1] == "8000"
    ids = [c[-1] for c in calls if c[1] == "inspect"]  # launch.sh inspects each replica it ran
    args = dict(a.split("=", 1) for a in runs[2][runs[2].index("trainer-entry") + 1 :])
    urls = args["GATEWAY_REPLICAS"].split(",")
    assert urls == [f"https://{job}--8000.hf.jobs" for job in ids]
    assert all(DOCUMENTED_URL.fullmatch(u) for u in urls)
    assert res.stderr.count("status has no expose_urls") == 1  # only the second replica
    assert f"job {ids[1]}'s status has no expose_urls" in res.stderr
    assert TOKEN not in res.stdout + res.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["SIDECAR_INSTALL=rollout-gateway"], "SIDECAR_INSTALL must be a URL or a path"),
        (["HF_TOKEN=x"], "unknown argument 'HF_TOKEN'"),
    ],
)
def test_trainer_entry_refuses_before_installing(args: list[str], message: str) -> None:
    """The trainer Job's command reads its KEY=VALUE arguments (as launch.sh passes them)
    and never pip-installs a bare name, which would resolve on PyPI."""
    env = {k: v for k, v in base_env().items() if k not in LEAKS}
    res = subprocess.run(
        ["bash", str(HF_DIR / "trainer-entry.sh"), "GATEWAY_REPLICAS=http://127.0.0.1:9",
         "TRAIN_CMD=true", *args],
        env=env, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert message in res.stderr
