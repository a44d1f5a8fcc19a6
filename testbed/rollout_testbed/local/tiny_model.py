"""Build a tiny, deterministic Qwen2 model + tokenizer + LoRA adapters for local vLLM.

    rollout-testbed make-tiny-model DIR [--seed 0] [--adapters 8] [--rank 8] [--targets q_v]

Needs torch, transformers, peft, tokenizers and safetensors, which live in the vLLM venv
(``scripts/install-vllm.sh``), never in the gateway's own venv. This module therefore
imports only the standard library at import time and can be run in three ways:

* ``rollout-testbed make-tiny-model DIR`` from the gateway venv: when the heavy packages
  are missing there, it re-runs itself with the vLLM venv's python (``ROLLOUT_TESTBED_VLLM_PYTHON``
  or ``<repo>/.venv-vllm/bin/python``), or prints the install command and exits 2;
* ``.venv-vllm/bin/python -m rollout_testbed.local.tiny_model DIR`` from the repository root;
* ``.venv-vllm/bin/python path/to/rollout_testbed/local/tiny_model.py DIR`` from anywhere:
  the file is self-contained, so no package need be installed in the vLLM venv.

Same seed and same pinned package versions give byte-identical files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SERVED_MODEL_NAME = "tiny-base"
ADAPTER_PREFIX = "trl-policy-v"
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
EOS_TOKEN_ID = 2
PAD_TOKEN_ID = 3
MAX_POSITION_EMBEDDINGS = 2048
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
HEAVY_MODULES = ("torch", "transformers", "peft", "tokenizers", "safetensors")
NO_DELEGATE_ENV = "ROLLOUT_GATEWAY_TINY_MODEL_NO_DELEGATE"
INSTALL_HINT = (
    "Install the vLLM venv with `make vllm` (or `bash scripts/install-vllm.sh`), then run\n"
    "  .venv-vllm/bin/python -m rollout_testbed.local.tiny_model DIR   (from the repository root)\n"
    "or set ROLLOUT_TESTBED_VLLM_PYTHON to that venv's python and use "
    "`rollout-testbed make-tiny-model DIR`."
)

# ---------------------------------------------------------------------------------------
# Corpus for the tokenizer (pure stdlib, deterministic)
# ---------------------------------------------------------------------------------------

_ONSETS = "- b c d f g h k l m n p r s t v w z st tr ch sh th pl gr".replace("-", "").split(" ")
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "y"]
_CODAS = "- - n r s t l m nd ng st ck".replace("-", "").split(" ")
_PUNCT = [".", ",", "?", "!", ":", ";"]
_ROLES = ["system", "user", "assistant"]


def training_corpus(seed: int, n_lines: int = 6000) -> list[str]:
    """Pseudo-English lines, ChatML fragments, numbers and code-ish text."""
    rng = random.Random(seed)
    words = sorted(
        {
            "".join(
                rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                for _ in range(rng.randint(1, 3))
            )
            for _ in range(3000)
        }
    )
    words = [w for w in words if w]
    # Zipf-like weights so that frequent words get merged into single tokens.
    weights = [1.0 / (i + 1) for i in range(len(words))]
    rng.shuffle(words)
    lines: list[str] = []
    for i in range(n_lines):
        k = rng.randint(4, 24)
        sentence = " ".join(rng.choices(words, weights=weights, k=k))
        if rng.random() < 0.3:
            sentence = sentence.capitalize()
        sentence += rng.choice(_PUNCT)
        if i % 7 == 0:
            sentence += f" {rng.randint(0, 99999)} + {rng.randint(0, 999)} = ?"
        if i % 11 == 0:
            sentence = f"def f_{rng.choice(words)}(x):\n    return x * {rng.randint(2, 9)}\n"
        if i % 5 == 0:
            role = rng.choice(_ROLES)
            sentence = f"<|im_start|>{role}\n{sentence}<|im_end|>\n"
        lines.append(sentence)
    return lines


# ---------------------------------------------------------------------------------------
# Heavy parts (lazy imports)
# ---------------------------------------------------------------------------------------


def _lazy(name: str) -> Any:
    """Import a heavy module at call time (typed Any: no stubs needed in the gateway venv)."""
    import importlib

    return importlib.import_module(name)


def missing_modules() -> list[str]:
    import importlib.util

    return [m for m in HEAVY_MODULES if importlib.util.find_spec(m) is None]


def _build_tokenizer(out: Path, seed: int) -> Any:
    tk = _lazy("tokenizers")
    decoders, models, pre_tokenizers = tk.decoders, tk.models, tk.pre_tokenizers
    processors, trainers = tk.processors, tk.trainers
    PreTrainedTokenizerFast = _lazy("transformers").PreTrainedTokenizerFast

    tok = tk.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(seed), trainer=trainer)
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(name) == i, (name, tok.token_to_id(name))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        bos_token=None,
        unk_token=None,
        model_max_length=MAX_POSITION_EMBEDDINGS,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    # transformers 5 writes "TokenizersBackend", which transformers 4 cannot load.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return fast


def _build_model(out: Path, seed: int, vocab_size: int) -> Any:
    torch = _lazy("torch")
    tf = _lazy("transformers")

    config = tf.Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = tf.Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    model.generation_config = tf.GenerationConfig(
        bos_token_id=0, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID
    )
    model.save_pretrained(str(out), safe_serialization=True)
    return model


def _build_adapters(
    out: Path, model: Any, *, seed: int, n: int, rank: int, targets: str
) -> list[str]:
    torch = _lazy("torch")
    peft = _lazy("peft")

    target_modules: str | list[str] = (
        "all-linear" if targets == "all-linear" else ["q_proj", "v_proj"]
    )
    names: list[str] = []
    root = out / "adapters"
    root.mkdir(parents=True, exist_ok=True)
    for i in range(1, n + 1):
        name = f"{ADAPTER_PREFIX}{i}"
        torch.manual_seed(seed * 100_003 + i)
        cfg = peft.LoraConfig(
            r=rank,
            lora_alpha=2 * rank,
            target_modules=target_modules,
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
            init_lora_weights=False,  # random A and B: outputs visibly differ from base
        )
        peft_model = peft.get_peft_model(model, cfg)
        peft_model.peft_config["default"].base_model_name_or_path = SERVED_MODEL_NAME
        adir = root / name
        peft_model.save_pretrained(str(adir), safe_serialization=True)
        (adir / "README.md").unlink(missing_ok=True)  # model card: noise only
        # target_modules is a set in memory: its JSON order depends on PYTHONHASHSEED.
        acfg_path = adir / "adapter_config.json"
        acfg = json.loads(acfg_path.read_text())
        if isinstance(acfg.get("target_modules"), list):
            acfg["target_modules"] = sorted(acfg["target_modules"])
        acfg_path.write_text(json.dumps(acfg, indent=2, sort_keys=True) + "\n")
        model = peft_model.unload()  # strip LoRA layers, keep the base weights intact
        names.append(name)
    return names


def _normalize_json_files(out: Path) -> None:
    """Drop absolute paths from the written JSON so two build dirs hash the same."""
    for path in sorted(out.rglob("*.json")):
        text = path.read_text()
        if str(out) in text:
            path.write_text(text.replace(str(out), "."))


def build(
    out_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    adapters: int = 8,
    rank: int = 8,
    targets: str = "q_v",
    force: bool = False,
) -> Path:
    """Build the tiny model into ``out_dir`` atomically (temp dir + rename)."""
    out = Path(out_dir).resolve()
    if out.exists() and any(out.iterdir()):
        if not force:
            raise FileExistsError(f"{out} exists and is not empty (use --force to rebuild)")
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tokenizer = _build_tokenizer(tmp, seed)
        model = _build_model(tmp, seed, len(tokenizer))
        names = _build_adapters(tmp, model, seed=seed, n=adapters, rank=rank, targets=targets)
        manifest = {
            "served_model_name": SERVED_MODEL_NAME,
            "seed": seed,
            "rank": rank,
            "targets": targets,
            "adapters": names,
            "eos_token_id": EOS_TOKEN_ID,
            "vocab_size": len(tokenizer),
        }
        (tmp / "tiny-model.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
        _normalize_json_files(tmp)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def tree_digest(root: str | os.PathLike[str]) -> dict[str, str]:
    """sha256 of every file under ``root``, keyed by relative path."""
    base = Path(root)
    return {
        str(p.relative_to(base)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(base.rglob("*"))
        if p.is_file()
    }


# ---------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rollout-testbed make-tiny-model",
        description="Build a tiny random Qwen2 model, tokenizer and LoRA adapters (no download).",
    )
    p.add_argument("dir", help="output directory (created; must be empty unless --force)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--adapters", type=int, default=8, help="number of LoRA adapters (default 8)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (vLLM is started with 8)")
    p.add_argument("--targets", choices=["q_v", "all-linear"], default="q_v")
    p.add_argument("--force", action="store_true", help="replace an existing DIR")
    return p


def _delegate(argv: Sequence[str]) -> int | None:
    """Re-run with the vLLM venv's python when this interpreter lacks torch & co."""
    if os.environ.get(NO_DELEGATE_ENV):
        return None
    try:
        from rollout_testbed.local.vllm_env import find_vllm_python
    except ImportError:
        return None
    python = find_vllm_python(None)
    if python is None or not python.exists():
        return None
    if python.resolve() == Path(sys.executable).resolve():
        return None
    print(f"make-tiny-model: using the vLLM venv python {python}", file=sys.stderr)
    env = dict(os.environ, **{NO_DELEGATE_ENV: "1"})
    return subprocess.call([str(python), str(Path(__file__).resolve()), *argv], env=env)


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(args_list)
    missing = missing_modules()
    if missing:
        rc = _delegate(args_list)
        if rc is not None:
            return rc
        print(
            f"make-tiny-model: {', '.join(missing)} not importable with {sys.executable}.\n"
            + INSTALL_HINT,
            file=sys.stderr,
        )
        return 2
    if args.adapters < 0 or args.rank < 1:
        print("make-tiny-model: --adapters must be >= 0 and --rank >= 1", file=sys.stderr)
        return 2
    try:
        out = build(
            args.dir,
            seed=args.seed,
            adapters=args.adapters,
            rank=args.rank,
            targets=args.targets,
            force=args.force,
        )
    except FileExistsError as exc:
        print(f"make-tiny-model: {exc}", file=sys.stderr)
        return 1
    manifest = json.loads((out / "tiny-model.json").read_text())
    print(f"tiny model: {out} (served name {SERVED_MODEL_NAME!r})")
    print(f"adapters:   {', '.join(manifest['adapters']) or '-'} in {out / 'adapters'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
