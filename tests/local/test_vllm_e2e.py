"""The tiny local model the real-vLLM layers serve (marked e2e: it needs the vLLM venv).

The launcher's replicas themselves are checked on the e2e session's pair
(``tests/e2e/test_vllm_replicas.py``, ``tests/e2e/test_vllm_down.py``).

These need the vLLM venv (``make vllm`` / ``bash scripts/install-vllm.sh``). They FAIL, never
skip, when it is missing: the CI installs it first. The python is ``$ROLLOUT_TESTBED_VLLM_PYTHON``,
default ``<repo>/.venv-vllm/bin/python``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from rollout_testbed.local.tiny_model import tree_digest

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
