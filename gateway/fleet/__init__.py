"""The replicas: who is up, who may take traffic, and the rule every control call obeys.

Pure (no I/O; every event takes ``now``):

* ``replicas``      the pool: membership, health thresholds, ejection, in-flight counts
* ``outliers``      the 5xx/429 breaker, one per replica
* ``retry_budget``  retries may add at most a fixed share to the load
* ``admission``     in-flight limits, gateway-wide and per client
* ``quorum``        lost vs refused replicas: the rule of every control call

The thin shells:

* ``aborts``        which tasks wait on which replica, so an ejection can cancel them
* ``discovery``     the desired replica set: a static list, DNS, a watched file
* ``control``       the fleet's pause state and its broadcasts

The parts built on them:

* ``shared``        breakers, retry budget and fleet loads that ``--workers N`` share
* ``rotation``      which replicas are in rotation: breakers, ejections, what leaving undoes
* ``selection``     the whole routing decision for one request: candidates and choice
* ``ledger``        one request's books, opened and closed in one place
* ``fanout``        the same call on several replicas at once
* ``health``        health rounds and membership changes
* ``metrics``       the fleet's scrape-time metrics
* ``preflight``     what the gateway checks and says once, at start
"""
