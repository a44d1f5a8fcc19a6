"""Each CPU shim equals what it replaces (no replicas needed; a few seconds).

* peak FLOPs: the stand-in returns what TRL's own lookup returns for a device it does not
  know, and TRL's original really cannot run on this CPU build;
* vLLM availability: only ``AsyncRolloutWorker``'s check changes, nothing else in TRL;
* tree attention: TRL's registered ``tree_fa3`` path, on the stand-in kernel, gives the
  plain HF forward's logits (eager and sdpa) within 1e-5 on the tiny model, for a packed
  trie with shared prompts, forks and two groups; the kernel alone matches a per-sequence
  reference for bottom-right causal masks, GQA, sliding windows and softcapping.

Plus the tokenizer configuration: TRL recognises the layer's model dir (no patch).
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from rollout_testbed.trl import cpu_shims
from rollout_testbed.trl.harness import CHATML_RESPONSE_TEMPLATE, build_model_dir

ORDER = 0
pytestmark = pytest.mark.timeout(300)

TRAINER_MOD = "trl.experimental.async_grpo.async_grpo_trainer"
WORKER_MOD = "trl.experimental.async_grpo.async_rollout_worker"
PACKING_MOD = "trl.experimental.async_grpo.packing"


@pytest.fixture
def shims() -> Iterator[None]:
    from accelerate.state import PartialState

    PartialState()  # TRL logs through accelerate's logger, which needs the state
    with cpu_shims.installed():
        yield


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build_model_dir()


# --------------------------------------------------------------------------- 1. FLOPs


def test_trl_peak_flops_lookup_needs_cuda_on_this_machine() -> None:
    """Why the shim exists: TRL's original raises on a CPU build of torch."""
    original = cpu_shims.original(TRAINER_MOD, "get_peak_flops_per_device")
    accelerator = SimpleNamespace(device=torch.device("cpu"))
    with pytest.raises((AssertionError, RuntimeError)):
        original(accelerator, "float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "fp8"])
def test_peak_flops_shim_returns_trls_answer_for_an_unknown_device(
    shims: None, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trl.trainer import utils as trl_utils

    mod = importlib.import_module(TRAINER_MOD)
    assert mod.get_peak_flops_per_device is cpu_shims.peak_flops_per_device
    accelerator = SimpleNamespace(device=torch.device("cpu"))
    got = mod.get_peak_flops_per_device(accelerator, dtype)
    assert got is None
    assert got == trl_utils.get_peak_flops("cpu", dtype)
    # TRL's own function, given a GPU name its table does not list, answers the same.
    original = cpu_shims.original(TRAINER_MOD, "get_peak_flops_per_device")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Mystery Accelerator 9000")
    assert original(accelerator, dtype) == got
    # And for a device TRL does know, the stand-in delegates to the same table.
    monkeypatch.setattr(cpu_shims, "device_name", lambda _d: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H100 80GB HBM3")
    assert mod.get_peak_flops_per_device(accelerator, dtype) == original(accelerator, dtype)


# --------------------------------------------------------------------------- 2. vLLM check


def _hide_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``find_spec("vllm")`` fail for TRL's import helper only."""
    import trl.import_utils as iu

    real = importlib.util.find_spec

    def find_spec(name: str, *a: Any, **kw: Any) -> Any:
        return None if name == "vllm" else real(name, *a, **kw)

    monkeypatch.setattr(iu.importlib.util, "find_spec", find_spec)


def _worker_kwargs() -> dict[str, Any]:
    return {"queue_maxsize": 4, "model_name": "m", "vllm_server_url": "http://127.0.0.1:9"}


def test_availability_shim_changes_only_the_rollout_workers_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import trl.import_utils as iu

    worker = importlib.import_module(WORKER_MOD)
    original_check = iu.is_vllm_available
    source = inspect.getsource(worker)
    # The worker uses vllm for nothing but this one check (it posts over aiohttp) ...
    assert source.count("is_vllm_available(") == 1
    assert "import vllm" not in source and "from vllm" not in source
    assert "is_vllm_available()" in inspect.getsource(worker.AsyncRolloutWorker.__init__)
    # ... and without the shim it refuses to start when vllm is not importable.
    _hide_vllm(monkeypatch)
    assert not original_check()
    with pytest.raises(ImportError, match="vLLM is required"):
        worker.AsyncRolloutWorker(**_worker_kwargs())
    init_before = worker.AsyncRolloutWorker.__init__
    with cpu_shims.installed():
        assert worker.is_vllm_available is cpu_shims.rollout_worker_vllm_available
        built = worker.AsyncRolloutWorker(**_worker_kwargs())  # no process is started
        assert built._process is None and built.model_version == 0
        # Nothing else moved: TRL's helper, the class, and every other module's binding.
        assert iu.is_vllm_available is original_check
        assert worker.AsyncRolloutWorker.__init__ is init_before
        from trl.generation import vllm_client

        assert vllm_client.is_vllm_available is original_check
    assert worker.is_vllm_available is original_check


# --------------------------------------------------------------------------- 3. attention


def _reference_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: list[int], cu_k: list[int],
    *, causal: bool, window: tuple[int, int], softcap: float, scale: float,
) -> torch.Tensor:  # fmt: skip
    """Per-sequence dense attention, written independently of the kernel under test."""
    outs = []
    group = q.shape[1] // k.shape[1]
    for b in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[b] : cu_q[b + 1]], k[cu_k[b] : cu_k[b + 1]], v[cu_k[b] : cu_k[b + 1]]
        lq, lk = qs.shape[0], ks.shape[0]
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(lq)[:, None] + (lk - lq)
        j = torch.arange(lk)[None, :]
        ok = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            ok &= j <= i
        if window[0] >= 0:
            ok &= j >= i - window[0]
        s = s.masked_fill(~ok, -math.inf)
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vs))
    return torch.cat(outs)


