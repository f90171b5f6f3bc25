"""API-key authentication of public calls (REST bearer token, gRPC `authorization` metadata).

Keys come from `--api-keys-file` (one per line; blank lines and `#` comments ignored) and
the environment variable SPLITSERVE_API_KEYS (comma-separated). With no key configured
authentication is off. A presented key is compared with every configured key using
`hmac.compare_digest` and no early exit, so the time taken does not depend on which key
(or which prefix of one) matched. Callers are identified by `client_id`, a short hash of
their key, used for per-key rate limits and in logs (the key itself is never logged).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping

from splitserve.gateway.errors import GatewayError

API_KEYS_ENV = "SPLITSERVE_API_KEYS"
ANONYMOUS = "anonymous"  # the client id of every caller when authentication is off
OPEN_HTTP_PATHS = frozenset({"/health", "/live", "/ready", "/metrics", "/docs", "/openapi.json"})
MISSING_KEY = "missing API key: send the header 'Authorization: Bearer <key>'"
WRONG_KEY = "invalid API key"


def load_api_keys(path: str, env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """Keys from the file at `path` (if given) and SPLITSERVE_API_KEYS; order kept, repeats dropped.

    The file holds one key a line, the whole line less its surrounding blanks: a `#` inside a key is part of
    it (cutting it there would let the key's prefix in), and only a line whose first non-blank is `#` is a
    comment. Raises ValueError naming the file when it cannot be read or a key has inner whitespace.
    """
    env = os.environ if env is None else env
    keys: list[str] = []
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--api-keys-file {path!r} cannot be read: {exc}") from None
        for number, line in enumerate(lines, 1):
            key = line.strip()
            if key.startswith("#"):
                continue
            if key and any(c.isspace() for c in key):
                raise ValueError(f"--api-keys-file {path!r} line {number}: a key must not contain whitespace")
            keys.append(key)
    keys += [part.strip() for part in env.get(API_KEYS_ENV, "").split(",")]
    return tuple(dict.fromkeys(k for k in keys if k))


def client_id_of(key: str) -> str:
    """A stable, non-secret name for a key: 'key-' + 12 hex digits of its sha256."""
    return "key-" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:12]


class ApiKeys:
    """The configured keys; `authenticate` maps an Authorization value to a client id."""

    def __init__(self, keys: tuple[str, ...] | list[str] = ()) -> None:
        self._keys = [(k.encode("utf-8"), client_id_of(k)) for k in keys]

    @property
    def num_keys(self) -> int:
        return len(self._keys)

    def authenticate(self, authorization: str | bytes | None) -> str:
        """The caller's client id; GatewayError("unauthenticated") when the key is missing or wrong.

        `authorization` is the header / metadata value, "Bearer <key>" (scheme case-insensitive).
        """
        if not self._keys:
            return ANONYMOUS
        if isinstance(authorization, bytes):
            authorization = authorization.decode("latin-1")
        scheme, _, token = (authorization or "").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise GatewayError("unauthenticated", MISSING_KEY, code="missing_api_key")
        presented = token.encode("utf-8", "surrogatepass")
        found = ""
        for key, client_id in self._keys:  # every key is compared: no early exit
            if hmac.compare_digest(presented, key):
                found = client_id
        if not found:
            raise GatewayError("unauthenticated", WRONG_KEY, code="invalid_api_key")
        return found
