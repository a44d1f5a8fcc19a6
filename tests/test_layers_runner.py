"""``scripts/test_layers.py``, the runner behind ``make test``: every layer runs whatever
happened before it, a hung layer is ended at its bound, a failed install marks the layers
that need it as not run, and the summary and the exit status say all of it.

Real processes, tiny commands; the runner's own layers are swapped for these.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "test_layers.py"
PY = sys.executable


def load_runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("test_layers_runner_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def runner() -> ModuleType:
    return load_runner()


def py(code: str) -> tuple[str, ...]:
    return (PY, "-c", code)


def run(runner: ModuleType, tmp_path: Path, layers: tuple[object, ...]) -> tuple[int, Any]:
    runner.LAYERS = layers
    out = tmp_path / "layers.json"
    rc = runner.main(["--json", str(out), "--logs", str(tmp_path / "logs")])
    return rc, json.loads(out.read_text())


def test_every_layer_runs_after_a_failure_and_the_run_fails(
    runner: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    layers = (
        runner.Layer("first", "fails", (py("print('== 1 failed, 2 passed in 0.1s =='); exit(1)"),)),
        runner.Layer("second", "passes", (py("print('3 passed in 0.2s')"),)),
    )
    rc, report = run(runner, tmp_path, layers)
    assert rc == 1
    assert [(r["name"], r["result"]) for r in report["layers"]] == [
        ("first", "failed"),
        ("second", "passed"),
    ]
    assert report["layers"][0]["tests"] == {"failed": 1, "passed": 2}
    assert report["layers"][1]["tests"] == {"passed": 3}
    text = capsys.readouterr().out
    assert "FAILED: first" in text and "3 passed in 0.2s" in text  # the output is echoed


def test_a_layer_passes_only_when_all_its_commands_pass(runner: ModuleType, tmp_path: Path) -> None:
    ok, bad = py("pass"), py("exit(3)")
    layers = (
        runner.Layer("mixed", "", (bad, ok)),  # the second still runs after the first failed
        runner.Layer("clean", "", (ok, ok)),
    )
    rc, report = run(runner, tmp_path, layers)
    assert rc == 1
    assert [r["result"] for r in report["layers"]] == ["failed", "passed"]


def test_a_hung_layer_is_killed_at_its_bound_with_its_children(
    runner: ModuleType, tmp_path: Path
) -> None:
    pid_file = tmp_path / "child.pid"
    hang = py(
        "import subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        f"open({str(pid_file)!r}, 'w').write(str(c.pid)); print('started', flush=True); "
        "time.sleep(600)"
    )
    layers = (
        runner.Layer("hangs", "", (hang,), bound_s=2.0),
        runner.Layer("after", "", (py("pass"),)),
    )
    t0 = time.monotonic()
    rc, report = run(runner, tmp_path, layers)
    assert time.monotonic() - t0 < 60  # far below the 600 s the commands would take
    assert rc == 1
    assert report["layers"][0]["result"] == "timed out after 2 s"
    assert report["layers"][1]["result"] == "passed"
    child = int(pid_file.read_text())
    # The grandchild went with its group: its /proc entry is gone or a zombie.
    stat = Path(f"/proc/{child}/stat")
    assert not stat.exists() or stat.read_text().split(") ")[1].startswith("Z")


def test_concurrent_commands_run_at_once_and_are_all_counted(
    runner: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "marker"
    # Each waits for the other's file: they pass only when they run at the same time.
    wait = (
        "import pathlib, time\n"
        "for _ in range(1200):\n"
        "    if pathlib.Path({p!r}).exists(): break\n"
        "    time.sleep(0.05)\n"
        "else: exit(1)\n"
    )

    def one(me: str, other: str, passed: int) -> tuple[str, ...]:
        mine, theirs = str(marker) + me, str(marker) + other
        return py(
            f"open({mine!r}, 'w')\n" + wait.format(p=theirs) + f"print('{passed} passed in 0.1s')"
        )

    a, b = one("a", "b", 1), one("b", "a", 2)
    layers = (runner.Layer("both", "", (a, b), concurrent=True),)
    rc, report = run(runner, tmp_path, layers)
    assert rc == 0, capsys.readouterr().out
    assert report["layers"][0]["tests"] == {"passed": 3}


def test_a_failed_install_marks_the_layers_that_need_it_not_run(
    runner: ModuleType, tmp_path: Path
) -> None:
    layers = (
        runner.Layer("install", "", (py("exit(1)"),), provides="thing"),
        runner.Layer("needs-it", "", (py("pass"),), needs="thing"),
        runner.Layer("independent", "", (py("pass"),)),
    )
    rc, report = run(runner, tmp_path, layers)
    assert rc == 1
    assert [r["result"] for r in report["layers"]] == [
        "failed",
        "not run: install failed",
        "passed",
    ]


def test_only_runs_the_named_layers_and_refuses_unknown_names(
    runner: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runner.LAYERS = (runner.Layer("a", "", (py("pass"),)), runner.Layer("b", "", (py("exit(1)"),)))
    out = tmp_path / "layers.json"
    assert runner.main(["--only", "a", "--json", str(out), "--logs", str(tmp_path)]) == 0
    assert [r["name"] for r in json.loads(out.read_text())["layers"]] == ["a"]
    with pytest.raises(SystemExit) as exc:
        runner.main(["--only", "fats"])
    assert exc.value.code == 2
    assert "unknown layer(s) fats; the layers are a, b" in capsys.readouterr().err


def test_the_real_layers_are_cheapest_first_and_install_before_what_needs_it() -> None:
    layers = load_runner().LAYERS
    names = [layer.name for layer in layers]
    assert names[:2] == ["lint", "fast"]  # before the multi-GB install
    install = next(i for i, layer in enumerate(layers) if layer.provides == "vllm")
    assert all(i > install for i, layer in enumerate(layers) if layer.needs == "vllm")
    assert {"trl", "faults-workers-2", "container", "e2e"} <= set(names)
    # the deploy files' rehearsal runs after the container layer, with the vLLM venv
    rehearsal = names.index("rehearsal")
    assert rehearsal == names.index("container") + 1
    assert layers[rehearsal].needs == "vllm"


def test_the_summary_repeats_each_failed_test_of_a_concurrent_layer(
    runner: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A truncated CI log keeps only the end; a concurrent layer's pytest output comes
    # minutes before it, so the summary must name what failed itself.
    fails = py(
        "print('FAILED tests/a.py::test_one - AssertionError: x')\n"
        "print('ERROR tests/b.py::test_two - RuntimeError: teardown')\n"
        "print('1 failed, 1 error, 3 passed in 0.1s'); exit(1)"
    )
    passes = py("print('a line with FAILED in it, not first'); print('2 passed in 0.1s')")
    layers = (runner.Layer("both", "", (fails, passes), concurrent=True),)
    rc, report = run(runner, tmp_path, layers)
    assert rc == 1
    assert report["layers"][0]["failures"] == [
        "FAILED tests/a.py::test_one - AssertionError: x",
        "ERROR tests/b.py::test_two - RuntimeError: teardown",
    ]
    summary = capsys.readouterr().out.split("===== test layers")[-1]
    assert "both: FAILED tests/a.py::test_one - AssertionError: x" in summary
    assert "both: ERROR tests/b.py::test_two" in summary


@pytest.mark.parametrize(
    ("printed", "floor", "result"),
    [
        ("== 5 passed in 0.1s ==", 5, "passed"),
        ("== 5 passed, 1 skipped in 0.1s ==", 5, "failed: 1 skipped"),
        ("== 3 passed in 0.1s ==", 5, "failed: 3 passed < floor 5"),
        ("== 4 deselected in 0.1s ==", 0, "failed: 0 passed < floor 0"),
    ],
)
def test_a_pytest_layer_that_exits_0_still_fails_when_it_proved_little(
    runner: ModuleType, tmp_path: Path, printed: str, floor: int, result: str
) -> None:
    layers = (runner.Layer("layer", "prints", (py(f"print({printed!r})"),), floor=floor),)
    rc, report = run(runner, tmp_path, layers)
    assert report["layers"][0]["result"] == result
    assert rc == (0 if result == "passed" else 1)


def test_a_layer_without_a_floor_is_judged_by_its_exit_code_alone(
    runner: ModuleType, tmp_path: Path
) -> None:
    rc, report = run(runner, tmp_path, (runner.Layer("lint", "prints nothing", (py("pass"),)),))
    assert (rc, report["layers"][0]["result"]) == (0, "passed")


def test_every_pytest_layer_has_a_floor() -> None:
    """A layer whose commands run pytest is held to a floor; the others are not."""
    module = load_runner()
    for layer in module.LAYERS:
        runs_pytest = any("pytest" in argv for argv in layer.commands)
        assert (layer.floor is not None) == runs_pytest, layer.name
        assert layer.floor is None or layer.floor > 0, layer.name


def test_the_record_keeps_each_layers_slowest_tests(
    runner: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = "2.50s call     tests/a.py::test_slow\n0.10s setup    tests/a.py::test_slow\n"
    printed = f"print({out!r}); print('== 1 passed in 2.6s ==')"
    rc, report = run(runner, tmp_path, (runner.Layer("one", "slow", (py(printed),), floor=1),))
    assert rc == 0
    assert report["layers"][0]["slowest"] == [
        {"seconds": 2.5, "test": "tests/a.py::test_slow (call)"},
        {"seconds": 0.1, "test": "tests/a.py::test_slow (setup)"},
    ]
    assert "2.5s  one: tests/a.py::test_slow (call)" in capsys.readouterr().out


def test_hogs_spin_while_the_layers_run_and_end_with_them() -> None:
    """``--hog K``: K processes each burn a core for as long as the block lasts, and none
    outlives it."""
    runner = load_runner()
    with runner.cpu_hogs(2):
        pids = _children_running_spin()
        assert len(pids) == 2, pids
        before = [_cpu_ticks(p) for p in pids]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(
            _cpu_ticks(p) > b for p, b in zip(pids, before, strict=True)
        ):
            time.sleep(0.05)
        assert all(_cpu_ticks(p) > b for p, b in zip(pids, before, strict=True))
    assert _children_running_spin() == []


def _children_running_spin() -> list[int]:
    """PIDs of this process's live children running the hog's loop."""
    me = str(Path("/proc/self").resolve().name)
    found = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            cmd = (proc / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[1] == me and fields[0] != "Z" and b"while time.monotonic() < end" in cmd:
            found.append(int(proc.name))
    return sorted(found)


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime
