"""Client and admin keys, and (multi-run mode) which run a request belongs to.

Keys arrive as ``Bearer KEY`` or as Basic auth's password, which is all TRL can send
(``http://user:KEY@gateway`` in its server URL). The admin key also opens client routes;
the client key never opens admin ones. Every comparison runs against every key: constant
time in the key material.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from pydantic import SecretStr

from gateway.config import Settings
from gateway.errors import Unauthorized
from gateway.runs.table import presented_credential
from gateway.runs.tenancy import Tenancy, Tenant

__all__ = ["Credentials", "check_key", "presents"]


def presents(authorization: bytes | None, keys: Sequence[bytes]) -> bool:
    """Whether ``authorization`` presents one of ``keys``."""
    presented = presented_credential(authorization)[1]
    ok = False
    for key in keys:
        ok |= presented is not None and hmac.compare_digest(presented, key)
    return ok


def check_key(authorization: bytes | None, keys: Sequence[bytes], what: str) -> None:
    """401 unless ``authorization`` presents one of ``keys`` (none configured: open)."""
    if keys and not presents(authorization, keys):
        raise Unauthorized(f"Invalid or missing {what}.", headers={"WWW-Authenticate": "Bearer"})


class Credentials:
    def __init__(self, settings: Settings, tenancy: Tenancy) -> None:
        admin = _key(settings.admin_key)
        client = _key(settings.api_key)
        self.admin_keys: tuple[bytes, ...] = (admin,) if admin is not None else ()
        self.client_keys: tuple[bytes, ...] = (
            tuple(k for k in (client, admin) if k is not None) if client is not None else ()
        )
        self._tenancy = tenancy

    def summary(self) -> dict[str, str]:
        """Which key each kind of call needs, read from the very keys the checks compare
        against: the start line and ``/gateway/status`` show this, so neither can claim
        more auth than is enforced. ``clients``: rollouts, models, status; ``control``:
        load, unload, pause, resume, reset. Each is ``api key``, ``admin key``, ``run
        keys`` or ``none``."""
        if self._tenancy.multi:
            return {"clients": "run keys", "control": "run keys"}
        clients = "api key" if self.client_keys else "none"
        return {"clients": clients, "control": "admin key" if self.admin_keys else clients}

    def tenant(self, authorization: bytes | None) -> Tenant:
        """The request's run: single-run mode's one run once the client key checks out, or
        (multi-run) the run whose key it presents."""
        check_key(authorization, self.client_keys, "API key")
        return self._tenancy.for_request(authorization)

    def is_admin(self, authorization: bytes | None) -> bool:
        return bool(self.admin_keys) and presents(authorization, self.admin_keys)

    def check_admin(self, authorization: bytes | None) -> None:
        check_key(authorization, self.admin_keys, "admin key")


def _key(secret: SecretStr | None) -> bytes | None:
    """A configured key's bytes. Fails closed: an empty key is an error here too (config
    refuses it at start), never "no key", which would open what it was meant to guard."""
    if secret is None:
        return None
    if not (key := secret.get_secret_value().encode()).strip():
        raise ValueError("an empty key is configured: refusing to serve without auth")
    return key
