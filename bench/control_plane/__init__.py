"""The control plane at scale, simulated (issue 27): adapter loads, pauses and rejoins
fanned out to 16-256 simulated replicas by a real gateway, one process or ``--workers 4``.

* ``harness``: the sim host processes (``rollout_testbed.sim.fleet_host``), the gateway,
  plain HTTP to them;
* ``sampler``: the gateway's CPU and memory over the run, every process of it, from /proc;
* ``scenario``: one configuration, phase by phase, with its checks of the control-call rule;
* ``report``: JSON, Markdown and PNG in ``bench/results/control_plane.*``;
* ``__main__``: ``python -m bench.control_plane`` (``make bench-control-plane``).

The fast layer runs a short version: ``tests/bench/test_control_plane.py``.
"""
