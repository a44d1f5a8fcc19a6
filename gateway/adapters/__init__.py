"""Adapters: what each replica holds, decided by a pure core and carried out by a shell.

Pure (sans-I/O; ``checks.check_path`` excepted, which reads the adapter folder):

* ``state``       the adapter registry and its lifecycle state machine
* ``naming``      ``<family>-v<N>`` names
* ``checks``      what a load request must pass, what a replica's listing says
* ``placement``   each run's home replicas on a shared fleet
* ``cache_salt``  a rollout's ``cache_salt``: the adapter copy's load generation

The shell:

* ``manager``     the facade the API calls: parse, check, decide (``state``), execute
* ``fanout``      the core's actions sent to the replicas concurrently, outcomes fed back
"""
