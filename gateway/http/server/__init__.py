"""The gateway's HTTP/1.1 server: client connections in, responses out.

* ``h1server``         the lean protocol every connection starts on; others go to uvicorn
* ``serving``          listening sockets, and running an app on them
* ``exchange``         one rollout's request and response, whichever protocol read it
* ``inbound``          the request as dispatch needs it
* ``disconnect``       noticing that the client left
* ``signals``          SIGHUP, SIGUSR1 and SIGUSR2: none ends a process unannounced
* ``uvicorn_private``  every private uvicorn name the server uses, and nothing else

No import cycle: ``uvicorn_private``, ``disconnect`` and ``signals`` import nothing else
from here, ``inbound`` and ``exchange`` build on the first two, ``h1server`` on
``exchange``, and ``serving`` on ``h1server``. Nothing here knows the replicas' side
(``gateway.http.upstream``); ``gateway.http.relay`` joins the two. The canary for
``uvicorn_private``: ``tests/http/server/test_uvicorn_internals.py``.
"""
