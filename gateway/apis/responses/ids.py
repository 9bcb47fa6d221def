"""Response ids that name the replica holding the response, authenticated by kvgate.

vLLM keeps a stored response (``store: true``) in the memory of the replica that
made it, so ``previous_response_id``, ``GET /v1/responses/{id}`` and
``POST /v1/responses/{id}/cancel`` only work on that replica. kvgate instances
share no state, so the id itself carries the way back: the id a client sees is

    resp_kg1.<replica name, base64url>.<the replica's own id, base64url>.<tag>

where ``tag`` is a truncated HMAC-SHA256 over the version, the replica, the
replica's id and the tenant's cache namespace. Any instance configured with the
same key decodes it; a client cannot point an id at another replica (steering
its continuation onto a replica of its choice), nor replay another tenant's id
(the namespace is in the tag, so it decodes to nothing). 128 bits of tag: a
forgery succeeds with probability 2^-128 per try.

The key: ``response_id_secret`` if set, else derived from ``server_secret``
(which every instance of a fleet already shares, as the cache_salt HMACs need
it too). Either way it is domain-separated, so a response-id tag never equals
a salt or key hash. Pure: the same inputs always give the same id.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from dataclasses import dataclass

__all__ = ["ResponseIds", "StoredAt", "derive_id_key"]

_PREFIX = "resp_kg1."
_TAG_BYTES = 16
_MAX_ID_CHARS = 512  # longer than any id kvgate makes from a sane replica name and upstream id


def derive_id_key(secret: str) -> bytes:
    return hmac.new(secret.encode("utf-8"), b"kvgate response ids v1", hashlib.sha256).digest()


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True, slots=True)
class StoredAt:
    """Where a response lives: the replica's name and the id that replica gave it."""

    replica: str
    upstream_id: str


class ResponseIds:
    """Encodes and decodes the ids kvgate hands to clients."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        self._key = key

    def _tag(self, replica: bytes, upstream: bytes, namespace: str) -> bytes:
        msg = b"\x00".join((b"kg1", replica, upstream, namespace.encode("utf-8", "surrogatepass")))
        return hmac.new(self._key, msg, hashlib.sha256).digest()[:_TAG_BYTES]

    def encode(self, replica: str, upstream_id: str, namespace: str) -> str:
        r, u = replica.encode("utf-8"), upstream_id.encode("utf-8")
        return f"{_PREFIX}{_b64(r)}.{_b64(u)}.{_b64(self._tag(r, u, namespace))}"

    def decode(self, client_id: object, namespace: str) -> StoredAt | None:
        """The replica and upstream id, or None for anything kvgate did not issue to this tenant."""
        if not isinstance(client_id, str) or len(client_id) > _MAX_ID_CHARS or not client_id.startswith(_PREFIX):
            return None
        parts = client_id[len(_PREFIX):].split(".")
        if len(parts) != 3:
            return None
        try:
            r, u, tag = (_unb64(p) for p in parts)
            replica, upstream = r.decode("utf-8"), u.decode("utf-8")
        except (binascii.Error, ValueError):
            return None
        if not hmac.compare_digest(tag, self._tag(r, u, namespace)):
            return None
        return StoredAt(replica, upstream)
