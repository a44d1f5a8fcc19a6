"""Stopping the launcher's replicas leaves nothing: no process, no private temp dir, no
state file, no entry in /tmp from vLLM. Last in the session (``E2E_ORDER``): it stops
every replica the session started, the one the kill/restart test started included."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from rollout_testbed.local import replicas as R

from tests.e2e.conftest import E2E

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
E2E_ORDER = 2  # last: it stops the session's replicas (tests/e2e/conftest.py)


def test_stopping_the_replicas_leaves_nothing(e2e_session: E2E) -> None:
    env = e2e_session
    assert env.sets, "the session reused replicas (ROLLOUT_TESTBED_E2E_REUSE_STATE): none to stop"
    env.close()  # the session's own teardown does it again: stopping is idempotent
    new = set(os.listdir(tempfile.gettempdir())) - env.tmp_before
    for rs in env.sets:
        for r in rs.replicas:
            assert R.group_members(r.pgid) == [], f"processes left in group {r.pgid}"
            assert R.health(r.url) is None
            assert not Path(r.tmpdir).exists()
        assert not Path(rs.state_file).exists()
        # Only entries of this run count as stray: names carry the run's id.
        ours = [n for n in new if rs.run_id[:8] in n]
        assert ours == [], ours
    # vLLM's own leftovers would show up by their usual names.
    suspicious = [n for n in new if n.startswith(("torchinductor", "vllm", "tmp", "pymp-"))]
    assert suspicious == [], suspicious
