from pathlib import Path

from rollout_testbed import demo
from rollout_testbed.demo import main, trainer_args


def test_demo_sim_mode_runs_clean() -> None:
    """The fast, torch-free demo mode end to end: every rollout served, groups together."""
    assert main(["--sim", "--steps", "4", "--prompts-per-step", "4", "--max-staleness", "1"]) == 0


def test_real_mode_driver_flags_parse() -> None:
    """The flags the real demo passes to the driver are ones its parser knows (no torch)."""
    from trainer.config import parse_config

    args = trainer_args(Path("m"), "http://127.0.0.1:1", Path("o"), steps=5, duration_s=9.0,
                        max_staleness=2, seed=0)  # fmt: skip
    cfg = parse_config(args)
    assert (cfg.max_steps, cfg.max_staleness, cfg.task) == (5, 2, "digits")


def test_real_mode_runs_the_driver_from_the_checkout() -> None:
    """The driver is ``python -m trainer`` from the repository, with the repository on its
    PYTHONPATH; the demo once looked for it in testbed/ and every real run failed."""
    assert Path(__file__).resolve().parents[1] == demo.REPO
    assert (demo.REPO / "trainer" / "__main__.py").is_file()
