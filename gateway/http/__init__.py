"""The socket layer: everything that reads or writes bytes on a connection.

* ``server``    the HTTP/1.1 server (a package): the lean protocol for rollouts, uvicorn
                for the rest, one exchange interface for both, disconnect detection;
* ``relay``     an upstream response streamed back to the client through the server's
                exchange: the one module that joins the two sides;
* ``h1client``  the keep-alive client for routed rollouts (``h1response``: its responses);
                ``upstream``: every call to a replica (h1client for rollouts, aiohttp for
                the rest) and its error mapping;
* ``liveness``  the image's HEALTHCHECK, standard library only.

uvicorn's private names appear only in ``server/uvicorn_private.py``
(``tests/http/server/test_uvicorn_internals.py``).
"""
