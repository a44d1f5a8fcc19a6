"""What every benchmark in ``bench/`` shares, so that each script is only its question.

* ``fronts``: the processes a benchmark measures and feeds: the gateway, vllm-router and
  the instant fake upstreams, each a ``rollout_testbed.procs.Proc`` pinned to its role's
  CPUs (``Fleet``), with their URLs and PIDs (``Front``). The sim replica fleet is
  ``rollout_testbed.procs.sim_fleet``.
* ``upstream``: the instant fake vLLM upstream (canned completion, or 16 SSE events).
* ``load``: the one load client (raw HTTP/1.1 on uvloop, closed or paced open loop), its
  one response parser, and ``run_client``/``spawn_client`` to run it pinned in a child.
* ``cpu``: the one reader of a process's (or process tree's) CPU time, from ``/proc``.
* ``rounds``: paired rounds (every variant once per round, the order rotated) and the
  medians and per-round ratios taken over them.
* ``replica_metrics``: a vLLM replica's ``vllm:*`` counters from ``/metrics``.
* ``percentile``: the one percentile rule the scripts quote (rank ``int(q * n)``).
* ``report``: machine facts, and the JSON + Markdown (+ PNG) a result is written as.
* ``podman``: the image benchmark's podman calls.
* ``trl``: the TRL benchmarks' clean fleet between modes (vLLM venv only).

Scripts import it as ``bench.lib`` (the repository root is on ``sys.path`` in the venv,
where the gateway is installed editable; the scripts add it too when run by path).
"""
