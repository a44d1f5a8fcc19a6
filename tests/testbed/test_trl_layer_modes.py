"""The TRL layer runs each scenario once, in the mode it proves, on one pair of replicas:
``Layer.use_gateway`` restarts the gateway on its port as ``serve --workers N``. Here on
two simulated replicas (real processes), so the fast layer holds the switch itself to
what the TRL layer relies on: the mode asked for is the mode that runs, on the same URL,
and asking again for the running mode restarts nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from rollout_testbed.procs import LOCAL, Proc, free_port, free_ports, sim_argv, stop_all
from rollout_testbed.trl.harness import GatewayProcess, Layer, get_json


@pytest.fixture
def layer(tmp_path: Path) -> Iterator[Layer]:
    sims = []
    try:
        for i, port in enumerate(free_ports(2)):
            url = f"http://{LOCAL}:{port}"
            sim = Proc(f"sim-{i}", sim_argv(port), tmp_path / f"sim-{i}.log", url=url)
            sims.append(sim.start())
        for sim in sims:
            sim.wait_http(timeout=60)
        urls = [s.url for s in sims]
        gw = GatewayProcess(urls, port=free_port(), log_path=tmp_path / "gateway.log", workers=1)
        gw.start()
        layer = Layer("unused", tmp_path, urls, gw, owned=False)
        try:
            yield layer
        finally:
            layer.gateway.stop()
    finally:
        stop_all(sims)


def test_the_gateway_switches_modes_on_its_port_and_keeps_a_running_one(layer: Layer) -> None:
    first = layer.gateway
    first_pid = first.proc.pid if first.proc else None
    layer.use_gateway(1)  # the mode it runs: nothing restarts
    assert layer.gateway is first and first.proc is not None and first.proc.pid == first_pid

    layer.use_gateway(2)
    second = layer.gateway
    assert second is not first and first.proc is None  # the old process was stopped
    assert (second.url, second.workers, layer.gateway.processes()) == (first.url, 2, 2)
    assert second.command()[second.command().index("--workers") + 1] == "2"
    assert get_json(second.url + "/v1/models")["data"], "the restarted gateway serves"

    layer.use_gateway(1)
    assert (layer.gateway.url, layer.gateway.processes()) == (first.url, 1)


def test_a_stopped_gateway_is_started_in_the_mode_asked(layer: Layer) -> None:
    """A fault test may leave the gateway down: the next scenario's mode starts it."""
    layer.gateway.stop()
    layer.use_gateway(2)
    assert layer.gateway.processes() == 2
