"""Fixtures: one simulated replica on a real socket, and an httpx client bound to it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from rollout_testbed.sim.config import SimConfig
from rollout_testbed.sim.testing import SimURL, running_sim


@pytest.fixture
def sim_config() -> SimConfig:
    return SimConfig(block_size=4, max_model_len=256)


@pytest.fixture
async def sim(sim_config: SimConfig) -> AsyncIterator[SimURL]:
    async with running_sim(sim_config) as url:
        yield url


@pytest.fixture
async def client(sim: SimURL) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=sim, timeout=10) as c:
        yield c
