from __future__ import annotations

import pytest
from rollout_testbed.sim.latency import LatencyModel
from rollout_testbed.sim.server import build_parser, config_from_args


def test_flags_map_to_config() -> None:
    args = build_parser().parse_args(
        [
            "--port",
            "9",
            "--model",
            "m",
            "--max-loras",
            "3",
            "--max-lora-rank",
            "16",
            "--block-size",
            "16",
            "--cache-blocks",
            "10",
            "--max-model-len",
            "512",
            "--latency-model",
            "decode=0.01",
            "--check-lora-paths",
        ]
    )
    cfg = config_from_args(args)
    assert (args.port, args.host) == (9, "127.0.0.1")
    assert (cfg.model, cfg.max_loras, cfg.max_lora_rank) == ("m", 3, 16)
    assert (cfg.block_size, cfg.cache_blocks, cfg.max_model_len) == (16, 10, 512)
    assert cfg.latency == LatencyModel(decode=0.01) and cfg.check_lora_paths


def test_defaults_and_bad_latency(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config_from_args(build_parser().parse_args(["--port", "1"]))
    assert cfg.latency.is_instant and not cfg.check_lora_paths
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--port", "1", "--latency-model", "nope=1"])
    assert "rollout-testbed sim-replica" in capsys.readouterr().err
