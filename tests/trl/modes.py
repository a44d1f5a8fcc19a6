"""Which gateway mode a TRL scenario runs against.

One layer, one pair of replicas, both modes: the gateway is restarted on its port when
the next scenario wants the other mode (``Layer.use_gateway``), which costs seconds, where
a second layer cost its own replicas' start and ran every marked scenario twice.
"""

from __future__ import annotations

import pytest

WORKERS = 2  # what a scenario marked ``workers`` runs against: ``serve --workers 2``


def workers_for(request: pytest.FixtureRequest) -> int:
    """The gateway's ``--workers`` for the test or module asking: ``WORKERS`` where it is
    marked ``workers``, else 1. Each scenario runs once, in the mode it proves: the marked
    ones are where ``--workers 2`` changes what happens (a sync must reach every worker,
    a run set must reach every worker, an ejection seen by one worker holds for both); the
    rest prove the one-process gateway, which the other real-vLLM layers also run."""
    return WORKERS if request.node.get_closest_marker("workers") else 1
