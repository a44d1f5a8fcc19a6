"""Session fixtures: the sidecar image, built once per session (and cached across them)."""

from __future__ import annotations

import pytest

from tests.container._podman import build_image, build_sim_image


@pytest.fixture(scope="session")
def image() -> str:
    return build_image()


@pytest.fixture(scope="session")
def sim_image(image: str) -> str:
    return build_sim_image(image)
