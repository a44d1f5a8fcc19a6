"""TRL 1.16's real ``AsyncGRPOTrainer`` through the gateway on CPU: the harness that the
TRL test layer (``tests/trl``) and the TRL benchmarks (``bench/trl_*.py``, ``bench/chaos.py``)
share, and the learning rule both judge a run by (``learning``).

It runs with the vLLM venv's python (torch, transformers, peft, trl) from a checkout, and
is not part of what ``rollout-testbed`` promises to an installed user.
"""
