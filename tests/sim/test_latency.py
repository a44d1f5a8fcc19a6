from __future__ import annotations

import pytest
from rollout_testbed.sim.latency import LatencyModel


def test_instant() -> None:
    m = LatencyModel.parse("instant")
    assert m == LatencyModel() and m.is_instant
    assert m.delays(1000, 5) == (0.0, 0.0)
    assert str(m) == "instant"


def test_parse_and_delays() -> None:
    m = LatencyModel.parse("prefill=2e-5, decode=1e-3,concurrency=1e-4")
    assert m == LatencyModel(prefill=2e-5, decode=1e-3, concurrency=1e-4)
    prefill, decode = m.delays(uncached_tokens=1000, in_flight=3)
    assert prefill == pytest.approx(0.02)
    assert decode == pytest.approx(1e-3 + 2 * 1e-4)
    assert m.delays(0, 1)[1] == pytest.approx(1e-3)
    assert LatencyModel.parse(str(m)) == m


def test_partial_spec_defaults_to_zero() -> None:
    assert LatencyModel.parse("decode=0.5") == LatencyModel(decode=0.5)


@pytest.mark.parametrize("spec", ["fast", "prefill", "prefill=x", "bogus=1", "decode=-1"])
def test_rejects_bad_specs(spec: str) -> None:
    with pytest.raises(ValueError):
        LatencyModel.parse(spec)
