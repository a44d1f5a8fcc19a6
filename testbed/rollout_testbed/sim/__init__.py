"""A simulated vLLM replica: same endpoints, status codes and bodies as vLLM 0.32's OpenAI
server (runtime LoRA, dev-mode pause/resume), a block-LRU prefix cache and a latency model.

Modules (imported directly; this package imports nothing so ``prefix_cache`` stays cheap):

* ``prefix_cache``  ``BlockPrefixCache``: vLLM-like whole-block prefix hits, pure
* ``latency``       ``LatencyModel``: prefill/decode/concurrency seconds per token
* ``tokenizer``     deterministic toy tokenizer, ChatML template and sampler
* ``config``        ``SimConfig`` (what ``vllm serve`` flags would set)
* ``state``         ``SimState``: engine state, pause gate, ``Faults``, ``SimStats``, metrics
* ``app``           ``create_sim_app(config) -> FastAPI``; state on ``app.state.sim``
* ``testing``       ``running_sim(config)``: a sim on a real socket inside a test
* ``server``        ``main(argv)`` for ``rollout-testbed sim-replica``
"""
