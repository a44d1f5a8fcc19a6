"""rollout-gateway: N vLLM replicas behind one TRL-compatible vLLM URL."""

__version__ = "0.1.0"