@pytest.mark.parametrize(
    ("causal", "window", "softcap"),
    [(True, (-1, -1), 0.0), (True, (3, 0), 0.0), (True, (-1, -1), 5.0), (False, (-1, -1), 0.0)],
)
def test_varlen_kernel_matches_per_sequence_reference(
    causal: bool, window: tuple[int, int], softcap: float
) -> None:
    g = torch.Generator().manual_seed(0)
    lens_q, lens_k = [3, 1, 5, 2], [7, 4, 5, 9]  # Lq <= Lk: bottom-right alignment matters
    cu_q = [0, *np.cumsum(lens_q).tolist()]
    cu_k = [0, *np.cumsum(lens_k).tolist()]
    q = torch.randn(cu_q[-1], 4, 16, generator=g)
    k = torch.randn(cu_k[-1], 2, 16, generator=g)
    v = torch.randn(cu_k[-1], 2, 16, generator=g)
    got = cpu_shims.varlen_attention(
        q, k, v, torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32),
        max(lens_q), max(lens_k), softmax_scale=0.3, causal=causal, window_size=window,
        softcap=softcap,
    )  # fmt: skip
    want = _reference_varlen(q, k, v, cu_q, cu_k, causal=causal, window=window,
                             softcap=softcap, scale=0.3)  # fmt: skip
    assert got.shape == q.shape
    assert (got - want).abs().max().item() < 1e-5


def _samples() -> list[dict[str, Any]]:
    """Two GRPO groups: shared prompts, completions that fork after a shared start."""
    rng = np.random.default_rng(0)
    out: list[dict[str, Any]] = []
    for group, (plen, n) in enumerate([(20, 4), (12, 3)]):
        prompt = rng.integers(4, 2000, plen).tolist()
        first: list[int] = []
        for s in range(n):
            comp = rng.integers(4, 2000, int(rng.integers(3, 10))).tolist()
            if s % 2 == 1:  # share the first 2 completion tokens with the group's first
                comp = first[:2] + comp
            first = first or comp
            ids = np.array(prompt + comp, dtype=np.int64)
            out.append({
                "input_ids": ids,
                "completion_mask": np.array([0] * plen + [1] * len(comp)),
                "old_log_probs": np.zeros(len(ids), dtype=np.float32),
                "advantage": 0.0,
                "group_id": group,
            })  # fmt: skip
    return out


