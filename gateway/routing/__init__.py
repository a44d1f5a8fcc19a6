"""Routing: which replica serves a rollout, decided by pure cores (no I/O; the caller
brings the loads and the candidates).

* ``policy``    the routing policies: pick one replica for a request, and say why
* ``decision``  what a policy reads and returns: request, candidates' loads, decision
* ``prefix``    payload -> canonical block stream -> chained block hashes (the key)
* ``index``     served prompt chains, and shared-template detection
* ``ring``      consistent-hash ring with virtual nodes and a bounded-load lookup
* ``fleet``     the fleet-wide load snapshot N data-plane workers route new keys by
* ``config``    the routing tunables, and adapter-family naming

The decision for one request, with the fleet's state: ``gateway.fleet.selection``.
"""
