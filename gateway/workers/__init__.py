"""``serve --workers N``: data-plane processes on one port, one control-plane owner.

* ``owner``     the owner's side of the control plane: the ``Hub`` every worker joins
* ``worker``    a data-plane worker: routes rollouts by the owner's snapshots
* ``snapshot``  the control state a worker routes by, as one immutable value
* ``channel``   messages between the owner and its workers: length-prefixed JSON
* ``merge``     one ``/metrics`` for the whole gateway: the owner's and every worker's

The processes themselves are forked by ``gateway.supervisor`` (``docs/workers.md``).
"""
