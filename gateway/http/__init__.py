"""The socket layer: everything that reads or writes bytes on a connection.

* ``server``      the HTTP/1.1 server (a package): client connections in, responses out
* ``relay``       an upstream response streamed back through the server's exchange
* ``h1client``    the keep-alive client for routed rollouts
* ``h1response``  what ``h1client`` hands back: one upstream response, and its errors
* ``upstream``    every call to a replica (``h1client`` for rollouts, aiohttp for the rest)
* ``failures``    what an upstream connection failure was, one word per cause
* ``liveness``    the image's HEALTHCHECK, standard library only

``relay`` is the one module that joins the two sides. uvicorn's private names appear only
in ``server/uvicorn_private.py`` (``tests/http/server/test_uvicorn_internals.py``).
"""
