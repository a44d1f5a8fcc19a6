"""``bench.lib.upstream``'s saturating mode and ``bench/cores.py``'s issue-28 additions: the
fake's capacity is what it claims (C slots of S ms, one FIFO queue, each connection's answers
in order), and the harness's flags parse as documented."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

import pytest

from bench.lib.upstream import HEALTH, RESPONSE, Capacity, SaturatingUpstream
from tests.bench import load_bench

cores = load_bench("cores")

REQUEST = b"POST /v1/completions HTTP/1.1\r\ncontent-length: 2\r\n\r\n{}"
HEALTH_REQUEST = b"GET /health HTTP/1.1\r\n\r\n"


class Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return False


def connection(capacity: Capacity) -> tuple[SaturatingUpstream, Transport]:
    conn = SaturatingUpstream(capacity)
    transport = Transport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    return conn, transport


class ManualTimers:
    """``Capacity``'s clock, moved by the test: a service time passes when the test says,
    never a real sleep that a loaded machine can overrun."""

    def __init__(self) -> None:
        self.now = 0.0
        self.due: list[tuple[float, int, Callable[..., object], tuple[Any, ...]]] = []
        self.order = itertools.count()  # timers due at once run in the order they were set

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> object:
        heapq.heappush(self.due, (self.now + delay, next(self.order), callback, args))
        return None

    def advance(self, seconds: float) -> None:
        """Run every timer due within ``seconds`` from now, in time order, at its time."""
        until = self.now + seconds
        while self.due and self.due[0][0] <= until + 1e-9:
            self.now, _, callback, args = heapq.heappop(self.due)
            callback(*args)
        self.now = until


def test_capacity_serves_c_at_a_time_then_in_arrival_order() -> None:
    timers = ManualTimers()
    capacity = Capacity(0.02, 2, timers)
    done: list[tuple[int, float]] = []
    for i in range(5):
        capacity.submit(lambda i=i: done.append((i, timers.now)))
    assert capacity.free == 0 and len(capacity.waiting) == 3 and capacity.max_waiting == 3
    timers.advance(0.019)
    assert done == [] and capacity.served == 0  # a slot is held its whole service time
    timers.advance(0.1)
    assert capacity.free == 2 and capacity.served == 5
    assert [i for i, _ in done] == [0, 1, 2, 3, 4]  # FIFO, whichever connection
    waves = [round(t / 0.02) for _, t in done]
    assert waves == [1, 1, 2, 2, 3]  # two slots: 5 requests take three service times


def test_a_connection_answers_in_order_and_health_never_queues() -> None:
    timers = ManualTimers()
    capacity = Capacity(0.01, 1, timers)
    busy, _ = connection(capacity)
    busy.data_received(REQUEST)  # takes the only slot
    conn, transport = connection(capacity)
    conn.data_received(HEALTH_REQUEST)
    assert transport.written == [HEALTH]  # at once, no slot needed
    conn.data_received(REQUEST + HEALTH_REQUEST)  # the health check waits its turn
    timers.advance(0.01)  # the busy request's service time: the slot passes on
    assert transport.written == [HEALTH]
    timers.advance(0.01)
    assert transport.written == [HEALTH, RESPONSE, HEALTH]


def test_cores_parses_the_saturating_mode_and_variants() -> None:
    args = cores.parse_args(
        ["--fake-service-ms", "4", "--fake-concurrency", "56", "--fronts", "gateway,gateway_rr",
         "--variant", 'tight:GATEWAY_ROUTING={"load_epsilon":0.05}', "--cores", "2"]
    )  # fmt: skip
    assert args.name == "cores-saturated"
    assert args.variant_env == {"tight": {"GATEWAY_ROUTING": '{"load_epsilon":0.05}'}}
    assert cores.parse_args(["--cores", "2"]).name == "cores"
    for bad in (["--variant", "rr:X=1"], ["--variant", "x:=1"], ["--fronts", "base"]):
        with pytest.raises(SystemExit):
            cores.parse_args(bad)


def test_the_saturated_targets_compare_each_core_count_with_rr() -> None:
    summary: dict[str, Any] = {
        "gateway@2": {"p99_vs_rr": 0.8, "rps_vs_rr": 1.1, "p99_ms": 8.0, "rps": 1100.0},
        "rr@2": {"p99_ms": 10.0, "rps": 1000.0},
        "gateway@8": {"p99_vs_rr": 1.04, "rps_vs_rr": 1.1, "p99_ms": 9.3, "rps": 43000.0},
        "rr@8": {"p99_ms": 9.0, "rps": 39000.0},
    }
    met = [t["met"] for t in cores.saturated_targets(summary, [2, 8])]
    assert met == [True, True, False, True]


def test_connections_reads_nothing_for_processes_that_are_gone() -> None:
    assert cores.connections([2**22 + 12345], 1, [2, 3]) == {
        "client_conns": [],
        "upstream_conns": [],
    }
