"""Fast tests of the local replica launcher: no vLLM needed (sim replicas on real sockets)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rollout_testbed.local import replicas as R
from rollout_testbed.local import tiny_model
from rollout_testbed.local.vllm_env import (
    VllmNotInstalledError,
    check_vllm_python,
    checkout_root,
    default_vllm_python,
    find_vllm_python,
    package_root,
)
from rollout_testbed.procs import free_ports

REPO = Path(__file__).resolve().parents[2]


def _tmp_entries(run_id: str) -> list[str]:
    return [n for n in os.listdir(tempfile.gettempdir()) if run_id[:8] in n]


# --- argument parsing -----------------------------------------------------------------


def test_parser_up_defaults() -> None:
    args = R.build_parser().parse_args(["up"])
    assert args.action == "up"
    assert args.n == 2
    assert args.base_port == 8101
    assert args.max_staleness == 4
    assert args.state_file == ".run/replicas.json"
    assert args.timeout == 300
    assert args.sim is False
    assert args.model_dir is None


def test_parser_up_flags() -> None:
    args = R.build_parser().parse_args(
        [
            *("up", "--n", "3", "--model-dir", "m", "--base-port", "9000"),
            *("--max-staleness", "2", "--state-file", "s.json"),
            *("--vllm-python", "/x/python", "--sim", "--timeout", "12"),
        ]
    )
    assert (args.n, args.model_dir, args.base_port, args.max_staleness) == (3, "m", 9000, 2)
    assert (args.state_file, args.vllm_python, args.sim, args.timeout) == (
        "s.json",
        "/x/python",
        True,
        12.0,
    )


@pytest.mark.parametrize("action", ["down", "status"])
def test_parser_down_status(action: str) -> None:
    args = R.build_parser().parse_args([action, "--state-file", "x.json"])
    assert args.action == action
    assert args.state_file == "x.json"


def test_parser_requires_action() -> None:
    with pytest.raises(SystemExit):
        R.build_parser().parse_args([])


def test_tiny_model_parser() -> None:
    args = tiny_model.build_parser().parse_args(["d", "--seed", "3", "--adapters", "2"])
    assert (args.dir, args.seed, args.adapters, args.rank, args.targets) == ("d", 3, 2, 8, "q_v")


# --- commands and state ------------------------------------------------------------------


def test_vllm_command_has_the_verified_flags() -> None:
    cmd = R.vllm_command("py", "/m", port=8101, host="127.0.0.1", max_loras=6, max_cpu_loras=8)
    assert cmd[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(cmd)
    for flag in (
        "--model /m",
        "--served-model-name tiny-base",
        "--port 8101",
        "--host 127.0.0.1",
        "--dtype bfloat16",
        "--max-model-len 512",
        "--block-size 32",
        "--enable-lora",
        "--max-loras 6",
        "--max-lora-rank 8",
        "--max-cpu-loras 8",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--kv-cache-memory-bytes 268435456",
    ):
        assert flag in joined, flag


def test_replica_env_for_vllm(tmp_path: Path) -> None:
    env = R._replica_env("vllm", "abc", core=1, tmpdir=tmp_path / "t", cache_dir=tmp_path / "c")
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["VLLM_HOST_IP"] == "127.0.0.1"
    assert env["TMPDIR"] == str(tmp_path / "t")
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(str(tmp_path / "c"))
    assert env["VLLM_CACHE_ROOT"].startswith(str(tmp_path / "c"))
    assert env[R.MARKER_ENV] == "abc"
    assert "PYTHONPATH" not in env


def test_private_tmpdir_is_short_enough(tmp_path: Path) -> None:
    deep = tmp_path / ("x" * 80)
    d = R._private_tmpdir(deep, 0, "0123456789abcdef")
    try:
        assert len(str(d)) <= R.MAX_TMPDIR_LEN + 20
        assert d.is_dir()
        assert not str(d).startswith(str(deep))
    finally:
        d.rmdir()


def _sample_set(tmp_path: Path) -> R.ReplicaSet:
    rs = R.ReplicaSet(
        kind="vllm",
        run_id="r" * 32,
        run_dir=str(tmp_path / "run"),
        state_file=str(tmp_path / "state.json"),
        host="127.0.0.1",
        served_model_name="tiny-base",
        model_dir="/m",
        max_staleness=4,
        max_loras=6,
        python="/py",
        started_at=1.5,
        cold_start_s=[20.0, 21.5],
    )
    for i in range(2):
        rs.replicas.append(
            R.Replica(
                index=i,
                port=8101 + i,
                url=f"http://127.0.0.1:{8101 + i}",
                pid=1000 + i,
                pgid=1000 + i,
                core=i,
                log=f"/run/replica-{i}.log",
                tmpdir=f"/run/r{i}/tmp",
                cmd=["python", "-m", "x"],
                start_ticks=42,
            )
        )
    return rs


def test_state_file_round_trip(tmp_path: Path) -> None:
    rs = _sample_set(tmp_path)
    rs.save()
    data = json.loads(Path(rs.state_file).read_text())
    assert data["version"] == R.STATE_VERSION
    assert [r["port"] for r in data["replicas"]] == [8101, 8102]
    assert "_procs" not in data
    back = R.ReplicaSet.load(rs.state_file)
    assert back.to_json() == rs.to_json()
    assert back.urls == ["http://127.0.0.1:8101", "http://127.0.0.1:8102"]
    assert back.serve_command() == (
        "rollout-gateway serve --replica http://127.0.0.1:8101 --replica http://127.0.0.1:8102"
    )


def test_state_file_bad_version(tmp_path: Path) -> None:
    p = tmp_path / "s.json"
    p.write_text(json.dumps({"version": 99, "replicas": []}))
    with pytest.raises(R.ReplicaError, match="version"):
        R.ReplicaSet.load(p)


def test_down_and_status_without_state_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert R.main(["down", "--state-file", str(tmp_path / "none.json")]) == 0
    assert R.main(["status", "--state-file", str(tmp_path / "none.json")]) == 1
    assert "no state file" in capsys.readouterr().out


# --- vLLM missing: clear errors ----------------------------------------------------------


def test_missing_vllm_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The gateway venv's python has no vllm by design.
    with pytest.raises(VllmNotInstalledError, match=r"install-vllm\.sh"):
        check_vllm_python(sys.executable)
    rc = R.main(
        [
            "up",
            "--vllm-python",
            sys.executable,
            "--state-file",
            str(tmp_path / "s.json"),
            "--base-port",
            str(free_ports(1)[0]),
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert "make vllm" in err
    assert "scripts/install-vllm.sh" in err
    assert not (tmp_path / "s.json").exists()


def test_missing_vllm_python_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ROLLOUT_TESTBED_VLLM_PYTHON", str(tmp_path / "nope" / "python"))
    assert find_vllm_python(None) == tmp_path / "nope" / "python"
    with pytest.raises(VllmNotInstalledError, match="make vllm"):
        check_vllm_python(None)


def test_roots_in_a_checkout() -> None:
    """The package's root (on a sim's PYTHONPATH) is testbed/; the checkout (the driver, the
    vLLM venv) is the repository. The demo once took testbed/ for the repository, and its
    driver failed with "No module named trainer"."""
    assert package_root() == REPO / "testbed"
    assert (package_root() / "rollout_testbed" / "__init__.py").is_file()
    assert checkout_root() == REPO
    assert default_vllm_python() == REPO / ".venv-vllm" / "bin" / "python"


def test_sim_replica_env_imports_the_testbed(tmp_path: Path) -> None:
    env = R._replica_env("sim", "abcd1234", core=0, tmpdir=tmp_path, cache_dir=tmp_path)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO / "testbed")


def test_tiny_model_without_torch_exits_2(tmp_path: Path) -> None:
    env = dict(os.environ, ROLLOUT_TESTBED_VLLM_PYTHON=str(tmp_path / "missing" / "python"))
    res = subprocess.run(
        [sys.executable, "-m", "rollout_testbed.local.tiny_model", str(tmp_path / "m")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 2, res.stderr
    assert "install-vllm.sh" in res.stderr
    assert ".venv-vllm/bin/python -m rollout_testbed.local.tiny_model" in res.stderr
    assert not (tmp_path / "m").exists()


# --- sim replicas on real sockets --------------------------------------------------------


@pytest.fixture
def sim_state(tmp_path: Path) -> Iterator[Path]:
    state = tmp_path / "state" / "replicas.json"
    yield state
    if state.exists():  # never leave processes behind, whatever the test did
        R.stop_replicas(state, grace=5)


def _run_cli(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollout_testbed.local.replicas", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.slow
def test_sim_up_status_down_cli(sim_state: Path) -> None:
    base = R.free_base_port(2)
    up = _run_cli(
        "up", "--sim", "--n", "2", "--base-port", str(base),
        "--state-file", str(sim_state), "--timeout", "60",
    )  # fmt: skip
    if up.returncode != 0 and "in use" in up.stderr:
        pytest.fail(f"port race: {up.stderr}")
    assert up.returncode == 0, up.stderr
    assert "rollout-gateway serve --replica http://127.0.0.1:" in up.stdout
    rs = R.ReplicaSet.load(sim_state)
    assert rs.kind == "sim"
    assert len(rs.replicas) == 2
    assert rs.max_loras == 6
    for r in rs.replicas:
        assert R.health(r.url) == 200
        assert R.owned_group_members(r.pgid, rs.run_id), "replica not running"
        assert os.getpgid(r.pid) == r.pgid
        assert r.pgid != os.getpgid(0), "replica must lead its own process group"

    st = _run_cli("status", "--state-file", str(sim_state), "--json")
    assert st.returncode == 0, st.stderr
    rows = json.loads(st.stdout)
    assert [row["health"] for row in rows] == [200, 200]
    assert all("tiny-base" in row["models"] for row in rows)

    down = _run_cli("down", "--state-file", str(sim_state))
    assert down.returncode == 0, down.stderr
    assert not sim_state.exists()
    for r in rs.replicas:
        assert R.group_members(r.pgid) == []
        assert R.health(r.url) is None
        assert not Path(r.tmpdir).exists()
    assert _tmp_entries(rs.run_id) == []

    st2 = _run_cli("status", "--state-file", str(sim_state))
    assert st2.returncode == 1


@pytest.mark.slow
def test_sim_api_start_stop_in_process(sim_state: Path) -> None:
    ports = free_ports(2)
    rs = R.start_replicas(2, sim=True, ports=ports, state_file=sim_state, timeout=60)
    try:
        assert rs.urls == [f"http://127.0.0.1:{p}" for p in ports]
        assert len(rs.cold_start_s) == 2
        # A second `up` on the same state file refuses while these are alive.
        with pytest.raises(R.ReplicaError, match="still running"):
            R.start_replicas(2, sim=True, ports=free_ports(2), state_file=sim_state)
        rows = R.replica_status(rs)
        assert all(row["health"] == 200 and row["processes"] >= 1 for row in rows)
    finally:
        notes = R.stop_replicas(rs, grace=10)
    assert any("SIGTERM" in n for n in notes)
    for r in rs.replicas:
        assert R.group_members(r.pgid) == []
    assert _tmp_entries(rs.run_id) == []
    # Idempotent.
    R.stop_replicas(rs, grace=1)


def test_port_in_use_is_refused(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(R.ReplicaError, match="in use"):
            R.start_replicas(1, sim=True, ports=[port], state_file=tmp_path / "s.json")


def test_fail_fast_with_log_tail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crashing(python: str, **_: object) -> list[str]:
        return [python, "-c", "import sys; print('boom-from-replica'); sys.exit(3)"]

    monkeypatch.setattr(R, "sim_command", crashing)
    t0 = time.monotonic()
    with pytest.raises(R.ReplicaError, match="boom-from-replica") as ei:
        R.start_replicas(1, sim=True, ports=free_ports(1), state_file=tmp_path / "s.json")
    assert time.monotonic() - t0 < 20
    assert "exited with code 3" in str(ei.value)
    assert not (tmp_path / "s.json").exists()


def test_health_timeout_stops_the_replica(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def sleeper(python: str, **_: object) -> list[str]:
        return [python, "-c", "import time; time.sleep(60)"]

    monkeypatch.setattr(R, "sim_command", sleeper)
    with pytest.raises(R.ReplicaError, match="not healthy after"):
        R.start_replicas(
            1, sim=True, ports=free_ports(1), state_file=tmp_path / "s.json", timeout=2
        )
    # The sleeper was stopped: nothing with our marker is left.
    assert not (tmp_path / "s.json").exists()


def test_down_never_kills_foreign_processes(tmp_path: Path) -> None:
    """A stale state file naming a live PGID that is not ours must not kill it."""
    foreign = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True
    )
    try:
        rs = _sample_set(tmp_path)
        rs.replicas = rs.replicas[:1]
        rs.replicas[0].pid = rs.replicas[0].pgid = foreign.pid
        rs.replicas[0].tmpdir = str(tmp_path / "t")
        rs.save()
        assert R.main(["down", "--state-file", rs.state_file, "--grace", "1"]) == 0
        assert foreign.poll() is None, "a foreign process group was signalled"
    finally:
        foreign.kill()
        foreign.wait(timeout=10)
