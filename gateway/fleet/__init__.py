"""The replicas: who is up, who may take traffic, and the rule every control call obeys.

Pure (no I/O; every event takes ``now``): ``replicas`` (the pool: health thresholds,
ejection, in-flight counts), ``outliers`` (the 5xx/429 breaker), ``retry_budget``,
``admission`` (in-flight limits), ``quorum`` (lost vs refused replicas). The thin shells:
``control`` (the fleet's pause state and its broadcasts), ``discovery`` (DNS, files) and
``aborts`` (which tasks wait on which replica, so an ejection can cancel them).
"""
