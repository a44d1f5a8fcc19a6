from gateway.demo import main


def test_demo_runs_clean() -> None:
    """The README demo end to end, smaller: every rollout served, every group together."""
    assert main(["--steps", "4", "--prompts-per-step", "4", "--max-staleness", "1"]) == 0
