"""Client and admin keys: ``Bearer KEY``, or Basic auth's password (all TRL can send)."""

from __future__ import annotations

import hmac
from base64 import b64decode
from collections.abc import Sequence

from starlette.requests import Request

from gateway.api.requests import header
from gateway.api.responses import gateway_of
from gateway.errors import Unauthorized


def _presented_key(value: bytes | None) -> bytes | None:
    """The key in an ``Authorization`` value: ``Bearer KEY``, or the password of ``Basic``
    auth, which is all TRL can send (``http://user:KEY@gateway`` in its server URL)."""
    if not value:
        return None
    scheme, _, rest = value.partition(b" ")
    scheme = scheme.lower()
    if scheme == b"bearer":
        return rest.strip()
    if scheme == b"basic":
        try:
            decoded = b64decode(rest.strip(), validate=True)
        except ValueError:
            return None
        return decoded.partition(b":")[2]
    return None


def check_key(authorization: bytes | None, keys: Sequence[bytes], what: str) -> None:
    """401 unless ``authorization`` presents one of ``keys`` (none configured: open)."""
    if not keys:
        return
    presented = _presented_key(authorization)
    # Compare against every key, always: constant time in the key material.
    ok = False
    for key in keys:
        ok |= presented is not None and hmac.compare_digest(presented, key)
    if not ok:
        raise Unauthorized(f"Invalid or missing {what}.", headers={"WWW-Authenticate": "Bearer"})


def require_client(request: Request) -> None:
    check_key(header(request, b"authorization"), gateway_of(request).client_keys, "API key")


def require_admin(request: Request) -> None:
    gw = gateway_of(request)
    if gw.admin_keys:
        check_key(header(request, b"authorization"), gw.admin_keys, "admin key")
    else:
        require_client(request)