def test_tree_attention_matches_plain_hf_forward(shims: None, model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo.packing import (
        TREE_ATTENTION,
        TreeRow,
        register_tree_attention,
    )

    packing: Any = importlib.import_module(PACKING_MOD)
    calls = [0]
    kernel = cpu_shims.CPU_KERNEL.flash_attn_varlen_func

    def counting(*a: Any, **kw: Any) -> torch.Tensor:
        calls[0] += 1
        return kernel(*a, **kw)

    register_tree_attention()  # TRL's own registration, as AsyncGRPOTrainer.__init__ does
    row = TreeRow()
    samples = _samples()
    for sample in samples:
        row.add(sample)
    packed = row.pack()
    n_raw = sum(len(s["input_ids"]) for s in samples)
    assert len(packed["input_ids"]) < n_raw  # the trie did share tokens
    assert len(packed["tree_cu_seqlens_q"]) - 1 > len(samples)  # and forked
    tree_kwargs = {
        "tree_kv_index": packed["tree_kv_index"],
        "tree_cu_seqlens_q": packed["tree_cu_seqlens_q"],
        "tree_cu_seqlens_k": packed["tree_cu_seqlens_k"],
        "tree_max_seqlen_q": int(packed["tree_max_seqlens"][0]),
        "tree_max_seqlen_k": int(packed["tree_max_seqlens"][1]),
    }

    def load(impl: str) -> Any:
        return AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32, attn_implementation=impl
        ).eval()

    tree = load(TREE_ATTENTION)
    with torch.no_grad():
        original_kernel = packing._flash_attn
        packing._flash_attn = lambda: SimpleNamespace(flash_attn_varlen_func=counting)
        try:
            logits = tree(
                input_ids=packed["input_ids"][None],
                position_ids=packed["position_ids"][None],
                **tree_kwargs,
            ).logits[0]
        finally:
            packing._flash_attn = original_kernel
        got = logits[packed["token_index"]]
        assert calls[0] == tree.config.num_hidden_layers  # really the tree path
        # The same tokens forwarded as one plain causal sequence differ (control).
        flat = load("eager")(input_ids=packed["input_ids"][None]).logits[0]
        assert (flat[packed["token_index"]] - got).abs().max().item() > 1e-2
        for impl in ("eager", "sdpa"):
            plain = load(impl)
            want = []
            for sample in samples:
                out = plain(input_ids=torch.tensor(sample["input_ids"])[None]).logits[0]
                mask = sample["completion_mask"]
                want += [out[p - 1] for p in range(1, len(mask)) if mask[p]]
            diff = (got - torch.stack(want)).abs().max().item()
            assert diff < 1e-5, f"tree_fa3 (CPU) vs {impl}: max |diff| {diff:.2e}"


# --------------------------------------------------------------------------- tokenizer


def test_layer_tokenizer_is_recognised_by_trl(model_dir: Path) -> None:
    """Configuration, not a patch: the model dir's tokenizer carries a ChatML
    ``response_template``, so TRL's rollout worker skips ``add_response_schema`` (which
    raises for any chat template it does not know) and parses completions with it."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import add_response_schema, parse_response

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert tok.response_template == CHATML_RESPONSE_TEMPLATE
    bare = AutoTokenizer.from_pretrained(str(model_dir))
    bare.response_template = None
    with pytest.raises(ValueError, match="Unrecognized chat template"):
        add_response_schema(bare)
    messages = [{"role": "user", "content": "Write 5 digits now."}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    ids = tok("12345 678", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert parse_response(tok, ids, prefix=prompt) == {"role": "assistant", "content": "12345 678"}
    truncated = parse_response(tok, ids[:2], prefix=prompt)  # max_tokens cut it short
    assert truncated["role"] == "assistant" and "12345 678".startswith(truncated["content"])
