"""Minimal asynchronous LoRA GRPO driver that speaks TRL 1.16's wire protocol.

``python -m trainer --gateway URL --model DIR --task digits --output-dir DIR`` (or
``python -m trainer ...``). Needs the ``[train]`` extra (torch, transformers, peft);
``trainer.cli`` itself imports only the standard library so the gateway's CLI can
delegate to it and it can re-run itself with the vLLM venv's python.
"""
