"""The gateway's HTTP/1.1 server: client connections in, responses out.

* ``h1server``  the lean protocol every connection starts on (rollouts read without ASGI;
                any other connection handed to uvicorn); ``serving``: listening sockets
                and running an app on them;
* ``exchange``  one rollout's request and response, whichever protocol read it;
                ``inbound``: the request as dispatch needs it; ``disconnect``: noticing
                that the client left;
* ``uvicorn_private``  every private uvicorn name the server uses, and nothing else
                (the canary: ``tests/http/server/test_uvicorn_internals.py``).

No import cycle: ``uvicorn_private`` and ``disconnect`` import nothing else from here,
``inbound`` and ``exchange`` build on them, ``h1server`` on ``exchange``, and ``serving``
on all of them. Nothing here knows the replicas' side (``gateway.http.upstream``);
``gateway.http.relay`` joins the two.
"""
