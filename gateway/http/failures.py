"""What an upstream connection failure was, named for an on-call: one word per cause.

Both clients (``h1client`` on the data path, aiohttp for control calls and probes) fail
with ``OSError`` subclasses before the first response byte; ``connect_kind`` turns one
into the word that the logs' ``kind`` field, the ``kind`` label of
``gateway_upstream_errors_total`` and the error message carry. Classified by exception
type and ``errno``, never by message text.

    dns              the replica's host name does not resolve (``socket.gaierror``)
    refused          nothing listens on the port (ECONNREFUSED): the replica is down
    unreachable      no route to the host or network (EHOSTUNREACH, ENETUNREACH)
    tls              the TLS handshake failed (certificate, protocol)
    connect_timeout  no connection within ``connect_timeout_s``
    reset            the connection died before any response byte (a stale keep-alive
                     connection, a replica that closes on accept)
    connect          any other ``OSError`` while connecting (e.g. several addresses that
                     all failed: Python folds those into one error without an errno)

``timeout`` (no answer within ``read_timeout_s``) and ``ejected`` (the replica left
rotation while the call waited) are the two other kinds the gateway names; neither is a
connection failure.
"""

from __future__ import annotations

import errno
import socket
import ssl

__all__ = ["CONCLUSIVE", "connect_kind"]

CONCLUSIVE = frozenset({"dns", "refused", "unreachable", "tls", "connect"})
"""Kinds that say the replica cannot be reached at all, for a probe as for a request: a
timeout or a reset may be one slow or unlucky connection."""

_UNREACHABLE = frozenset({errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN})


def connect_kind(exc: BaseException) -> str:
    """The kind of a failure to connect (or of a connection lost before any response
    byte). aiohttp wraps the ``OSError``; its ``os_error`` is unwrapped by the caller or
    found here as ``__cause__``/``os_error``."""
    inner = getattr(exc, "os_error", None)
    if isinstance(inner, BaseException) and inner is not exc:
        exc = inner
    if isinstance(exc, socket.gaierror):
        return "dns"
    if isinstance(exc, (ssl.SSLError, ssl.CertificateError)):
        return "tls"
    if isinstance(exc, TimeoutError):
        return "connect_timeout"
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)):
        return "reset"
    if isinstance(exc, OSError) and exc.errno in _UNREACHABLE:
        return "unreachable"
    return "connect"
