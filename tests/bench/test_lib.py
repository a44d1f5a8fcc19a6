"""``bench/lib``: the one response parser, the stream check, paired rounds and the CPU
reader, on inputs small enough to check by hand (the benchmarks' figures rest on them)."""

from __future__ import annotations

import os
import time

import pytest

from bench.lib import cpu, load, percentile, replica_metrics
from bench.lib.rounds import Budget, med, paired_rounds, ratio_per_round, rotated
from bench.lib.upstream import RESPONSE, sse_chunks

CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"


def test_a_sized_response_is_whole_only_with_its_body() -> None:
    buf = bytearray(RESPONSE + b"HTTP/1.1 200")  # the next response has begun
    parsed = load.parse_response(buf)
    assert parsed is not None
    status, head, consumed = parsed
    assert (status, consumed) == (200, len(RESPONSE))
    assert head.startswith(b"http/1.1 200 ok") and b"content-length" in head
    assert load.parse_response(bytearray(RESPONSE[:-1])) is None


def test_a_chunked_response_is_whole_at_its_last_chunk_and_dechunks() -> None:
    for cut in range(len(CHUNKED)):
        assert load.parse_response(bytearray(CHUNKED[:cut])) is None, cut
    parsed = load.parse_response(bytearray(CHUNKED))
    assert parsed is not None and parsed[2] == len(CHUNKED)
    assert load.body_of(CHUNKED, parsed[1]) == b"abcde"


def test_a_response_without_framing_is_a_protocol_error() -> None:
    with pytest.raises(load.ProtocolError):
        load.parse_response(bytearray(b"HTTP/1.1 200 OK\r\nx: y\r\n\r\nbody"))
    with pytest.raises(load.ProtocolError):
        load.parse_response(bytearray(b"garbage\r\n\r\n"))


def test_the_stream_check_accepts_the_upstreams_stream_and_nothing_less() -> None:
    stream = b"".join(sse_chunks())
    parsed = load.parse_response(bytearray(stream))
    assert parsed is not None and parsed[2] == len(stream)
    head = parsed[1]
    assert load.check_stream(200, head, stream) == 200
    # one token event fewer, or no [DONE]: broken; JSON for a stream request: not a stream
    events = sse_chunks()
    short = b"".join(events[:1] + events[2:])
    assert load.check_stream(200, head, short) == load.STATUS_BROKEN_STREAM
    no_done = stream.replace(b"data: [DONE]", b"data: [DONX]")
    assert load.check_stream(200, head, no_done) == load.STATUS_BROKEN_STREAM
    sized = load.parse_response(bytearray(RESPONSE))
    assert sized is not None
    assert load.check_stream(200, sized[1], RESPONSE) == load.STATUS_NOT_A_STREAM
    assert load.check_stream(503, head, stream) == 503


def test_the_client_argv_names_every_option_it_is_given() -> None:
    argv = load.client_argv("http://h:1", rate=300.0, requests=10, stream=True, warmup=0,
                            seed=0, start_at=1733130000.123456)  # fmt: skip
    assert argv[1:] == ["-m", "bench.lib.load", "--url", "http://h:1", "--rate", "300.0",
                        "--requests", "10", "--stream", "--seed", "0",
                        "--start-at", "1733130000.123456"]  # fmt: skip
    args = load._parser().parse_args(argv[3:])
    assert (args.rate, args.requests, args.stream, args.warmup) == (300.0, 10, True, 0)


def test_paired_rounds_rotate_log_and_ratios_are_taken_per_round() -> None:
    log: list[dict[str, object]] = []
    for _, _, note in paired_rounds("abc", 4, log=log, key=str.upper):
        note["extra"] = 1
    assert [n["order"] for n in log] == [list("ABC"), list("BCA"), list("CAB"), list("ABC")]
    assert [n["round"] for n in log] == [1, 2, 3, 4]
    assert all(n["extra"] == 1 and float(n["duration_s"]) >= 0 for n in log)  # type: ignore[arg-type]
    assert rotated([], 3) == []
    rounds = [{"a": 2.0, "b": 1.0}, {"a": 9.0, "b": 3.0}, {"a": 4.0, "b": 1.0}, {"a": 1.0}]
    assert ratio_per_round(rounds, "a", "b", float) == 3.0  # median of 2, 3, 4
    assert med([1.0, float("nan"), 3.0]) == 2.0


def test_a_spent_budget_stops_rounds_after_the_first() -> None:
    spent = Budget(0.0)
    assert [r for r, _, _ in paired_rounds("ab", 5, spent)] == [0]


def test_the_cpu_reader_sees_this_process_burn_cpu() -> None:
    pid = os.getpid()
    ns0, s0 = cpu.tree_oncpu_ns(pid), cpu.cpu_s(pid)
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    assert cpu.tree_oncpu_ns(pid) - ns0 >= 0.15e9
    assert cpu.cpu_s(pid) - s0 >= 0.1  # clock ticks: coarser
    st = cpu.stat(pid)
    assert st is not None and st[0] == os.getppid()
    assert pid in cpu.tree(os.getppid())
    assert cpu.stat(2**22 + 1) is None and cpu.cpu_s(2**22 + 1) == 0.0


def test_the_percentile_is_the_value_at_rank_q_n() -> None:
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]  # any order
    assert [percentile.pct(xs, q) for q in (0.0, 0.5, 0.99, 1.0)] == [1.0, 3.0, 5.0, 5.0]
    assert (
        percentile.pct(range(100), 0.99) == 99
    )  # rank 99 of 100: the top, not p99 by interpolation
    assert percentile.pct_or_none([1.0, 2.3456], 0.5, 2) == 2.35
    assert percentile.pct_or_none([], 0.5, 2) is None
    with pytest.raises(ValueError):
        percentile.pct([], 0.5)


def test_replica_counters_are_summed_over_labels_and_vllm_only() -> None:
    text = (
        "# TYPE vllm:prefix_cache_hits_total counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 3.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 4.0\n'
        "vllm:prefix_cache_queries_total 1e1\n"
        "process_cpu_seconds_total 9.0\n"
    )
    assert replica_metrics.summed(text) == {
        "vllm:prefix_cache_hits_total": 7.0,
        "vllm:prefix_cache_queries_total": 10.0,
    }
