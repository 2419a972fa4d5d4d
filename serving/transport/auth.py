"""Bearer tokens, checked the same way for every transport: the admin token for IndexAdmin (and
the HTTP admin routes), the search token, when one is set, for everything else."""

from __future__ import annotations

import hashlib
import hmac
from enum import Enum

from serving.errors import PermissionDenied, Unauthenticated


class Scope(Enum):
    ADMIN = "admin"
    SEARCH = "search"
    OPEN = "open"  # health, reflection, the console's static files


class Tokens:
    def __init__(self, admin_token: str | None, search_token: str | None) -> None:
        self.admin_token = admin_token
        self.search_token = search_token

    def check(self, scope: Scope, authorization: str | None) -> None:
        """Raise Unauthenticated (no bearer token) or PermissionDenied (a wrong one, or admin
        calls on a server started without an admin token) unless `authorization`, the header's
        value, grants `scope`."""
        if scope is Scope.ADMIN:
            if self.admin_token is None:
                raise PermissionDenied("admin API disabled: start the server with --admin-token")
            expected = self.admin_token
        elif scope is Scope.SEARCH and self.search_token is not None:
            expected = self.search_token
        else:
            return
        supplied = authorization or ""
        if not supplied.startswith("Bearer "):
            raise Unauthenticated("missing 'authorization: Bearer <token>'")
        if not hmac.compare_digest(supplied[len("Bearer ") :].encode(), expected.encode()):
            raise PermissionDenied("invalid token")


def token_fingerprint(authorization: str | None) -> str:
    """Who made an authenticated call, for the audit log: a fingerprint of the bearer token,
    never the token itself."""
    token = (authorization or "").removeprefix("Bearer ")
    return f"token sha256:{hashlib.sha256(token.encode()).hexdigest()[:12]}" if token else "no token"
