"""Several runs sharing one fleet (``docs/many-runs.md``); single-run mode is one implicit run.

Pure:

* ``table``        the runs: who a request belongs to, its adapter names on the replicas
* ``scope``        a run's answers show its own adapter names, its requests name its own
* ``lifecycle``    runs joining and leaving a live gateway: what a reload changes
* ``fairshare``    weighted fair share of the replicas' rollout slots across runs
* ``usage``        what each run used of the fleet, and an answer's token counts
* ``aborts``       rollouts cancelled on purpose, each owed a complete answer

The shells and parts:

* ``tenancy``      the runs at run time: each run's adapter manager, homes, pause
* ``placing``      multi-run mode's fleet chores: placing the runs, sweeping replicas
* ``fairness``     the async shell of the fair share: a rollout's wait for a slot
* ``credentials``  client and admin keys; the run a key names
* ``mode``         what differs between one implicit run and several named ones
* ``metrics``      per-run metrics
"""
