"""The parts a ``gateway.core.Gateway`` is made of, each built with what it needs.

``rotation`` (which replicas are in), ``selection`` (the routing decision), ``ledger``
(one request's books), ``fanout`` (one call on several replicas), ``health`` (rounds
and membership), ``credentials`` (keys and runs). They import downward only: rotation
first, then what uses it; none knows the ``Gateway`` that holds them.
"""
