"""Suite-wide fixtures. Secrets used by tests are constants here, and every log record the
suite produces is checked for them at the end of the session (a leak fails the run)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import pytest

from tests.deploy._proc import sim_replica as _sim_replica

UPSTREAM_TOKEN = "hf_TESTSECRET_upstream_7Qx9"
CLIENT_KEY = "sk-TESTSECRET-client-4Fz2"
ADMIN_KEY = "sk-TESTSECRET-admin-8Lm3"
SECRETS = (UPSTREAM_TOKEN, CLIENT_KEY, ADMIN_KEY)


class _Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # a broken record must not hide others
            text = str(record.msg)
        if record.exc_info and record.exc_info[1] is not None:
            text += " " + repr(record.exc_info[1])
        self.lines.append(f"{record.name}: {text}")


RECORDER = _Recorder()

# Property tests: ``make test`` (what CI runs to land a change) replays the same examples
# every time, so a landing is never refused by a case nobody has seen before, and time
# plays no part (no per-example deadline, no "too slow" health check: this VM drifts).
# ``make test-explore`` draws fresh examples, round after round: run it before a change
# lands (docs/testing.md, "Property tests"). The vLLM venv's layers (trainer, TRL) have no
# property tests and no hypothesis.
with contextlib.suppress(ImportError):
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "landing",
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        print_blob=True,
    )
    settings.register_profile(
        "explore",
        derandomize=False,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        print_blob=True,
    )
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "landing"))


@pytest.fixture(scope="session", autouse=True)
def _no_secret_in_logs() -> Iterator[None]:
    root = logging.getLogger()
    previous = root.level
    root.addHandler(RECORDER)
    root.setLevel(logging.DEBUG)
    yield
    root.removeHandler(RECORDER)
    root.setLevel(previous)
    leaks = [line for line in RECORDER.lines if any(s in line for s in SECRETS)]
    assert not leaks, f"secrets leaked into {len(leaks)} log lines, e.g. {leaks[0][:200]}"


@pytest.fixture
def sim_replica() -> Iterator[str]:
    """One ``rollout-testbed sim-replica`` process for the test; yields its base URL once
    it answers (``tests/deploy/_proc.py``)."""
    with _sim_replica() as url:
        yield url
