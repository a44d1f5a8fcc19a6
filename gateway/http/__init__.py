"""The socket layer: everything that reads or writes bytes on a connection.

* ``h1server``  the lean HTTP/1.1 server protocol for rollouts (hands other connections to
                uvicorn); ``serving``: listening sockets and the draining server;
* ``inbound``   one request as both servers describe it; ``relay``: responses and streams
                back to the client, disconnect detection;
* ``h1client``  the keep-alive client for routed rollouts; ``upstream``: every call to a
                replica (h1client for rollouts, aiohttp for the rest) and its error mapping.

uvicorn's private names appear only here (``tests/http/test_uvicorn_internals.py``).
"""
